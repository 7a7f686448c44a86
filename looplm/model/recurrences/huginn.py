"""Huginn's recurrence, from "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent
Depth Approach" (the Huginn-0125 checkpoint; :mod:`looplm.model.families.huginn` maps it).

    u_t = W [s_t ; e]                          the adapter over the concatenated state and input
    s_{t+1} = u_t + G(u_t)                     the shared core (4 sandwich blocks in turn)

``e`` is the prelude's output (re-injected every step through the adapter's second half). The
initial state is zero (the reference's deterministic option, ``init_scale=0``) or the reference's
draw (``state_init=random``: truncated normal N(0, σ²) at ±3σ, σ = ``init_std``). The readout
normalises s_T with the final norm before the coda (``model.coda_norm``). The forcing bias at
s = 0 is ``W[0; e] + G(W[0; e]) ≠ 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from looplm.model.recurrences.base import LoopContext, Recurrence, advance, register
from looplm.model.recurrences.parcae import STATE_INITS, initial_state
from looplm.settings import setting


@dataclass
class HuginnConfig:
    # zero | random (the reference's truncated-normal draw)
    state_init: str = setting("zero", choices=STATE_INITS)
    init_std: float = setting(0.0, lo=0)  # σ of the random initial state


@register
class Huginn(Recurrence):
    """Concatenation adapter, then the shared core."""

    name = "huginn"
    Config = HuginnConfig
    equation = "u_t = W[s_t; e],  s_{t+1} = u_t + G(u_t),  s_0 = 0 (or a random draw)"
    reference = (
        "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth Approach (Huginn)"
    )

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: HuginnConfig) -> int:
        return 2 * d_model * d_model  # W

    def __init__(self, d_model: int, cfg: HuginnConfig) -> None:
        super().__init__(d_model, cfg)
        self.adapter = nn.Linear(2 * d_model, d_model, bias=False)

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return initial_state(ctx.e, self.cfg.state_init, self.cfg.init_std)

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        e = ctx.e if self.source_gain == 1.0 else self.source_gain * ctx.e
        u = self.adapter(torch.cat([state, e], dim=-1))
        return advance(block, u)
