"""The Jacobian lens (looplm.diagnostics.lens): its equations against an independent float64
brute-force Jacobian of the unrolled model, the estimators, merging, files, readouts and errors."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.diagnostics import lens as L
from looplm.errors import LoopLMError
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
            rec = steps[t].recurrence

            def f(h, ctx=ctx, rec=rec, t=t):
                state = h if rec is None else rec.from_hidden(h, ctx)
                last = list(model.unroll(ctx, loops, state=state, start=t))[-1]
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
