"""Each method's defining equation, checked against an independent computation of one step.

The model is built at the tiny preset, in float64, eval mode, with every weight perturbed off its
initial value; the expected next state is computed here from ``model.block`` and the recurrence's
own parameters, written out from the equation (nothing is reused from the recurrence's code).
Then the forcing bias ``b_t(e) = model.step(h*, ctx, t) − h*`` is checked per method: exactly zero
where the method claims it, non-zero where the paper measures it non-zero.
"""

from __future__ import annotations

import math

import pytest
import torch

import looplm
from looplm.model import build_model
from looplm.model.recurrences import get_recurrence_class
from looplm.settings.config import UNSHARED

ATOL = 1e-12
LOOPED = [n for n in looplm.recurrence_names() if n != UNSHARED]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are dispatch-bound: one intra-op thread is faster and spares shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _setup(name: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = build_model("tiny", name, **{"dropout": 0.0, **kw}).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 257, (3, 8), generator=torch.Generator().manual_seed(seed))
    ctx = model.prepare(ids)
    h = ctx.anchor + 0.5 * torch.randn_like(ctx.anchor)  # a random state off the anchor
    return model, model.recurrence, model.block, ctx, h


def _gamma(t: int, d: int) -> torch.Tensor:
    """The sinusoid written out: γ[2i] = sin(t / 10000^(2i/d)), γ[2i+1] = cos(…)."""
    out = torch.empty(d, dtype=torch.float64)
    for i in range(d // 2):
        w = 1.0 / 10000 ** (2 * i / d)
        out[2 * i], out[2 * i + 1] = math.sin(t * w), math.cos(t * w)
    return out


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _mask(delta: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    return torch.tensor([float((d**2).sum() > eps) for d in delta], dtype=delta.dtype)[
        :, None, None
    ]


# ----------------------------------------------------------------------------- adapters


@torch.no_grad()
def test_capacity_matched_equation():
    model, rec, G, ctx, h = _setup("capacity_matched")
    assert rec.w_in is None and rec.cfg.step_scale == 0.5
    _close(model.step(h, ctx, 2), h + 0.5 * G(h + rec.alpha * ctx.anchor))
    _close(rec.init_state(ctx), ctx.e + 0.1 * rec.anchors.init_delta_proj(ctx.e))


@torch.no_grad()
@pytest.mark.parametrize("t", [0, 5, 47])
def test_step_conditioned_equation_6(t):
    model, rec, G, ctx, h = _setup("step_conditioned")
    d = h.shape[-1]
    src = rec.alpha * rec.w_in(ctx.anchor) + 0.015 * rec.p_step(_gamma(t, d))
    _close(model.step(h, ctx, t), h + 0.35 * G(h + src))


@torch.no_grad()
@pytest.mark.parametrize("t", [0, 3, 7, 8, 47, 95])
def test_step_film_table_equation(t):
    model, rec, G, ctx, h = _setup("step_film")
    d = h.shape[-1]
    row = rec.film_table.weight[min(t, 7)]  # clamped beyond the 8 trained steps
    a, c = row[:d], row[d:]
    x = h + rec.alpha * rec.w_in(ctx.anchor)
    _close(model.step(h, ctx, t), h + 0.35 * G((1 + a) * x + c))


@torch.no_grad()
@pytest.mark.parametrize("t", [0, 9, 47])
def test_step_film_sinusoidal_equation(t):
    model, rec, G, ctx, h = _setup("step_film", step_embedding="sinusoidal", film_scale=0.5)
    d = h.shape[-1]
    ac = rec.film_proj.weight @ (_gamma(t, d) / math.sqrt(d / 2))
    a, c = ac[:d], ac[d:]
    x = h + rec.alpha * rec.w_in(ctx.anchor)
    _close(model.step(h, ctx, t), h + 0.35 * G((1 + 0.5 * a) * x + 0.5 * c))
    assert not torch.allclose(model.step(h, ctx, t), model.step(h, ctx, t + 1))


# ----------------------------------------------------------------------------- norm reset


@torch.no_grad()
@pytest.mark.parametrize("period, t", [(4, 0), (4, 3), (4, 7), (4, 8), (2, 1), (1, 0)])
def test_norm_reset_equation(period, t):
    model, rec, G, ctx, h = _setup("norm_reset", period=period)
    y = h + G(h + ctx.e)
    want = rec.reset_gain * _rms(y, 1e-6) if (t + 1) % period == 0 else y
    _close(model.step(h, ctx, t), want)


# ----------------------------------------------------------------------------- SC-Cond family


@torch.no_grad()
@pytest.mark.parametrize("name", ["sc_cond", "sc_cond_nomask", "scse_leak", "sc_cond_subtractive"])
def test_source_conditioned_equations(name):
    """Listing 1 in hidden coordinates: anchor + (1 − λ)·Δ + m·s·u."""
    model, rec, G, ctx, h = _setup(name)
    leak = 0.02 if name == "scse_leak" else 0.0
    masked = name != "sc_cond_nomask"
    c = rec.kappa * rec.cond_proj(ctx.anchor)  # κ W_c h*
    # example 0 sits inside the zero-deviation threshold region, the others do not
    h = h.clone()
    h[0] = ctx.anchor[0] + 1e-7 * torch.randn_like(h[0])
    delta = h - ctx.anchor
    u = G(delta + c)
    if name == "sc_cond_subtractive":
        u = u - G(c)
    m = _mask(delta) if masked else torch.ones(3, 1, 1, dtype=h.dtype)
    assert m[0] == (0.0 if masked else 1.0) and bool((m[1:] == 1).all())
    want = ctx.anchor + (1 - leak) * delta + m * 0.5 * u
    _close(model.step(h, ctx, 4), want)
    # raw pre-mask map (mask=False): the same update without m
    _close(model.step(h, ctx, 4, mask=False), ctx.anchor + (1 - leak) * delta + 0.5 * u)


@torch.no_grad()
def test_masked_state_is_left_bit_exactly_unchanged():
    """In state coordinates, a masked example's Δ is returned untouched (Eq. 4: q̄ = 0)."""
    for name in ("sc_cond", "sc_cond_subtractive"):
        model, rec, G, ctx, h = _setup(name)
        delta = torch.zeros_like(h)
        delta[0] = 1e-7 * torch.randn_like(h[0])  # ‖Δ‖² ≈ 1e-11 < ε
        delta[1] = torch.randn_like(h[1])
        out = rec.step(G, delta, ctx, 0)
        assert torch.equal(out[0], delta[0]) and torch.equal(out[2], delta[2])
        assert not torch.equal(out[1], delta[1])


# ----------------------------------------------------------------------------- Eq. 22


@torch.no_grad()
@pytest.mark.parametrize("tau", [0.0, 0.015])
def test_forcing_subtraction_equation_22(tau):
    model, rec, G, ctx, h = _setup("forcing_subtraction", step_tau=tau)
    t = 6
    delta = h - ctx.anchor
    tau_t = tau * rec.p_step(_gamma(t, h.shape[-1])) if tau else 0.0
    src = rec.alpha * rec.w_in(ctx.e)  # α W_in e (the embedding, not h*)
    u = G(ctx.anchor + delta + src + tau_t) - G(ctx.anchor + src + tau_t)
    _close(model.step(h, ctx, t), ctx.anchor + delta + 0.35 * u)
    _close(rec.init_state(ctx), rec.anchors.initial(ctx.e) - ctx.anchor)


# ------------------------------------------------ gated loop and hyper-connections (related work)


@torch.no_grad()
def test_gated_equation():
    model, rec, G, ctx, h = _setup("gated")
    x = h + ctx.e
    z = torch.sigmoid(_rms(x, torch.finfo(x.dtype).eps) @ rec.gate_proj.weight.T + rec.gate_bias)
    _close(model.step(h, ctx, 1), z * h + (1 - z) * (h + rec.layerscale * G(x)))
    assert rec.init_state(ctx) is ctx.e


@torch.no_grad()
@pytest.mark.parametrize("name", ["hyper_looped", "hyper_scse"])
def test_hyper_connection_lane_equations(name):
    model, rec, G, ctx, h = _setup(name, lanes=3)
    B, L, d = h.shape
    n = 3
    H = 0.5 * torch.randn(B, n, L, d, dtype=h.dtype)  # distinct lanes
    H[1] = 0.0  # an example at the anchor (hyper_scse: masked)
    H[2, 0] = 0.0  # lane 0 at zero, the others not: the mask looks at every lane (active)
    a, R, b = rec.hc_read, rec.hc_mix, rec.hc_write
    x = sum(a[i] * H[:, i] for i in range(n))
    if name == "hyper_looped":
        u = G(x + ctx.e)
    else:
        u = 0.5 * G(x) * _mask(H.flatten(1, 2))
    want = torch.stack([sum(R[i, j] * H[:, i] for i in range(n)) + b[j] * u for j in range(n)], 1)
    _close(rec.step(G, H, ctx, 2), want)
    base = 0.0 if name == "hyper_looped" else ctx.anchor
    _close(rec.to_hidden(H, ctx), base + H.mean(1))
    if name == "hyper_scse":
        assert torch.equal(rec.step(G, H, ctx, 2)[1], torch.zeros_like(H[1]))


@torch.no_grad()
@pytest.mark.parametrize("name, base", [("hyper_looped", "looped"), ("hyper_scse", "scse")])
def test_hyper_connections_start_as_their_base_recurrence(name, base):
    torch.manual_seed(0)
    hyper = build_model("tiny", name, dropout=0.0).double().eval()
    ref = build_model("tiny", base, dropout=0.0).double().eval()
    missing, unexpected = ref.load_state_dict(hyper.state_dict(), strict=False)
    assert not missing and all(k.startswith("recurrence.hc_") for k in unexpected)
    ids = torch.randint(0, 257, (2, 8))
    torch.testing.assert_close(hyper(ids, loops=5), ref(ids, loops=5), atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------- forcing bias

# The built-in methods' claims, pinned: b_t(e) = 0 exactly (the mask, G(0) = 0, or the eval-mode
# subtraction), and the raw pre-mask b̃_t = 0 too (zero-preserving core or exact subtraction).
# Every class declares its own (zero_forcing_bias, zero_raw_forcing_bias); test_forcing_bias
# checks those declarations, so a new method needs no entry here.
ZERO_BIAS = {
    "scse", "sc_cond", "scse_leak", "sc_cond_subtractive", "forcing_subtraction", "hyper_scse",
}  # fmt: skip
ZERO_RAW = {"scse", "hyper_scse", "sc_cond_subtractive", "forcing_subtraction"}
BUILTIN = [
    n for n in LOOPED if get_recurrence_class(n).__module__.startswith("looplm.model.recurrences.")
]


def test_zero_bias_claims_match_the_classes():
    classes = {n: get_recurrence_class(n) for n in BUILTIN}
    assert {n for n, c in classes.items() if c.zero_forcing_bias} == ZERO_BIAS
    assert {n for n, c in classes.items() if c.zero_raw_forcing_bias} == ZERO_RAW
    for name in LOOPED:  # a zero raw map is zero after the mask too
        cls = get_recurrence_class(name)
        assert cls.zero_forcing_bias or not cls.zero_raw_forcing_bias, name


@torch.no_grad()
@pytest.mark.parametrize("name", LOOPED)
def test_forcing_bias(name):
    cls = get_recurrence_class(name)
    torch.manual_seed(0)
    model = build_model("tiny", name).eval()  # float32, dropout 0.1 switched off by eval()
    ctx = model.prepare(torch.randint(0, 257, (2, 12)))
    for t in (0, 5, 47):
        b = model.step(ctx.anchor, ctx, t) - ctx.anchor
        raw = model.step(ctx.anchor, ctx, t, mask=False) - ctx.anchor
        if cls.zero_forcing_bias:
            assert torch.equal(b, torch.zeros_like(b)), f"{name}: b_{t} ≠ 0"
        else:
            assert b.abs().max() > 1e-4, f"{name}: b_{t} should be non-zero"
        if cls.zero_raw_forcing_bias:
            assert torch.equal(raw, torch.zeros_like(raw)), f"{name}: raw b̃_{t} ≠ 0"
        else:
            assert raw.abs().max() > 1e-4, f"{name}: raw b̃_{t} should be non-zero"


@torch.no_grad()
def test_forcing_subtraction_cancels_only_without_dropout():
    """Eq. 22's two body calls draw independent dropout masks in training mode (paper, App.)."""
    torch.manual_seed(0)
    model = build_model("tiny", "forcing_subtraction", dropout=0.1)
    ctx = model.eval().prepare(torch.randint(0, 257, (2, 12)))
    model.train()
    b = model.step(ctx.anchor, ctx, 0) - ctx.anchor
    assert b.abs().max() > 1e-4
    for name in ("sc_cond", "sc_cond_subtractive"):  # the mask holds in training mode too
        m = build_model("tiny", name, dropout=0.1)
        c = m.eval().prepare(torch.randint(0, 257, (2, 12)))
        m.train()
        assert torch.equal(m.step(c.anchor, c, 0), c.anchor)


@pytest.mark.parametrize(
    "settings", [{}, {"learn_gain": True, "injection_gain": 0.15, "step_scale": 0.7}]
)
def test_looped_variants_equation_and_learned_gain_gradient(settings):
    """h_{t+1} = h_t + s·G(h_t + g·e): g = 1 fixed by default, or the learned α (init 0.15)."""
    model, rec, block, ctx, h = _setup("looped", **settings)
    g = 1.0 if not settings else float(rec.alpha)
    s = settings.get("step_scale", 1.0)
    if settings:
        assert g == pytest.approx(0.15 + 0.0, abs=0.2)  # perturbed off its init by _setup
        assert isinstance(rec.alpha, torch.nn.Parameter) and rec.alpha.requires_grad
    expected = h + s * block(h + g * ctx.e)
    _close(model.step(h, ctx, 0), expected)
    if settings:
        model.train()
        ids = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(1))
        loss = model.loss(ids, ids, loops=3)
        (grad,) = torch.autograd.grad(loss, [rec.alpha])
        assert grad.abs() > 0
        assert any(p is rec.alpha for p in model.recurrence.no_decay_parameters())
