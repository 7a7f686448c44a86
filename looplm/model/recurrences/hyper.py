"""Hyper-connections across loop steps: n parallel residual lanes (default 4).

One of the two case studies of "How much is one recurrence worth?". Static hyper-connections (Zhu
et al., "Hyper-Connections") applied to the loop rather than to a stack of layers. The recurrent
state is a stack of n lanes ``H_t`` of shape (B, n, L, d); one set of mixing weights is shared by
every loop step (as the block is), so any depth can be evaluated::

    x_t = Σ_i a_i H_t[i]                              read     (a ∈ R^n, init e_0)
    u_t = U(x_t)                                      the base method's block update
    H_{t+1}[j] = Σ_i R_ij H_t[i] + m_t · b_j u_t      write    (R ∈ R^{n×n} init I, b ∈ R^n init 1)

Hidden coordinates are the lane mean, ``h = mean_i H[i]``; ``from_hidden(h)`` puts h on every lane
(so ``model.step(h, ctx, t)`` is the step from the replicated state — the multi-lane state is not
recoverable from h). With this init all lanes stay equal and each method starts exactly as its base
recurrence; the one-hot read breaks the lane symmetry under training.

``hyper_looped``:  H_0[i] = e,  U(x) = G(x + g·e),  no mask (b_t ≠ 0 at the anchor h* = e).
``hyper_scse``:    lanes hold deviations, H_0[i] = Δ_0 = H0(e) − h*,  U(x) = s·G(x),
                   m_t = 1{‖H_t^(b)‖²_F > ε} per example over all lanes; h = h* + mean_i H[i].
                   H = 0 stays exactly 0 (G(0) = 0 and the mixing is linear), so b_t(e) = 0.

a, R and b are gains: they are exempt from weight decay (decay would pull R from I towards 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from looplm.model.recurrences.anchors import ANCHOR_MODES, AnchorInit
from looplm.model.recurrences.base import LoopContext, Recurrence, register
from looplm.settings import setting


class HyperBase(Recurrence):
    """Lane bookkeeping shared by the hyper-connection recurrences."""

    body_calls_per_step = 1

    @classmethod
    def parameter_formula(cls, d_model: int, cfg) -> int:
        n = cfg.lanes
        return n + n * n + n  # read a, mix R, write b

    def __init__(self, d_model: int, cfg) -> None:
        super().__init__(d_model, cfg)
        n = cfg.lanes
        read = torch.zeros(n)
        read[0] = 1.0
        self.hc_read = nn.Parameter(read)  # a
        self.hc_mix = nn.Parameter(torch.eye(n))  # R
        self.hc_write = nn.Parameter(torch.ones(n))  # b

    def lanes_from(self, x: torch.Tensor) -> torch.Tensor:
        """Replicate (B, L, d) onto the lanes: (B, n, L, d)."""
        return x.unsqueeze(1).expand(-1, self.cfg.lanes, -1, -1)

    def read(self, lanes: torch.Tensor) -> torch.Tensor:
        """x = Σ_i a_i H[i]: (B, n, L, d) → (B, L, d)."""
        return torch.einsum("i,bild->bld", self.hc_read.to(lanes.dtype), lanes)

    def write(self, lanes: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Σ_i R_ij H[i] + b_j u: (B, n, L, d), (B, L, d) → (B, n, L, d)."""
        mixed = torch.einsum("ij,bild->bjld", self.hc_mix.to(lanes.dtype), lanes)
        return mixed + self.hc_write.to(u.dtype)[None, :, None, None] * u.unsqueeze(1)

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return [self.hc_read, self.hc_mix, self.hc_write]


@dataclass
class HyperLoopedConfig:
    lanes: int = setting(4, lo=1)  # n
    injection_gain: float = 1.0  # g


@register
class HyperLooped(HyperBase):
    """The looped baseline with n hyper-connected residual lanes."""

    name = "hyper_looped"
    Config = HyperLoopedConfig
    equation = (
        "x_t = Σ_i a_i H_t[i];  H_{t+1}[j] = Σ_i R_ij H_t[i] + b_j·G(x_t + g·e);  H_0[i] = e, "
        "h = mean_i H[i],  n = 4"
    )
    reference = (
        "The recurrence-equivalence exponent φ (hyper-connections case study); static HC of "
        "Zhu et al. on the loop"
    )
    zero_forcing_bias = False

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return self.lanes_from(ctx.e)

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        g = self.cfg.injection_gain * self.source_gain
        u = block(self.read(state) + g * ctx.e)
        return self.write(state, u)

    def to_hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return state.mean(dim=1)

    def from_hidden(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return self.lanes_from(h)


@dataclass
class HyperSCSEConfig:
    lanes: int = setting(4, lo=1)  # n
    step_scale: float = 0.5  # s
    eps: float = 1e-8  # ε of the zero-deviation mask
    # learned | embedding | init | frozen_random (Table 2 ablations)
    anchor: str = setting("learned", choices=ANCHOR_MODES)
    anchor_scale: float = 0.1  # scale of anchor_proj in h* = e + scale·anchor_proj(e) (Listing 1)
    # scale of init_delta_proj in H0(e) = e + scale·init_delta_proj(e)
    init_delta_scale: float = 0.1


@register
class HyperSCSE(HyperBase):
    """SCSE with n hyper-connected deviation lanes."""

    name = "hyper_scse"
    Config = HyperSCSEConfig
    equation = (
        "x_t = Σ_i a_i Δ_t[i];  Δ_{t+1}[j] = Σ_i R_ij Δ_t[i] + m_t·b_j·s·G(x_t);  "
        "h = h* + mean_i Δ[i],  s = 0.5, n = 4"
    )
    reference = "The recurrence-equivalence exponent φ (hyper-connections) on SCSE (Eqs. 2–5)"
    zero_forcing_bias = True
    zero_raw_forcing_bias = True

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: HyperSCSEConfig) -> int:
        return super().parameter_formula(d_model, cfg) + AnchorInit.n_parameters(
            d_model, cfg.anchor
        )

    def __init__(self, d_model: int, cfg: HyperSCSEConfig) -> None:
        super().__init__(d_model, cfg)
        self.anchors = AnchorInit(d_model, cfg.anchor, cfg.anchor_scale, cfg.init_delta_scale)

    def prepare(self, e: torch.Tensor) -> LoopContext:
        return self.anchors.context(e)

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return self.lanes_from(ctx.extra["h0"] - ctx.anchor)

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        q = self.cfg.step_scale * block(self.read(state))
        if mask:
            active = state.float().pow(2).sum(dim=(1, 2, 3)) > self.cfg.eps  # (B,)
            q = q * active.to(q.dtype)[:, None, None]
        return self.write(state, q)

    def to_hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return ctx.anchor + state.mean(dim=1)

    def from_hidden(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return self.lanes_from(h - ctx.anchor)
