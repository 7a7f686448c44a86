"""Diagnostics: forcing bias, R_t, gain, steering, counterfactual (Lemma 1), convergence."""

from __future__ import annotations

import math

import pytest
import torch

from looplm import build_model
from looplm.diagnostics import (
    AnchorMap,
    anchor_response,
    anchor_start_steering,
    convergence_depth,
    counterfactual_check,
    energy_ratio,
    random_direction_gain,
    source_gain,
    successive_kl,
    unit_directions,
)
from looplm.diagnostics.convergence import TOKEN_TYPES, _byte_types, _piece_types
from looplm.model.recurrences import get_recurrence_class, recurrence_names
from looplm.settings.config import UNSHARED


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: one intra-op thread is faster, much faster on a busy shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(recurrence: str, dtype=torch.float32, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return build_model("tiny", recurrence, dropout=0.0, **kw).eval().to(dtype)


def _ids(B: int = 2, L: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(seed))


def _unroll(model, ids, loops):
    with torch.no_grad():
        return model(ids, loops=loops, return_states=True)


# ----------------------------------------------------------------------------- anchor response


def test_scse_forcing_bias_and_raw_bias_exactly_zero():
    model = _model("scse")  # float32, as trained (the CLI test covers float64)
    out = _unroll(model, _ids(), 6)
    res = anchor_response(
        model, out.context, out.states, generator=torch.Generator().manual_seed(0)
    )
    assert res["bias_max_abs"] == [0.0] * 6
    assert res["raw_bias_max_abs"] == [0.0] * 6
    assert res["ratio"] == [0.0] * 6
    # the ordinary trajectory is far from the anchor (non-collapse check)
    assert all(e > 0 for e in res["anchor_energy"])
    assert all(u > 0 for u in res["update_energy"])
    for t in range(6):  # bit-exact in hidden coordinates too
        for mask in (True, False):
            b = AnchorMap(model, out.context, mask=mask).bias(t)
            assert torch.equal(b, torch.zeros_like(b))


def test_zero_forcing_flag_holds_for_every_registered_recurrence():
    """Recurrences declaring ``zero_forcing_bias`` have b_t = 0 exactly in their anchor coordinates."""
    names = [n for n in recurrence_names() if n != UNSHARED]
    flagged = [n for n in names if get_recurrence_class(n).zero_forcing_bias]
    assert "scse" in flagged
    ids = _ids(2, 6)
    for name in flagged:
        model = _model(name)
        with torch.no_grad():
            ctx = model.prepare(ids)
            for t in (0, 3):
                b = AnchorMap(model, ctx).bias(t)
                assert float(b.abs().max()) == 0.0, name


def test_looped_forcing_bias_is_nonzero_and_is_G_of_injected_anchor():
    model = _model("looped", torch.float64)
    out = _unroll(model, _ids(), 4)
    res = anchor_response(
        model, out.context, out.states, generator=torch.Generator().manual_seed(0)
    )
    assert all(b > 0 for b in res["bias_energy"])
    assert all(r > 0 for r in res["ratio"])
    e = out.context.e
    # h* = e, so b_t(e) = G((1 + g)·e) with g = 1 (module docstring of recurrences/looped.py)
    with torch.no_grad():
        expected = model.block(2.0 * e)
    torch.testing.assert_close(AnchorMap(model, out.context).bias(2), expected)
    # R_t from its definition on this batch
    b0 = AnchorMap(model, out.context).bias(0)
    upd = out.states[1] - out.states[0]
    assert res["ratio"][0] == pytest.approx(float(b0.pow(2).mean() / upd.pow(2).mean()), rel=1e-9)


def test_energy_ratio_formula_and_floor():
    b = torch.full((2, 3, 4), 2.0)
    assert energy_ratio(b, torch.ones(2, 3, 4)) == pytest.approx(4.0)
    assert energy_ratio(b, torch.full((2, 3, 4), 0.5)) == pytest.approx(16.0)
    # N⁻¹‖update‖² = 1e-16 < 1e-12: the floor is active
    assert energy_ratio(b, torch.full((2, 3, 4), 1e-8)) == pytest.approx(4.0 / 1e-12)
    assert energy_ratio(b, torch.zeros(2, 3, 4)) == pytest.approx(4.0e12)
    assert energy_ratio(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)) == 0.0
    # N counts every entry: one non-zero entry out of 24
    one = torch.zeros(2, 3, 4)
    one[1, 2, 3] = 3.0
    assert energy_ratio(one, torch.ones(2, 3, 4)) == pytest.approx(9.0 / 24)


