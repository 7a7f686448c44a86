"""An ordinary Transformer with N distinct layers (the unshared controls and references).

Layer i computes ``h_{i+1} = h_i + G_i(h_i)`` with ``h_0 = e``; called with ``loops=T`` it runs the
first ``min(T, N)`` layers (the paper reports the Transformer-8 reference only from T = 8).
``.states`` of ``return_states=True`` are the layer outputs; there is no shared block, anchor or
step.
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.config import ModelConfig
from looplm.model.lm import LanguageModelBase, LoopOutput, check_loops


class UnsharedLM(LanguageModelBase):
    """N-layer pre-norm Transformer LM with the same embedding and readout as LoopedLM."""

    is_looped = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(self.new_block() for _ in range(cfg.n_layers))
        self._init_weights()

    def active_depth(self, loops: int | None) -> int:
        return len(self.layers) if loops is None else min(check_loops(loops), len(self.layers))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        loops: int | None = None,
        *,
        keep_all: bool = False,
        truncate_k: int = 0,
        checkpoint_loops: bool = False,
    ) -> list[torch.Tensor]:
        h = self.embed(input_ids)
        mask = self.attention_mask(input_ids)
        out = [h] if keep_all else []
        for layer in self.layers[: self.active_depth(loops)]:
            h = h + layer(h, mask=mask)
            if keep_all:
                out.append(h)
        return out if keep_all else [h]

    def iter_depths(self, input_ids: torch.Tensor, depths: list[int]):
        """Yield ``(T, h)`` for sorted ``depths``; depth T runs the first min(T, N) layers."""
        wanted = sorted({check_loops(int(d)) for d in depths})
        h = self.embed(input_ids)
        mask = self.attention_mask(input_ids)
        done = 0
        for T in wanted:
            for layer in self.layers[done : self.active_depth(T)]:
                h = h + layer(h, mask=mask)
            done = self.active_depth(T)
            yield T, h

    def forward(
        self, input_ids: torch.Tensor, loops: int | None = None, return_states: bool = False
    ) -> torch.Tensor | LoopOutput:
        if not return_states:
            (h,) = self.hidden_states(input_ids, loops)
            return self.readout(h)
        states = self.hidden_states(input_ids, loops, keep_all=True)
        return LoopOutput(self.readout(states[-1]), states, None, None)
