"""Many prompts through a fixed number of slots: continuous (or static) batching.

    looplm generate CHECKPOINT --prompts prompts.txt --slots 8 [--halt kl --threshold X]

:func:`generate_many` keeps up to ``slots`` sequences in one batch. Every step samples one token
for each sequence, then runs one cached decoding pass over all of them at once; each row has its
own number of cached positions (:class:`~looplm.decoding.decoder.RaggedKVCache`), so prompts of any
length share a batch without padding. When a sequence ends (its ``max_new`` tokens, or the
end-of-text token with ``stop_at_eot``) the next prompt is prefilled alone and takes its slot
(``schedule="continuous"``); ``schedule="static"`` instead runs fixed groups of ``slots`` prompts,
each until its longest sequence ends (ended rows keep being computed, as in a padded batch).

Each sequence gets exactly the tokens :func:`looplm.decoding.decoder.decode` gives it alone (tested): the
same prefill at full depth T, the same per-token halting (decisions are per token, and a row
attends only to its own cache), the same sliding window past the context (the slot is prefilled
again from the last ``context - slide + 1`` tokens), and sampling from the request's own seeded
generator.

The same batch can be driven by arrivals instead of a list (:class:`Batcher`, what
``looplm serve`` runs): a request joins at the next token boundary (it takes an ended row's
place, or :meth:`Batcher.join_queued` adds a row), leaves when it ends or is cancelled (:meth:`Batcher.cancel`: a client
that went away frees its slot at the next token), and every token is reported as it is chosen
(``on_token``). Joining and leaving change no other row's tokens.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from looplm.decoding.decoder import (
    Halting,
    RaggedKVCache,
    StaticKVCache,
    _sample,
    adaptive_next_logits,
    next_logits,
    step_readouts,
)
from looplm.errors import LoopLMError

SCHEDULES = ("continuous", "static")

__all__ = ["SCHEDULES", "BatchResult", "Batcher", "Completion", "Request", "generate_many"]


@dataclass(frozen=True)
class Request:
    """One prompt: token ids, how many tokens to add, and how to sample them (temperature 0 is
    greedy; ``seed`` seeds this request's own generator). ``logprobs``: record each chosen
    token's log-probability under the model (log-softmax of the logits, before temperature) and,
    when > 0, that many most likely alternatives."""

    ids: tuple[int, ...]
    max_new: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.ids:
            raise LoopLMError("a prompt must have at least one token")
        if isinstance(self.max_new, bool) or not isinstance(self.max_new, int) or self.max_new < 1:
            raise LoopLMError(f"max_new={self.max_new!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise LoopLMError(f"temperature={self.temperature!r} must be >= 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise LoopLMError(f"top_k={self.top_k!r} must be an integer >= 1")
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < 2**63
        ):
            raise LoopLMError(f"seed={self.seed!r} must be an integer in [0, 2**63 - 1]")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or self.logprobs < 0):
            raise LoopLMError(f"logprobs={self.logprobs!r} must be an integer >= 0")


@dataclass
class Completion:
    """The generated tokens of one request and the loop depth that chose each of them; with
    ``Request.logprobs`` each token's log-probability and its top alternatives (id, logprob);
    ``finish``: why it ended — ``length`` (max_new), ``stop`` (end of text), ``cancelled``."""

    tokens: list[int] = field(default_factory=list)
    loops: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str = ""


@dataclass
class BatchResult:
    """Completions in request order, with what the run cost."""

    completions: list[Completion]
    seconds: float
    steps: int  # batched decoding passes
    row_steps: int  # rows those passes computed (ended rows of a static batch included)
    prompt_loops: list[int] = field(default_factory=list)  # per prompt token (prefill halting)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def mean_loops(self) -> float:
        loops = [d for c in self.completions for d in c.loops]
        return sum(loops) / len(loops) if loops else math.nan


class _Row:
    """A sequence in a slot: its request, all its tokens so far, and its sampling generator."""

    def __init__(self, index: object, request: Request) -> None:
        self.index, self.request = index, request
        self.tokens = list(request.ids)
        self.out = Completion()
        self.generator = torch.Generator().manual_seed(request.seed)
        self.done = False


def generate_many(
    model: nn.Module,
    requests: list[Request],
    *,
    slots: int = 8,
    loops: int = 8,
    halt: str = "none",
    threshold: float = 0.0,
    slide: int = 1,
    eot_id: int | None = None,
    schedule: str = "continuous",
    progress: bool = False,
    prefill_halt: bool = False,
) -> BatchResult:
    """Generate every request's continuation with at most ``slots`` sequences per batch (see the
    module docstring). ``eot_id``: a sequence also ends after this token; ``prefill_halt``: prompt
    tokens halt by the same rule as generated ones (:func:`looplm.decoding.decoder.decode`). Loop-level
    batching: :func:`looplm.decoding.loop_batching.generate_loop_level`."""
    from tqdm import tqdm

    halting = check_batch(model, requests, slots, loops, halt, threshold, slide)
    if schedule not in SCHEDULES:
        raise LoopLMError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
    model.eval()
    total = sum(r.max_new for r in requests)
    bar = tqdm(total=total, disable=not progress, unit="tok", leave=False)
    run = Batcher(model, loops, halting, slide=slide, eot_id=eot_id, prefill_halt=prefill_halt)
    run.bar = bar
    for item in enumerate(requests):
        run.queue.append(item)
    t0 = time.perf_counter()
    with torch.no_grad():
        while run.queue or run.rows:
            if not run.rows:
                run.start_batch(slots)
            run.sample()
            if schedule == "continuous":
                run.refill_or_drop()
            elif all(row.done for row in run.rows):  # static: the group is over
                run.rows = []
                continue
            run.slide_full_windows()
            run.decode()
    bar.close()
    seconds = time.perf_counter() - t0
    completions = [run.completions[i] for i in range(len(requests))]
    return BatchResult(completions, seconds, run.steps, run.row_steps, run.prompt_loops)


def check_batch(
    model: nn.Module,
    requests: list[Request],
    slots: int,
    loops: int,
    halt: str,
    threshold: float,
    slide: int,
) -> Halting:
    """The checks of a batched generation's settings (one-line errors); its halting rule."""
    from looplm.model.lm import check_loops

    check_loops(loops)
    halting = Halting(halt, float(threshold))
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise LoopLMError(f"slots={slots!r} must be an integer >= 1")
    if not getattr(model, "is_looped", False):
        raise LoopLMError("batched generation needs a looped model (recurrence != unshared)")
    context = model.config.context
    if not 1 <= slide <= context:
        raise LoopLMError(f"slide={slide} must be in [1, context={context}]")
    vocab = model.config.vocab_size
    for r in requests:
        if min(r.ids) < 0 or max(r.ids) >= vocab:
            raise LoopLMError(f"a prompt has token ids outside the vocabulary [0, {vocab})")
    return halting


