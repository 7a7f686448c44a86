"""The Jacobian lens (looplm.lens.jacobian, looplm.lens.readout): its equations against an independent float64
brute-force Jacobian of the unrolled model, the estimators, merging, files, readouts and errors."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.errors import LoopLMError
from looplm.lens import jacobian as L
from looplm.lens import readout as R
from looplm.model import build_model

SMALL = dict(d_model=8, n_heads=2, d_ff=16, context=8, vocab_size=24, dropout=0.0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(method: str = "scse", seed: int = 0, dtype=torch.float64, **kw):
    """A tiny model whose block is sharpened so that h_T depends visibly on h_t."""
    torch.manual_seed(seed)
    model = build_model("tiny", method, **{**SMALL, **kw}).eval().to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "emb" not in name:
                p.mul_(3.0)
    return model


def prompts(n: int, length: int = 6, seed: int = 1, vocab: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g)


def brute_force_lens(
    model, ids: torch.Tensor, loops: int, skip: int = 0
) -> dict[int, torch.Tensor]:
    """E_{prompt, p ≥ skip} Σ_{p' ≥ p} ∂h_T[p'] / ∂h_t[p] from full autograd Jacobians of the unroll
    restarted at step t (torch.autograd.functional.jacobian, float64), one prompt at a time."""
    out = {}
    for t in range(loops + 1):
        acc, n = torch.zeros(model.config.d_model, model.config.d_model, dtype=torch.float64), 0
        for b in range(ids.shape[0]):
            x = ids[b : b + 1]
            with torch.no_grad():
                ctx = model.prepare(x)
                steps = list(model.unroll(ctx, loops))
            h_t = steps[t].hidden.detach()

            def f(h, ctx=ctx, step=steps[t], t=t):
                last = list(model.unroll(ctx, loops, state=step.state_for(h), start=t))[-1]
                return model.finish(last.hidden, ctx)

            jac = torch.autograd.functional.jacobian(f, h_t)  # (1, L, d, 1, L, d)
            jac = jac[0, :, :, 0, :, :]  # (p', i, p, j)
            Lx = x.shape[1]
            for p in range(skip, Lx):
                acc += jac[p:, :, p, :].sum(0)
                n += 1
        out[t] = acc / n
    return out


FAMILIES = [
    ("scse", {}),
    ("looped", {}),
    ("scse", {"core_layers": 2}),
    ("gated", {}),
    ("hyper_scse", {}),
    ("looped", {"coda_layers": 1, "prelude_layers": 1}),
    ("unshared", {"n_layers": 3}),
]


@pytest.mark.parametrize("method,kw", FAMILIES, ids=lambda v: str(v))
def test_exact_lens_equals_brute_force_jacobian(method, kw):
    model = tiny(method, **kw)
    loops = 3
    ids = prompts(3)
    lens = L.fit_jacobian_lens(model, [ids[:2], ids[2:]], loops=loops, mode="exact")
    ref = brute_force_lens(model, ids, loops)
    assert set(lens.jacobians) == set(range(loops + 1))
    for t in range(loops + 1):
        err = (lens.jacobians[t] - ref[t]).abs().max().item()
        assert err < 1e-8, (t, err)
    # the Jacobian is not trivially the identity before the last step
    assert (lens.jacobians[0] - torch.eye(8, dtype=torch.float64)).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["scse", "hyper_looped", "unshared"])
def test_state_for_replaces_the_hidden_state_and_keeps_the_rest(method):
    model = tiny(method, n_layers=3) if method == "unshared" else tiny(method)
    with torch.no_grad():
        ctx = model.prepare(prompts(2))
        steps = list(model.unroll(ctx, 2))
    st = steps[1]
    assert torch.equal(st.state_for(st.hidden), st.state)  # bit for bit
    delta = torch.randn_like(st.hidden)
    moved = L.LoopStep(1, st.state_for(st.hidden + delta), ctx, st.recurrence)
    assert torch.allclose(moved.hidden, st.hidden + delta, atol=1e-12)


def test_skip_positions_matches_brute_force():
    model = tiny("scse")
    ids = prompts(2)
    lens = L.fit_jacobian_lens(model, [ids], loops=2, skip_positions=2)
    ref = brute_force_lens(model, ids, 2, skip=2)
    full = L.fit_jacobian_lens(model, [ids], loops=2)
    for t in range(3):
        assert (lens.jacobians[t] - ref[t]).abs().max() < 1e-8
    assert (lens.jacobians[0] - full.jacobians[0]).abs().max() > 1e-6
    assert lens.n_positions == 2 * 4


@pytest.mark.parametrize("method", ["scse", "looped", "gated", "unshared"])
def test_last_step_jacobian_is_identity_exactly(method):
    model = tiny(method, dtype=torch.float32, **({"n_layers": 4} if method == "unshared" else {}))
    lens = L.fit_jacobian_lens(model, [prompts(3)], loops=4)
    assert torch.equal(lens.jacobians[4], torch.eye(8, dtype=torch.float64))


def test_hutchinson_error_falls_like_inverse_sqrt_probes():
    model = tiny("scse")
    ids = prompts(4)
    exact = L.fit_jacobian_lens(model, [ids], loops=2)
    ns = [4, 16, 64, 256]
    errs = []
    for n in ns:
        e = []
        for seed in range(4):
            h = L.fit_jacobian_lens(model, [ids], loops=2, mode="hutchinson", probes=n, seed=seed)
            e.append(float((h.jacobians[0] - exact.jacobians[0]).norm() ** 2))
        errs.append(math.sqrt(sum(e) / len(e)))  # root-mean-square error over seeds
    slope = (math.log(errs[-1]) - math.log(errs[0])) / (math.log(ns[-1]) - math.log(ns[0]))
    assert -0.65 < slope < -0.35, (errs, slope)
    assert errs[-1] < 0.2 * errs[0]
    assert h.estimator == "hutchinson" and h.probes == 256


def test_merge_equals_fit_on_union():
    model = tiny("looped")
    a, b = prompts(3, seed=2), prompts(5, seed=3)
    merged = L.fit_jacobian_lens(model, [a], loops=3).merge(L.fit_jacobian_lens(model, [b], 3))
    union = L.fit_jacobian_lens(model, [a, b], loops=3)
    assert merged.n_prompts == 8 and merged.n_positions == union.n_positions == 8 * 6
    for t in range(4):
        assert (merged.jacobians[t] - union.jacobians[t]).abs().max() < 1e-12
    other = L.fit_jacobian_lens(model, [a], loops=2)
    with pytest.raises(LoopLMError, match="loops=3 and loops=2"):
        merged.merge(other)


def test_save_load_round_trip(tmp_path):
    model = tiny("scse")
    lens = L.fit_jacobian_lens(model, [prompts(2)], loops=2, corpus="random ids")
    lens.save(tmp_path / "lens")
    back = L.JacobianLens.load(tmp_path / "lens")
    assert back.metadata() == lens.metadata()
    for t in range(3):
        assert torch.equal(back.jacobians[t], lens.jacobians[t])
    back.check_model(model, loops=2)
    data = (tmp_path / "lens" / "lens.safetensors").read_bytes()
    (tmp_path / "lens" / "lens.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(LoopLMError, match="checksum"):
        L.JacobianLens.load(tmp_path / "lens")


@pytest.mark.parametrize("method,kw", [("scse", {}), ("looped", {}), ("unshared", {"n_layers": 3})])
def test_logit_lens_at_last_step_reproduces_model_logits(method, kw):
    model = tiny(method, dtype=torch.float32, **kw)
    ids = prompts(3)
    hidden, logits = L.loop_states(model, ids, 3)
    lens = L.logit_lens(model, 3)
    out = L.lens_logits(lens, model, hidden)
    assert torch.equal(out[-1], model(ids, loops=3))
    assert torch.equal(out[-1], logits)
    jl = L.fit_jacobian_lens(model, [ids], loops=3)
    assert torch.equal(L.lens_logits(jl, model, hidden)[-1], logits)  # J_T = I exactly
    assert not torch.allclose(out[0], logits)


def test_bad_input_is_one_line_error():
    model = tiny("scse")
    ids = prompts(2)
    with pytest.raises(LoopLMError, match="loops=0"):
        L.fit_jacobian_lens(model, [ids], loops=0)
    with pytest.raises(LoopLMError, match="mode='jacobi'"):
        L.fit_jacobian_lens(model, [ids], loops=2, mode="jacobi")
    lens = L.fit_jacobian_lens(model, [ids], loops=2)
    with pytest.raises(LoopLMError, match="fitted at T=2"):
        lens.check_model(model, loops=8)
    with pytest.raises(LoopLMError, match="fitted on model"):
        lens.check_model(tiny("scse", seed=1))
    with pytest.raises(LoopLMError, match="step t=3"):
        lens.transform(torch.zeros(8, dtype=torch.float64), 3)
    with pytest.raises(LoopLMError, match="unshared model has 3 layers"):
        L.fit_jacobian_lens(tiny("unshared", n_layers=3), [ids], loops=4)
    with pytest.raises(LoopLMError, match="skip_positions=6"):
        L.fit_jacobian_lens(model, [ids], loops=2, skip_positions=6)


# --------------------------------------------------------------------------- tuned lens, fidelity
def test_tuned_lens_is_affine_per_step_and_beats_identity_in_training():
    model = tiny("looped", dtype=torch.float32)
    ids = [prompts(8, seed=4), prompts(8, seed=5)]
    tuned = R.fit_tuned_lens(model, ids, loops=3, steps=60, lr=1e-2)
    hidden, _ = L.loop_states(model, ids[0], 3)
    A, b = tuned.weights[1].float(), tuned.biases[1].float()
    expect = model.readout(torch.einsum("ij,blj->bli", A, hidden[1]) + b)
    assert torch.allclose(tuned.apply(model, hidden[1], 1), expect, atol=1e-5)
    untrained = R.fit_tuned_lens(model, ids, loops=3, steps=0)
    assert untrained.final_kl[0] > 1e-3
    for t in range(3):
        assert tuned.final_kl[t] < 0.8 * untrained.final_kl[t]
        assert torch.equal(untrained.weights[t], torch.eye(8, dtype=torch.float64))


def test_tuned_lens_save_load(tmp_path):
    model = tiny("scse", dtype=torch.float32)
    tuned = R.fit_tuned_lens(model, [prompts(4)], loops=2, steps=5)
    tuned.save(tmp_path / "tuned")
    back = R.TunedLens.load(tmp_path / "tuned")
    assert back.metadata() == tuned.metadata()
    assert all(torch.equal(back.weights[t], tuned.weights[t]) for t in range(3))
    with pytest.raises(LoopLMError, match="kind 'tuned_lens'"):
        L.JacobianLens.load(tmp_path / "tuned")


def test_fidelity_metrics_against_torch_reference():
    model = tiny("looped", dtype=torch.float32)
    x = prompts(5, seed=6)
    y = torch.full_like(x, -100)
    y[:, -1] = prompts(5, seed=7)[:, 0]
    y[0, 2] = 3
    logit = L.logit_lens(model, 3)
    fid = R.fidelity(model, {"logit": logit}, [(x, y)], loops=3, k=2)
    hidden, final = L.loop_states(model, x, 3)
    q = torch.log_softmax(model.readout(hidden[1]).double(), -1)
    p = torch.log_softmax(final.double(), -1)
    kl = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean(1)
    assert torch.allclose(fid.values["logit"]["kl"][1], kl, atol=1e-10)
    assert fid.values["logit"]["kl"][3].abs().max() < 1e-12
    assert torch.equal(fid.values["logit"]["top1"][3], torch.ones(5, dtype=torch.float64))
    agree = (q.argmax(-1) == final.argmax(-1)).double().mean(1)
    assert torch.equal(fid.values["logit"]["top1"][1], agree)
    top2 = final.topk(2, -1).indices
    hit0 = [bool((top2[0, pos] == y[0, pos]).any()) for pos in (2, 5)]
    assert float(fid.values["logit"]["pass_at_k"][3][0]) == sum(hit0) / 2
    big = R.fidelity(model, {"logit": logit}, [(x, y)], loops=3, k=24)
    assert torch.equal(big.values["logit"]["pass_at_k"], torch.ones(4, 5, dtype=torch.float64))
    with pytest.raises(LoopLMError, match="fitted at T=3, not at loops=2"):
        R.fidelity(model, {"logit": logit}, [(x, y)], loops=2)


def test_lens_band_reads_paired_intervals():
    n = 40
    g = torch.Generator().manual_seed(0)
    noise = lambda: 0.01 * torch.randn(4, n, generator=g, dtype=torch.float64)  # noqa: E731
    base = torch.ones(4, n, dtype=torch.float64)
    better = base.clone()
    better[1:3] -= 0.5  # lower KL at steps 1 and 2 only
    vals = {
        "jacobian": {"kl": better + noise(), "top1": base, "pass_at_k": base},
        "logit": {"kl": base + noise(), "top1": base, "pass_at_k": base},
    }
    summary = R.Fidelity(3, 5, ["jacobian", "logit"], vals).summary(n_boot=500)
    band = R.lens_band(summary)
    assert band["steps"] == [1, 2] and band["range"] == [1 / 3, 2 / 3]
    assert R.lens_band(summary, "logit", "jacobian")["steps"] == []


# --------------------------------------------------------------------------- structure
from looplm.lens import structure as S  # noqa: E402


def test_rank_measures_pinned_by_hand():
    m = S.spectrum_measures(torch.diag(torch.tensor([1.0, 1.0, 0.0, 0.0])))
    assert m["effective_rank"] == pytest.approx(2.0) and m["participation_ratio"] == 2.0
    m = S.spectrum_measures(torch.diag(torch.tensor([3.0, 1.0])))
    assert m["participation_ratio"] == pytest.approx(100 / 82)
    assert m["effective_rank"] == pytest.approx(
        math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    )
    model = tiny("scse")
    rows = S.workspace_ranks(model, L.logit_lens(model, 2))
    assert rows[0]["J_effective_rank"] == pytest.approx(8.0) and len(rows) == 3


def test_subspace_overlap_and_random_baseline():
    e = torch.eye(6, dtype=torch.float64)
    a = S.top_subspace(torch.diag(torch.tensor([5.0, 4, 3, 0, 0, 0])), 2)
    b = S.top_subspace(torch.diag(torch.tensor([0.0, 0, 0, 5, 4, 3])), 2)
    assert S.overlap(a, a) == pytest.approx(1.0)
    assert S.overlap(a, b) == pytest.approx(0.0, abs=1e-12)
    c = S.top_subspace(e[[0, 3]] * torch.tensor([[2.0], [1.0]]), 1)  # top direction: e_0
    assert S.overlap(c, a[:, :1]) == pytest.approx(1.0)
    rnd = S.random_overlap(6, 2, n=2000)
    assert rnd["expected"] == pytest.approx(1 / 3) and abs(rnd["mean"] - 1 / 3) < 0.02
    assert rnd["p95"] > rnd["mean"]
    with pytest.raises(LoopLMError, match="k=7"):
        S.top_subspace(e, 7)


def _hand_lens(jacs: dict[int, torch.Tensor]) -> L.JacobianLens:
    return L.JacobianLens(jacs, max(jacs), "exact", 1, 1, "")


def test_stationarity_and_persistence_on_hand_made_fits():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 5, generator=g, dtype=torch.float64) * 0.6
    stat = lambda T: _hand_lens({t: torch.matrix_power(A, T - t) for t in range(T + 1)})  # noqa: E731
    out = S.stationarity([stat(4), stat(2)])
    (pair,) = out["pairs"]
    assert pair["loops"] == [2, 4] and pair["same_lag"] == [0.0, 0.0, 0.0]
    assert min(pair["same_step"]) > 0.1  # J_t^(2) = A^(2−t) against J_t^(4) = A^(4−t)
    per = S.persistence(stat(2), stat(4), k=2)
    assert per["same_lag"] == pytest.approx([1.0, 1.0, 1.0])
    with pytest.raises(LoopLMError, match="4 → 2"):
        S.persistence(stat(4), stat(2))


def test_step_jacobians_and_composition_gap():
    model = tiny("scse")
    ids = [prompts(3, seed=8)]
    steps = S.fit_step_jacobians(model, ids, loops=3)
    for s in range(3):  # M_s is the lens of depth s + 1 at step s
        ref = L.fit_jacobian_lens(model, ids, loops=s + 1).jacobians[s]
        assert (steps[s] - ref).abs().max() < 1e-12
    lens1 = L.fit_jacobian_lens(model, ids, loops=1)
    assert S.composition_gap(lens1, {0: steps[0]}) == [pytest.approx(0.0, abs=1e-14), 0.0]
    lens3 = L.fit_jacobian_lens(model, ids, loops=3)
    gap = S.composition_gap(lens3, steps)
    assert gap[3] == 0.0 and gap[2] < 1e-12 and gap[0] > 1e-6  # E of a product ≠ product of E


# --------------------------------------------------------------------------- interventions
from looplm.lens import interventions as I  # noqa: E402


def test_coordinate_swap_and_project_out_geometry():
    ua = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    ub = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    r = torch.tensor([0.0, 0.0, 3.0, -1.0], dtype=torch.float64)
    h = (2 * ua + 5 * ub + r).reshape(1, 1, 4)
    assert torch.allclose(I.coordinate_swap(h, ua, ub), (5 * ua + 2 * ub + r).reshape(1, 1, 4))
    half = I.coordinate_swap(h, ua, ub, 0.5)
    assert torch.allclose(half, (3.5 * ua + 3.5 * ub + r).reshape(1, 1, 4))
    assert torch.equal(I.coordinate_swap(h, ua, ua), h)  # a self-swap is exact
    ref = (1 * ua + 3 * ub - r).reshape(1, 1, 4)  # the clean state: coordinates (1, 3)
    to_ref = I.coordinate_swap(h, ua, ub, reference=ref)
    assert torch.allclose(to_ref, (3 * ua + 1 * ub + r).reshape(1, 1, 4))
    # swapping twice with the reference stays swapped; without it, it swaps back
    twice = I.coordinate_swap(to_ref, ua, ub, reference=ref)
    assert torch.allclose(twice, to_ref)
    assert torch.allclose(I.coordinate_swap(I.coordinate_swap(h, ua, ub), ua, ub), h)
    assert torch.equal(I.coordinate_swap(h, ua, ua, reference=h), h)
    p = I.project_out(h, torch.stack([ua, ub]))
    assert torch.allclose(p, r.reshape(1, 1, 4))
    assert torch.equal(I.steer(h, ua, 0.0), h)


@pytest.mark.parametrize("method,kw", [("scse", {}), ("looped", {}), ("unshared", {"n_layers": 3})])
def test_self_swap_and_zero_steer_are_exact_no_ops(method, kw):
    model = tiny(method, dtype=torch.float32, **kw)
    ids = prompts(4, seed=9)
    lens = L.fit_jacobian_lens(model, [ids], loops=3)
    base = model(ids, loops=3)
    tok = torch.tensor([1, 2, 3, 4])
    clean, _ = L.loop_states(model, ids, 3)
    for kind, strength, a, b, ref in [
        ("swap", 1.0, tok, tok, None),
        ("swap", 1.0, tok, tok, clean),
        ("steer", 0.0, tok, tok + 1, None),
    ]:
        edit = I.token_edit(kind, model, lens, a, b, strength, ref)
        out = I.intervene(model, ids, 3, (0, 3), edit)
        assert torch.equal(out, base), kind
    real = I.token_edit("swap", model, lens, tok, tok + 1, 1.0)
    assert not torch.equal(I.intervene(model, ids, 3, (1, 2), real), base)


def test_intervention_at_the_last_step_reads_the_edited_state():
    model = tiny("scse", dtype=torch.float64)
    ids = prompts(2, seed=10)
    hidden, _ = L.loop_states(model, ids, 3)
    delta = torch.randn(8, dtype=torch.float64)
    out = I.intervene(model, ids, 3, (3, 3), lambda t, h: I.steer(h, delta, 0.7))
    assert torch.allclose(out, model.readout(hidden[3] + 0.7 * delta), atol=1e-12)
    # an edit at one position of step 1 changes nothing before that position (causal attention)
    pos = torch.zeros(2, 6, dtype=torch.bool)
    pos[:, 3] = True
    out = I.intervene(model, ids, 3, (1, 1), lambda t, h: I.steer(h, delta, 1.0), positions=pos)
    base = model(ids, loops=3)
    assert torch.equal(out[:, :3], base[:, :3]) and not torch.allclose(out[:, 3:], base[:, 3:])


def test_dose_response_zero_dose_and_bad_band():
    model = tiny("looped", dtype=torch.float32)
    x = prompts(6, seed=11)
    lens = L.fit_jacobian_lens(model, [x], loops=3)
    res = I.dose_response(model, lens, [x], 3, (1, 2), strengths=(0.0, 1.0, 4.0))
    assert res["n_prompts"] == 6 and res["target"]["to_rival"][0] == 0.0
    assert res["target"]["changed"][0] == 0.0 and res["control"]["changed"][0] == 0.0
    with torch.no_grad():
        logits = model(x, loops=3)[:, -1]
    top2 = logits.topk(2, -1)
    margin = float((top2.values[:, 1] - top2.values[:, 0]).mean())
    assert res["target"]["margin"][0] == pytest.approx(margin, abs=1e-5)
    for kind in ("steer", "project"):
        other = I.dose_response(model, lens, [x], 3, (1, 3), kind=kind, strengths=(0.0, 8.0))
        assert other["target"]["changed"][0] == 0.0 and other["kind"] == kind
        assert other["target"]["margin"][1] != other["target"]["margin"][0]
    with pytest.raises(LoopLMError, match=r"band=\(2, 4\) lies outside the loop steps 0 … 3"):
        I.dose_response(model, lens, [x], 3, (2, 4))
    with pytest.raises(LoopLMError, match="band=\\(-1, 2\\)"):
        I.intervene(model, x, 3, (-1, 2), lambda t, h: h)
    with pytest.raises(LoopLMError, match="kind='push'"):
        I.dose_response(model, lens, [x], 3, (1, 2), kind="push")
    with pytest.raises(LoopLMError, match="fitted at T=3"):
        I.dose_response(model, lens, [x], 4, (1, 2))


# --------------------------------------------------------------------------- the command
def _checkpoint(path, recurrence: str, seed: int = 0, **extra) -> str:
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config

    kw = dict(dropout=0.0, d_model=16, n_heads=2, d_ff=32, **extra)
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            f"model.recurrence={recurrence}",
            "data.dataset=bool_logic",
            "train.depth_max=3",
            *[f"model.{k}={v}" for k, v in kw.items()],
        ],
    )
    torch.manual_seed(seed)
    model = build_model("tiny", recurrence, **kw)
    save_checkpoint(path, model, cfg, state={"step": 0})
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("lens_ckpt") / "scse", "scse")


def test_lens_cli_writes_json_lenses_and_figures(ckpt, tmp_path, capsys):
    import json

    from looplm.cli import main

    out = tmp_path / "lens"
    argv = ["lens", ckpt, "--out", str(out), "--prompts", "4", "--eval-prompts", "4"]
    argv += ["--extrapolate", "5", "--extrapolate-mode", "hutchinson", "--probes", "2"]
    argv += ["--batch-size", "2", "--tuned-steps", "3", "--k", "2"]
    assert main(argv) == 0
    assert "lens of scse at T=3" in capsys.readouterr().out
    res = json.loads((out / "lens.json").read_text())
    assert res["loops"] == 3 and set(res["fidelity"]) == {"3", "5"}
    assert res["n_fit_prompts"] == 4 and res["n_eval_prompts"] == 4
    assert len(res["fidelity"]["5"]["arms"]["jacobian"]["kl"]) == 6
    assert len(res["structure"]["composition_gap"]) == 4
    assert res["fidelity"]["5"]["estimator"] == "hutchinson"
    for name in ("lens_slice.png", "lens_slice.html", "lens_fidelity.png", "lens_angles.png"):
        assert (out / name).stat().st_size > 1000, name
    assert (out / "lens_dose.png").is_file()
    lens = L.JacobianLens.load(out / "lens_T3")
    assert lens.corpus == "bool_logic/eval" and lens.n_prompts == 4
    # reuse the saved lens: same model and T accepted, another T refused with one line
    reuse = ["lens", ckpt, "--out", str(tmp_path / "again"), "--prompts", "4", "--eval-prompts"]
    reuse += ["4", "--extrapolate", "", "--lens", str(out / "lens_T3"), "--no-plots"]
    assert main(reuse + ["--no-composition", "--tuned-steps", "0"]) == 0
    capsys.readouterr()
    assert main(argv + ["--lens", str(out / "lens_T3"), "--loops", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: loops=2: this lens was fitted at T=3") and "\n" not in err


def test_lens_cli_bad_input_is_one_line(ckpt, tmp_path, capsys):
    from looplm.cli import main

    other = _checkpoint(tmp_path / "other", "scse", seed=1)
    base = ["lens", ckpt, "--out", str(tmp_path / "o"), "--prompts", "2", "--eval-prompts", "2"]
    base += ["--extrapolate", ""]
    fit = tmp_path / "fit"
    fit_argv = ["lens", other, "--out", str(fit), "--prompts", "2", "--eval-prompts", "2"]
    fit_argv += ["--extrapolate", "", "--tuned-steps", "0", "--no-plots", "--no-composition"]
    assert main(fit_argv) == 0
    capsys.readouterr()
    cases = [
        (["--loops", "0"], "--loops 0"),
        (["--band-steps", "2,7"], "band=(2, 7) lies outside the loop steps 0 … 3"),
        (["--mode", "jacobi"], "mode='jacobi'"),
        (["--extrapolate", "2"], "extrapolated depth 2 must be deeper"),
        (["--lens", str(fit / "lens_T3")], "fitted on model"),
    ]
    for extra, msg in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert msg in err and "\n" not in err, (extra, err)
    # the old name of --band-steps still works for one release, with a note naming the new one
    assert main([*base, "--band", "2,7"]) == 2
    note, error = capsys.readouterr().err.strip().split("\n")
    assert note.startswith("note: --band is now --band-steps") and "band=(2, 7) lies" in error


def test_token_ranks_per_step():
    model = tiny("looped", dtype=torch.float32)
    ids = prompts(3, seed=12)
    logit = L.logit_lens(model, 3)
    hidden, final = L.loop_states(model, ids, 3)
    pos = torch.tensor([5, 2, 4])
    top = final[torch.arange(3), pos].argmax(-1)
    ranks = R.token_ranks(model, {"logit": logit}, ids, 3, pos, top)["logit"]
    assert ranks.shape == (4, 3) and torch.equal(ranks[3], torch.zeros(3, dtype=torch.long))
    order = model.readout(hidden[1][1, 2]).argsort(descending=True)
    assert int(ranks[1, 1]) == int((order == top[1]).nonzero())
    with pytest.raises(LoopLMError, match="positions must lie in 0 … 5"):
        R.token_ranks(model, {"logit": logit}, ids, 3, torch.tensor([6, 0, 0]), top)


def test_lens_cli_on_an_unshared_model_fits_one_lens_per_layer(tmp_path, capsys):
    import json

    from looplm.cli import main

    ck = _checkpoint(tmp_path / "unshared", "unshared", n_layers=2)
    out = tmp_path / "lens"
    argv = ["lens", ck, "--out", str(out), "--prompts", "2", "--eval-prompts", "2"]
    assert main(argv + ["--tuned-steps", "1", "--k", "2"]) == 0
    res = json.loads((out / "lens.json").read_text())
    assert res["family"] == "unshared" and res["loops"] == 2 and list(res["fidelity"]) == ["2"]
    assert (out / "lens_angles.png").is_file() and "stationarity" not in res["structure"]
    assert main(argv + ["--loops", "3"]) == 2
    assert "unshared model has 2 layers" in capsys.readouterr().err


def test_a_kl_band_never_goes_below_zero():
    """The lens figures shade mean ± CI; a KL's band is cut at 0 (a wide interval around a small
    KL drew a negative KL on the symlog axis), other metrics keep theirs."""
    import numpy as np

    from looplm.lens.plots import band

    mean, ci = np.array([0.001, 0.5]), np.array([0.004, 0.1])
    lo, hi = band(mean, ci, nonnegative=True)
    assert lo.tolist() == [0.0, 0.4] and np.allclose(hi, [0.005, 0.6])
    assert band(mean, ci)[0][0] < 0
