"""Halting inside the unroll: which tokens or examples keep stepping, and when they stop.

:meth:`looplm.model.lm.LoopedLM.unroll` takes a halting object and asks it, around every loop
step, which rows the shared core computes and which states change. Two kinds exist:

* :class:`TokenHalting` — **per-token** halting with frozen states. After every loop step
  t < T a decision looks at the tokens still active; a halted token keeps its recurrent state
  for the rest of the unroll and later, still active tokens keep attending to it. Once some token
  has halted the core runs in its active-row mode (``Block(x, active=…)``: queries, attention
  rows, output projection and SwiGLU for active rows only; keys and values for every row). With a
  KV cache, steps after every token has halted still write the keys/values of each slot's block
  input (:class:`KeysValuesOnly`), so later tokens find every slot filled. The per-token
  evaluation (:mod:`looplm.adaptive.halting`) and adaptive decoding (:mod:`looplm.decoding.decoder`) both
  run through it.
* :class:`ExampleHalting` — **per-example** early exit with row compaction: an example that stops
  leaves the batch, so each later step costs only the examples still running (the max-token rule
  of :mod:`looplm.adaptive.depth`).

A decision is a callable ``decide(t, h, cur, prev) -> (n,) bool`` over the n active tokens (rows
of ``h`` in row-major order of the active tokens). What it compares is declared by attributes:
``needs_logits`` (default True) — ``cur``/``prev`` are ``log p_t``/``log p_{t−1}`` (float32,
asked chunk by chunk of rows, so a decision that reads them must be row-wise), read out from
``model.finish(h_t)`` (through the exit map and any coda layers, as the final readout; without a
KV cache only: a cached pass cannot run its coda once per step);
``needs_hidden`` — ``cur``/``prev`` are ``h_t``/``h_{t−1}``; ``needs_tokens`` — ``cur`` holds the
active tokens' flat indices into the (B·L) batch (a decision with per-token memory, told of a new
unroll by ``start(n, device)``); neither — both are None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.block import PartCall, core_part
from looplm.model.loss import chunk_rows
from looplm.model.readout import log_probs, row_chunks
from looplm.model.recurrences import LoopContext


# ============================================================================ statistics
def relative_update(h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
    """Per-token ``‖h − h_prev‖₂ / ‖h_prev‖₂``: (…, d) × 2 → (…) float64."""
    num = (h.double() - h_prev.double()).norm(dim=-1)
    den = h_prev.double().norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    return num / den


def max_token_updates(h: torch.Tensor, h_prev: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The per-example max-token statistic: max over scored tokens of the relative update, (B,)."""
    r = relative_update(h, h_prev).masked_fill(~valid, 0.0)  # (B, L)
    return r.amax(dim=1)