class Batcher:
    """A running batch between token boundaries: the rows in it, their cache and next-token
    logits, and the requests waiting in ``queue`` ((key, Request) pairs).

    :func:`generate_many` fills ``queue`` from a list; a server calls, at every token boundary,
    :meth:`sample` (one token per row; ``on_token(key, token, depth, completion)`` hears each),
    :meth:`refill_or_drop` (arrivals put in ``queue`` take ended rows' places, the other ended
    rows leave), :meth:`join_queued` (the remaining arrivals join as new rows),
    :meth:`slide_full_windows` and :meth:`decode`. The model is validated by the caller
    (:func:`generate_many` does it)."""

    def __init__(
        self,
        model: nn.Module,
        loops: int,
        halting: Halting,
        *,
        slide: int = 1,
        eot_id: int | None = None,
        prefill_halt: bool = False,
        on_token=None,
    ) -> None:
        self.model, self.loops, self.halting = model, loops, halting
        self.prefill_halt = prefill_halt and halting.enabled
        self.slide, self.eot_id, self.bar, self.on_token = slide, eot_id, None, on_token
        self.context = model.config.context
        self.device = model.tok_emb.weight.device
        self.queue: deque[tuple[object, Request]] = deque()
        self.completions: dict[object, Completion] = {}  # key -> its finished completion
        self.rows: list[_Row] = []
        self.cache = RaggedKVCache(self.context, 0)
        # (B, V) next-token logits of every row
        self.logits = torch.empty(0, model.config.vocab_size, device=self.device)
        self.fresh: dict[int, int] = {}  # rows whose logits come from a prefill: its depth
        self.depth = torch.empty(0, dtype=torch.long)  # the others': their pass's depth
        self.prompt_loops: list[int] = []  # depth of every prompt token (prefill halting)
        self.steps = self.row_steps = 0

    def prefill(self, b: int, keep: int) -> None:
        """Row ``b``'s last ``keep`` tokens prefilled alone at full depth into slot ``b``."""
        single = StaticKVCache(self.context)  # eager: each row's own prompt length, run once
        row = self.rows[b]
        ids = torch.tensor([row.tokens[-keep:]], dtype=torch.long, device=self.device)
        if self.prefill_halt:
            logits, d = adaptive_next_logits(self.model, ids, self.loops, single, self.halting)
            if not row.out.tokens:  # the prompt itself (not a window slid past the context)
                self.prompt_loops.extend(d[0].tolist())
            self.fresh[b] = int(d[0, -1])
        elif self.halting.rule == "kl" and step_readouts(self.model):
            # the prompt's per-step coda keys/values for the later KL reads (threshold 0: the
            # fixed-depth pass)
            logits, _ = adaptive_next_logits(
                self.model, ids, self.loops, single, Halting("kl", 0.0)
            )
            self.fresh[b] = self.loops
        else:
            logits = next_logits(self.model, ids, self.loops, single)
            self.fresh[b] = self.loops
        self.logits[b] = logits[0]
        self.cache.load_row(b, single)

    def start_batch(self, slots: int) -> None:
        """A new batch: the next ``slots`` requests, each prefilled."""
        self.rows = [_Row(*self.queue.popleft()) for _ in range(min(slots, len(self.queue)))]
        self.cache = RaggedKVCache(self.context, len(self.rows))
        V = self.model.config.vocab_size
        self.logits = torch.empty(len(self.rows), V, device=self.device)
        self.fresh = {}
        for b in range(len(self.rows)):
            self.prefill(b, self.context)

    def sample(self) -> None:
        """One token for every live sequence; a sequence that is complete ends."""
        for b, row in enumerate(self.rows):
            if row.done:
                continue
            r = row.request
            logits = self.logits[b : b + 1]
            tok = int(_sample(logits, r.temperature, r.top_k, row.generator))
            row.tokens.append(tok)
            row.out.tokens.append(tok)
            row.out.loops.append(self.fresh[b] if b in self.fresh else int(self.depth[b]))
            if r.logprobs is not None:
                self._record_logprobs(row, logits[0], tok)
            if self.bar is not None:
                self.bar.update(1)
            if len(row.out.tokens) == r.max_new or tok == self.eot_id:
                row.out.finish = "stop" if tok == self.eot_id else "length"
                self._end(row)
            if self.on_token is not None:
                self.on_token(row.index, tok, row.out.loops[-1], row.out)
        self.fresh = {}

    @staticmethod
    def _record_logprobs(row: _Row, logits: torch.Tensor, tok: int) -> None:
        logp = torch.log_softmax(logits.float(), -1)
        row.out.logprobs.append(float(logp[tok]))
        k = row.request.logprobs
        if k:
            top = torch.topk(logp, min(k, logp.shape[-1]))
            pairs = zip(top.indices.tolist(), top.values.tolist())
            row.out.top_logprobs.append([(int(i), float(v)) for i, v in pairs])

    def _end(self, row: _Row) -> None:
        row.done = True
        self.completions[row.index] = row.out
        if self.bar is not None:
            self.bar.update(row.request.max_new - len(row.out.tokens))

    def join_queued(self) -> None:
        """Every request in ``queue`` joins the running batch now: new rows (the cache grows once
        for all of them), each prefilled alone (its first token is sampled at the next
        :meth:`sample`). Call after :meth:`refill_or_drop`, which refills ended rows in place."""
        n = len(self.queue)
        if not n:
            return
        first = len(self.rows)
        self.rows += [_Row(*self.queue.popleft()) for _ in range(n)]
        self.cache.add_rows(n)
        self.logits = torch.cat([self.logits, self.logits.new_empty(n, self.logits.shape[1])])
        for b in range(first, first + n):
            self.prefill(b, self.context)

    def cancel(self, key: object) -> bool:
        """End the sequence ``key`` (its row leaves at the next :meth:`refill_or_drop`; a queued
        one is removed); False if it is neither running nor queued."""
        for row in self.rows:
            if row.index == key and not row.done:
                row.out.finish = "cancelled"
                self._end(row)
                return True
        for item in self.queue:
            if item[0] == key:
                self.queue.remove(item)
                return True
        return False

    def refill_or_drop(self) -> None:
        """Continuous batching: an ended row takes the next request; with none left it leaves."""
        keep = []
        for b, row in enumerate(self.rows):
            if row.done and self.queue:
                self.rows[b] = _Row(*self.queue.popleft())
                self.prefill(b, self.context)
            if not self.rows[b].done:
                keep.append(b)
        if len(keep) < len(self.rows):
            self.rows = [self.rows[b] for b in keep]
            self.cache.index_rows(torch.tensor(keep, dtype=torch.long))
            self.logits = self.logits[keep]
            self.fresh = {keep.index(b): d for b, d in self.fresh.items()}

    def slide_full_windows(self) -> None:
        """A live row whose window is full is prefilled again from its last tokens."""
        for b, row in enumerate(self.rows):
            full = int(self.cache._length[b]) >= self.context
            if not row.done and b not in self.fresh and full:
                self.prefill(b, self.context - self.slide + 1)

    def decode(self) -> None:
        """One cached pass over every row not prefilled this step (ended rows of a static batch
        included: they are computed, their positions kept and their tokens dropped)."""
        step = [b for b in range(len(self.rows)) if b not in self.fresh]
        if not step:
            return
        cache, idx = self.cache, torch.tensor(step, dtype=torch.long)  # rows of this pass
        last = torch.tensor([[self.rows[b].tokens[-1]] for b in step], device=self.device)
        ended = torch.tensor([self.rows[b].done for b in step])
        if bool(ended.any()):  # at a position the window still has
            cache._length[idx[ended]] = cache._length[idx[ended]].clamp(max=self.context - 1)
        before = cache._length[idx].clone()
        cache.using(idx)
        self.depth = torch.full((len(self.rows),), self.loops, dtype=torch.long)
        if self.halting.rule == "none":
            out = next_logits(self.model, last, self.loops, cache)
        else:
            out, d = adaptive_next_logits(self.model, last, self.loops, cache, self.halting)
            self.depth[idx] = d[:, -1].cpu()
        cache.using(None)
        if bool(ended.any()):
            cache._length[idx[ended]] = before[ended]
        self.logits[idx.to(self.device)] = out.to(self.logits.dtype)
        self.steps += 1
        self.row_steps += len(step)
