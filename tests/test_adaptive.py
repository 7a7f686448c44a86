"""Adaptive depth: max-token stopping (calibration, ceiling/first-step limits), per-token KL
halting (exactness at τ = 0, frozen-state semantics, work skipping), the linear router."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from looplm.adaptive.depth import (
    calibrate_threshold,
    evaluate_maxtoken,
    maxtoken_forward,
    stopping_depths,
    update_trace,
)
from looplm.adaptive.halting import (
    LinearRouter,
    evaluate_per_token,
    fit_router,
    harvest_router_data,
    per_token_halting,
)
from looplm.errors import LoopLMError
from looplm.evaluate.records import flops_per_token
from looplm.model import build_model
from looplm.model.halting_rules import KLHalt, RouterHalt

SMALL = dict(d_model=32, n_heads=2, d_ff=64, context=16, dropout=0.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: one intra-op thread is ~10x faster on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(method: str = "scse", seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = build_model("tiny", method, **{**SMALL, **kw}).eval()
    if method == "scse":  # random init barely moves h; sharpen the block so depth matters
        with torch.no_grad():
            for p in model.block.parameters():
                if p.dim() == 2:
                    p.mul_(4.0)
    return model


def batches(n: int, L: int = 16, bs: int = 64, seed: int = 1, partial: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, n, bs):
        b = min(bs, n - i)
        x = torch.randint(0, 257, (b, L), generator=g)
        y = torch.randint(0, 257, (b, L), generator=g)
        out.append((x, y))
    if partial:  # a last partial window: padded inputs, ignored targets
        x, y = out[-1]
        y[-1, L // 2 :] = -100
        x[-1, L // 2 :] = 0
    return out


def fixed_nll(model, data, T):
    s = n = 0.0
    for x, y in data:
        a, b = model.nll_sum(x, y, T)
        s, n = s + a, n + b
    return s, n


# ---------------------------------------------------------------- rule 1: max-token stopping
def test_maxtoken_threshold_zero_runs_to_ceiling_and_equals_fixed_depth():
    model = tiny("scse")
    data = batches(40, bs=16, partial=True)
    C = 12
    r = evaluate_maxtoken(model, data, 0.0, C)
    assert r["mean_depth"] == C
    assert r["depth_hist"][-1] == r["n_examples"] and sum(r["depth_hist"][:-1]) == 0
    s, n = fixed_nll(model, data, C)
    assert r["n_tokens"] == n
    assert r["sum_nll"] == pytest.approx(s, rel=1e-6)  # float64 vs float32 summation
    for x, y in data:  # the states themselves are the fixed-depth states, bit for bit
        h, depth = maxtoken_forward(model, x, y != -100, 0.0, C)
        assert bool((depth == C).all())
        assert torch.equal(h, model.hidden_states(x, C)[0])


def test_maxtoken_infinite_threshold_stops_at_first_step():
    model = tiny("looped")
    data = batches(40, bs=16)
    r = evaluate_maxtoken(model, data, math.inf, 48)
    assert r["mean_depth"] == 1.0
    assert r["depth_hist"][0] == r["n_examples"]
    s, _ = fixed_nll(model, data, 1)
    assert r["sum_nll"] == pytest.approx(s, rel=1e-6)
    x, y = data[0]
    h, depth = maxtoken_forward(model, x, y != -100, math.inf, 48)
    assert bool((depth == 1).all()) and torch.equal(h, model.hidden_states(x, 1)[0])


def test_stopping_depths_first_crossing():
    u = np.array([[0.5, 0.3, 0.1, 0.05], [0.5, 0.6, 0.7, 0.8], [0.01, 0.9, 0.01, 0.9]])
    assert stopping_depths(u, 0.2).tolist() == [3, 4, 1]
    assert stopping_depths(u, 0.0).tolist() == [4, 4, 4]
    assert stopping_depths(u, math.inf).tolist() == [1, 1, 1]


@pytest.mark.parametrize("method", ["scse", "looped"])
def test_calibration_hits_target_budget_and_transfers_to_online_early_exit(method):
    model = tiny(method, seed=3)
    calib = batches(256, bs=128, seed=5)  # 256 calibration examples
    trace = update_trace(model, calib, 48)
    assert trace.n_examples == 256
    for target in (8, 16, 24):
        cal = calibrate_threshold(trace, target)
        assert abs(cal.achieved - target) <= 0.5, (method, target, cal)
        # the real early-exit implementation reproduces the offline (full-trace) accounting
        online = evaluate_maxtoken(model, calib, cal.threshold, 48)
        assert online["mean_depth"] == pytest.approx(cal.achieved, abs=0.05)
    with pytest.raises(LoopLMError):
        calibrate_threshold(trace, 60)


def test_maxtoken_forward_drops_finished_examples():
    model = tiny("scse", seed=2)
    x, y = batches(16, bs=16)[0]
    valid = y != -100
    trace = update_trace(model, [(x, y)], 20)
    thr = float(np.median(trace.updates[:, 5]))
    h, depth = maxtoken_forward(model, x, valid, thr, 20)
    expect = stopping_depths(trace.updates, thr)
    assert depth.tolist() == expect.tolist()
    # each example's output is its fixed-depth state at its own stopping depth
    for b in range(x.shape[0]):
        (hb,) = model.hidden_states(x[b : b + 1], int(depth[b]))
        torch.testing.assert_close(h[b], hb[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- rule 2: per-token KL halting
@pytest.mark.parametrize("method", ["scse", "looped", "step_conditioned", "hyper_scse"])
def test_kl_threshold_zero_reproduces_full_depth_logits_exactly(method):
    model = tiny(method)
    x, _ = batches(8, bs=8)[0]
    C = 10
    h, depth = per_token_halting(model, x, KLHalt(0.0), C)
    assert bool((depth == C).all())
    assert torch.equal(model.readout(h), model(x, loops=C))


def test_kl_infinite_threshold_halts_every_token_after_one_loop():
    model = tiny("scse")
    x, _ = batches(8, bs=8)[0]
    h, depth = per_token_halting(model, x, KLHalt(math.inf), 30)
    assert bool((depth == 1).all())
    assert torch.equal(model.readout(h), model(x, loops=1))


class HaltEvenAt:
    """Test decision: tokens at even positions halt after loop ``at``."""

    needs_logits = False

    def __init__(self, at: int, L: int, B: int) -> None:
        self.at = at
        self.even = (torch.arange(L) % 2 == 0).expand(B, L)

    def __call__(self, t, h, logp, logp_prev):
        self.active = getattr(self, "active", torch.ones_like(self.even))
        out = self.even[self.active] if t == self.at else torch.zeros(h.shape[0], dtype=torch.bool)
        if t == self.at:
            self.active = self.active & ~self.even
        return out


@pytest.mark.parametrize("skip", [False, True])
def test_frozen_tokens_keep_state_and_stay_visible_to_attention(skip):
    """Independent reference for the looped recurrence h ← h + G(h + e): halted tokens keep
    their state and later tokens keep attending to those frozen states."""
    model = tiny("looped", seed=4)
    x, _ = batches(4, bs=4)[0]
    B, L = x.shape
    C, at = 8, 3
    h, depth = per_token_halting(model, x, HaltEvenAt(at, L, B), C, skip=skip)
    even = torch.arange(L) % 2 == 0
    assert depth[:, even].eq(at).all() and depth[:, ~even].eq(C).all()
    with torch.no_grad():
        e = model.embed(x)
        ref = e.clone()
        for t in range(C):
            new = ref + model.block(ref + e)
            keep = even.view(1, L, 1) & torch.tensor(t >= at)
            ref = torch.where(keep, ref, new)
    torch.testing.assert_close(h, ref, rtol=1e-5, atol=1e-5)


def test_sparse_block_matches_dense_block_on_active_rows():
    model = tiny("scse", seed=6)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 32, generator=g)
    active = torch.rand(3, 16, generator=g) < 0.4
    active[1] = False  # an example with no active token
    active[2, -1] = True
    with torch.no_grad():
        dense = model.block(x)
        sparse = model.block(x, active=active)
    torch.testing.assert_close(sparse[active], dense[active], rtol=1e-5, atol=1e-6)
    assert bool((sparse[~active] == 0).all())


def test_kl_halting_skip_and_dense_agree_and_depth_decreases_with_threshold():
    model = tiny("scse", seed=7)
    data = batches(32, bs=16)
    full = evaluate_per_token(model, data, KLHalt(0.0), 16)
    assert full["mean_depth"] == 16
    s, _ = fixed_nll(model, data, 16)
    assert full["sum_nll"] == pytest.approx(s, rel=1e-6)
    thr = 1e-4
    a = evaluate_per_token(model, data, KLHalt(thr), 16, skip=True)
    b = evaluate_per_token(model, data, KLHalt(thr), 16, skip=False)
    assert 1 <= a["mean_depth"] < 16
    assert a["mean_depth"] == pytest.approx(b["mean_depth"], abs=0.02)
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-3)
    c = evaluate_per_token(model, data, KLHalt(thr * 100), 16, repeats=2, time_dense=True)
    assert c["mean_depth"] <= a["mean_depth"]
    assert c["wall_clock_s"] > 0 and c["wall_clock_dense_s"] > 0 and c["timing_repeats"] == 2


def test_adaptive_cli_writes_one_row_per_rule_setting(tmp_path, capsys):
    from looplm.cli import main
    from looplm.model import model_from_config
    from looplm.model.checkpoint import save_checkpoint
    from looplm.results.store import ResultsStore
    from looplm.settings.config import load_config

    cfg = load_config(
        None,
        [
            "model.d_model=32",
            "model.n_heads=2",
            "model.d_ff=64",
            "model.dropout=0.0",
            "eval.n_examples=32",
            "train.seed=4",
        ],
    )  # the tiny bool_logic task: no corpus needed
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ck", model_from_config(cfg.model), cfg, state={"step": 0})
    args = [
        "adaptive",
        str(tmp_path / "ck"),
        "--ceiling",
        "4",
        "--budgets",
        "2,3",
        "--kl-thresholds",
        "0.01",
        "--router-probs",
        "0.5",
        "--timing-depths",
        "2,4",
        "--store",
        str(tmp_path / "r.sqlite"),
        "--batch-size",
        "16",
    ]
    assert main(args) == 0
    assert main(args) == 0
    assert "maxtoken:budget=2" in capsys.readouterr().out
    recs = ResultsStore(tmp_path / "r.sqlite").query()
    assert sorted(r.adaptive_mode for r in recs) == [
        "kl:thr=0.01",
        "maxtoken:budget=2",
        "maxtoken:budget=3",
        "router:p=0.5",
    ]
    assert {(r.depth, r.seed, r.split) for r in recs} == {(4, 4, "test")}
    assert all(set(r.extra["uniform_wall_clock_s"]) == {"2", "4"} for r in recs)


# ---------------------------------------------------------------- rule 3: linear router
def test_fit_router_learns_a_separable_rule():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2000, 8, generator=g)
    Y = (X[:, 0] - 0.5 * X[:, 3] > 0.2).float()
    r = fit_router(X, Y)
    assert r.stats["train_accuracy"] > 0.97
    d = LinearRouter.from_dict(r.to_dict())
    torch.testing.assert_close(d.weight, r.weight)


def test_router_harvest_and_halting_run_end_to_end():
    model = tiny("scse", seed=8)
    calib, test = batches(32, bs=16, seed=9), batches(16, bs=16, seed=10)
    X, Y = harvest_router_data(model, calib, 12, label_threshold=1e-4)
    assert X.shape == (32 * 16 * 11, 32) and set(Y.unique().tolist()) <= {0.0, 1.0}
    router = fit_router(X, Y, label_threshold=1e-4)
    lo = evaluate_per_token(model, test, RouterHalt(router, 0.05), 12)
    hi = evaluate_per_token(model, test, RouterHalt(router, 1.0), 12)
    assert 1 <= lo["mean_depth"] <= hi["mean_depth"] <= 12


def test_adaptive_rejects_unshared_models_and_bad_settings():
    model = build_model("tiny", "unshared", **SMALL, n_layers=2).eval()
    x, y = batches(4, bs=4)[0]
    with pytest.raises(LoopLMError, match="shared-block"):
        maxtoken_forward(model, x, y != -100, 0.1, 4)
    with pytest.raises(LoopLMError):
        KLHalt(-1.0)
    with pytest.raises(LoopLMError):
        per_token_halting(tiny("scse"), x, KLHalt(0.1), 0)


def test_flop_proxy_at_integer_depth_matches_looplm_flops():
    import looplm

    f = flops_per_token(preset="22m", recurrence="scse", mean_depth=8, seq_len=128)
    assert f["flops_per_token_body"] == looplm.flops("22m", "scse", 8, 128)["body"]
    assert f["flops_per_token_body_head"] == looplm.flops("22m", "scse", 8, 128)["body_head"]
    half = flops_per_token(preset="22m", recurrence="scse", mean_depth=8.5, seq_len=128)
    per = looplm.flops("22m", "scse", 1, 128)["body"]
    assert half["flops_per_token_body"] == pytest.approx(8.5 * per)


# ---------------------------------------------------------------- chunked readouts
def test_readout_statistics_are_chunked_and_exact(monkeypatch):
    """Adaptive evaluation and the diagnostics read out in chunks of rows (no (N, V) table): with
    five rows a chunk the halting depths, NLL and successive KL equal the one-chunk results."""
    import looplm.model.loss as loss
    from looplm.adaptive.measure import nll_rows
    from looplm.diagnostics.convergence import successive_kl

    model = tiny("scse", seed=7)
    x, y = batches(8, bs=8)[0]
    h_ref, d_ref = per_token_halting(model, x, KLHalt(1e-4), 12)
    nll_ref, hit_ref = nll_rows(model, h_ref, y)
    states = model(x, loops=3, return_states=True).states
    kl_ref = successive_kl(model.readout, states)
    monkeypatch.setattr(loss, "CHUNK_ELEMENTS", 5 * 257)  # 5 rows a chunk at |V| = 257
    h, d = per_token_halting(model, x, KLHalt(1e-4), 12)
    assert torch.equal(d, d_ref) and 1 < d.float().mean() < 12
    torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)
    nll, hit = nll_rows(model, h_ref, y)
    torch.testing.assert_close(nll, nll_ref)
    assert torch.equal(hit, hit_ref)
    manual = torch.nn.functional.cross_entropy(model.readout(h_ref).flatten(0, 1), y.flatten())
    assert float(nll.mean()) == pytest.approx(float(manual), rel=1e-6)
    torch.testing.assert_close(successive_kl(model.readout, states), kl_ref)
