"""Each family's training recipe pinned to its description (looplm.training.recipes): Huginn's log-normal
Poisson loop count and truncation, Parcae's Poisson draw, Ouro's expected-loss objective against
an independent computation, and Ouro's gate-only stage changing only the gate."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pretrained_common import load

from looplm.errors import LoopLMError
from looplm.settings.config import load_config
from looplm.training.recipes import (
    exit_distribution,
    freeze_for_recipe,
    ouro_expected_loss,
    ouro_gate_loss,
    step_plan,
)


def _cfg(*overrides: str):
    return load_config("tiny_bool", list(overrides))


def _draws(cfg, n: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    plans = [step_plan(s, cfg) for s in range(n)]
    return np.array([p.loops for p in plans]), np.array([p.truncate_k for p in plans])


def test_huginn_draws_a_log_normal_poisson_loop_count_and_backprops_the_last_8():
    """T = 1 + Poisson(λ), log λ ~ N(log r̄ − σ²/2, σ²), σ = ½: E[T] = r̄ + 1 and
    Var[T] = r̄ + r̄²(e^{σ²} − 1) (a Poisson mixture: E[λ] + Var[λ]); gradients through the last
    min(8, T) steps (truncate_k 0 = all of them when T ≤ 8)."""
    r = 32
    T, k = _draws(_cfg("train.recipe=huginn", f"train.depth_mean={r}"))
    assert abs(T.mean() - (r + 1)) < 0.5  # standard error ≈ 0.13
    var = r + r * r * (math.exp(0.25) - 1)  # 322.8
    assert abs(T.var() / var - 1) < 0.06
    assert T.min() >= 1 and (T > 3 * r).any()  # the long tail the training relies on
    assert np.array_equal(np.where(T > 8, 8, 0), k)
    again, _ = _draws(_cfg("train.recipe=huginn", f"train.depth_mean={r}"), 50)
    assert np.array_equal(again, T[:50])  # seeded by step: the same on every rank and resume
    _, k4 = _draws(_cfg("train.recipe=huginn", "train.depth_mean=32", "train.truncate_k=4"), 200)
    assert set(k4) == {4}


def test_parcae_draws_poisson_truncated_full():
    """T = max(Poisson(r̄), 1) (mean ≈ r̄, variance ≈ r̄), the last min(4, T) steps with
    gradients (the published configs' mean_backprop_depth)."""
    T, k = _draws(_cfg("train.recipe=parcae", "train.depth_mean=8"))
    assert abs(T.mean() - 8) < 0.1 and abs(T.var() / 8 - 1) < 0.06
    assert T.min() >= 1
    assert np.array_equal(np.where(T > 4, 4, 0), k)


def test_looplm_recipe_is_uniform_1_to_8():
    T, k = _draws(_cfg(), 4000)
    assert set(T) == set(range(1, 9)) and not k.any()
    counts = np.bincount(T)[1:]
    assert counts.min() > 400  # each of the 8 depths about 500 times


def test_a_recipe_needs_its_mean_depth_and_known_names():
    with pytest.raises(LoopLMError, match="depth_mean >= 1"):
        step_plan(0, _cfg("train.recipe=huginn"))
    with pytest.raises(LoopLMError, match="train.recipe='nope'; allowed: looplm, huginn"):
        _cfg("train.recipe=nope")


# ------------------------------------------------------------------ Ouro
def _ouro():
    model = load("ouro").double().eval()
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    y = torch.roll(ids, -1, 1)
    y[0, :3] = -100  # a prompt: unsupervised
    return model, ids, y


def _independent(model, ids, y, T):
    """Per-token CE of each depth from its own forward pass, and the gate at each state."""
    ce, lam = [], []
    torch.set_grad_enabled(False)
    out = model(ids, loops=T, return_states=True)
    for t in range(1, T + 1):
        logits = model(ids, loops=t)
        ce.append(F.cross_entropy(logits.transpose(1, 2), y.clamp_min(0), reduction="none"))
        lam.append(torch.sigmoid(model.recurrence.exit_gate(out.states[t])).squeeze(-1))
    torch.set_grad_enabled(True)
    return ce, lam


def test_ouro_expected_loss_matches_an_independent_computation():
    model, ids, y = _ouro()
    T, beta = 4, 0.1
    cfg = _cfg(f"train.exit_beta={beta}")
    ce, lam = _independent(model, ids, y, T)
    want = 0.0
    for b in range(2):
        for i in range(7):
            if y[b, i] < 0:
                continue
            survive, total, entropy = 1.0, 0.0, 0.0
            for t in range(T):
                p = survive * (lam[t][b, i] if t < T - 1 else 1.0)  # the last step: what is left
                total += p * ce[t][b, i]
                entropy -= p * torch.log(p)
                survive = survive * (1 - lam[t][b, i])
            want += total - beta * entropy
    got = ouro_expected_loss(model, ids, y, T, cfg)
    torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype), rtol=1e-6, atol=1e-8)
    p = exit_distribution(torch.stack(lam))
    torch.testing.assert_close(p.sum(0), torch.ones_like(p[0]))


def test_ouro_gate_loss_matches_an_independent_computation():
    model, ids, y = _ouro()
    T = 4
    cfg = _cfg("train.gate_k=50", "train.gate_gamma=0.005")
    ce, lam = _independent(model, ids, y, T)
    want = 0.0
    for b in range(2):
        for i in range(7):
            if y[b, i] < 0:
                continue
            terms = []
            for t in range(1, T):
                gain = max(0.0, float(ce[t - 1][b, i] - ce[t][b, i]))
                w = 1 / (1 + math.exp(-50 * (gain - 0.005)))
                lt = float(lam[t][b, i])
                terms.append(-(w * math.log(1 - lt) + (1 - w) * math.log(lt)))
            want += sum(terms) / len(terms)
    got = ouro_gate_loss(model, ids, y, T, cfg)
    assert float(got.detach()) == pytest.approx(want, rel=1e-6)


def test_ouro_gate_stage_changes_only_the_gate():
    model, ids, y = _ouro()
    cfg = _cfg("train.recipe=ouro_gate")
    freeze_for_recipe(model, cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["recurrence.exit_gate.weight", "recurrence.exit_gate.bias"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        ouro_gate_loss(model, ids, y, 4, cfg).backward()
        opt.step()
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed == trainable
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recurrence="scse"))
    from looplm.model import model_from_config

    with pytest.raises(LoopLMError, match="has none"):
        freeze_for_recipe(model_from_config(plain.model), plain)