# ----------------------------------------------------------------------------- gain


def test_random_direction_gain_of_linear_map_is_norm_of_A_v():
    g = torch.Generator().manual_seed(3)
    B, L, d = 2, 3, 4
    A = torch.randn(L * d, L * d, generator=g, dtype=torch.float64)

    def fn(x):
        return (x.reshape(B, -1) @ A.T).reshape(B, L, d)

    x = torch.randn(B, L, d, generator=g, dtype=torch.float64)
    dirs = unit_directions((B, L, d), 4, generator=g, dtype=torch.float64)
    assert dirs.shape == (4, B, L, d)
    torch.testing.assert_close(
        dirs.reshape(4, B, -1).norm(dim=-1), torch.ones(4, B, dtype=torch.float64)
    )
    gains = random_direction_gain(fn, x, dirs, eps=1e-3)
    expected = (dirs.reshape(4, B, -1) @ A.T).norm(dim=-1)  # ‖A v‖ per direction and example
    torch.testing.assert_close(gains, expected, rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------- steering


def test_anchor_start_steering_scse_stays_and_looped_follows_dose():
    ids = _ids(3, 6)
    scse = _model("scse", torch.float64)
    st, arrays = anchor_start_steering(scse, scse.prepare(ids), 5)
    assert st["stays_at_anchor"] and not st["dose"]["source_channel"]
    assert float(abs(arrays["traj"]).max()) == 0.0

    looped = _model("looped", torch.float64)
    ctx = looped.prepare(ids)
    st, arrays = anchor_start_steering(looped, ctx, 5)
    assert not st["stays_at_anchor"] and st["dose"]["source_channel"]
    assert st["ray_cosine_per_step_mean"][0] == pytest.approx(1.0)  # Δ_1 = b_0(e)
    assert looped.recurrence.source_gain == 1.0  # restored
    assert arrays["traj"].shape == (3, 6, looped.config.d_model)
    # the dose-response reference is the injection-removed rollout: h_{t+1} = h_t + G(h_t)
    with torch.no_grad(), source_gain(looped, 0.0):
        h = looped.step(ctx.anchor, ctx, 0)
        expected = ctx.anchor + looped.block(ctx.anchor)
    torch.testing.assert_close(h, expected)
    ratio = {g: st["dose"][f"gain_{g:g}"]["displacement_over_push"]["mean"] for g in (0.5, 1, 2)}
    assert 0 < ratio[0.5] < ratio[1] < ratio[2]


# ----------------------------------------------------------------------------- counterfactual


def test_lemma1_and_theorem2_hold_on_tiny_additive_model():
    model = _model("looped", torch.float64, d_model=64, n_heads=2, d_ff=128)
    for p in model.parameters():
        p.requires_grad_(False)
    out = _unroll(model, _ids(2, 6), 1)
    tmap = AnchorMap(model, out.context, mask=False)
    delta0 = out.states[0] - out.context.anchor
    res = counterfactual_check(tmap, delta0, 3, n_nodes=8, max_panels=1, power_iters=0)
    assert not res["trivial"] and min(res["E_norm"]) > 0
    assert res["lemma1_max_rel_error"] < 1e-4
    assert res["theorem2_rel_error"] < 1e-4
    # the check is sensitive: a one-node (midpoint) secant misses the curvature
    coarse = counterfactual_check(tmap, delta0, 3, n_nodes=1, max_panels=1, power_iters=0)
    assert coarse["lemma1_max_rel_error"] > 100 * max(res["lemma1_max_rel_error"], 1e-12)


def test_corollary3_bound_on_a_contractive_map():
    g = torch.Generator().manual_seed(5)
    W, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))  # ‖W‖₂ = 1
    c = torch.randn(1, 2, 6, generator=g, dtype=torch.float64)

    def tmap(delta, t):  # ‖J‖₂ ≤ 0.5, b_t = c·(1 + 0.1 t)
        return 0.5 * torch.tanh(delta @ W) + c * (1 + 0.1 * t)

    delta0 = torch.randn(1, 2, 6, generator=g, dtype=torch.float64)
    res = counterfactual_check(tmap, delta0, 5, n_nodes=16, power_iters=30)
    assert res["lemma1_max_rel_error"] < 1e-10
    c3 = res["corollary3"]
    assert c3["premise_holds"] is True and c3["q"] <= 0.5 + 1e-9
    assert c3["holds"] is True and c3["E_T_norm"] <= c3["bound"]
    q, B, n = c3["q"], c3["B"], c3["n"]
    assert c3["bound"] == pytest.approx(B * (1 - q**n) / (1 - q))


