"""The looped Transformer baseline with additive source injection (anchor ``h* = e``).

    h_0 = e,   h_{t+1} = h_t + s·G(h_t + g·e)

Two variants, both reachable by settings:

* ``looped`` (defaults ``injection_gain=1, learn_gain=false, step_scale=1``): a fixed injection
  gain g = 1 — the common input-injection form (the paper gives no equation for its baseline).
* the paper-described baseline (``learn_gain=true, injection_gain=0.15``): g = α is a learned
  scalar initialised to 0.15 — "the baseline's separately learned additive-injection gain α,
  initialized to the configured value 0.15" (Listing 1 caption and the leak-diagnostic paragraph).
  ``looplm methods`` lists it as ``looped learn_gain=true injection_gain=0.15``.

``step_scale`` s scales the block's update as the adapters' s does (the paper names no s for its
baseline: 1 here). ``recurrence.source_gain`` multiplies g at evaluation time (the injection-gain
dose-response of Figure 4b). At the anchor the forcing bias is ``b_t(e) = s·G((1 + g)·e) ≠ 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.recurrences.base import LoopContext, Recurrence, register


@dataclass
class LoopedConfig:
    injection_gain: float = 1.0  # g (fixed), or α's initial value when learn_gain
    learn_gain: bool = False  # True: g = α, a learned scalar (no weight decay)
    step_scale: float = 1.0  # s

    def validate(self) -> None:
        if not isinstance(self.learn_gain, bool):
            raise LoopLMError(f"learn_gain={self.learn_gain!r} must be true or false")
        if self.step_scale <= 0:
            raise LoopLMError(f"step_scale={self.step_scale} must be > 0")


@register
class Looped(Recurrence):
    """Additive-injection looped Transformer baseline."""

    name = "looped"
    Config = LoopedConfig
    equation = "h_0 = e;  h_{t+1} = h_t + s·G(h_t + g·e),  g = 1 fixed, s = 1;  anchor h* = e"
    reference = "looped Transformer baseline (update rule is the toolkit's; paper gives none)"
    # Other settings that define a named variant: (label, settings, equation, reference).
    variants = (
        (
            "looped learn_gain=true injection_gain=0.15",
            {"learn_gain": True, "injection_gain": 0.15},
            "h_0 = e;  h_{t+1} = h_t + s·G(h_t + α·e),  α learned, α₀ = 0.15, s = 1",
            "the paper's baseline as its text describes it (learned gain α initialised to 0.15)",
        ),
    )

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: LoopedConfig) -> int:
        return 1 if cfg.learn_gain else 0  # α

    def __init__(self, d_model: int, cfg: LoopedConfig) -> None:
        super().__init__(d_model, cfg)
        self.alpha = (
            nn.Parameter(torch.tensor(float(cfg.injection_gain))) if cfg.learn_gain else None
        )

    @property
    def gain(self) -> torch.Tensor | float:
        """The injection gain g (the learned α when ``learn_gain``), times ``source_gain``."""
        g = self.alpha if self.alpha is not None else self.cfg.injection_gain
        return g * self.source_gain

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return ctx.e

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        return state + self.cfg.step_scale * block(state + self.gain * ctx.e)

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return [self.alpha] if self.alpha is not None else []
