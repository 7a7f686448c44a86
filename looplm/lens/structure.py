"""Workspace structure of fitted Jacobian lenses (:mod:`looplm.lens.jacobian`).

* **Rank** of J_t and of the token map ``D_t = W_U diag(γ) J_t``: with singular values σ_i and
  p_i = σ_i / Σσ, the effective rank ``exp(−Σ p_i log p_i)`` and the participation ratio
  ``(Σσ_i²)² / Σσ_i⁴`` (both d for an isotropic map, 1 for rank one).
* **Subspaces**: the top-k right singular vectors of J_t, the directions of h_t that move the final
  state most (the row space, where the token directions D_t live). Two subspaces are compared by
  the mean squared cosine of their k principal angles, ``‖U_aᵀ U_b‖_F² / k`` ∈ [0, 1]; for random
  k-dimensional subspaces of R^d its expectation is k/d (:func:`random_overlap`).
* **Stationarity**: the weights are shared, so if the dynamics were stationary J_{t→T} would
  depend on T − t only: ``J^{(T_a)}_{T_a−k}`` vs ``J^{(T_b)}_{T_b−k}`` at the same lag k, against
  the same absolute step.
* **Composition**: the expected Jacobian of the composed map against the product of the expected
  one-step Jacobians ``J_T · M_{T−1} ⋯ M_t``, ``M_s = E Σ_{p'≥p} ∂h_{s+1}[p'] / ∂h_s[p]`` (the
  expectation of a product is not the product of expectations; the gap says how much of J_t is
  prompt-specific).
* **Persistence**: the overlap of each step's subspace at T with the subspace at an extrapolated
  depth T' (same step, and same lag to the end).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from looplm.errors import LoopLMError
from looplm.lens.jacobian import (
    Batch,
    JacobianLens,
    batch_ids,
    check_lens_loops,
    frozen_weights,
    position_masks,
    unroll_for_lens,
)


# --------------------------------------------------------------------------- rank
def spectrum_measures(matrix: torch.Tensor) -> dict[str, float]:
    """Effective rank (entropy of normalised singular values) and participation ratio."""
    s = torch.linalg.svdvals(matrix.double())
    if float(s.sum()) == 0.0:
        return {"effective_rank": 0.0, "participation_ratio": 0.0, "top_sv": 0.0}
    p = s / s.sum()
    p = p[p > 0]
    erank = float(torch.exp(-(p * p.log()).sum()))
    pr = float(s.pow(2).sum() ** 2 / s.pow(4).sum())
    return {"effective_rank": erank, "participation_ratio": pr, "top_sv": float(s[0])}


def token_map(model: torch.nn.Module, lens: JacobianLens, t: int) -> torch.Tensor:
    """``D_t = W_U diag(γ) J_t`` (V, d): the token directions of step t."""
    return lens.token_directions(model, t, torch.arange(model.config.vocab_size))


def workspace_ranks(model: torch.nn.Module, lens: JacobianLens) -> list[dict[str, float]]:
    """Per loop step: rank measures of J_t and of D_t = W_U diag(γ) J_t."""
    rows = []
    for t in lens.steps():
        j = spectrum_measures(lens.jacobians[t])
        w = spectrum_measures(token_map(model, lens, t))
        rows.append(
            {"t": t, **{f"J_{k}": v for k, v in j.items()}, **{f"WJ_{k}": v for k, v in w.items()}}
        )
    return rows


# --------------------------------------------------------------------------- subspaces
def check_k(k: int, d: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise LoopLMError(f"k={k!r}: the subspace dimension must lie in 1 … {d}")
    return k


def top_subspace(matrix: torch.Tensor, k: int) -> np.ndarray:
    """Orthonormal basis (d, k) of the top-k right singular vectors of ``matrix`` (·, d)."""
    check_k(k, matrix.shape[1])
    _, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return vh[:k].T.cpu().numpy()


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean squared cosine of the principal angles between span(a) and span(b) (each (d, k))."""
    from scipy.linalg import subspace_angles

    cos2 = np.cos(subspace_angles(a, b)) ** 2
    return float(cos2.mean())


def random_overlap(d: int, k: int, n: int = 1000, seed: int = 0) -> dict[str, float]:
    """Overlap of independent uniformly random k-subspaces of R^d: expectation k/d, and the
    sampled mean and 95th / 99th percentiles over ``n`` pairs (the random baseline)."""
    check_k(k, d)
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n):
        qa, _ = np.linalg.qr(rng.standard_normal((d, k)))
        qb, _ = np.linalg.qr(rng.standard_normal((d, k)))
        vals.append(float(np.sum((qa.T @ qb) ** 2)) / k)
    arr = np.asarray(vals)
    return {
        "expected": k / d,
        "mean": float(arr.mean()),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
    }


