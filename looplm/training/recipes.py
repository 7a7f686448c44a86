"""Each family's training recipe: the loop depth drawn per optimizer step, how many of its last
steps carry gradients, and the objective (``train.recipe``).

* ``looplm`` — T ~ U{depth_min … depth_max} (U{1 … 8} by default), the loss of ``train.objective``
  (``final``: h_T only; ``per_step``: every h_t) with ``train.truncate_k`` (0: full backprop).
* ``huginn`` — "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth Approach":
  the randomised recurrence, a log-normal Poisson draw around the mean r̄ (``depth_mean``)::

      τ ~ N(log r̄ − σ²/2, σ²),  σ = 1/2;   T = 1 + Poisson(e^τ)     (so E[T] = r̄ + 1)

  backpropagating through the last k = min(k̄, T) steps only, k̄ = ``truncate_k`` or 8 (the
  reference's ``mean_backprop_depth``). The reference code (seal-rg/recurrent-pretraining,
  ``randomized_iteration_sampler``) draws ``rate ~ LogNormal(μ, σ)``, ``p = Poisson(rate) + 1``,
  ``n = max(p − k̄, 0)`` steps without and ``k = min(k̄, p)`` with gradients.
* ``parcae`` — Parcae's published configs (``sampling_scheme: poisson-truncated-full``,
  ``mean_recurrence: 8``, ``mean_backprop_depth: 4``) and its reference code
  (sandyresearch/parcae, ``parcae_lm/models/parcae/parcae.py``): T = max(Poisson(r̄), 1) with
  gradients through the last min(T, k̄) steps, k̄ = ``truncate_k`` or 4. The reference draws T per
  sequence; looplm draws it per optimizer step (one T for the batch).
* ``ouro`` — "Scaling Latent Reasoning via Looped Language Models", stage I: the exit gate's
  per-step probabilities λ_t = σ(w·h_t + b) define the exit distribution over t = 1 … T::

      p(t) = λ_t · Π_{j<t}(1 − λ_j)  (t < T),     p(T) = Π_{j<T}(1 − λ_j)
      L = Σ_t p(t)·ℓ_t − β·H(p),      H(p) = −Σ_t p(t)·log p(t)

  per supervised token (ℓ_t its cross-entropy read from h_t), T = ``depth_mean`` (the trained
  loop count), β = ``exit_beta``. Gradients reach the model through ℓ_t and the gate through p.
* ``ouro_gate`` — Ouro's stage II, the gate trained alone (every other parameter frozen) on the
  loss improvement between steps: with I_t = max(0, ℓ_{t−1} − ℓ_t) (detached) and the
  continuation target w_t = σ(k·(I_t − γ)) (``gate_k``, ``gate_gamma``)::

      L = −Σ_{t=2…T} [w_t·log(1 − λ_t) + (1 − w_t)·log λ_t] / (T − 1)

  per supervised token: a step that still lowered the loss by more than γ teaches the gate at
  that step to continue, one that did not to stop.

A checkpoint imported from a family (``init=``) defaults to that family's recipe; HRM-Text and
looplm's own checkpoints to ``looplm``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from looplm.data.sources import step_seed
from looplm.errors import LoopLMError
from looplm.settings.config import RunConfig
from looplm.targets import IGNORE_INDEX

HUGINN_SIGMA = 0.5  # σ of the log-normal rate (the reference's fixed value)
BACKPROP_DEPTH = {"huginn": 8, "parcae": 4}  # the references' mean_backprop_depth
FAMILY_RECIPE = {"huginn": "huginn", "parcae": "parcae", "ouro": "ouro", "hrm_text": "looplm"}
EXIT_RECIPES = ("ouro", "ouro_gate")

#: ``loss_fn(model, x, y, loops, cfg) -> summed loss`` of one micro-batch
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int, RunConfig], torch.Tensor]


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step runs: ``loops`` steps, gradients through the last
    ``truncate_k`` (0: all), and ``loss_fn`` (None: the model's own ``loss``)."""

    loops: int
    truncate_k: int = 0
    loss_fn: LossFn | None = None


def recipe_of(cfg: RunConfig) -> str:
    """The run's recipe name (``train.recipe``, or ``looplm`` when left empty)."""
    return cfg.train.recipe or "looplm"


def _rng(cfg: RunConfig, step: int) -> np.random.Generator:
    return np.random.default_rng(step_seed(cfg.train.seed, step, 0) ^ 0x7EC1)


def huginn_depth(rng: np.random.Generator, mean: int, backprop: int) -> tuple[int, int]:
    """(T, k) of Huginn's randomised recurrence: T = 1 + Poisson(e^τ), τ ~ N(log r̄ − σ²/2, σ²);
    k = min(k̄, T) steps with gradients."""
    mu = math.log(mean) - HUGINN_SIGMA**2 / 2
    rate = rng.lognormal(mean=mu, sigma=HUGINN_SIGMA)
    total = int(rng.poisson(rate)) + 1
    return total, min(backprop, total)


def parcae_depth(rng: np.random.Generator, mean: int, backprop: int) -> tuple[int, int]:
    """(T, k) of Parcae's poisson-truncated-full draw: T = max(Poisson(r̄), 1), k = min(k̄, T)."""
    total = max(int(rng.poisson(mean)), 1)
    return total, min(backprop, total)


