"""Anchor-start source-steering diagnostic (paper Figure 4, "Anchor-Start Source-Steering").

Rollouts start exactly at the anchor, ``Δ_0 = 0`` (``h_0 = h*``), instead of the model's ordinary
initial state, and run the model's own one-step map ``h_{t+1} = step(h_t, t)``:

* (a) forcing-aligned motion: at the anchor the first move is the forcing bias, ``Δ_1 = b_0(e)``;
  the trajectory–forcing-ray cosine ``cos(Δ_t, t·b_0(e)) = cos(Δ_t, b_0(e))`` says whether the
  trajectory keeps following that input-specific ray. For SCSE ``b_t = 0`` and the rollout stays
  at the anchor exactly (the cosine is undefined and reported as null).
* (b) dose-response: only the evaluation-time injection gain changes
  (``recurrence.source_gain`` ∈ {0, ½, 1, 2}). Displacements are taken relative to the
  injection-removed rollout, ``D_g,t = Δ_t^(g) − Δ_t^(0)``; the paper's evidence of source steering
  is that ``D_½`` and ``D_2`` are collinear and grow with the gain. Sizes are reported relative to the
  full-gain anchor push ``‖Δ_T^(1)‖_F``; ``cos(D_g,T, Δ_T^(1))`` measures alignment with the realized
  drift. A recurrence that ignores ``source_gain`` (no injected source) gives ``D ≡ 0``.

All geometry is per example on the full (L, d) deviation (Frobenius inner products). For the
figure, each state is summarised by its sequence mean over positions (a d-vector), saved as arrays.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from looplm.diagnostics.gain import per_example_norm
from looplm.diagnostics.settings import DOSE_GAINS


@contextmanager
def source_gain(model: torch.nn.Module, gain: float) -> Iterator[None]:
    """Temporarily multiply the recurrence's evaluation-time injection gain by ``gain``."""
    rec = model.recurrence
    old = rec.source_gain
    rec.source_gain = old * gain
    try:
        yield
    finally:
        rec.source_gain = old


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-example cosine of (B, …) tensors: (B,) float64, NaN where a norm is zero."""
    a2, b2 = a.reshape(a.shape[0], -1).double(), b.reshape(b.shape[0], -1).double()
    den = a2.norm(dim=-1) * b2.norm(dim=-1)
    cos = (a2 * b2).sum(-1) / den
    return torch.where(den > 0, cos, torch.full_like(cos, math.nan))


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _stats(values: Sequence[float]) -> dict[str, float | None]:
    vals = _finite(values)
    if not vals:
        return {"min": None, "mean": None, "max": None}
    return {"min": min(vals), "mean": sum(vals) / len(vals), "max": max(vals)}


@torch.no_grad()
def anchor_start_rollout(model: torch.nn.Module, context, loops: int) -> list[torch.Tensor]:
    """``[h_0 = h*, h_1, …, h_T]`` under the model's one-step map (current ``source_gain``)."""
    h = context.anchor
    out = [h]
    for t in range(loops):  # eager: an intervention (the anchor start, a source gain) per step
        h = model.step(h, context, t)
        out.append(h)
    return out


def _dose_summary(
    gains: Sequence[float],
    disp_norm: dict[float, list[torch.Tensor]],
    disp_T: dict[float, torch.Tensor],
    delta_T: torch.Tensor,
    push: torch.Tensor,
) -> dict[str, object]:
    """The dose-response numbers: displacement D_g relative to the push ‖Δ_T‖, its alignment
    with the drift, growth in t and in g, collinearity of the lowest and highest gain."""
    has_source = any(float(d.abs().max()) > 0 for d in disp_T.values())
    dose: dict[str, object] = {"source_channel": has_source}
    lo, hi = min(gains), max(gains)
    for g in gains:
        norms = torch.stack(disp_norm[g])  # (T+1, B)
        grows = (norms[1:] >= norms[:-1] * (1 - 1e-9)).all(dim=0)  # per example
        ratio = torch.where(push > 0, norms[-1] / push, torch.full_like(push, math.nan))
        dose[f"gain_{g:g}"] = {
            "displacement_over_push": _stats(ratio.tolist()),
            "cos_with_drift": _stats(_cos(disp_T[g], delta_T).tolist()),
            "grows_monotonically_frac": float(grows.double().mean()) if has_source else None,
        }
    if has_source and len(gains) > 1:
        dose["collinearity_lo_hi"] = _stats(_cos(disp_T[lo], disp_T[hi]).tolist())
        end = torch.stack([per_example_norm(disp_T[g]).cpu() for g in sorted(gains)])  # (G, B)
        dose["monotone_in_gain_frac"] = float((end[1:] > end[:-1]).all(dim=0).double().mean())
        rms = torch.sqrt(
            torch.stack([per_example_norm(disp_T[g]).cpu() ** 2 for g in gains]).mean(0)
        )
        dose["rms_displacement_over_push"] = _stats(
            torch.where(push > 0, rms / push, torch.full_like(push, math.nan)).tolist()
        )
    return dose