def overlap_matrix(
    lens_a: JacobianLens, lens_b: JacobianLens | None = None, k: int = 8
) -> np.ndarray:
    """(T_a+1, T_b+1) overlaps of the top-k subspaces of every step of ``lens_a`` with every step
    of ``lens_b`` (default: ``lens_a`` itself)."""
    lens_b = lens_a if lens_b is None else lens_b
    if lens_a.d_model != lens_b.d_model:
        raise LoopLMError(f"lens widths differ: {lens_a.d_model} vs {lens_b.d_model}")
    ua = [top_subspace(lens_a.jacobians[t], k) for t in lens_a.steps()]
    ub = [top_subspace(lens_b.jacobians[t], k) for t in lens_b.steps()]
    return np.array([[overlap(x, y) for y in ub] for x in ua])


def persistence(lens_a: JacobianLens, lens_b: JacobianLens, k: int = 8) -> dict[str, Any]:
    """How the subspaces of a depth-T_a fit persist in a deeper fit T_b ≥ T_a: per step t of
    ``lens_a`` the overlap with step t of ``lens_b`` (same step) and with step T_b − (T_a − t)
    (same lag to the end)."""
    Ta, Tb = lens_a.loops, lens_b.loops
    if Tb < Ta:
        raise LoopLMError(f"persistence runs from a shallower fit to a deeper one, got {Ta} → {Tb}")
    m = overlap_matrix(lens_a, lens_b, k)
    return {
        "from_loops": Ta,
        "to_loops": Tb,
        "k": k,
        "same_step": [float(m[t, t]) for t in range(Ta + 1)],
        "same_lag": [float(m[t, Tb - Ta + t]) for t in range(Ta + 1)],
        "random": random_overlap(lens_a.d_model, k),
    }


# --------------------------------------------------------------------------- stationarity
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = 0.5 * (a.norm() + b.norm())
    return float((a - b).norm() / den) if float(den) > 0 else 0.0


def stationarity(lenses: Sequence[JacobianLens]) -> dict[str, Any]:
    """Relative distances ``‖J^a − J^b‖_F / mean norm`` between fits at different depths, at the
    same lag k = T − t (stationary dynamics: ≈ 0) and at the same absolute step t, for
    k = 0 … min T, for each pair of depths."""
    fits = sorted(lenses, key=lambda f: f.loops)
    if len(fits) < 2 or len({f.loops for f in fits}) != len(fits):
        raise LoopLMError("stationarity needs fits at two or more distinct depths T")
    pairs = []
    for i, a in enumerate(fits):
        for b in fits[i + 1 :]:
            Ta, Tb = a.loops, b.loops
            lags = list(range(Ta + 1))
            pairs.append(
                {
                    "loops": [Ta, Tb],
                    "lag": lags,
                    "same_lag": [_rel(a.jacobians[Ta - k], b.jacobians[Tb - k]) for k in lags],
                    "same_step": [_rel(a.jacobians[Ta - k], b.jacobians[Ta - k]) for k in lags],
                }
            )
    return {"pairs": pairs}


def fit_step_jacobians(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    loops: int,
    *,
    pad_id: int | None = None,
    skip_positions: int = 0,
) -> dict[int, torch.Tensor]:
    """The expected one-step Jacobians ``M_s = E Σ_{p'≥p} ∂h_{s+1}[p'] / ∂h_s[p]`` (exact, d
    vector-Jacobian products per step and batch), s = 0 … T−1, from one unroll per batch."""
    check_lens_loops(model, loops)
    d = model.config.d_model
    sums = [torch.zeros(d, d, dtype=torch.float64) for _ in range(loops)]
    n = 0
    was = model.training
    model.eval()
    try:
        with frozen_weights(model):
            for batch in batches:
                ids = batch_ids(batch)
                src, tgt = position_masks(ids, pad_id, skip_positions)
                run = unroll_for_lens(model, ids, loops)
                srcw = src.double()[..., None]
                for s in range(loops):
                    out = run.hidden[s + 1]
                    tg = tgt.to(out.dtype)[..., None]
                    for i in range(d):
                        u = torch.zeros(d, dtype=out.dtype)
                        u[i] = 1.0
                        (g,) = torch.autograd.grad(out, run.states[s], u * tg, retain_graph=True)
                        g = run.hidden_grad(s, g).double() * srcw
                        sums[s][i] += g.sum(dim=(0, 1)).cpu()
                n += int(src.sum())
    finally:
        model.train(was)
    if n == 0:
        raise LoopLMError("the batches hold no source position (all padding?)")
    return {s: sums[s] / n for s in range(loops)}


def composition_gap(lens: JacobianLens, steps: dict[int, torch.Tensor]) -> list[float]:
    """Per step t: ``‖J_t − J_T M_{T−1} ⋯ M_t‖_F / ‖J_t‖_F`` (0 at t = T)."""
    T = lens.loops
    if sorted(steps) != list(range(T)):
        raise LoopLMError(f"one-step Jacobians for steps 0 … {T - 1} needed, got {sorted(steps)}")
    out = [0.0] * (T + 1)
    prod = lens.jacobians[T].double()
    for t in range(T - 1, -1, -1):
        prod = prod @ steps[t].double()
        J = lens.jacobians[t].double()
        out[t] = float((J - prod).norm() / J.norm())
    return out
