"""An ordinary Transformer with N distinct layers (the unshared controls and references).

Layer i computes ``h_{i+1} = h_i + G_i(h_i)`` with ``h_0 = e``; called with ``loops=T`` it runs the
first ``min(T, N)`` layers (the paper reports the Transformer-8 reference only from T = 8).
``.states`` of ``return_states=True`` are the layer outputs; there is no shared block, anchor or
step.
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.model.lm import LanguageModelBase, LoopOutput, LoopStep, check_loops, check_start
from looplm.model.recurrences import LoopContext
from looplm.settings.config import ModelConfig


class UnsharedLM(LanguageModelBase):
    """N-layer pre-norm Transformer LM with the same embedding and readout as LoopedLM."""

    is_looped = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(self.new_block() for _ in range(cfg.n_layers))
        self._init_weights()

    def active_depth(self, loops: int | None) -> int:
        return len(self.layers) if loops is None else min(check_loops(loops), len(self.layers))

    def prepare(self, input_ids: torch.Tensor) -> LoopContext:
        """e = P(x) (the layer-0 state) and the attention mask, as a looped model's context."""
        e = self.embed(input_ids)
        mask = self.attention_mask(input_ids)
        return LoopContext(e=e, anchor=e, extra={} if mask is None else {"attn_mask": mask})

    def unroll(
        self,
        context: LoopContext,
        loops: int | None = None,
        *,
        state: torch.Tensor | None = None,
        start: int = 0,
    ):
        """The looped model's unroll interface over distinct layers: yields the
        :class:`~looplm.model.lm.LoopStep` after layers start … min(loops, N) (state = h_i)."""
        depth = self.active_depth(loops)
        check_start(start, depth, state)
        h = context.e if state is None else state
        mask = context.extra.get("attn_mask")
        yield LoopStep(start, h, context, None)
        for i in range(start, depth):
            h = h + self.layers[i](h, mask=mask)
            yield LoopStep(i + 1, h, context, None)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        loops: int | None = None,
        *,
        keep_all: bool = False,
        truncate_k: int = 0,
        checkpoint_loops: bool = False,
    ) -> list[torch.Tensor]:
        out = [st.state for st in self.unroll(self.prepare(input_ids), loops)]
        return out if keep_all else out[-1:]

    def iter_depths(self, input_ids: torch.Tensor, depths: list[int]):
        """Yield ``(T, h)`` for sorted ``depths``; depth T runs the first min(T, N) layers."""
        wanted = sorted({check_loops(int(d)) for d in depths})
        states = self.unroll(self.prepare(input_ids), wanted[-1])
        st = next(states)
        for T in wanted:
            while st.t < self.active_depth(T):
                st = next(states)
            yield T, st.state

    def forward(
        self, input_ids: torch.Tensor, loops: int | None = None, return_states: bool = False
    ) -> torch.Tensor | LoopOutput:
        if not return_states:
            (h,) = self.hidden_states(input_ids, loops)
            return self.readout(h)
        states = self.hidden_states(input_ids, loops, keep_all=True)
        return LoopOutput(self.readout(states[-1]), states, None, None)
