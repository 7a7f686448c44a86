"""Source-Centered State Evolution (SCSE), paper Eqs. 2–5 and Listing 1.

    h* = e + 0.1 · anchor_proj(e)            (Eq. 2, once per input)
    Δ0 = H0(e) − h*,  H0(e) = e + 0.1 · init_delta_proj(e)
    q_t = s · G(Δ_t)                         (Eq. 3)
    m_b,t = 1{‖Δ_t^(b)‖²_F > ε}              (per example, Eq. 4)
    Δ_{t+1} = Δ_t + m_b,t · q_t              (Eq. 5)
    h_T = h* + Δ_T

s = 0.5, ε = 1e-8. The state is kept in deviation coordinates (Eq. 5), so ``Δ = 0`` stays exactly
0: the forcing bias ``b_t(e) = T_t(0; e)`` is zero bit-exactly, and so is the raw pre-mask
``b̃_t(e)`` because ``G(0) = 0``. Listing 1's ``anchor + delta + q`` works in hidden coordinates and
differs from Eq. 5 by rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from looplm.model.recurrences.anchors import ANCHOR_MODES, AnchorInit
from looplm.model.recurrences.base import LoopContext, Recurrence, register
from looplm.settings import setting


def zero_deviation_mask(delta: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 4's per-example mask ``1{‖Δ^(b)‖²_F > ε}``: (B, L, d) → (B, 1, 1) in Δ's dtype."""
    return (delta.float().pow(2).sum(dim=(1, 2), keepdim=True) > eps).to(delta.dtype)


@dataclass
class SCSEConfig:
    step_scale: float = 0.5  # s
    eps: float = setting(1e-8, lo=0)  # ε of the zero-deviation mask
    # learned | embedding | init | frozen_random (Table 2 ablations)
    anchor: str = setting("learned", choices=ANCHOR_MODES)
    anchor_scale: float = 0.1  # scale of anchor_proj in h* = e + scale·anchor_proj(e) (Listing 1)
    # scale of init_delta_proj in H0(e) = e + scale·init_delta_proj(e)
    init_delta_scale: float = 0.1
    proj_init: str = "normal"  # normal | identity: where anchor_proj / init_delta_proj start


@register
class SCSE(Recurrence):
    """SCSE: evolve the anchor-relative deviation through the zero-preserving core."""

    name = "scse"
    Config = SCSEConfig
    equation = "Δ_{t+1} = Δ_t + 1{‖Δ_t‖²_F>ε} · s·G(Δ_t);  h* = e + 0.1·a(e),  h_T = h* + Δ_T"
    reference = "Eqs. 2–5, Listing 1"
    zero_forcing_bias = True
    zero_raw_forcing_bias = True  # G(0) = 0: the core maps zero deviation to zero

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: SCSEConfig) -> int:
        return AnchorInit.n_parameters(d_model, cfg.anchor)  # a(e), H0

    def __init__(self, d_model: int, cfg: SCSEConfig) -> None:
        super().__init__(d_model, cfg)
        self.anchors = AnchorInit(
            d_model, cfg.anchor, cfg.anchor_scale, cfg.init_delta_scale, cfg.proj_init
        )

    def prepare(self, e: torch.Tensor) -> LoopContext:
        return self.anchors.context(e)

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return ctx.extra["h0"] - ctx.anchor  # Δ0

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        q = self.cfg.step_scale * block(state)  # Eq. 3
        if mask:
            q = q * zero_deviation_mask(state, self.cfg.eps)  # Eq. 4
        return state + q  # Eq. 5

    def to_hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return ctx.anchor + state

    def from_hidden(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return h - ctx.anchor
