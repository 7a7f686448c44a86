"""LoopedLM: embed → [prelude] → anchor/initial state → loop(core, recurrence, T) → [coda] → readout.

    e = P(x)                       token (+ learned position) embedding    (B, L, d)
    e ← prelude(e)                 ``prelude_layers`` non-looped layers (none by default)
    ctx = recurrence.prepare(e)    h* and whatever the method computes once
    s_0 = recurrence.init_state(ctx)
    s_{t+1} = recurrence.step(G, s_t, ctx, t)     t = 0 … T−1, one shared core G
    h = coda(exit(h_T))            the recurrence's exit map (identity by default), then
                                   ``coda_layers`` non-looped layers (none by default)
    logits = RMSNorm(h) @ Eᵀ       tied output head                         (B, L, V)

The readout options (``tie_head``, ``final_norm``, ``logit_scale``, ``logit_softcap``,
``emb_scale``, ``coda_norm``) and the block options serve checkpoints trained elsewhere
(:mod:`looplm.model.families`); their defaults are the lines above.

The shared core G is one block, or ``core_layers`` = k blocks composed into one update
(:class:`~looplm.model.block.Core`). Positions are learned (absolute), rotary or absent
(``model.positions``); ``model.attention=adjacency`` replaces causal attention by the input's graph
(:func:`looplm.model.masks.adjacency_mask`) in every layer.

The loop count is a call-time argument: one trained model is evaluated at any depth. States are kept
only when asked for (``return_states=True``), so evaluation memory is flat in T.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from looplm.errors import LoopLMError
from looplm.model.block import Block, BlockCall, Core, KVCache, positions
from looplm.model.halting import UnrollHalting
from looplm.model.loss import linear_cross_entropy, linear_nll_and_correct
from looplm.model.masks import adjacency_mask
from looplm.model.readout import readout_nll, readout_nll_static, score_tokens
from looplm.model.recurrences import LoopContext, Recurrence, build_recurrence
from looplm.settings.config import ModelConfig
from looplm.targets import IGNORE_INDEX


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


@dataclass
class Scores:
    """What :meth:`LanguageModelBase.score` reads from hidden states (summed or per token)."""

    nll: torch.Tensor  # Σ NLL (scalar) or per token (B, L) float64, 0 where unscored
    n_tokens: torch.Tensor  # number of scored positions (scalar)
    correct: torch.Tensor | None  # argmax hits: a count or (B, L) bool; None with gradients


@dataclass
class LoopStep:
    """The loop state after ``t`` steps of one unroll (t = 0 is the initial state)."""

    t: int
    state: torch.Tensor  # s_t in the recurrence's own coordinates (SCSE: Δ_t)
    context: LoopContext
    recurrence: Recurrence | None  # None: the state is the hidden state (unshared layers)
    _hidden: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def hidden(self) -> torch.Tensor:
        """h_t in hidden-state coordinates, before any coda (SCSE: h* + Δ_t); computed once."""
        if self.recurrence is None:
            return self.state
        if self._hidden is None:
            self._hidden = self.recurrence.to_hidden(self.state, self.context)
        return self._hidden

    def state_for(self, h: torch.Tensor) -> torch.Tensor:
        """The recurrent state of this step with its hidden state replaced by ``h``:
        ``s_t + from_hidden(h) − from_hidden(h_t)``, which keeps whatever the state holds beyond
        h_t (hyper-connection lanes) and is ``s_t`` bit for bit when ``h`` is h_t. An analysis
        that edits h_t continues with ``unroll(…, state=step.state_for(h′), start=t)``."""
        if self.recurrence is None:
            return h
        rec, ctx = self.recurrence, self.context
        return self.state + (rec.from_hidden(h, ctx) - rec.from_hidden(self.hidden, ctx))


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """LoopLMError naming an id outside [0, vocab_size) (reads values: check host tensors)."""
    lo, hi = (int(input_ids.min()), int(input_ids.max())) if input_ids.numel() else (0, 0)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise LoopLMError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_loops(loops: int) -> int:
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise LoopLMError(f"loops={loops!r}: the loop depth T must be an integer >= 1")
    return loops


def check_start(start: int, loops: int, state: torch.Tensor | None) -> int:
    """The first step of an unroll: 0 … loops, and a later one only from a given state."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= loops:
        raise LoopLMError(f"start={start!r}: the first loop step must lie in 0 … {loops}")
    if state is None and start != 0:
        raise LoopLMError(f"start={start}: an unroll from a later step needs its state")
    return start