def token_mask(state: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """(B, L) token mask → broadcastable over a recurrent state shaped (B, …, L, d)."""
    B, L = active.shape
    if state.dim() < 3 or state.shape[0] != B or state.shape[-2] != L:
        raise LoopLMError(
            f"per-token halting needs recurrent states shaped (batch, ..., length, width); "
            f"got {tuple(state.shape)} for a ({B}, {L}) batch"
        )
    return active.view(B, *([1] * (state.dim() - 3)), L, 1)


def index_context(ctx: LoopContext, idx: torch.Tensor) -> LoopContext:
    """The context of the batch rows ``idx`` (every context tensor is batch-first)."""
    return LoopContext(
        e=ctx.e[idx], anchor=ctx.anchor[idx], extra={k: v[idx] for k, v in ctx.extra.items()}
    )


class PreviousReadout:
    """``log p_{t−1}`` of N rows (float32, (N, V)), compared with the next readout chunk by chunk.

    :meth:`advance` reads out new states of some rows, hands each chunk ``(rows, logp,
    logp_prev)`` to ``fn`` and stores ``logp`` as the rows' new previous readout.
    """

    def __init__(self, model: nn.Module, h: torch.Tensor) -> None:
        self.readout, self.vocab = model.readout, model.config.vocab_size
        if h.shape[0] <= chunk_rows(self.vocab):  # one chunk
            self.logp = log_probs(self.readout, h, torch.float32)
            return
        self.logp = torch.empty(h.shape[0], self.vocab, dtype=torch.float32, device=h.device)
        for c in row_chunks(h.shape[0], self.vocab):
            self.logp[c] = log_probs(self.readout, h[c], torch.float32)

    def advance(
        self,
        h: torch.Tensor,
        fn: Callable[[slice, torch.Tensor, torch.Tensor], torch.Tensor],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """New states ``h`` (n, d) of ``rows`` (default: all N; a bool mask over the N rows or
        their indices) → ``fn(chunk, logp, logp_prev)``'s outputs, concatenated."""
        n = h.shape[0]
        if n <= chunk_rows(self.vocab):  # one chunk (decoding, small batches): no index lists
            logp = log_probs(self.readout, h, torch.float32)  # (n, V)
            out = fn(slice(None), logp, self.logp if rows is None else self.logp[rows])
            if rows is None:
                self.logp = logp
            else:
                self.logp[rows] = logp
            return out
        if rows is not None and rows.dtype == torch.bool:
            rows = rows.nonzero().squeeze(1)
        out = []
        for c in row_chunks(n, self.vocab):
            idx = c if rows is None else rows[c]
            logp = log_probs(self.readout, h[c], torch.float32)  # (n_c, V)
            out.append(fn(c, logp, self.logp[idx]))
            self.logp[idx] = logp
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=h.device)


class PreviousHidden:
    """``h_{t−1}`` of N rows ((N, d)); the same interface as :class:`PreviousReadout`."""

    def __init__(self, model: nn.Module, h: torch.Tensor) -> None:
        self.h = h

    def advance(self, h: torch.Tensor, fn, rows: torch.Tensor | None = None) -> torch.Tensor:
        prev = self.h if rows is None else self.h[rows]
        out = fn(slice(None), h, prev)
        # out of place: the table may share memory with a state (to_hidden can return it)
        self.h = h if rows is None else self.h.index_put((rows,), h)
        return out


# ============================================================================ per token
class TokenHalting:
    """Per-token halting with frozen states for one unroll (see the module docstring).

    ``decide``: the decision (asked after every loop step t < T about the active tokens).
    ``skip``: run the core on active rows only once some token has halted (False: the dense core,
    with halted tokens' states still frozen — the same results up to rounding, no work skipped).
    ``finish``: called as ``finish(h_t, context)`` for a readout rule's reads instead of
    ``model.finish`` (once at t = 0, then once after every step with an active token).
    After the unroll ``depth`` (B, L) int64 holds the loop steps each token took.
    """

    def __init__(
        self, decide: Callable, *, skip: bool = True, finish: Callable | None = None
    ) -> None:
        self.decide, self.skip = decide, skip
        self.finish = finish  # what a readout rule reads through instead of ``model.finish``
        self.active: torch.Tensor | None = None
        self.depth: torch.Tensor | None = None
        self.n_active = 0
        self._prev: PreviousReadout | PreviousHidden | None = None
        self._idx: torch.Tensor | None = None  # the active tokens' flat indices once some halted
        self._finish: Callable | None = None
        self._kv_core: KeysValuesOnly | None = None

    @property
    def running(self) -> bool:
        """Whether any token is still active."""
        return self.n_active > 0

    @property
    def dense(self) -> bool:
        """Whether every token is still active."""
        return self.n_active == self._size

    def start(self, model: nn.Module, step, loops: int) -> None:
        """Every token of the step's batch active; the previous readout/state from ``step``."""
        B, L = step.context.e.shape[:2]
        dev = step.context.e.device
        self.active = torch.ones(B, L, dtype=torch.bool, device=dev)
        self.depth = torch.full((B, L), loops, dtype=torch.long, device=dev)
        self.n_active = self._size = B * L
        if hasattr(self.decide, "start"):
            self.decide.start(B * L, dev)
        table = None
        if getattr(self.decide, "needs_logits", True):
            table = PreviousReadout
        elif getattr(self.decide, "needs_hidden", False):
            table = PreviousHidden
        # A readout-based rule reads what the readout reads: the state through the model's exit
        # map and coda (``model.finish``, identity for most looped models), over the whole
        # sequence since coda layers attend across positions.
        # (``finish``: a cached pass's own, which keeps the coda's keys/values of every step)
        reader = self.finish or getattr(model, "finish", None)
        self._finish = reader if table is PreviousReadout else None
        first = self._read(step) if table is PreviousReadout else step.hidden
        self._prev = table(model, first.reshape(B * L, -1)) if table else None

    def _read(self, step) -> torch.Tensor:
        """What the readout reads at ``step`` (B, L, d): ``model.finish(h_t)`` — the hidden
        state itself for a model without exit map or coda."""
        return step.hidden if self._finish is None else self._finish(step.hidden, step.context)

    def bind(self, core) -> None:
        """Before a step: the core computes the active rows (all while every token is active)."""
        core.active = None if (self.n_active == self._size or not self.skip) else self.active

    def merge(self, state: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """After a step: halted tokens keep their state."""
        if self.n_active == self._size:
            return new
        return torch.where(token_mask(state, self.active), new, state)

    def observe(self, step, loops: int) -> None:
        """After step t < T: ask the decision about the active tokens; halt those it says.

        Stays eager (the active rows are a data-dependent shape) with one host sync per step:
        the active tokens' flat indices, whose count decides the next step's dense / active-row
        mode and whether to go on; every gather and scatter here reads those indices (no
        boolean indexing, which would sync once more each)."""
        t = step.t
        if t >= loops:
            return
        h = step.hidden
        B, L = self.active.shape
        dense = self.n_active == B * L
        idx = None if dense else self._idx  # the active tokens' flat indices (row-major)
        # (N, d) rows of the active tokens; while all are active, a view
        h_act = h.reshape(B * L, -1) if dense else h.reshape(B * L, -1)[idx]
        if getattr(self.decide, "needs_tokens", False):
            rows = torch.arange(B * L, device=h.device) if dense else idx
            halt = self.decide(t, h_act, rows, None)
        elif self._prev is None:
            halt = self.decide(t, h_act, None, None)
        else:
            decide = self.decide
            ask = lambda c, cur, prev: decide(t, h_act[c], cur, prev)  # noqa: E731
            r_act = h_act
            if self._finish is not None:
                r = self._read(step)
                if r is not h:
                    r_act = r.reshape(B * L, -1) if dense else r.reshape(B * L, -1)[idx]
            halt = self._prev.advance(r_act, ask, idx)
        if dense:
            stop = halt.view(B, L)
        else:
            stop = torch.zeros_like(self.active).view(-1).index_put_((idx,), halt).view(B, L)
        self.depth = self.depth.masked_fill(stop, t)
        self.active = self.active & ~stop
        self._idx = self.active.view(-1).nonzero().squeeze(1)  # the step's one host sync
        self.n_active = self._idx.numel()

    def keys_values_only(self, rec: nn.Module, core, state, context, t: int) -> None:
        """A step after every token has halted: each block call only writes its keys/values."""
        if self._kv_core is None:
            self._kv_core = KeysValuesOnly(core, self.active)
        self._kv_core.calls = 0
        rec.step(self._kv_core, state, context, t)


class KeysValuesOnly:
    """The core once every token of a cached pass has halted: each call only writes the
    keys/values of its input into its slot(s) — the block's path for a call without active rows —
    and returns G = 0 (the recurrence's result is discarded; the states stay frozen). The
    keys/values are a function of the input alone, so an input equal to the one the same call
    received at the previous step gets that step's keys/values copied when the cache can copy
    (``copy_new``; a frozen SCSE state is the block input itself, so after the first halted step
    no projection runs)."""

    def __init__(self, core, no_rows: torch.Tensor) -> None:
        self.core, self.no_rows = core, no_rows  # (B, L) all False
        self.calls = 0  # block calls made in the current loop step
        self.seen: dict[int, tuple[torch.Tensor, int]] = {}  # call → (input, first slot)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        core, i = self.core, self.calls
        self.calls += 1
        n = getattr(core.block, "n_layers", 1)
        cache = core.cache
        prev = self.seen.get(i)
        if prev is not None and hasattr(cache, "copy_new") and torch.equal(prev[0], x):
            for j in range(n):
                cache.copy_new(prev[1] + j, core.slot + j, x.shape[-2])
            core.slot += n
        else:
            self.seen[i] = (x, core.slot)
            core.active = self.no_rows
            core(x)
        return torch.zeros_like(x)

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        """x + G(x) with G = 0 here: the keys/values are written, the state is returned."""
        self(x)
        return x

    def part(self, index: int, parts: int) -> PartCall:
        """Part of the core's layers (:meth:`looplm.model.block.BlockCall.part`), keys and
        values only."""
        return PartCall(self, self.core, core_part(self.core.block, index, parts))


# ============================================================================ per example
class ExampleHalting:
    """Per-example early exit with row compaction for one unroll.

    ``decide(t, h, h_prev, rows) -> (A,) bool`` is asked after every step t < T about the A
    examples still running (``rows``: their indices in the original batch; h, h_prev (A, L, d)).
    A stopped example leaves the batch. After the unroll ``out`` (B, L, d) holds each example's
    final hidden state and ``depth`` (B,) its loop steps.
    """

    compacts = True

    def __init__(self, decide: Callable) -> None:
        self.decide = decide
        self.out: torch.Tensor | None = None
        self.depth: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self._prev: torch.Tensor | None = None

    @property
    def running(self) -> bool:
        return self.rows is not None and self.rows.numel() > 0

    def start(self, model: nn.Module, step, loops: int) -> None:
        h = step.hidden
        B = h.shape[0]
        self.out = torch.empty_like(h)
        self.depth = torch.full((B,), loops, dtype=torch.long, device=h.device)
        self.rows = torch.arange(B, device=h.device)
        self._prev = h

    def bind(self, core) -> None:
        pass

    def merge(self, state: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return new

    def observe(self, step, loops: int):
        """After step t: record stopped examples; the compacted (state, context) or None."""
        h, rows = step.hidden, self.rows
        if step.t >= loops:
            self.out[rows] = h
            self.rows = rows[:0]
            return None
        stop = self.decide(step.t, h, self._prev, rows)  # (A,)
        self._prev = h
        if not bool(stop.any()):  # the step's one host sync: whether the batch shrinks
            return None
        self.out[rows[stop]] = h[stop]
        self.depth[rows[stop]] = step.t
        keep = ~stop
        self.rows, self._prev = rows[keep], h[keep]
        if not self.running:
            return None
        return step.state[keep], index_context(step.context, keep)


UnrollHalting = TokenHalting | ExampleHalting  # what ``LoopedLM.unroll(…, halting=…)`` takes
