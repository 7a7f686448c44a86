"""One scheduler under the server: the continuous batch of :mod:`looplm.decoding.batching`, driven by
arrivals.

A thread owns the model. Requests (:class:`Job`) wait in a bounded FIFO queue; at every token
boundary the thread (1) ends the sequences whose clients cancelled (a stop string, a client that
went away, a timeout), (2) samples one token for every running sequence and reports it, (3) admits
waiting jobs while fewer than ``slots`` sequences run — each takes an ended sequence's row in
place, or joins as a new row (the cache grows once per step) — and lets the other ended sequences
leave, (4) runs one decoding pass. With ``schedule="loop"`` step (4) is one loop-level iteration
(:mod:`looplm.decoding.loop_batching`: every row at its own loop step, a token reported as soon as it
halts, arrivals prefilled in chunks beside the running rows) and (2)-(3) happen inside it; depth
settings the loop-level batch does not serve fall back to a token-level one. Sequences with different depth settings (``loops``, halting rule, threshold,
prefill halting) run in separate batches, one :class:`~looplm.decoding.batching.Batcher` per setting,
stepped in turn; ``slots`` bounds them together, so memory is bounded by slots × context.

Each sequence's tokens and depths are those :func:`looplm.decoding.decoder.decode` gives it alone (the
batcher's guarantee: rows are independent), whatever arrives or leaves meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from looplm.decoding.batching import Batcher, Completion, Request
from looplm.decoding.decoder import Halting
from looplm.decoding.loop_batching import LoopBatcher
from looplm.errors import LoopLMError

SCHEDULES = ("continuous", "loop")

log = logging.getLogger("looplm.decoding.serve")


@dataclass(frozen=True)
class Depth:
    """How one sequence is decoded: loop ceiling, halting rule and threshold, prefill halting."""

    loops: int
    rule: str = "none"  # none or a decoding rule of looplm.model.halting_rules
    threshold: float = 0.0
    prefill_halt: bool = False


@dataclass
class Job:
    """One sequence to generate. ``sink(event)`` hears (through the scheduler's ``deliver``)
    ``("prompt_logprobs", list)`` (when ``echo_logprobs``), ``("token", id, depth)`` per token,
    then ``("done", Completion)`` — or ``("error", message)``."""

    key: int
    request: Request
    depth: Depth
    sink: Callable[[tuple], None]
    echo_logprobs: int | None = None  # alternatives per prompt token (None: no prompt logprobs)


class QueueFull(Exception):
    """The queue holds ``max_queue`` jobs already."""


class Scheduler:
    """Runs :class:`Job` s through continuous batches on a background thread (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        slots: int,
        max_queue: int,
        slide: int = 1,
        eot_id: int | None = None,
        metrics=None,
        schedule: str = "continuous",
        prefill_chunk: int = 32,
    ) -> None:
        if schedule not in SCHEDULES:
            raise LoopLMError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
        self.schedule, self.prefill_chunk = schedule, prefill_chunk
        self.model, self.slots, self.max_queue = model.eval(), slots, max_queue
        self.slide, self.eot_id, self.metrics = slide, eot_id, metrics
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._cancel: set[int] = set()
        self._jobs: dict[int, Job] = {}  # running: key -> job
        self._batchers: dict[Depth, Batcher | LoopBatcher] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._next_key = 0
        self._out: list[tuple[Callable, tuple]] = []  # (sink, event) of this step
        # hands a step's events over at once (the server: one wake-up of its event loop per
        # step, not one per token); by default each sink is called on the scheduler thread
        self.deliver: Callable[[list[tuple[Callable, tuple]]], None] = call_each

    # ------------------------------------------------------------------ called from any thread
    def new_key(self) -> int:
        with self._cond:
            self._next_key += 1
            return self._next_key

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` together, or raise :class:`QueueFull` (none is queued): at most
        ``slots`` running plus ``max_queue`` waiting."""
        with self._cond:
            if len(self._jobs) + len(self._pending) + len(jobs) > self.slots + self.max_queue:
                raise QueueFull
            self._pending.extend(jobs)
            self._cond.notify()

    def cancel(self, key: int) -> None:
        """End ``key`` at the next token boundary (its slot is freed then)."""
        with self._cond:
            self._cancel.add(key)
            self._cond.notify()

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="looplm-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; jobs still queued or running get an error event."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stop and not (self._pending or self._jobs or self._cancel):
                    self._cond.wait()
                if self._stop:
                    break
                cancel, self._cancel = self._cancel, set()
            try:
                self._step(cancel)
            except Exception as exc:  # a fault fails the sequences it touched, not the server
                log.error("scheduler step failed: %s: %s", type(exc).__name__, exc)
                self._fail_all(f"internal error while generating ({type(exc).__name__})")
            self._flush()
        self._fail_all("the server is shutting down")
        self._flush()

    def _emit(self, job: Job, event: tuple) -> None:
        self._out.append((job.sink, event))

    def _flush(self) -> None:
        if self._out:
            out, self._out = self._out, []
            self.deliver(out)

    def _step(self, cancel: set[int]) -> None:
        with self._cond:  # a job cancelled while it waits never starts
            for job in [j for j in self._pending if j.key in cancel]:
                self._pending.remove(job)
                self._emit(job, ("done", Completion(finish="cancelled")))
        for key in cancel:
            job = self._jobs.get(key)
            batcher = self._batchers[job.depth] if job is not None else None
            if batcher is not None and batcher.cancel(key):
                self._finish(key, batcher.completions.get(key, Completion(finish="cancelled")))
        token = [b for b in self._batchers.values() if isinstance(b, Batcher)]
        for batcher in token:
            batcher.sample()
        while self.running < self.slots:  # arrivals wait in their batch's queue ...
            with self._cond:
                if not self._pending:
                    break
                job = self._pending.popleft()
                self._jobs[job.key] = job
            self._admit(job)
        for batcher in self._batchers.values():
            if isinstance(batcher, Batcher):
                batcher.refill_or_drop()  # ... take ended rows' places, other ended rows leave,
                batcher.join_queued()  # and the rest join as new rows
        self._drop_idle()
        for batcher in self._batchers.values():
            if _loop(batcher):  # loop steps of every row until a token comes out (as it halts)
                self._iterate(batcher)
            else:
                batcher.slide_full_windows()
                batcher.decode()
        self._drop_idle()  # a loop-level batch whose last sequence ended in this iteration

    def _iterate(self, batcher: LoopBatcher) -> None:
        """Loop-level iterations until some sequence has a new token, an arrival or a
        cancellation waits, or a loop's worth of iterations ran: the step's bookkeeping (and one
        hand-over of events) is paid once per token boundary, as for a token-level batch."""
        made = batcher.tokens_out
        for _ in range(batcher.loops):
            batcher.iterate()
            if batcher.tokens_out > made or self._pending or self._cancel or not batcher.busy:
                return

    def _drop_idle(self) -> None:
        idle = [d for d, b in self._batchers.items() if not (b.busy if _loop(b) else b.rows)]
        for depth in idle:
            del self._batchers[depth]

    def _admit(self, job: Job) -> None:
        if self.metrics is not None:
            self.metrics.prompt_tokens += len(job.request.ids)
        if job.echo_logprobs is not None:
            self._emit(job, ("prompt_logprobs", self._prompt_logprobs(job)))
        batcher = self._batchers.get(job.depth)
        if batcher is None and self.schedule == "loop":
            batcher = self._loop_batcher(job.depth)
        if batcher is None:
            d = job.depth
            batcher = Batcher(
                self.model,
                d.loops,
                Halting(d.rule, d.threshold),
                slide=self.slide,
                eot_id=self.eot_id,
                prefill_halt=d.prefill_halt,
                on_token=self._on_token,
            )
            self._batchers[d] = batcher
        batcher.queue.append((job.key, job.request))

    def _loop_batcher(self, d: Depth) -> LoopBatcher | None:
        """A loop-level batch for depth setting ``d``, or None where it does not serve it
        (prefill halting, halt=kl through coda layers, a step map that depends on t): those
        sequences run in a token-level batch."""
        try:
            batcher = LoopBatcher(
                self.model,
                d.loops,
                Halting(d.rule, d.threshold),
                slots=self.slots,
                slide=self.slide,
                eot_id=self.eot_id,
                prefill_halt=d.prefill_halt,
                on_token=self._on_token,
                prefill_chunk=self.prefill_chunk,
            )
        except LoopLMError as exc:
            log.info("token-level batch for %s: %s", d, exc)
            return None
        self._batchers[d] = batcher
        return batcher

    def _prompt_logprobs(self, job: Job) -> list[tuple[float, list[tuple[int, float]]]]:
        """(log p(x_i | x_<i), top alternatives) of prompt tokens 1 … L−1 at the full depth
        (one uncached forward pass over the prompt, which fits the context)."""
        ids = torch.tensor(
            [job.request.ids], dtype=torch.long, device=self.model.tok_emb.weight.device
        )
        logp = torch.log_softmax(self.model(ids, loops=job.depth.loops)[0, :-1].float(), -1)
        chosen = logp.gather(1, ids[0, 1:, None])[:, 0].tolist()
        k = job.echo_logprobs or 0
        out = []
        top = torch.topk(logp, min(k, logp.shape[-1])) if k else None
        for i, lp in enumerate(chosen):
            alts = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if k else []
            out.append((lp, alts))
        return out

    def _on_token(self, key: int, token: int, depth: int, out: Completion) -> None:
        job = self._jobs[key]
        if self.metrics is not None:
            self.metrics.token(depth, job.depth.loops, job.depth.rule)
        self._emit(job, ("token", token, depth))
        if out.finish:
            self._finish(key, out)

    def _finish(self, key: int, out: Completion) -> None:
        job = self._jobs.pop(key)
        self._batchers[job.depth].completions.pop(key, None)  # the sink has it; keep no copy
        if out.finish == "cancelled" and self.metrics is not None:
            self.metrics.cancelled += 1
        self._emit(job, ("done", out))

    def _fail_all(self, message: str) -> None:
        with self._cond:
            jobs = list(self._jobs.values()) + list(self._pending)
            self._jobs.clear()
            self._pending.clear()
        self._batchers.clear()
        for job in jobs:
            self._emit(job, ("error", message))


def _loop(batcher) -> bool:
    return isinstance(batcher, LoopBatcher)


def call_each(events: list[tuple[Callable, tuple]]) -> None:
    """Call each ``sink(event)`` in order."""
    for sink, event in events:
        sink(event)
