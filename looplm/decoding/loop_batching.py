"""Loop-level continuous batching: every row of the batch at its own loop step.

    looplm generate CHECKPOINT --prompts prompts.txt --schedule loop [--halt kl --threshold X]

The token-level batcher (:class:`looplm.decoding.batching.Batcher`) runs one decoding pass per token
boundary: all rows loop together, halted rows drop out of the later steps, and the pass lasts as
long as its deepest token. Here the unit of work is one **loop step**. Every row (a *lane*) carries
its own loop index ``t``; one iteration applies the shared core once to all lanes, each writing its
keys/values into the cache slot of its own step and attending to its own sequence's keys/values of
that step. A lane whose token halts (or reaches T) leaves the loop in the same iteration — its
remaining step slots are filled (the key/value rule below), the coda runs, the token is sampled —
and its sequence's next token enters the loop (embedding and prelude) so that the next iteration
applies step 1 to it. The batch never waits for its deepest row and never shrinks while sequences
are running::

    iteration      i      i+1    i+2    i+3    i+4
    lane 0 (seq A) t=3    t=4*   t=1    t=2    t=3      * halts: token sampled, next one enters
    lane 1 (seq B) t=1    t=2    t=3*   t=1    t=2
    lane 2 (seq C) t=6    t=7    t=8*   t=1    t=2      (T = 8: leaves at the ceiling)
    prefill (D)    t=5    t=6    t=7    t=8    → lane 3 at i+5 (its chunk rode along)

**Key/value rule.** A token that halts after step d owes the cache its keys/values of the slots of
steps d+1 … T (later tokens that are still looping read those slots). They are those of the block
input the recurrence builds from the token's **frozen state** (the block's update taken as 0), the
rule of :func:`looplm.decoding.decoder.decode` (:class:`looplm.model.halting.KeysValuesOnly`): they are
computed once when the token leaves and copied into the remaining step slots (the frozen state's
block input is the same at every later step: the scheduler serves only recurrences whose step does
not depend on t, which it checks). So every sequence gets the tokens and loop depths that
:func:`looplm.decoding.decoder.decode` gives it alone (tested: mixed depths, joins, leaves, cancels,
prefill chunks).

**Prefill.** A new request's prompt (or a window slid past the context) is prefilled in chunks of at
most ``prefill_chunk`` tokens, one loop step of each in-flight chunk per iteration, beside the
decoding lanes: an arrival costs the running sequences one small extra block call per iteration,
never a stall of T steps over the whole prompt. The chunks' keys/values are those of a one-pass
prefill (causal attention: a chunk reads the earlier chunks' keys/values of its own step).

**Static shapes.** With ``static=True`` the lanes are padded to a bucketed count (powers of two up
to ``slots``; padding lanes compute into a scratch cache row) and every key/value read spans the
whole context, so the per-iteration core step has a fixed set of shapes: compiled once per bucket
(``compile=True``: :func:`torch.compile`, CUDA-graph replayed on a GPU — ``reduce-overhead``).

Not served here (they raise :class:`~looplm.errors.LoopLMError`; the token-level batcher serves
them): prefill halting, ``halt=kl`` on a model with coda layers (its reads go through the coda at
every step), recurrences whose step depends on t, data-given attention masks.
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch
from torch import nn

from looplm.decoding.batching import Batcher, BatchResult, Completion, Request, _Row, check_batch
from looplm.decoding.decoder import (
    Halting,
    _sample,
    adaptive_next_logits,
    next_logits,
    step_readouts,
)
from looplm.decoding.loop_cache import LoopKVCache, slot_layout
from looplm.errors import LoopLMError
from looplm.model.halting import KeysValuesOnly
from looplm.model.halting_rules import GateHalt, KLHalt, halting_rule
from looplm.model.lm import LoopStep
from looplm.model.readout import log_probs
from looplm.model.recurrences import LoopContext

__all__ = ["LoopBatcher", "LoopKVCache", "buckets", "generate_loop_level"]


def generate_loop_level(
    model: nn.Module,
    requests: list[Request],
    *,
    slots: int = 8,
    loops: int = 8,
    halt: str = "none",
    threshold: float = 0.0,
    slide: int = 1,
    eot_id: int | None = None,
    progress: bool = False,
    prefill_chunk: int = 32,
    static: bool = False,
    compile: bool | str = False,
) -> BatchResult:
    """:func:`looplm.decoding.batching.generate_many` (same arguments and result) on a loop-level batch of
    at most ``slots`` sequences (module docstring): ``steps`` counts core applications,
    ``row_steps`` the sequences they computed."""
    from tqdm import tqdm

    halting = check_batch(model, requests, slots, loops, halt, threshold, slide)
    model.eval()
    run = LoopBatcher(
        model, loops, halting, slots=slots, slide=slide, eot_id=eot_id,
        prefill_chunk=prefill_chunk, static=static, compile=compile,
    )  # fmt: skip
    run.bar = tqdm(total=sum(r.max_new for r in requests), disable=not progress, leave=False)
    run.queue.extend(enumerate(requests))
    t0 = time.perf_counter()
    while run.busy:
        run.iterate()
    run.bar.close()
    seconds = time.perf_counter() - t0
    completions = [run.completions[i] for i in range(len(requests))]
    return BatchResult(completions, seconds, run.steps, run.row_steps)


def buckets(slots: int) -> list[int]:
    """The lane counts of a static batch: 1, 2, 4, … and ``slots`` itself."""
    out, n = [], 1
    while n < slots:
        out.append(n)
        n *= 2
    return [*out, slots]


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop depths checked per model


def _check_served(
    model: nn.Module, loops: int, halting: Halting, prefill_halt: bool, prefill_chunk: int
) -> None:
    """What the loop-level batch does not serve: one-line errors."""
    why = None
    if prefill_halt and halting.enabled:
        why = "prefill halting runs"
    elif (
        halting.rule != "none" and halting_rule(halting.rule).needs_logits and step_readouts(model)
    ):
        why = "halt=kl on a model with coda layers runs"
    elif model.config.attention != "causal":
        why = "a data-given attention mask runs"
    if why:
        raise LoopLMError(f"{why} on the token-level schedule (--schedule continuous)")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise LoopLMError(f"prefill_chunk={prefill_chunk!r} must be an integer >= 1")
    if loops not in _PROBED.setdefault(model, set()):  # a server starts batches often
        _check_step_invariant(model, loops)
        _PROBED[model].add(loops)


def _decision(model: nn.Module, halting: Halting, device: torch.device):
    """The halting decision of ``halting`` (None when tokens never halt)."""
    if not halting.enabled:
        return None
    decide = halting_rule(halting.rule).build(halting.threshold, model=model)
    if getattr(decide, "needs_tokens", False):  # per-token memory (the exit gate's running sums)
        decide.start(0, device)
    return decide


def _check_step_invariant(model: nn.Module, loops: int) -> None:
    """Rows at different loop steps share one core call only if the step map does not depend on
    t: checked on a random state at every t < T (the model's unroll from step t, no cache)."""
    g = torch.Generator().manual_seed(0)
    dev = model.tok_emb.weight.device
    ctx = model.prepare(torch.randint(0, model.config.vocab_size, (1, 2), generator=g).to(dev))
    s0 = next(model.unroll(ctx, 1)).state
    s = s0 + 0.1 * torch.randn(s0.shape, generator=g).to(s0)
    ref = _one_step(model, model.core_call(ctx), s, ctx)
    for t in range(1, loops):
        if not torch.equal(_one_step(model, model.core_call(ctx), s, ctx, t), ref):
            raise LoopLMError(
                f"recurrence {model.config.recurrence!r} steps depend on the loop index; "
                "loop-level batching needs a step map shared by every t (use --schedule continuous)"
            )


def _one_step(model: nn.Module, core, s: torch.Tensor, ctx: LoopContext, t: int = 0):
    """The state after one application of ``core`` to state ``s`` (the model's unroll from step
    t, one step)."""
    steps = model.unroll(ctx, t + 1, state=s, start=t, core=core)
    next(steps)
    return next(steps).state


class _Prefill:
    """A sequence's window being prefilled in chunks, one loop step per iteration."""

    def __init__(self, row: _Row, crow: int, keep: int) -> None:
        self.row, self.crow = row, crow
        self.ids = row.tokens[-keep:]
        self.done = 0  # tokens of ``ids`` whose keys/values are complete
        self.gen = None  # the current chunk's unroll
        self.last = None


class LoopBatcher:
    """A loop-level continuous batch (module docstring) with the :class:`~looplm.decoding.batching.Batcher`
    interface a driver needs: ``queue`` of (key, Request), ``completions``, :meth:`cancel`,
    ``on_token(key, token, depth, completion)`` and :meth:`iterate` (one loop step for every
    lane, one for every in-flight prefill chunk). ``slots`` bounds the sequences running
    (decoding or prefilling)."""

    def __init__(
        self,
        model: nn.Module,
        loops: int,
        halting: Halting,
        *,
        slots: int = 8,
        slide: int = 1,
        eot_id: int | None = None,
        prefill_halt: bool = False,
        on_token=None,
        prefill_chunk: int = 32,
        static: bool = False,
        compile: bool | str = False,
    ) -> None:
        _check_served(model, loops, halting, prefill_halt, prefill_chunk)
        self.model, self.loops, self.halting, self.slots = model, loops, halting, slots
        self.slide, self.eot_id, self.on_token, self.bar = slide, eot_id, on_token, None
        self.prefill_chunk, self.static = prefill_chunk, static or compile
        self.context = model.config.context
        self.device = model.tok_emb.weight.device
        self.prelude, self.per_step, coda = slot_layout(model)
        self.first_core = self.prelude
        self.coda_slot = self.prelude + loops * self.per_step
        # row 0: the scratch row of padding lanes; a static batch allocates every row up front
        rows = slots + 1 if self.static else 1
        self.cache = LoopKVCache(self.context, self.coda_slot + coda, rows)
        self.free_rows: list[int] = list(range(rows - 1, 0, -1))
        self.queue: deque[tuple[object, Request]] = deque()
        self.completions: dict[object, Completion] = {}
        self.prefills: list[_Prefill] = []
        self.lanes: list[_Row | None] = []
        self.lt: dict[str, torch.Tensor] = {}  # per-lane tensors (state, context, t, …)
        self.decide = _decision(model, halting, self.device)
        # core applications, rows they computed, iterations, and applications whose lanes were
        # at different loop steps
        self.steps = self.row_steps = self.iterations = self.mixed_steps = 0
        self.tokens_out = 0  # tokens sampled so far
        self.alone_pass = True  # a lone sequence takes its token's whole pass at once
        self.alone_tokens = 0  # tokens made by whole-token passes
        self.lane_counts: set[int] = set()  # the batch sizes the core step has run at
        self._step_fn = self._core_step
        if compile:
            backend = compile if isinstance(compile, str) else "inductor"
            cuda = self.device.type == "cuda" and backend == "inductor"
            mode = "reduce-overhead" if cuda else None  # CUDA graphs replay the step
            self._step_fn = torch.compile(
                self._core_step, dynamic=False, mode=mode, backend=backend
            )

    # ------------------------------------------------------------------ the driver's view
    @property
    def rows(self) -> list[_Row]:
        """The running sequences (decoding or prefilling)."""
        return [r for r in self.lanes if r is not None] + [p.row for p in self.prefills]

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.prefills or any(r is not None for r in self.lanes))

    def cancel(self, key: object) -> bool:
        """End the sequence ``key`` now (its lane or cache row is freed); False if it is neither
        running nor queued."""
        for b, row in enumerate(self.lanes):
            if row is not None and row.index == key:
                row.out.finish = "cancelled"
                self._end(row)
                self._free_lane(b)
                return True
        for p in self.prefills:
            if p.row.index == key:
                p.row.out.finish = "cancelled"
                self._end(p.row)
                self.prefills.remove(p)
                self._free_row(p.crow)
                return True
        for item in self.queue:
            if item[0] == key:
                self.queue.remove(item)
                return True
        return False

    @torch.no_grad()
    def iterate(self) -> None:
        """Admit queued requests while fewer than ``slots`` run, then one loop step for every
        lane and every in-flight prefill chunk."""
        while self.queue and len(self.rows) < self.slots:
            row = _Row(*self.queue.popleft())
            self.prefills.append(_Prefill(row, self._new_row(), self.context))
        self.iterations += 1
        ready = self._prefill_step()
        live = [b for b, r in enumerate(self.lanes) if r is not None]
        waiting = self.queue and len(self.rows) < self.slots  # an arrival could join now
        alone = self.alone_pass and len(live) == 1
        if alone and not self.prefills and not ready and not waiting:
            self._alone(live[0])  # nothing shares the step: the token's whole pass at once
        elif live:
            self._decode_step()
        if ready:
            self._emit_and_enter([(p.row, p.crow, p.last, self.loops) for p in ready])
        self._fit_lanes()

    # ------------------------------------------------------------------ cache rows and lanes
    def _new_row(self) -> int:
        if self.free_rows:
            r = self.free_rows.pop()
        else:
            r = self.cache.n_rows
            self.cache.grow(max(r + 1, 2 * r))
            self.free_rows.extend(range(self.cache.n_rows - 1, r, -1))
        self.cache.length[r] = 0
        return r

    def _free_row(self, r: int) -> None:
        self.cache.length[r] = 0
        self.free_rows.append(r)

    def _free_lane(self, b: int) -> None:
        self._free_row(int(self.lt["crow"][b]))
        self.lanes[b] = None
        self.lt["crow"][b] = 0
        self.lt["t"][b] = 0

    def _end(self, row: _Row) -> None:
        row.done = True
        self.completions[row.index] = row.out
        if self.bar is not None:
            self.bar.update(row.request.max_new - len(row.out.tokens))

    def _target(self, n: int) -> int:
        if not self.static:
            return n
        return next(b for b in buckets(max(self.slots, 1)) if b >= n) if n else 0

    def _fit_lanes(self) -> None:
        """Idle lanes dropped down to the lane count of the live ones (exact, or its bucket)."""
        live = [b for b, r in enumerate(self.lanes) if r is not None]
        want = self._target(len(live))
        if want >= len(self.lanes) or not self.lanes:
            return
        idle = [b for b, r in enumerate(self.lanes) if r is None]
        keep = sorted(live + idle[: want - len(live)])
        self._index_lanes(torch.tensor(keep, dtype=torch.long))

    def _index_lanes(self, idx: torch.Tensor) -> None:
        self.lanes = [self.lanes[i] for i in idx.tolist()]
        self.lt = {k: v[idx.to(v.device)] for k, v in self.lt.items()}
        if isinstance(self.decide, GateHalt):
            self.decide.cdf = self.decide.cdf[idx.to(self.device)]
            self.decide.remaining = self.decide.remaining[idx.to(self.device)]

    def _add_lanes(self, n: int, like: dict[str, torch.Tensor]) -> None:
        """``n`` more idle lanes (zero state, scratch cache row), to the bucketed count."""
        total = self._target(len(self.lanes) + n)
        n = total - len(self.lanes)
        self.lanes += [None] * n
        for k, v in like.items():
            pad = v.new_zeros(n, *v.shape[1:])
            self.lt[k] = pad if k not in self.lt else torch.cat([self.lt[k], pad])
        if isinstance(self.decide, GateHalt):
            self.decide.cdf = torch.cat([self.decide.cdf, self.decide.cdf.new_zeros(n)])
            self.decide.remaining = torch.cat(
                [self.decide.remaining, self.decide.remaining.new_ones(n)]
            )

    # ------------------------------------------------------------------ the loop step
    def _core_step(self, K, V, s, e, anchor, extra, crow, offset, length):
        """One application of the core to every lane (each at its own step): the new states.
        The cache buffers are arguments so that a compiled step sees them as inputs."""
        model = self.model
        view = self.cache.view(crow, offset, full=self.static)
        view.lengths, view.K, view.V = length, K, V
        ctx = LoopContext(e=e, anchor=anchor, extra=dict(extra))
        return _one_step(model, model.core_call(ctx, cache=view), s, ctx)

    def _context(self, idx=None) -> LoopContext:
        lt = self.lt
        pick = (lambda z: z) if idx is None else (lambda z: z[idx])  # noqa: E731
        extra = {k[2:]: pick(v) for k, v in lt.items() if k.startswith("x:")}
        return LoopContext(e=pick(lt["e"]), anchor=pick(lt["anchor"]), extra=extra)

    def _decode_step(self) -> None:
        lt, T = self.lt, self.loops
        crow, t = lt["crow"], lt["t"]
        ctx = self._context()
        if self.cache.K is None:  # the buffers exist after the first prefill's first call
            raise LoopLMError("loop-level cache used before any prefill")
        s = self._step_fn(
            self.cache.K,
            self.cache.V,
            lt["s"],
            ctx.e,
            ctx.anchor,
            ctx.extra,
            crow.to(self.device),
            (t * self.per_step).to(self.device),
            self.cache.length[crow].to(self.device),
        )
        live = torch.tensor([r is not None for r in self.lanes])
        self.lane_counts.add(len(self.lanes))
        lt["s"] = s
        t = lt["t"] = t + live.long()
        self.steps += 1
        self.row_steps += int(live.sum())
        tl = t[live]
        self.mixed_steps += int(tl.min() != tl.max())
        leave = live & (t >= T)
        ask = live & (t < T)
        if self.decide is not None and bool(ask.any()):
            leave |= self._decisions(ask, s)
        if bool(leave.any()):
            self._leave(leave.nonzero().squeeze(1))

    def _alone(self, b: int) -> None:
        """Lane ``b``, the only one running, at the start of its token: the token's whole cached
        pass (:func:`looplm.decoding.decoder.adaptive_next_logits`, what ``looplm generate`` runs) instead
        of one iteration per loop step — the same keys/values and decisions, none of the
        per-iteration bookkeeping."""
        lt, row = self.lt, self.lanes[b]
        if int(lt["t"][b]) != 0:  # mid-token (others were running): finish it step by step
            return self._decode_step()
        cr = int(lt["crow"][b])
        ids = torch.tensor([[row.tokens[-1]]], device=self.device)
        view = self.cache.view(torch.tensor([cr]), None)
        # (the entered token's prelude slots are written again, with the same keys/values)
        if self.halting.enabled:
            logits, d = adaptive_next_logits(self.model, ids, self.loops, view, self.halting)
            depth = int(d[0, -1])
        else:
            logits, depth = next_logits(self.model, ids, self.loops, view), self.loops
        self.steps += depth
        self.row_steps += depth
        self.alone_tokens += 1
        self.lanes[b] = None
        lt["crow"][b] = lt["t"][b] = 0
        self._emit_and_enter([(row, cr, logits, depth)])

    def _hidden(self, s: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """h_t of lanes (n, d) (one position per lane)."""
        ctx = self._context(idx)
        h = LoopStep(0, s, ctx, self.model.recurrence).hidden
        return h.reshape(h.shape[0], -1)

    def _decisions(self, ask: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The halting decision of the lanes ``ask`` (B,) bool after their step: halted (B,)."""
        idx = ask.nonzero().squeeze(1).to(self.device)
        h = self._hidden(s[idx], idx)
        stop = torch.zeros(len(self.lanes), dtype=torch.bool)
        d = self.decide
        if isinstance(d, GateHalt):
            halt = d(0, h, idx, None)
        elif isinstance(d, KLHalt):
            ctx = self._context(idx)
            r = self.model.finish(h.view(len(idx), 1, -1), ctx).reshape(len(idx), -1)
            logp = log_probs(self.model.readout, r, torch.float32)
            halt = d(0, h, logp, self.lt["prev"][idx])
            self.lt["prev"][idx] = logp
        else:
            halt = d(0, h, h, self.lt["prev"][idx])
            self.lt["prev"][idx] = h
        stop[idx.cpu()] = halt.cpu()
        return stop

    def _leave(self, idx: torch.Tensor) -> None:
        """Lanes ``idx`` whose token halted or reached T: the remaining step slots, the coda, the
        readout; each token is sampled and the sequence's next token enters the loop."""
        model, lt, T = self.model, self.lt, self.loops
        dev = self.device
        crow, t = lt["crow"][idx], lt["t"][idx]
        didx = idx.to(dev)
        s, ctx = lt["s"][didx], self._context(didx)
        early = t < T
        if bool(early.any()):  # the key/value rule: the frozen state's block input
            e = early.nonzero().squeeze(1)
            ed = e.to(dev)
            ectx = LoopContext(ctx.e[ed], ctx.anchor[ed], {k: v[ed] for k, v in ctx.extra.items()})
            view = self.cache.view(crow[e], (t[e] * self.per_step))
            view.write_only = True
            core = model.core_call(ectx, cache=view)
            kv = KeysValuesOnly(core, torch.zeros(len(e), 1, dtype=torch.bool, device=dev))
            _one_step(model, kv, s[ed], ectx)
            self.cache.fill_steps(crow[e], t[e], T, self.per_step, self.first_core)
        h = LoopStep(0, s, ctx, model.recurrence).hidden
        view = self.cache.view(crow, None)
        h = model.finish(h, ctx, cache=view, first_slot=self.coda_slot)
        self.cache.length[crow] += 1
        logits = model.readout(h[:, -1])
        items = []
        for i, b in enumerate(idx.tolist()):
            items.append((self.lanes[b], int(crow[i]), logits[i : i + 1], int(t[i])))
            self.lanes[b] = None  # its next token re-enters below (a lane of its own)
            lt["crow"][b] = 0
            lt["t"][b] = 0
        self._emit_and_enter(items)

    # ------------------------------------------------------------------ tokens out, tokens in
    def _emit_and_enter(self, items: list) -> None:
        """Sample each (row, cache row, logits, depth); a sequence that goes on enters a lane
        with its next token, or (window full) a prefill of its last tokens."""
        enter = []
        for row, cr, logits, depth in items:
            r = row.request
            tok = int(_sample(logits, r.temperature, r.top_k, row.generator))
            row.tokens.append(tok)
            row.out.tokens.append(tok)
            row.out.loops.append(depth)
            self.tokens_out += 1
            if r.logprobs is not None:
                Batcher._record_logprobs(row, logits[0], tok)
            if self.bar is not None:
                self.bar.update(1)
            if len(row.out.tokens) == r.max_new or tok == self.eot_id:
                row.out.finish = "stop" if tok == self.eot_id else "length"
                self._end(row)
            if self.on_token is not None:
                self.on_token(row.index, tok, depth, row.out)
            if row.done:
                self._free_row(cr)
            elif int(self.cache.length[cr]) >= self.context:  # slide: prefill the last tokens
                self.cache.length[cr] = 0
                self.prefills.append(_Prefill(row, cr, self.context - self.slide + 1))
            else:
                enter.append((row, cr))
        if enter:
            self._enter(enter)

    def _enter(self, items: list[tuple[_Row, int]]) -> None:
        """New tokens into the loop: embedding and prelude (their slots), the initial state, the
        halting rule's step-0 reference; each takes an idle lane."""
        model, dev = self.model, self.device
        crow = torch.tensor([cr for _, cr in items], dtype=torch.long)
        ids = torch.tensor([[row.tokens[-1]] for row, _ in items], device=dev)
        view = self.cache.view(crow, None)
        ctx = model.prepare(ids, cache=view, pos_offset=self.cache.length[crow].to(dev))
        first = next(model.unroll(ctx, 1))  # the initial state (nothing computed yet)
        s = first.state
        new = {"s": s, "e": ctx.e, "anchor": ctx.anchor}
        new.update({"x:" + k: v for k, v in ctx.extra.items()})
        if self.decide is not None and not isinstance(self.decide, GateHalt):
            h = first.hidden
            if isinstance(self.decide, KLHalt):
                r = model.finish(h, ctx).reshape(len(items), -1)
                new["prev"] = log_probs(model.readout, r, torch.float32)
            else:
                new["prev"] = h.reshape(len(items), -1)
        new = {k: v.to(dev) for k, v in new.items()}
        new["crow"], new["t"] = crow, torch.zeros_like(crow)
        idle = [b for b, r in enumerate(self.lanes) if r is None]
        if len(idle) < len(items):
            self._add_lanes(len(items) - len(idle), new)
            idle = [b for b, r in enumerate(self.lanes) if r is None]
        lanes = torch.tensor(idle[: len(items)], dtype=torch.long)
        for k, v in new.items():
            self.lt[k][lanes.to(self.lt[k].device)] = v
        if isinstance(self.decide, GateHalt):
            ld = lanes.to(dev)
            self.decide.cdf[ld], self.decide.remaining[ld] = 0.0, 1.0
        for b, (row, _) in zip(lanes.tolist(), items):
            self.lanes[b] = row

    # ------------------------------------------------------------------ chunked prefill
    def _prefill_step(self) -> list[_Prefill]:
        """One loop step of every in-flight prefill chunk; the prefills whose last chunk is done
        (their ``last`` logits set) leave the list."""
        model, dev, ready = self.model, self.device, []
        for p in list(self.prefills):
            # eager: one loop step at a time, interleaved with decoding; a prompt's last chunk
            # is shorter than the others and the cache offsets are data
            if p.gen is None:  # the next chunk enters: embedding, prelude, step 0
                chunk = p.ids[p.done : p.done + self.prefill_chunk]
                ids = torch.tensor([chunk], dtype=torch.long, device=dev)
                rows = torch.tensor([p.crow])
                view = self.cache.view(rows, None)
                ctx = model.prepare(ids, cache=view, pos_offset=self.cache.length[rows].to(dev))
                core = model.core_call(ctx, cache=view)
                p.gen = model.unroll(ctx, self.loops, core=core)
                p.ctx, p.core, p.view, p.n = ctx, core, view, len(chunk)
                next(p.gen)  # t = 0: no work
            step = next(p.gen)
            if step.t < self.loops:
                continue
            h = model.finish(step.hidden, p.ctx, cache=p.view, first_slot=p.core.slot)
            self.cache.length[p.crow] += p.n
            p.done += p.n
            p.gen = None
            if p.done == len(p.ids):
                p.last = model.readout(h[:, -1])
                self.prefills.remove(p)
                ready.append(p)
        return ready
