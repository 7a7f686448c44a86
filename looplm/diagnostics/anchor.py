"""Pointwise anchor response along the model's own unroll (paper Eqs. 7–9, Table 3).

Every family is measured in its own anchor coordinates: ``Δ = h − h*`` with the anchor ``h*`` the
recurrence computes once per input, and the one-step deviation map

    T_t(Δ; e) = step(h* + Δ, t) − h*                      (hidden coordinates, before readout)

The decomposition ``T_t(Δ) = Δ + b_t(e) + a_t(Δ; e)`` (Eq. 7) defines the forcing bias
``b_t(e) = T_t(0; e)`` (Eq. 8); ``b̃_t(e)`` is the same with the raw, pre-mask map. Per step:

    R_t(e)  = N⁻¹‖b_t‖²_F / max(N⁻¹‖Δ_{t+1} − Δ_t‖²_F, 1e-12)        (Eq. 9)
    E_Δ,t   = N⁻¹‖Δ_t‖²_F                                              (Table 3)

with N the number of scalar entries of the measured batch tensor and Δ_t the ordinary trajectory.
Each quantity is computed for one batch of fixed shape; batch values are then averaged over the
measured batches (paper, "Anchor-Coordinate Forcing-Bias Energy Ratios").
"""

from __future__ import annotations

import torch

from looplm.diagnostics.gain import random_direction_gain, unit_directions
from looplm.diagnostics.settings import EPS_FD, N_DIRECTIONS

RATIO_FLOOR = 1e-12


def mean_square(x: torch.Tensor) -> float:
    """``N⁻¹‖x‖²_F`` over all entries, accumulated in float64."""
    return float(x.double().pow(2).mean())


def energy_ratio(bias: torch.Tensor, update: torch.Tensor, floor: float = RATIO_FLOOR) -> float:
    """Eq. 9: ``N⁻¹‖b‖²_F / max(N⁻¹‖update‖²_F, floor)`` for one measured batch tensor."""
    return mean_square(bias) / max(mean_square(update), floor)


class AnchorMap:
    """The one-step deviation map ``T_t(Δ; e) = step(h* + Δ, t) − h*`` of a prepared input.

    Works for any registered recurrence through ``model.step`` (hidden coordinates); ``mask=False``
    selects the raw pre-mask map ``T̃_t``.
    """

    def __init__(self, model: torch.nn.Module, context, *, mask: bool = True) -> None:
        self.model = model
        self.context = context
        self.anchor = context.anchor  # (B, L, d)
        self.mask = mask

    def __call__(self, delta: torch.Tensor, t: int) -> torch.Tensor:
        """Δ (B, L, d) → T_t(Δ) (B, L, d)."""
        # eager: one step of perturbed states, called per probe direction (and under jvp/vjp)
        h = self.model.step(self.anchor + delta, self.context, t, mask=self.mask)
        return h - self.anchor

    def bias(self, t: int) -> torch.Tensor:
        """``b_t(e) = T_t(0; e)``; evaluated at h = h* exactly (no ``h* + 0`` rounding)."""
        return self.model.step(self.anchor, self.context, t, mask=self.mask) - self.anchor


# long: Eqs. 7-9 per loop step; the per-step quantities share one set of locals
@torch.no_grad()
def anchor_response(
    model: torch.nn.Module,
    context,
    states: list[torch.Tensor],
    *,
    n_dirs: int = N_DIRECTIONS,
    eps_fd: float = EPS_FD,
    generator: torch.Generator | None = None,
    keep_bias: bool = False,
) -> dict[str, list]:
    """Per-step anchor diagnostics for one batch along its ordinary unroll.

    Args:
        model: a looped model in eval mode.
        context: ``model.prepare(ids)``.
        states: ``[h_0 … h_T]`` of that unroll (``model(ids, loops=T, return_states=True)``).
        n_dirs, eps_fd: random-direction gain settings (4 directions, ε = 1e-3).
        generator: RNG for the probe directions.

    Returns:
        lists indexed by t = 0 … T−1 (``anchor_energy``: t = 0 … T): ``bias_energy``
        (N⁻¹‖b_t‖²), ``bias_max_abs``, ``raw_bias_energy`` and ``raw_bias_max_abs`` (b̃_t),
        ``update_energy`` (N⁻¹‖Δ_{t+1} − Δ_t‖²), ``ratio`` (R_t), ``anchor_energy`` (E_Δ,t),
        ``gain`` (mean over directions and examples) and ``gain_std``; with ``keep_bias`` also
        the tensors ``bias`` (b_t, for the counterfactual).
    """
    masked = AnchorMap(model, context, mask=True)
    raw = AnchorMap(model, context, mask=False)
    anchor = context.anchor
    loops = len(states) - 1
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "bias_energy",
            "bias_max_abs",
            "raw_bias_energy",
            "raw_bias_max_abs",
            "update_energy",
            "ratio",
            "anchor_energy",
            "gain",
            "gain_std",
        )
    }
    biases = []
    for t in range(loops):
        b = masked.bias(t)  # (B, L, d)
        if keep_bias:
            biases.append(b)
        b_raw = raw.bias(t)
        update = states[t + 1] - states[t]  # Δ_{t+1} − Δ_t (h* cancels)
        out["bias_energy"].append(mean_square(b))
        out["bias_max_abs"].append(float(b.abs().max()))
        out["raw_bias_energy"].append(mean_square(b_raw))
        out["raw_bias_max_abs"].append(float(b_raw.abs().max()))
        out["update_energy"].append(mean_square(update))
        out["ratio"].append(energy_ratio(b, update))
        out["anchor_energy"].append(mean_square(states[t] - anchor))
        delta = states[t] - anchor
        dirs = unit_directions(
            tuple(delta.shape), n_dirs, generator=generator, dtype=delta.dtype, device=delta.device
        )
        g = random_direction_gain(lambda x, t=t: masked(x, t), delta, dirs, eps=eps_fd)  # (n, B)
        out["gain"].append(float(g.mean()))
        out["gain_std"].append(float(g.std()) if g.numel() > 1 else 0.0)
    out["anchor_energy"].append(mean_square(states[loops] - anchor))
    if keep_bias:
        out["bias"] = biases
    return out