# ----------------------------------------------------------------------------- convergence


def test_kl_per_loop_zero_when_states_constant_and_positive_otherwise():
    model = _model("looped", torch.float64)
    ids = _ids(2, 8)
    out = _unroll(model, ids, 4)
    kl = successive_kl(model.readout, out.states)
    assert kl.shape == (4, 2, 8) and float(kl[0].mean()) > 0
    # KL(p_1 ‖ p_0) from its definition
    p1 = torch.softmax(model.readout(out.states[1]).double(), -1)
    p0 = torch.softmax(model.readout(out.states[0]).double(), -1)
    manual = (p1 * (p1.log() - p0.log())).sum(-1)
    torch.testing.assert_close(kl[0], manual)
    # a model whose block update is identically zero: h_{t+1} = h_t
    with torch.no_grad():
        model.block.attn.proj.weight.zero_()
        model.block.mlp.down.weight.zero_()
    out = _unroll(model, ids, 4)
    assert all(torch.equal(h, out.states[0]) for h in out.states)
    kl = successive_kl(model.readout, out.states)
    assert torch.equal(kl, torch.zeros_like(kl))
    assert torch.equal(convergence_depth(kl, 1e-3), torch.ones(2, 8, dtype=torch.long))


def test_convergence_depth_first_loop_below_threshold():
    kl = torch.tensor([[[0.5, 0.5]], [[1e-4, 0.2]], [[0.3, 0.1]]])  # (T=3, B=1, L=2)
    assert convergence_depth(kl, 1e-3).tolist() == [[2, 4]]  # 4 = T + 1: never below τ


def test_token_types_bytes_and_pieces():
    row = list(b"The cat's owner didn't see it, 42.\n")
    kinds = _byte_types(row, 256)
    assert set(kinds) <= set(TOKEN_TYPES)
    by_char = dict(zip("The cat's owner didn't see it, 42.\n", kinds))
    assert kinds[:3] == ["function"] * 3  # "The"
    assert kinds[4:9] == ["content"] * 5  # "cat's" (possessive of a noun)
    assert kinds[16:22] == ["function"] * 6  # "didn't"
    assert by_char[" "] == "whitespace" and by_char[","] == "punctuation"
    assert by_char["4"] == "other" and kinds[-1] == "whitespace"
    pieces = ["The", " cat", "'s", " didn", "'t", " walk", "ing", ",", " ", "\n"]
    assert _piece_types(pieces) == [
        "function", "content", "content", "function", "function", "content", "content",
        "punctuation", "whitespace", "whitespace",
    ]  # fmt: skip


def test_diagnostics_run_for_every_registered_recurrence():
    """The diagnostics use only the public model interface, so any registered method works."""
    from looplm.diagnostics.runner import DiagnoseOptions, diagnose_model

    ids = _ids(1, 4)
    batches = [(ids, torch.full_like(ids, -100))]
    opts = DiagnoseOptions(loops=2, n_dirs=1, steer_inputs=1, check_steps=0)
    for name in recurrence_names():
        if name == UNSHARED:
            continue
        model = _model(name, d_model=32, n_heads=2, d_ff=64)
        res, _ = diagnose_model(model, batches, opts, progress=False)
        s = res["summary"]
        assert s["anchor_energy_T"] is not None and math.isfinite(s["anchor_energy_T"]), name
        assert math.isfinite(s["gain_t0"]), name


def test_the_r_t_title_says_when_the_bars_are_past_the_trained_depth():
    from looplm.diagnostics.plots import last_step_text

    row = {"summary": {"last_step": 47}, "convergence": {"ref_depth": 8}}
    assert last_step_text([row]) == "t = 47 (T = 48, extra-loop: trained to T ≤ 8)"
    inside = {"summary": {"last_step": 7}, "convergence": {"ref_depth": 8}}
    assert last_step_text([inside]) == "t = 7"