class LanguageModelBase(nn.Module):
    """Embedding, readout, loss and initialisation shared by looped and unshared models."""

    is_looped = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = (
            nn.Embedding(cfg.context, cfg.d_model) if cfg.positions == "learned" else None
        )
        self.emb_drop = nn.Dropout(cfg.dropout)
        # The final norm; without one (final_norm=false) the readout reads h itself.
        self.norm_f = (
            nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps, elementwise_affine=cfg.norm_weight)
            if cfg.final_norm
            else nn.Identity()
        )
        self.lm_head = None if cfg.tie_head else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's matrix (V, d): the token embedding when tied."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def new_block(self, layer: int | None = None) -> Block:
        """A Transformer layer with this model's width, norms and position encoding; ``layer``:
        its index in prelude, core, coda order (for per-layer options: value embeddings)."""
        c = self.config
        rope_base = c.rope_base if c.positions == "rope" else 0.0
        return Block(
            c.d_model,
            c.n_heads,
            c.d_ff,
            c.dropout,
            c.norm_eps,
            rope_base,
            n_kv_heads=c.kv_heads,
            norm_placement=c.norm_placement,
            qk_norm=c.qk_norm,
            qk_bias=c.qk_bias,
            mlp=c.mlp,
            rope_layout=c.rope_layout,
            value_embed=c.vocab_size if layer in c.value_embed_layers else 0,
            reference_rounding=c.reference_rounding,
            attn_gate=c.attn_gate,
            norm_weight=c.norm_weight,
        )

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The data-given attention mask (B, L, L) of ``model.attention=adjacency``, else None."""
        if self.config.attention != "adjacency":
            return None
        return adjacency_mask(input_ids)

    def finish(self, h: torch.Tensor, context: LoopContext | None = None, **kw) -> torch.Tensor:
        """What the readout reads from a state: identity here (a looped model applies its coda)."""
        return h

    def hops_per_step(self) -> tuple[int, int]:
        """(hops per loop step, hops outside the loop) of adjacency attention: a k-layer core
        moves information k hops per step, prelude and coda layers one hop each; an unshared
        model's layers one hop each (its ``loops`` count layers)."""
        c = self.config
        if not c.is_looped:
            return 1, 0
        return c.core_layers, c.prelude_layers + c.coda_layers

    @staticmethod
    def run_layers(
        layers: nn.ModuleList,
        h: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        first_slot: int = 0,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``h ← h + G_i(h)`` through non-looped ``layers`` (prelude, coda, unshared stack)."""
        call = BlockCall(None, cache=cache, mask=mask, first_slot=first_slot, tokens=tokens)
        for layer in layers:
            call.block = layer
            h = call.advance(h)  # h + G_i(h), in the layer's own order
        return h

    def _init_weights(self) -> None:
        """``model.init`` (see :class:`~looplm.settings.config.ModelConfig`).

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

    def embed(self, input_ids: torch.Tensor, pos_offset: int | torch.Tensor = 0) -> torch.Tensor:
        """(B, L) token ids → e = P(x): (B, L, d); positions start at ``pos_offset`` (an int, or
        a (B,) tensor: each row's own start)."""
        if input_ids.dim() != 2:
            raise LoopLMError(
                f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}"
            )
        L = input_ids.shape[1]
        per_row = torch.is_tensor(pos_offset)
        end = (
            (int(pos_offset.max()) if pos_offset.numel() else 0) + L if per_row else pos_offset + L
        )
        if end > self.config.context:
            raise LoopLMError(
                f"sequence length {end} is longer than the model's context {self.config.context}"
            )
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise LoopLMError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
        # Eager calls on the CPU check ids here (a GPU check would sync); a compiled graph
        # cannot read a tensor's value, so the training loop checks each batch on the host
        # before it moves to the device (:func:`check_token_ids`).
        if input_ids.device.type == "cpu" and not torch.compiler.is_compiling():
            check_token_ids(input_ids, self.config.vocab_size)
        e = self.tok_emb(input_ids)
        if self.config.emb_scale != 1.0:
            e = e * self.config.emb_scale
        if self.pos_emb is not None:
            e = e + self.pos_emb(positions(pos_offset, L, input_ids.device))  # (L | B×L, d)
        return self.emb_drop(e)

    @property
    def plain_readout(self) -> bool:
        """Whether the readout is ``RMSNorm(h) @ Wᵀ`` alone (no logit scale or softcap), so the
        fused chunked loss applies."""
        c = self.config
        return c.logit_scale == 1.0 and not c.logit_softcap

    def readout(self, h: torch.Tensor) -> torch.Tensor:
        """C(RMSNorm(h)) with the head tied to the token embedding: (…, d) → (…, V).

        Options: an untied head (``tie_head=false``), no final norm (``final_norm=false``), logits
        times ``logit_scale``, then ``c·tanh(logits / c)`` for ``logit_softcap`` = c > 0."""
        c = self.config
        logits = F.linear(self.norm_f(h), self.head_weight)
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.logit_softcap:
            logits = c.logit_softcap * torch.tanh(logits / c.logit_softcap)
        return logits

    def hidden_states(self, input_ids: torch.Tensor, loops: int, **kw) -> list[torch.Tensor]:
        raise NotImplementedError

    def score(
        self,
        h: torch.Tensor,
        targets: torch.Tensor,
        *,
        per_token: bool = False,
        hits: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> Scores:
        """The one scorer: the readout of states ``h`` (B, L, d) against ``targets`` (B, L) at
        the positions whose target is not ``IGNORE_INDEX``, chunked over rows (no (N, V) logits
        table is kept).

        Summed (default): ``nll`` Σ NLL (float32, differentiable when gradients are on — the
        training loss — with ``correct`` None then, as with ``hits=False``) and ``correct`` the
        number of argmax hits.
        ``per_token``: ``nll`` (B, L) float64 (0 where unscored) and ``correct`` (B, L) bool, the
        logits cast to ``dtype`` before the log-softmax. ``n_tokens``: the scored positions.
        A hit is the argmax over the whole vocabulary (task accuracy counts these).
        """
        valid = targets != IGNORE_INDEX
        n = valid.sum()
        if torch.compiler.is_compiling() and not per_token:  # no shape may depend on targets
            nll, correct = readout_nll_static(self.readout, h, targets, hits)
            return Scores(nll, n, correct)
        if per_token:
            V = self.config.vocab_size
            nll, correct = score_tokens(self.readout, h, targets, V, dtype=dtype)
            return Scores(nll, n, correct)
        tgt = targets[valid]  # (N,)
        w = self.head_weight
        if not self.plain_readout:  # scaled or capped logits: the readout itself, chunked
            rows = h[valid]
            if torch.is_grad_enabled() and (rows.requires_grad or w.requires_grad):
                nll = F.cross_entropy(self.readout(rows).float(), tgt, reduction="sum")
                return Scores(nll, n, None)
            nll, hit = readout_nll(self.readout, rows, tgt, self.config.vocab_size)
            return Scores(nll.sum().float(), n, hit.sum() if hits else None)
        x = self.norm_f(h[valid])  # (N, d)
        grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        if grad or not hits:
            return Scores(linear_cross_entropy(x, w, tgt), n, None)
        nll, count = linear_nll_and_correct(x, w, tgt)
        return Scores(nll, n, count)

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
        """Mean next-token cross-entropy over positions whose target is not ``IGNORE_INDEX``.

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
        total = 0.0
        for h in hs:  # summed NLL of each supervised readout, averaged over the readouts
            scored = self.score(h, targets, hits=False)
            total = total + scored.nll
        total = total / len(hs)
        return total if reduction == "sum" else total / scored.n_tokens.clamp(min=1)

    @torch.no_grad()
    def nll_sum(
        self, input_ids: torch.Tensor, targets: torch.Tensor, loops: int
    ) -> tuple[float, int]:
        """(Σ NLL, number of predicted tokens) at depth ``loops`` — for token-weighted PPL."""
        (h,) = self.hidden_states(input_ids, loops)
        scored = self.score(h, targets, hits=False)
        return float(scored.nll), int(scored.n_tokens)

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
        # Non-looped layers are created before the core so that a 0/1/0 model registers (and
        # initialises) its modules exactly as a plain single-block model.
        p, k = cfg.prelude_layers, cfg.core_layers
        self.prelude = nn.ModuleList(self.new_block(i) for i in range(p))
        self.block = (
            self.new_block(p) if k == 1 else Core([self.new_block(p + i) for i in range(k)])
        )
        self.coda = nn.ModuleList(self.new_block(p + k + i) for i in range(cfg.coda_layers))
        self.recurrence = build_recurrence(cfg.recurrence, cfg.d_model, cfg.recurrence_args)
        self._init_weights()

    # -- the one-step map ------------------------------------------------------------------
    def prepare(
        self, input_ids: torch.Tensor, *, cache: KVCache | None = None, pos_offset: int = 0
    ) -> LoopContext:
        """Everything computed once per input: e (after the prelude), h*, … and the attention
        mask (``ctx.extra["attn_mask"]`` for adjacency attention). With ``cache`` the prelude's
        keys/values go to slots 0 … prelude_layers − 1."""
        mask = self.attention_mask(input_ids)
        e = self.embed(input_ids, pos_offset=pos_offset)
        tokens = input_ids if self.config.value_embed_layers else None
        if len(self.prelude):
            e = self.run_layers(self.prelude, e, mask, cache, tokens=tokens)
        ctx = self.recurrence.prepare(e)
        if mask is not None:
            ctx.extra["attn_mask"] = mask
        if tokens is not None:  # value embeddings read the token ids in every layer
            ctx.extra["tokens"] = tokens
        return ctx

    def core_call(
        self,
        context: LoopContext,
        *,
        cache: KVCache | None = None,
        active: torch.Tensor | None = None,
    ) -> BlockCall:
        """The shared core G bound to this pass (mask, cache slots after the prelude's, active
        rows): what a recurrence's ``step`` calls."""
        return BlockCall(
            self.block,
            cache=cache,
            active=active,
            mask=context.extra.get("attn_mask"),
            first_slot=len(self.prelude),
            tokens=context.extra.get("tokens"),
        )

    def finish(
        self,
        h: torch.Tensor,
        context: LoopContext | None = None,
        *,
        cache: KVCache | None = None,
        first_slot: int = 0,
    ) -> torch.Tensor:
        """The coda applied to a loop state (B, L, d): what the readout reads. Identity without
        coda layers. ``first_slot``: the coda's first KV-cache slot.

        Before the coda: the recurrence's ``exit`` map (identity unless the method defines one),
        then the final norm when ``coda_norm``."""
        h = self.recurrence.exit(h)
        if self.config.coda_norm:
            h = self.norm_f(h)
        if not len(self.coda):
            return h
        extra = context.extra if context is not None else {}
        return self.run_layers(
            self.coda, h, extra.get("attn_mask"), cache, first_slot, tokens=extra.get("tokens")
        )

    def step(
        self, h: torch.Tensor, context: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        """h_{t+1} from any hidden state h (hidden coordinates).

        ``mask=False`` gives the raw pre-mask map (for b̃_t diagnostics).
        """
        rec = self.recurrence
        s = rec.step(self.core_call(context), rec.from_hidden(h, context), context, t, mask=mask)
        return rec.to_hidden(s, context)

    # -- the unroll ------------------------------------------------------------------------
    def unroll(
        self,
        context: LoopContext,
        loops: int,
        *,
        state: torch.Tensor | None = None,
        start: int = 0,
        core: BlockCall | None = None,
        truncate_k: int = 0,
        checkpoint_loops: bool = False,
        halting: UnrollHalting | None = None,
    ) -> Iterator[LoopStep]:
        """The one unroll of the shared core: yields the :class:`LoopStep` of t = start … loops.

        ``state``: the recurrent state at step ``start`` (default: the recurrence's initial state
        at ``start = 0``), e.g. a perturbed state to continue from. ``core``: a bound core (KV
        cache, active rows) instead of ``self.core_call(context)``. ``truncate_k`` > 0 runs the
        first loops − k steps without gradient (truncated backprop); ``checkpoint_loops``
        recomputes each step in the backward pass. The caller may stop iterating at any step.

        ``halting`` (:mod:`looplm.model.halting`) stops tokens or examples early: per token, halted
        tokens keep their state and the core computes active rows only (once every token has
        halted the unroll ends, or with a KV cache goes on writing keys/values only); per example,
        stopped examples leave the batch (later steps carry the remaining rows). Its ``depth``
        (and ``out`` per example) hold the result once the unroll is done.
        """
        check_start(start, check_loops(loops), state)
        rec = self.recurrence
        core = core if core is not None else self.core_call(context)
        s = rec.init_state(context) if state is None else state
        first = LoopStep(start, s, context, rec)
        if halting is not None:
            if getattr(halting, "compacts", False) and core.cache is not None:
                raise LoopLMError("per-example halting drops rows, which a KV cache cannot follow")
            halting.start(self, first, loops)
        yield first
        n_free = loops - truncate_k if 0 < truncate_k < loops else 0
        for t in range(start, loops):
            if halting is not None and not halting.running:  # all halted: frozen from here on
                if core.cache is None:
                    return
                halting.keys_values_only(rec, core, s, context, t)  # later tokens read them
                yield LoopStep(t + 1, s, context, rec)
                continue
            if halting is not None:
                halting.bind(core)
            new = self._advance(core, s, context, t, t < n_free, checkpoint_loops)
            if halting is None:
                s = new
                yield LoopStep(t + 1, s, context, rec)
                continue
            s = halting.merge(s, new)
            step = LoopStep(t + 1, s, context, rec)
            compacted = halting.observe(step, loops)
            yield step
            if compacted is not None:  # stopped examples leave the batch
                s, context = compacted
                core = self.core_call(context)

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
        """[h_T] (or [h_0 … h_T] with ``keep_all``) in hidden coordinates, each passed through
        the coda (so each is what the readout reads)."""
        ctx = context if context is not None else self.prepare(input_ids)
        steps = self.unroll(ctx, loops, truncate_k=truncate_k, checkpoint_loops=checkpoint_loops)
        if keep_all:
            return [self.finish(st.hidden, ctx) for st in steps]
        for last in steps:  # noqa: B007 — only the final state is read
            pass
        return [self.finish(last.hidden, ctx)]

    def iter_depths(self, input_ids: torch.Tensor, depths: list[int]):
        """Yield ``(T, h_T)`` for each T in sorted ``depths`` from one unroll (cost: max depth);
        h_T has passed through the coda."""
        wanted = sorted({check_loops(int(d)) for d in depths})
        ctx = self.prepare(input_ids)
        for st in self.unroll(ctx, wanted[-1]):
            if st.t in wanted:
                yield st.t, self.finish(st.hidden, ctx)

    def _advance(
        self, core: BlockCall, s: torch.Tensor, ctx: LoopContext, t: int, free: bool, ckpt: bool
    ) -> torch.Tensor:
        """s_t → s_{t+1}: without gradient when ``free`` (the early loops of truncated
        backprop), recomputed in the backward pass when ``ckpt``, else plainly."""
        if free:
            with torch.no_grad():
                return self.recurrence.step(core, s, ctx, t)
        if ckpt and torch.is_grad_enabled():
            e, anchor = ctx.e, ctx.anchor  # passed so checkpoint tracks them
            return checkpoint(self._step_state, s, e, anchor, t, ctx, use_reentrant=False)
        return self.recurrence.step(core, s, ctx, t)

    def _step_state(self, s, e, anchor, t, ctx):  # e/anchor passed so checkpoint tracks them
        return self.recurrence.step(self.core_call(ctx), s, ctx, t)

    def forward(
        self, input_ids: torch.Tensor, loops: int = 8, return_states: bool = False
    ) -> torch.Tensor | LoopOutput:
        """input_ids (B, L) → logits (B, L, V), or a :class:`LoopOutput` with the states.

        ``.states`` are the loop states h_0 … h_T (before any coda); the logits read
        ``coda(h_T)``.
        """
        if not return_states:
            (h,) = self.hidden_states(input_ids, loops)
            return self.readout(h)
        ctx = self.prepare(input_ids)
        states = [st.hidden for st in self.unroll(ctx, loops)]
        logits = self.readout(self.finish(states[-1], ctx))
        return LoopOutput(logits, states, ctx.anchor, ctx)