# long: the gains' rollouts run in lockstep and share the per-step bookkeeping
@torch.no_grad()
def anchor_start_steering(
    model: torch.nn.Module,
    context,
    loops: int,
    *,
    gains: Sequence[float] = DOSE_GAINS,
    ref_depth: int = 8,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Run the anchor-start rollouts at source gains {0} ∪ ``gains`` in lockstep.

    Args:
        model: a looped model in eval mode.
        context: ``model.prepare(ids)`` for the (few) steering inputs, (B, L).
        loops: rollout length T.
        gains: evaluation-time gain multipliers (1 = trained) for the dose-response.
        ref_depth: the largest trained depth; its mean anchor distance is reported (the dotted
            circle of Figure 4a).

    Returns:
        (summary numbers, arrays for the figure). Arrays (float32): ``traj`` (B, T+1, d) sequence
        means of Δ_t at gain 1; ``ray`` (B, d) sequence mean of b_0; ``dose_<g>`` (B, T+1, d)
        sequence means of D_g,t.
    """
    anchor = context.anchor
    all_gains = sorted(set(gains) | {0.0, 1.0})
    h = {g: anchor for g in all_gains}
    seq_mean = {g: [torch.zeros_like(anchor[:, 0]).float().cpu()] for g in all_gains}  # Δ_0 = 0
    disp_norm = {g: [torch.zeros(anchor.shape[0], dtype=torch.float64)] for g in gains}
    dist = [torch.zeros(anchor.shape[0], dtype=torch.float64)]
    cosines: list[torch.Tensor] = []
    b0 = None
    for t in range(loops):
        for g in all_gains:  # eager: each gain is set on the model around its own step
            with source_gain(model, g):
                h[g] = model.step(h[g], context, t)
            seq_mean[g].append((h[g] - anchor).mean(dim=1).float().cpu())  # (B, d)
        delta1 = h[1.0] - anchor
        if b0 is None:
            b0 = delta1  # Δ_1 from Δ_0 = 0 is b_0(e)
        cosines.append(_cos(delta1, b0).cpu())
        dist.append(per_example_norm(delta1).cpu())
        for g in gains:
            disp_norm[g].append(per_example_norm(h[g] - h[0.0]).cpu())
    delta_T = h[1.0] - anchor
    push = per_example_norm(delta_T).cpu()  # (B,)
    disp_T = {g: h[g] - h[0.0] for g in gains}

    cos_all = torch.stack(cosines)  # (T, B)
    stays = float(max(float(d.max()) for d in dist)) == 0.0
    dose = _dose_summary(gains, disp_norm, disp_T, delta_T, push)
    dist_t = torch.stack(dist)  # (T+1, B)
    summary = {
        "n_inputs": int(anchor.shape[0]),
        "loops": loops,
        "stays_at_anchor": stays,
        "forcing_bias_norm_t0": _stats(per_example_norm(b0).tolist()) if b0 is not None else None,
        "ray_cosine": _stats(cos_all.flatten().tolist()),
        "ray_cosine_per_step_mean": [
            (sum(_finite(c.tolist())) / len(_finite(c.tolist()))) if _finite(c.tolist()) else None
            for c in cos_all
        ],
        "anchor_distance_per_step": dist_t.mean(dim=1).tolist(),
        "anchor_distance_ref_depth": float(dist_t[min(ref_depth, loops)].mean()),
        "ref_depth": min(ref_depth, loops),
        "anchor_push_T": _stats(push.tolist()),
        "dose": dose,
    }
    arrays = {
        "traj": torch.stack(seq_mean[1.0], dim=1).numpy(),  # (B, T+1, d)
        "ray": seq_mean[1.0][1].numpy() if loops >= 1 else seq_mean[1.0][0].numpy(),  # (B, d)
    }
    for g in gains:
        arrays[f"dose_{g:g}"] = (
            torch.stack(seq_mean[g], dim=1) - torch.stack(seq_mean[0.0], dim=1)
        ).numpy()
    return summary, arrays
