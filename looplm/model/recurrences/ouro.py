"""Ouro's loop, from "Scaling Latent Reasoning via Looped Language Models" (the Ouro checkpoints;
:mod:`looplm.model.families.ouro` maps them): the whole layer stack is the shared core, the final
norm closes every step, and a learned exit gate reads every step's state.

    s_0 = e
    s_{t+1} = N(s_t + G(s_t))                  G: all layers in turn; N the final norm
    λ_t = σ(w · s_t + b)                       the exit gate's probability of stopping at step t

The readout reads s_T without a further norm (``model.final_norm=false``). The gate does not
change the states: :class:`looplm.model.halting_rules.GateHalt` turns it into a halting rule (stop a
token once its cumulative exit probability ``1 − Π_{j≤t}(1 − λ_j)`` reaches a threshold). No
input re-injection: the forcing bias at s = 0 is ``N(G(0)) = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.recurrences.base import LoopContext, Recurrence, advance, register


@dataclass
class OuroConfig:
    norm_eps: float = 1e-6  # ε of the per-step norm N

    def validate(self) -> None:
        if not self.norm_eps > 0:
            raise LoopLMError(f"norm_eps={self.norm_eps} must be > 0")


@register
class Ouro(Recurrence):
    """The layer stack looped, normalised after every step, with an exit gate."""

    name = "ouro"
    Config = OuroConfig
    equation = "s_0 = e,  s_{t+1} = N(s_t + G(s_t)),  λ_t = σ(w·s_t + b)"
    reference = "Scaling Latent Reasoning via Looped Language Models (Ouro)"
    uses_all_parameters = False  # the exit gate reads the states; the loss does not

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: OuroConfig) -> int:
        return d_model + d_model + 1  # N's gain, the gate's w and b

    def __init__(self, d_model: int, cfg: OuroConfig) -> None:
        super().__init__(d_model, cfg)
        self.norm = nn.RMSNorm(d_model, eps=cfg.norm_eps)
        self.exit_gate = nn.Linear(d_model, 1)

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return ctx.e

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        return self.norm(advance(block, state))

    def exit_probability(self, h: torch.Tensor) -> torch.Tensor:
        """λ = σ(w · h + b): (…, d) → (…), the gate's probability of stopping at this state."""
        return torch.sigmoid(self.exit_gate(h)).squeeze(-1)
