"""The looped Transformer baseline with additive source injection.

    h* = e,  h_0 = e,  h_{t+1} = h_t + G(h_t + g·e)

The paper gives no update rule for its looped baseline; this is the toolkit's (the common
input-injection form). The injection gain ``g`` (default 1) can be changed at evaluation time
through ``recurrence.source_gain`` (the dose-response diagnostic multiplies it). At the anchor the
forcing bias is ``b_t(e) = G((1 + g)·e) ≠ 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from looplm.model.recurrences.base import LoopContext, Recurrence, register


@dataclass
class LoopedConfig:
    injection_gain: float = 1.0  # g


@register
class Looped(Recurrence):
    """Additive-injection looped Transformer baseline."""

    name = "looped"
    Config = LoopedConfig
    equation = "h_0 = e;  h_{t+1} = h_t + G(h_t + g·e),  g = 1;  anchor h* = e"
    reference = "looped Transformer baseline (update rule is the toolkit's; paper gives none)"

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return ctx.e

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        g = self.cfg.injection_gain * self.source_gain
        return state + block(state + g * ctx.e)
