"""HRM-Text's two-state loop, from "Hierarchical Reasoning Model" (the HRM-Text checkpoints;
:mod:`looplm.model.families.hrm_text` maps them). The core's layers form two stacks of equal
depth, a fast low-level stack L (the first half) and a slow high-level stack H (the second half);
the state is the pair (z_H, z_L), and one loop step is one high-level cycle:

    z_H,0 = e,   z_L,0 = z₀                    z₀ a stored vector (zeros when trained; frozen)
    repeat n times:  z_L ← N(L(z_L + z_H))     L(x) = x + G_L(x), the stack's layers in turn
    z_H ← N(H(z_H + z_L))                      N: RMSNorm without gain, closing every stack
    h_t = z_H,t                                what the readout reads (no further norm)

``n`` is ``inner_steps`` (the published ``L_cycles``); the loop count is the number of
high-level cycles (``H_cycles``). A one-layer core serves as both stacks (weights shared). The
state is a (B, 2, L, d) stack of the two, z_H first; ``from_hidden(h)`` pairs h with z₀. With a KV
cache every stack application takes its own slots, in call order: L n times, then H. No input
re-injection besides the states' own sums: the forcing bias at h = 0 is not zero (z₀ and the
stacks' sums enter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.recurrences.base import LoopContext, Recurrence, advance, register
from looplm.settings import setting


@dataclass
class HrmTextConfig:
    inner_steps: int = setting(3, lo=1)  # n: low-level applications per high-level cycle (L_cycles)
    norm_eps: float = 1e-6  # ε of the stack-closing norm N

    def validate(self) -> None:
        if not self.norm_eps > 0:
            raise LoopLMError(f"norm_eps={self.norm_eps} must be > 0")


@register
class HrmText(Recurrence):
    """Two stacks, two states: n low-level steps, then one high-level step, per loop step."""

    name = "hrm_text"
    Config = HrmTextConfig
    # (n + 1) applications of half the core per step: 2 cores' worth at the published n = 3 and
    # split core (a one-layer core, shared by both stacks, runs n + 1 = 4 times: undercounted).
    body_calls_per_step = 2
    equation = (
        "z_L ← N(L(z_L + z_H)) n times, then z_H ← N(H(z_H + z_L));  z_H,0 = e, z_L,0 = z₀, h = z_H"
    )
    reference = "Hierarchical Reasoning Model (HRM-Text)"

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: HrmTextConfig) -> int:
        return d_model  # z₀ (frozen, but a parameter of the published checkpoint)

    def __init__(self, d_model: int, cfg: HrmTextConfig) -> None:
        super().__init__(d_model, cfg)
        # The published models keep z₀ at zero and never train it.
        self.z_L_init = nn.Parameter(torch.zeros(d_model), requires_grad=False)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """N(x) = x / sqrt(mean(x²) + ε) over the width, in float32, cast back."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.norm_eps).to(x.dtype)

    def _pair(self, z_h: torch.Tensor) -> torch.Tensor:
        """(z_H, z₀ broadcast) as a (B, 2, L, d) state."""
        z_l = self.z_L_init.to(dtype=z_h.dtype, device=z_h.device).expand_as(z_h)
        return torch.stack([z_h, z_l], dim=1)

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return self._pair(ctx.e)

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        z_h, z_l = state.unbind(dim=1)
        low, high = block.part(0, 2), block.part(1, 2)
        for _ in range(self.cfg.inner_steps):
            z_l = self.norm(advance(low, z_l + z_h))
        z_h = self.norm(advance(high, z_h + z_l))
        return torch.stack([z_h, z_l], dim=1)

    def to_hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return state[:, 0]

    def from_hidden(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return self._pair(h)