def _mean_depth(cfg: RunConfig) -> int:
    if cfg.train.depth_mean < 1:
        raise LoopLMError(
            f"train.recipe={cfg.train.recipe} needs train.depth_mean >= 1 (the mean loop count; "
            "an init checkpoint supplies its trained count)"
        )
    return cfg.train.depth_mean


def step_plan(step: int, cfg: RunConfig, is_looped: bool = True) -> StepPlan:
    """The depth, truncation and objective of optimizer step ``step`` (the same on every rank and
    on a resumed run: seeded by the run seed and the step)."""
    tc = cfg.train
    if not is_looped:
        return StepPlan(cfg.model.n_layers, tc.truncate_k)
    name = recipe_of(cfg)
    if name == "looplm":
        rnd = random.Random(step_seed(tc.seed, step, 0) ^ 0x5EED)
        return StepPlan(rnd.randint(tc.depth_min, tc.depth_max), tc.truncate_k)
    if name in BACKPROP_DEPTH:
        draw = huginn_depth if name == "huginn" else parcae_depth
        loops, k = draw(_rng(cfg, step), _mean_depth(cfg), tc.truncate_k or BACKPROP_DEPTH[name])
        return StepPlan(loops, k if k < loops else 0)
    loss = ouro_expected_loss if name == "ouro" else ouro_gate_loss
    return StepPlan(_mean_depth(cfg), 0, loss)


def eval_loops(cfg: RunConfig) -> int:
    """The depth a run's validation reads: depth_max (looplm), else the recipe's mean depth."""
    if recipe_of(cfg) == "looplm" or cfg.train.depth_mean < 1:
        return cfg.train.depth_max
    return cfg.train.depth_mean


# ----------------------------------------------------------------------------- Ouro's objectives
def exit_distribution(lam: torch.Tensor) -> torch.Tensor:
    """p (T, …) from the per-step exit probabilities λ (T, …): p(t) = λ_t Π_{j<t}(1 − λ_j) for
    t < T, and the remaining mass Π_{j<T}(1 − λ_j) at t = T (so Σ_t p(t) = 1)."""
    survive = torch.cumprod(1 - lam, dim=0)  # S_t = Π_{j≤t}(1 − λ_j)
    before = torch.cat([torch.ones_like(lam[:1]), survive[:-1]])  # S_{t−1}
    p = lam * before
    return torch.cat([p[:-1], before[-1:]])


def _step_losses(model, x, y, loops: int):
    """(per-token CE ℓ (T, B, L), gate λ (T, B, L), supervised mask (B, L)) for t = 1 … T."""
    rec = model.recurrence
    if not hasattr(rec, "exit_probability"):
        raise LoopLMError(
            f"train.recipe needs a model with an exit gate (recurrence ouro), not "
            f"{model.config.recurrence!r}"
        )
    ctx = model.prepare(x)
    mask = y != IGNORE_INDEX
    tgt = y.masked_fill(~mask, 0)
    ces, lams = [], []
    for st in model.unroll(ctx, loops):
        if st.t == 0:
            continue
        logits = model.readout(model.finish(st.hidden, ctx)).float()  # (B, L, V)
        ce = F.cross_entropy(logits.transpose(1, 2), tgt, reduction="none")  # (B, L)
        ces.append(ce)
        lams.append(rec.exit_probability(st.hidden).float())  # (B, L)
    return torch.stack(ces), torch.stack(lams), mask


def ouro_expected_loss(model, x, y, loops: int, cfg: RunConfig) -> torch.Tensor:
    """Σ over supervised tokens of Σ_t p(t)·ℓ_t − β·H(p) (summed, like the trainer's losses)."""
    ce, lam, mask = _step_losses(model, x, y, loops)
    p = exit_distribution(lam)  # (T, B, L)
    entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(0)  # (B, L)
    per_token = (p * ce).sum(0) - cfg.train.exit_beta * entropy
    return per_token[mask].sum()


def ouro_gate_loss(model, x, y, loops: int, cfg: RunConfig) -> torch.Tensor:
    """Σ over supervised tokens of the gate's cross-entropy against the continuation target
    w_t = σ(k·(max(0, ℓ_{t−1} − ℓ_t) − γ)), averaged over t = 2 … T."""
    if loops < 2:
        raise LoopLMError(f"train.recipe=ouro_gate compares steps: needs depth >= 2, got {loops}")
    ce, lam, mask = _step_losses(model, x, y, loops)
    ce = ce.detach()
    improve = (ce[:-1] - ce[1:]).clamp_min(0)  # I_t for t = 2 … T: (T−1, B, L)
    w = torch.sigmoid(cfg.train.gate_k * (improve - cfg.train.gate_gamma))
    lam = lam[1:].clamp(1e-6, 1 - 1e-6)  # λ_t for t = 2 … T
    bce = -(w * torch.log1p(-lam) + (1 - w) * torch.log(lam)).mean(0)  # (B, L)
    return bce[mask].sum()


def freeze_for_recipe(model: torch.nn.Module, cfg: RunConfig) -> None:
    """``ouro_gate`` trains the exit gate alone: every other parameter is frozen."""
    if recipe_of(cfg) != "ouro_gate":
        return
    gate = getattr(model.recurrence, "exit_gate", None)
    if gate is None:
        raise LoopLMError(
            "train.recipe=ouro_gate trains an exit gate: the model has none (recurrence "
            f"{model.config.recurrence!r}; allowed: ouro)"
        )
    keep = {id(p) for p in gate.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
