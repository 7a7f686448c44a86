"""The exact bias-subtraction counterfactual (paper appendix "When Zero-Deviation Forcing
Accumulates": Eq. 10, Lemma 1, Theorem 2, Corollary 3).

From one initial deviation ``Δ_{t0}`` the original and the bias-subtracted trajectories are

    Δ_{t+1} = T_t(Δ_t)                 Δ̄_{t+1} = T_t(Δ̄_t) − b_t(e)          (Eq. 10)

and ``E_t = Δ_t − Δ̄_t`` is the counterfactual forcing response. With the exact secant map
``A_t^sec = ∫₀¹ J_Δ T_t(Δ̄_t + ξ E_t) dξ`` (Eq. 11),

    E_{t+1} = A_t^sec E_t + b_t                                            (Lemma 1, Eq. 12)
    E_T = Σ_k Φ_E(T, k+1) b_k                                              (Theorem 2, Eq. 13)
    ‖A_t^sec‖ ≤ q < 1, ‖b_t‖ ≤ B  ⇒  ‖E_T‖ ≤ B (1 − qⁿ)/(1 − q)            (Corollary 3, Eq. 14)

:func:`counterfactual_check` verifies these numerically for any differentiable map: ``A_t^sec v``
is computed from Jacobian-vector products (``torch.func.jvp``) at the nodes of an adaptive
composite Gauss–Legendre rule on [0, 1] (trained maps can be nearly singular along a long secant
segment, where a hidden state passes close to 0 inside RMSNorm), ``‖A_t^sec‖₂`` by power iteration
with vector-Jacobian products. The masked SCSE map is
discontinuous at Δ = 0; the paper then applies the result to the raw map, whose ``b̃_t`` is zero
for SCSE's zero-preserving core, so the check is trivial there (E ≡ 0).

Forward-mode AD through attention needs the math SDPA backend on the CPU; :func:`math_sdpa`
selects it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import jvp, vjp

from looplm.diagnostics.anchor import mean_square

DeltaMap = Callable[[torch.Tensor, int], torch.Tensor]


@contextmanager
def math_sdpa() -> Iterator[None]:
    """Use the math ``scaled_dot_product_attention`` backend (forward AD works through it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


Quadrature = list[tuple[float, float]]  # (ξ, weight) pairs on [0, 1]


def gauss_legendre01(n: int, a: float = 0.0, b: float = 1.0) -> tuple[list[float], list[float]]:
    """Gauss–Legendre nodes and weights on [a, b] (exact for polynomials of degree ≤ 2n − 1)."""
    x, w = np.polynomial.legendre.leggauss(n)
    half = (b - a) / 2
    return [float(v) for v in a + (x + 1) * half], [float(v) for v in w * half]


def _rule(n: int, a: float, b: float) -> Quadrature:
    return list(zip(*gauss_legendre01(n, a, b)))


def secant_apply(
    fn: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    segment: torch.Tensor,
    tangent: torch.Tensor,
    n_nodes: int = 16,
    *,
    quadrature: Quadrature | None = None,
) -> torch.Tensor:
    """``A^sec v = ∫₀¹ J fn(start + ξ·segment) v dξ`` as a weighted sum of JVPs.

    The rule is ``quadrature`` if given, else ``n_nodes``-point Gauss–Legendre on [0, 1].
    """
    rule = quadrature if quadrature is not None else _rule(n_nodes, 0.0, 1.0)
    out = torch.zeros_like(tangent)
    for xi, w in rule:  # eager: forward-mode autograd of one step at each quadrature node
        _, jv = jvp(fn, (start + xi * segment,), (tangent,))
        out = out + w * jv.detach()
    return out


def adaptive_secant(
    fn: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    segment: torch.Tensor,
    tangent: torch.Tensor,
    *,
    n_nodes: int = 8,
    rtol: float = 1e-8,
    max_panels: int = 32,
) -> tuple[torch.Tensor, float, Quadrature]:
    """``A^sec v`` by adaptive composite Gauss–Legendre quadrature.

    Each panel is integrated with ``n_nodes`` points on the whole panel and on its two halves;
    the difference estimates the panel's error, and the panel with the largest error is split
    until the summed estimate is below ``rtol·‖A^sec v‖`` or ``max_panels`` is reached. Along a
    long secant segment the map can be nearly singular (RMSNorm of a hidden state that passes
    close to 0), which a single global rule cannot resolve.

    Returns:
        (value, relative error estimate, the final composite rule — reusable for other tangents).
    """

    def integral(a: float, b: float) -> torch.Tensor:
        return secant_apply(fn, start, segment, tangent, quadrature=_rule(n_nodes, a, b))

    def panel(a: float, b: float, whole: torch.Tensor) -> tuple:
        m = (a + b) / 2
        left, right = integral(a, m), integral(m, b)
        return (float((whole - left - right).norm()), a, b, left, right)

    panels = [panel(0.0, 1.0, integral(0.0, 1.0))]
    while True:
        total = sum(p[3] + p[4] for p in panels)
        err = sum(p[0] for p in panels)
        scale = float(total.norm())
        if err <= rtol * max(scale, torch.finfo(total.dtype).tiny) or len(panels) >= max_panels:
            break
        worst = max(range(len(panels)), key=lambda i: panels[i][0])
        _, a, b, left, right = panels.pop(worst)
        m = (a + b) / 2
        panels += [panel(a, m, left), panel(m, b, right)]
    rule: Quadrature = []
    for _, a, b, _, _ in sorted(panels, key=lambda p: p[1]):
        m = (a + b) / 2
        rule += _rule(n_nodes, a, m) + _rule(n_nodes, m, b)
    rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    return total, rel, rule


def secant_opnorm(
    fn: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    segment: torch.Tensor,
    *,
    quadrature: Quadrature | None = None,
    n_nodes: int = 16,
    iters: int = 30,
    generator: torch.Generator | None = None,
    stop_above: float | None = None,
) -> float:
    """Power-iteration estimate of ``‖A^sec‖₂`` (a lower bound that tightens with ``iters``).

    Every ``‖A v‖`` with ‖v‖ = 1 is a lower bound of the norm, so with ``stop_above`` the
    iteration returns as soon as one exceeds it (enough to decide ``‖A^sec‖₂ ≥ stop_above``).
    """
    rule = quadrature if quadrature is not None else _rule(n_nodes, 0.0, 1.0)
    vjps = [(w, vjp(fn, start + xi * segment)[1]) for xi, w in rule]
    v = torch.randn(start.shape, generator=generator, dtype=torch.float64).to(start)
    v = v / v.norm()
    for _ in range(iters):
        av = secant_apply(fn, start, segment, v, quadrature=rule)
        sigma = float(av.norm())
        if sigma == 0.0:
            return 0.0
        if stop_above is not None and sigma >= stop_above:
            return sigma
        atav = sum(w * f(av)[0] for w, f in vjps).detach()  # Aᵀ A v
        v = atav / atav.norm()
    return float(secant_apply(fn, start, segment, v, quadrature=rule).norm())


@torch.no_grad()
def bias_subtraction(
    tmap: DeltaMap,
    delta0: torch.Tensor,
    loops: int,
    t0: int = 0,
    biases: list[torch.Tensor] | None = None,
) -> dict:
    """Eq. 10 from ``Δ_{t0} = delta0`` for ``loops`` steps (no derivatives needed).

    ``biases`` may hold the already computed ``b_t = T_t(0)`` for t = t0 … t0+loops−1.

    Returns ``E_energy`` (N⁻¹‖E_t‖²_F, t = t0 … t0+loops), ``bias_energy`` (N⁻¹‖b_t‖²_F),
    ``delta_energy`` (N⁻¹‖Δ_t‖²_F) and the final tensors ``delta_T`` and ``delta_bar_T``.
    """
    delta = bar = delta0
    out = {"E_energy": [0.0], "bias_energy": [], "delta_energy": [mean_square(delta0)]}
    zero = torch.zeros_like(delta0)
    for t in range(t0, t0 + loops):
        b = tmap(zero, t) if biases is None else biases[t - t0]
        delta, bar = tmap(delta, t), tmap(bar, t) - b
        out["E_energy"].append(mean_square(delta - bar))
        out["bias_energy"].append(mean_square(b))
        out["delta_energy"].append(mean_square(delta))
    out["delta_T"], out["delta_bar_T"] = delta, bar
    return out


@dataclass
class _Walk:
    """The two trajectories over the interval and the per-step Lemma 1 quantities."""

    delta: torch.Tensor
    bar: torch.Tensor
    acc: torch.Tensor
    rel: list[float]
    e_norm: list[float]
    b_norm: list[float]
    lower: list[float | None]
    quad_err: list[float]
    quad_panels: list[int]
    segments: list


def _walk(
    tmap: DeltaMap,
    delta0: torch.Tensor,
    steps: int,
    t0: int,
    n_nodes: int,
    max_panels: int,
    rtol: float,
) -> _Walk:
    """Step Δ_t and Δ̄_t from ``delta0``; per step the secant integral A_t E_t (Lemma 1), the
    running Σ Φ b (Theorem 2) and the segments Corollary 3's power iteration needs."""
    delta = bar = delta0.detach()
    acc = torch.zeros_like(delta0)  # Σ Φ b via the recursion S_{t+1} = A_t S_t + b_t
    zero = torch.zeros_like(delta0)
    rel, e_norm, b_norm, lower, quad_err, quad_panels = [], [], [], [], [], []
    segments = []  # (t, Δ̄_t, E_t, rule) of the non-trivial steps, for the power iteration
    tiny = torch.finfo(delta0.dtype).tiny
    with math_sdpa():
        for t in range(t0, t0 + steps):

            def fn(x: torch.Tensor, t: int = t) -> torch.Tensor:
                return tmap(x, t)

            with torch.no_grad():
                b = fn(zero)
                delta_next = fn(delta)
                bar_next = fn(bar) - b
            e = delta - bar
            e_next = delta_next - bar_next
            if e.any():
                a_e, q_err, rule = adaptive_secant(
                    fn, bar, e, e, n_nodes=n_nodes, rtol=rtol, max_panels=max_panels
                )
            else:  # Δ̄_t = Δ_t: the segment is a point, A_t^sec = J T_t(Δ̄_t), and A·0 = 0
                a_e, q_err, rule = zero, 0.0, [(0.5, 1.0)]
            quad_err.append(q_err)
            quad_panels.append(len(rule) // (2 * n_nodes) if e.any() else 0)
            rel.append(float((e_next - a_e - b).norm() / e_next.norm().clamp_min(tiny)))
            # A_t^sec is linear: a zero tangent needs no JVPs (SCSE's E ≡ 0)
            acc = (secant_apply(fn, bar, e, acc, quadrature=rule) if acc.any() else zero) + b
            e_n = float(e.norm())
            lower.append(float(a_e.norm()) / e_n if e_n > 0 else None)
            if segments or float(b.abs().max()) > 0 or e_n > 0:
                segments.append((t, bar, e, rule))
            e_norm.append(float(e_next.norm()))
            b_norm.append(float(b.norm()))
            delta, bar = delta_next.detach(), bar_next.detach()
    return _Walk(delta, bar, acc, rel, e_norm, b_norm, lower, quad_err, quad_panels, segments)


# long: Lemma 1 / Theorem 2 / Corollary 3 over one walk, each bound beside its check
def counterfactual_check(
    tmap: DeltaMap,
    delta0: torch.Tensor,
    steps: int,
    *,
    t0: int = 0,
    n_nodes: int = 8,
    max_panels: int = 32,
    rtol: float = 1e-8,
    power_iters: int = 10,
    generator: torch.Generator | None = None,
) -> dict:
    """Numerical check of Lemma 1, Theorem 2 and (when its premise holds) Corollary 3.

    Args:
        tmap: a differentiable deviation map ``T_t(Δ)`` (use float64 for a tight check).
        delta0: the shared initial deviation ``Δ_{t0}``.
        steps: interval length n = T − t0.
        n_nodes, max_panels, rtol: the adaptive composite Gauss–Legendre rule of the secant
            integral (:func:`adaptive_secant`; ``max_panels=1`` is a plain ``n_nodes`` rule).
            The composite rule found for ``A_t E_t`` is reused for Theorem 2 and the norm.
        power_iters: power iterations for ``‖A_t^sec‖₂`` (0 skips Corollary 3).

    Corollary 3's premise ``‖A_t^sec‖₂ ≤ q < 1`` is decided in two stages. ``‖A_t E_t‖/‖E_t‖`` is
    a free lower bound of ``‖A_t^sec‖₂`` (A_t E_t is computed for Lemma 1 anyway): when it reaches 1
    at some step the premise provably fails. Otherwise ``‖A_t^sec‖₂`` is estimated by power
    iteration (also a lower bound, tight once converged), and the bound is evaluated with it.
    Steps where b_t = 0 and E_t = 0 leave E_{t+1} = 0 whatever A_t is, so the interval starts at
    the first step where the recursion is not identically zero.

    Returns:
        per-step lists ``lemma1_rel_error`` (‖E_{t+1} − A E_t − b_t‖ / ‖E_{t+1}‖), ``E_norm``
        (‖E_{t+1}‖), ``bias_norm``, ``secant_lower_bound``, ``quadrature_rel_error_est`` and
        ``quadrature_panels``; ``lemma1_verified`` (max error < 1e-4), ``theorem2_rel_error``
        (‖E_T − Σ Φ b‖ / ‖E_T‖); ``corollary3`` {premise_holds, q, q_method, B, n, bound,
        E_T_norm, holds}. Norms are Euclidean over the whole vectorized batch (examples do not
        interact, so A^sec is block diagonal and its norm is the largest example's).
    """
    w = _walk(tmap, delta0, steps, t0, n_nodes, max_panels, rtol)
    delta, bar, acc, rel, e_norm, b_norm = w.delta, w.bar, w.acc, w.rel, w.e_norm, w.b_norm
    lower, quad_err, quad_panels, segments = w.lower, w.quad_err, w.quad_panels, w.segments
    tiny = torch.finfo(delta0.dtype).tiny
    e_T = delta - bar
    e_T_norm = float(e_T.norm())
    out = {
        "t0": t0,
        "steps": steps,
        "n_nodes": n_nodes,
        "max_panels": max_panels,
        "dtype": str(delta0.dtype).replace("torch.", ""),
        "lemma1_rel_error": rel,
        "lemma1_max_rel_error": max(rel) if rel else 0.0,
        "lemma1_verified": (max(rel) if rel else 0.0) < 1e-4,
        "quadrature_rel_error_est": quad_err,
        "quadrature_panels": quad_panels,
        "E_norm": e_norm,
        "bias_norm": b_norm,
        "secant_lower_bound": lower,
        "theorem2_rel_error": float((e_T - acc).norm() / max(e_T_norm, tiny)),
        "trivial": e_T_norm == 0.0 and max(b_norm, default=0.0) == 0.0,
    }
    if power_iters:
        out["corollary3"] = _corollary3(
            tmap, segments, lower, b_norm, e_T_norm, power_iters, generator, out
        )
    return out


def _corollary3(
    tmap: DeltaMap,
    segments: list,
    lower: list[float | None],
    b_norm: list[float],
    e_T_norm: float,
    power_iters: int,
    generator: torch.Generator | None,
    out: dict,
) -> dict:
    """Corollary 3's bound ``‖E_T‖ ≤ B (1 − qⁿ) / (1 − q)`` when ``‖A_t^sec‖₂ ≤ q < 1``; the
    per-step secant norms go into ``out["secant_norm"]`` when they are estimated."""
    big_b, n = max(b_norm, default=0.0), len(segments)
    c3 = {"B": big_b, "n": n, "E_T_norm": e_T_norm}
    known = [v for v in lower if v is not None]
    if not segments:  # b_t = 0 and E_t = 0 throughout: E_T = 0 ≤ 0 = the bound
        c3.update(premise_holds=None, q=None, q_method=None, bound=0.0, holds=e_T_norm == 0.0)
        return c3
    if known and max(known) >= 1.0:
        c3.update(
            premise_holds=False,
            q=max(known),
            q_method="lower bound ‖A E‖/‖E‖",
            bound=None,
            holds=None,
        )
        return c3
    q_t = []
    with math_sdpa(), torch.enable_grad():
        for t, start, seg, rule in segments:
            q_t.append(
                secant_opnorm(
                    lambda x, t=t: tmap(x, t),
                    start,
                    seg,
                    quadrature=rule,
                    iters=power_iters,
                    generator=generator,
                    stop_above=1.0,
                )
            )
            if q_t[-1] >= 1.0:  # the premise fails; the remaining norms are not needed
                break
    q = max(q_t)
    premise = q < 1.0
    bound = big_b * (1 - q**n) / (1 - q) if premise else None
    out["secant_norm"] = q_t
    c3.update(
        premise_holds=premise,
        q=q,
        q_method=f"power iteration ({power_iters} steps)"
        if premise
        else "power iteration, stopped at a lower bound >= 1",
        bound=bound,
        holds=(e_T_norm <= bound * (1 + 1e-9)) if premise else None,
    )
    return c3
