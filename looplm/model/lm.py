"""LoopedLM: embed → anchor/initial state → loop(block, recurrence, T) → readout.

    e = P(x)                       token + learned position embedding      (B, L, d)
    ctx = recurrence.prepare(e)    h* and whatever the method computes once
    s_0 = recurrence.init_state(ctx)
    s_{t+1} = recurrence.step(block, s_t, ctx, t)     t = 0 … T−1, one shared block
    logits = RMSNorm(h_T) @ Eᵀ     tied output head                         (B, L, V)

The loop count is a call-time argument: one trained model is evaluated at any depth. States are kept
only when asked for (``return_states=True``), so evaluation memory is flat in T.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from looplm.config import ModelConfig
from looplm.errors import LoopLMError
from looplm.model.block import Block
from looplm.model.loss import linear_cross_entropy
from looplm.model.recurrences import LoopContext, build_recurrence


@dataclass
class LoopOutput:
    """``model(ids, loops=T, return_states=True)``.

    logits: (B, L, V); states: [h_0 … h_T] each (B, L, d) in hidden-state coordinates;
    anchor: h* (B, L, d); context: what ``model.step`` needs (None for unshared models).
    """

    logits: torch.Tensor
    states: list[torch.Tensor]
    anchor: torch.Tensor | None
    context: LoopContext | None


def check_loops(loops: int) -> int:
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise LoopLMError(f"loops={loops!r}: the loop depth T must be an integer >= 1")
    return loops


class LanguageModelBase(nn.Module):
    """Embedding, readout, loss and initialisation shared by looped and unshared models."""

    is_looped = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.norm_f = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def _init_weights(self) -> None:
        """``model.init`` (see :class:`~looplm.config.ModelConfig`).

        ``normal`` (default): GPT-2 style N(0, init_std = 0.02) for every projection and
        N(0, emb_std = 0.02) for both embeddings (frozen projections included: a frozen random
        anchor is drawn from the same distribution, then never trained). ``depth_scaled``: the
        block's residual output projections get std init_std / sqrt(2·init_depth). Modules that
        define ``init_weights()`` (e.g. a recurrence's projection start) run it afterwards.
        """
        cfg = self.config
        residual = cfg.init_std / math.sqrt(2 * cfg.init_depth)
        embeddings = (self.tok_emb, self.pos_emb)
        for m in self.modules():
            if any(m is e for e in embeddings):
                nn.init.normal_(m.weight, mean=0.0, std=cfg.emb_std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(m, nn.Linear):
                out_proj = getattr(m, "residual_output", False) and cfg.init == "depth_scaled"
                nn.init.normal_(m.weight, mean=0.0, std=residual if out_proj else cfg.init_std)
        for m in self.modules():
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights()

    def embed(self, input_ids: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:
        """(B, L) token ids → e = P(x): (B, L, d); positions start at ``pos_offset``."""
        if input_ids.dim() != 2:
            raise LoopLMError(
                f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}"
            )
        L = input_ids.shape[1]
        if pos_offset + L > self.config.context:
            raise LoopLMError(
                f"sequence length {pos_offset + L} is longer than the model's context "
                f"{self.config.context}"
            )
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise LoopLMError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        if input_ids.device.type == "cpu" and input_ids.numel():  # on GPU this would sync
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise LoopLMError(
                    f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})"
                )
        pos = torch.arange(pos_offset, pos_offset + L, device=input_ids.device)
        return self.emb_drop(self.tok_emb(input_ids) + self.pos_emb(pos))

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """C(RMSNorm(h)) with the head tied to the token embedding: (…, d) → (…, V)."""
        return F.linear(self.norm_f(h), self.tok_emb.weight)

    def hidden_states(self, input_ids: torch.Tensor, loops: int, **kw) -> list[torch.Tensor]:
        raise NotImplementedError

    def _nll_from_hidden(
        self, hs: list[torch.Tensor], targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed NLL over supervised positions (targets != -100), averaged over ``hs``."""
        valid = targets != -100
        n = valid.sum()
        tgt = targets[valid]  # (N,)
        total = 0.0
        for h in hs:
            # readout + CE over supervised positions only, chunked over rows (looplm.model.loss):
            # no (N, V) fp32 logits are kept for the backward pass.
            x = self.norm_f(h[valid])  # (N, d)
            total = total + linear_cross_entropy(x, self.tok_emb.weight, tgt)
        return total / len(hs), n

    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        loops: int = 8,
        *,
        objective: str = "final",
        truncate_k: int = 0,
        checkpoint_loops: bool = False,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Mean next-token cross-entropy over positions whose target is not -100.

        objective ``final`` supervises only h_T (silent thinking); ``per_step`` averages the loss of
        every intermediate readout h_1 … h_T. ``truncate_k`` > 0 backpropagates through the last k
        loops only; ``checkpoint_loops`` recomputes each loop step in the backward pass.
        ``reduction="sum"`` returns the summed NLL instead of the mean (the trainer divides by the
        token count of the whole global batch).
        """
        if reduction not in ("mean", "sum"):
            raise LoopLMError(f"reduction={reduction!r}; allowed: mean, sum")
        hs = self.hidden_states(
            input_ids,
            loops,
            keep_all=objective == "per_step",
            truncate_k=truncate_k,
            checkpoint_loops=checkpoint_loops,
        )
        if objective == "per_step":
            hs = hs[1:] if len(hs) > 1 else hs
        total, n = self._nll_from_hidden(hs, targets)
        return total if reduction == "sum" else total / n.clamp(min=1)

    @torch.no_grad()
    def nll_sum(
        self, input_ids: torch.Tensor, targets: torch.Tensor, loops: int
    ) -> tuple[float, int]:
        """(Σ NLL, number of predicted tokens) at depth ``loops`` — for token-weighted PPL."""
        hs = self.hidden_states(input_ids, loops)
        total, n = self._nll_from_hidden(hs, targets)
        return float(total), int(n)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameters the model carries (tied head counted once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def no_decay_parameters(self) -> set[int]:
        """ids of parameters without weight decay: ≤1-D tensors (norms, scalar gains)."""
        return {id(p) for p in self.parameters() if p.dim() < 2}


class LoopedLM(LanguageModelBase):
    """A weight-shared looped Transformer LM; ``model(ids, loops=T)`` → logits (B, L, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.block = Block(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.dropout, cfg.norm_eps)
        self.recurrence = build_recurrence(cfg.recurrence, cfg.d_model, cfg.recurrence_args)
        self._init_weights()

    # -- the one-step map ------------------------------------------------------------------
    def prepare(self, input_ids: torch.Tensor) -> LoopContext:
        """Everything computed once per input: e, h*, …"""
        return self.recurrence.prepare(self.embed(input_ids))

    def step(
        self, h: torch.Tensor, context: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        """h_{t+1} from any hidden state h (hidden coordinates).

        ``mask=False`` gives the raw pre-mask map (for b̃_t diagnostics).
        """
        rec = self.recurrence
        s = rec.step(self.block, rec.from_hidden(h, context), context, t, mask=mask)
        return rec.to_hidden(s, context)

    # -- the unroll ------------------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        loops: int,
        *,
        keep_all: bool = False,
        truncate_k: int = 0,
        checkpoint_loops: bool = False,
        context: LoopContext | None = None,
    ) -> list[torch.Tensor]:
        """[h_T] (or [h_0 … h_T] with ``keep_all``) in hidden coordinates."""
        check_loops(loops)
        rec = self.recurrence
        ctx = context if context is not None else self.prepare(input_ids)
        s = rec.init_state(ctx)
        out = [rec.to_hidden(s, ctx)] if keep_all else []
        n_free = loops - truncate_k if 0 < truncate_k < loops else 0
        for t in range(loops):
            if t < n_free:  # truncated backprop: early loops carry no gradient
                with torch.no_grad():
                    s = rec.step(self.block, s, ctx, t)
            elif checkpoint_loops and torch.is_grad_enabled():
                s = checkpoint(self._step_state, s, ctx.e, ctx.anchor, t, ctx, use_reentrant=False)
            else:
                s = rec.step(self.block, s, ctx, t)
            if keep_all:
                out.append(rec.to_hidden(s, ctx))
        if not keep_all:
            out.append(rec.to_hidden(s, ctx))
        return out

    def iter_depths(self, input_ids: torch.Tensor, depths: list[int]):
        """Yield ``(T, h_T)`` for each T in sorted ``depths`` from one unroll (cost: max depth)."""
        wanted = sorted({check_loops(int(d)) for d in depths})
        rec = self.recurrence
        ctx = self.prepare(input_ids)
        s = rec.init_state(ctx)
        for t in range(wanted[-1]):
            s = rec.step(self.block, s, ctx, t)
            if t + 1 in wanted:
                yield t + 1, rec.to_hidden(s, ctx)

    def _step_state(self, s, e, anchor, t, ctx):  # e/anchor passed so checkpoint tracks them
        return self.recurrence.step(self.block, s, ctx, t)

    def forward(
        self, input_ids: torch.Tensor, loops: int = 8, return_states: bool = False
    ) -> torch.Tensor | LoopOutput:
        """input_ids (B, L) → logits (B, L, V), or a :class:`LoopOutput` with the states."""
        if not return_states:
            (h,) = self.hidden_states(input_ids, loops)
            return self.readout(h)
        ctx = self.prepare(input_ids)
        states = self.hidden_states(input_ids, loops, keep_all=True, context=ctx)
        return LoopOutput(self.readout(states[-1]), states, ctx.anchor, ctx)
