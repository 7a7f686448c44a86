"""Gated looped recurrence with LayerScale ("Thinking Deeper, Not Longer").

The paper's abstract names three ingredients that keep a depth recurrence stable for 20+ steps: the
silent-thinking objective (``train.objective=final``, the default), LayerScale initialisation and
"an identity-biased gate that opens a gradient highway across steps". It gives no equation; the
toolkit's reconstruction is a highway-gated residual step on the looped baseline::

    x_t = h_t + g·e                                   (additive input injection, g = 1)
    u_t = λ ⊙ G(x_t)                                  (LayerScale: per-channel λ, init 0.1)
    z_t = σ(W_z · rms(x_t) + b_z)                     (carry gate, per token and channel)
    h_{t+1} = z_t ⊙ h_t + (1 − z_t) ⊙ (h_t + u_t)  =  h_t + (1 − z_t) ⊙ u_t

with ``h_0 = h* = e``, ``rms(x) = x / RMS(x)`` parameter-free, W_z d×d bias-free and the gate bias
``b_z`` initialised to +2 so the gate starts mostly closed to the update (carry z ≈ 0.88): the
step map starts close to the identity, ``∂h_{t+1}/∂h_t ≈ I``, which is the gradient highway across
steps. λ and b_z are vectors (no weight decay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from looplm.model.recurrences.base import LoopContext, Recurrence, register


@dataclass
class GatedConfig:
    layerscale_init: float = 0.1  # λ_0
    gate_bias: float = 2.0  # b_z init: σ(2) ≈ 0.88 carry
    injection_gain: float = 1.0  # g


@register
class Gated(Recurrence):
    """LayerScale update through an identity-biased highway gate (reconstructed from the abstract
    of "Thinking Deeper, Not Longer")."""

    name = "gated"
    Config = GatedConfig
    body_calls_per_step = 1
    equation = (
        "z_t = σ(W_z rms(h_t + e) + b_z);  h_{t+1} = h_t + (1 − z_t) ⊙ λ ⊙ G(h_t + e),  "
        "λ₀ = 0.1, b_z₀ = 2 (reconstruction)"
    )
    reference = (
        "Depth-recurrent Transformers on compositional tasks (LayerScale + identity-biased "
        "gate); equation is the toolkit's"
    )
    zero_forcing_bias = False

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: GatedConfig) -> int:
        return d_model + d_model * d_model + d_model  # λ, W_z, b_z

    def __init__(self, d_model: int, cfg: GatedConfig) -> None:
        super().__init__(d_model, cfg)
        self.layerscale = nn.Parameter(torch.full((d_model,), float(cfg.layerscale_init)))  # λ
        self.gate_proj = nn.Linear(d_model, d_model, bias=False)  # W_z
        self.gate_bias = nn.Parameter(torch.full((d_model,), float(cfg.gate_bias)))  # b_z

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        return ctx.e

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Carry gate z_t from the block input x_t: (B, L, d) → (B, L, d) in (0, 1)."""
        return torch.sigmoid(self.gate_proj(F.rms_norm(x, (self.d_model,))) + self.gate_bias)

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        x = state + (self.cfg.injection_gain * self.source_gain) * ctx.e
        z = self.gate(x)
        return state + (1.0 - z) * (self.layerscale * block(x))

    def no_decay_parameters(self) -> list[nn.Parameter]:
        return [self.layerscale, self.gate_bias]
