"""Parcae's stable (diagonal) injection, from "Parcae: Scaling Laws For Stable Looped Language
Models" (the published Parcae checkpoints; :mod:`looplm.model.families.parcae` maps them).

    ē = N_p(e)                                 optional norm of the prelude output (once)
    δ = softplus(dt),  λ = exp(−δ ⊙ exp(A_log))  per channel, λ ∈ (0, 1)
    u_t = λ ⊙ s_t + δ ⊙ (ē Bᵀ)                 the injection (a discretised ds/dt = −A s + B ē)
    s_{t+1} = u_t + G(u_t)                     the shared core (a k-layer core: k blocks in turn)
    exit(s_T) = C s_T                          a projection out of the loop, before the coda

The state's initial value is zero or the reference's draw (``state_init=random``: truncated
normal N(0, σ²) at ±3σ, σ = ``init_std``, drawn from the global generator per call). With λ < 1
the map from the state is a contraction before G, which is what keeps the loop stable. The
forcing bias at s = 0 is ``δ ⊙ (ē Bᵀ) + G(δ ⊙ (ē Bᵀ)) ≠ 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.recurrences.base import LoopContext, Recurrence, advance, register
from looplm.settings import setting

STATE_INITS = ("zero", "random")


def initial_state(e: torch.Tensor, how: str, std: float) -> torch.Tensor:
    """The loop's starting state, shaped like ``e``: zeros, or truncated N(0, std²) at ±3·std."""
    if how == "zero" or std == 0:
        return torch.zeros_like(e)
    s = torch.empty_like(e)
    return nn.init.trunc_normal_(s, mean=0.0, std=std, a=-3 * std, b=3 * std)


@dataclass
class ParcaeConfig:
    prelude_norm: bool = False  # normalise the prelude output once before the loop (N_p)
    norm_eps: float = 1e-5  # ε of N_p
    # zero | random (the reference's truncated-normal draw)
    state_init: str = setting("zero", choices=STATE_INITS)
    init_std: float = setting(0.0, lo=0)  # σ of the random initial state

    def validate(self) -> None:
        if self.norm_eps <= 0:
            raise LoopLMError(f"norm_eps={self.norm_eps} must be > 0")


@register
class Parcae(Recurrence):
    """Diagonal stable injection, a shared core and an exit projection."""

    name = "parcae"
    Config = ParcaeConfig
    equation = (
        "u_t = λ⊙s_t + δ⊙(ēBᵀ),  s_{t+1} = u_t + G(u_t),  λ = exp(−δ⊙exp(A_log));  exit C s_T"
    )
    reference = "Parcae: Scaling Laws For Stable Looped Language Models (diagonal injection)"

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: ParcaeConfig) -> int:
        return 2 * d_model + 2 * d_model * d_model + (d_model if cfg.prelude_norm else 0)

    def __init__(self, d_model: int, cfg: ParcaeConfig) -> None:
        super().__init__(d_model, cfg)
        self.prelude_norm = nn.RMSNorm(d_model, eps=cfg.norm_eps) if cfg.prelude_norm else None
        # The reference's start: λ = √(1/5) in every channel, B = C = I.
        delta = -0.5 * math.log(0.2)  # δ₀ = −log λ₀ (A = 1); dt_bias = softplus⁻¹(δ₀)
        self.A_log = nn.Parameter(torch.zeros(d_model))
        self.dt_bias = nn.Parameter(torch.full((d_model,), delta + math.log(-math.expm1(-delta))))
        self.B = nn.Parameter(torch.eye(d_model))
        self.C = nn.Linear(d_model, d_model, bias=False)

    def init_weights(self) -> None:
        with torch.no_grad():
            self.C.weight.copy_(torch.eye(self.d_model))

    def prepare(self, e: torch.Tensor) -> LoopContext:
        if self.prelude_norm is not None:
            e = self.prelude_norm(e)
        dt = F.softplus(self.dt_bias)
        # δ ⊙ (ē Bᵀ): the same every step, computed once (B, L, d)
        return LoopContext(e=e, anchor=e, extra={"drive": dt * (e @ self.B.T)})

    def decay(self) -> torch.Tensor:
        """λ = exp(−δ ⊙ exp(A_log)), (d,)."""
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return initial_state(ctx.e, self.cfg.state_init, self.cfg.init_std)

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        drive = ctx.extra["drive"]
        if self.source_gain != 1.0:
            drive = self.source_gain * drive
        u = state * self.decay() + drive
        return advance(block, u)

    def exit(self, h: torch.Tensor) -> torch.Tensor:
        return self.C(h)
