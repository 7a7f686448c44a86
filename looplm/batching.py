"""Many prompts through a fixed number of slots: continuous (or static) batching.

    looplm generate CHECKPOINT --prompts prompts.txt --slots 8 [--halt kl --threshold X]

:func:`generate_many` keeps up to ``slots`` sequences in one batch. Every step samples one token
for each sequence, then runs one cached decoding pass over all of them at once; each row has its
own number of cached positions (:class:`~looplm.generate.RaggedKVCache`), so prompts of any
length share a batch without padding. When a sequence ends (its ``max_new`` tokens, or the
end-of-text token with ``stop_at_eot``) the next prompt is prefilled alone and takes its slot
(``schedule="continuous"``); ``schedule="static"`` instead runs fixed groups of ``slots`` prompts,
each until its longest sequence ends (ended rows keep being computed, as in a padded batch).

Each sequence gets exactly the tokens :func:`looplm.generate.decode` gives it alone (tested): the
same prefill at full depth T, the same per-token halting (decisions are per token, and a row
attends only to its own cache), the same sliding window past the context (the slot is prefilled
again from the last ``context - slide + 1`` tokens), and sampling from the request's own seeded
generator.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.generate import (
    Halting,
    RaggedKVCache,
    StaticKVCache,
    _sample,
    adaptive_next_logits,
    next_logits,
)

SCHEDULES = ("continuous", "static")

__all__ = ["SCHEDULES", "BatchResult", "Completion", "Request", "generate_many"]


@dataclass(frozen=True)
class Request:
    """One prompt: token ids, how many tokens to add, and how to sample them (temperature 0 is
    greedy; ``seed`` seeds this request's own generator)."""

    ids: tuple[int, ...]
    max_new: int = 32
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.ids:
            raise LoopLMError("a prompt must have at least one token")
        if isinstance(self.max_new, bool) or not isinstance(self.max_new, int) or self.max_new < 1:
            raise LoopLMError(f"max_new={self.max_new!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise LoopLMError(f"temperature={self.temperature!r} must be >= 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise LoopLMError(f"top_k={self.top_k!r} must be an integer >= 1")


@dataclass
class Completion:
    """The generated tokens of one request and the loop depth that chose each of them."""

    tokens: list[int] = field(default_factory=list)
    loops: list[int] = field(default_factory=list)


@dataclass
class BatchResult:
    """Completions in request order, with what the run cost."""

    completions: list[Completion]
    seconds: float
    steps: int  # batched decoding passes
    row_steps: int  # rows those passes computed (ended rows of a static batch included)

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

    def __init__(self, index: int, request: Request) -> None:
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
) -> BatchResult:
    """Generate every request's continuation with at most ``slots`` sequences per batch (see the
    module docstring). ``eot_id``: a sequence also ends after this token."""
    from tqdm import tqdm

    from looplm.model.lm import check_loops

    check_loops(loops)
    halting = Halting(halt, float(threshold))
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise LoopLMError(f"slots={slots!r} must be an integer >= 1")
    if schedule not in SCHEDULES:
        raise LoopLMError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if not getattr(model, "is_looped", False):
        raise LoopLMError("batched generation needs a looped model (recurrence != unshared)")
    context = model.config.context
    if not 1 <= slide <= context:
        raise LoopLMError(f"slide={slide} must be in [1, context={context}]")
    vocab = model.config.vocab_size
    for r in requests:
        if min(r.ids) < 0 or max(r.ids) >= vocab:
            raise LoopLMError(f"a prompt has token ids outside the vocabulary [0, {vocab})")
    model.eval()
    device = model.tok_emb.weight.device
    queue = deque(enumerate(requests))
    completions: list[Completion | None] = [None] * len(requests)
    bar = tqdm(
        total=sum(r.max_new for r in requests), disable=not progress, unit="tok", leave=False
    )
    t0 = time.perf_counter()
    steps = row_steps = 0

    def prefill(row: _Row, keep: int) -> torch.Tensor:
        """Prefill ``row``'s last ``keep`` tokens alone at full depth: (1, V) logits."""
        single = StaticKVCache(context)
        ids = torch.tensor([row.tokens[-keep:]], dtype=torch.long, device=device)
        logits = next_logits(model, ids, loops, single)
        cache.load_row(slot_of[row.index], single)
        return logits

    rows: list[_Row] = []
    cache = RaggedKVCache(context, 0)
    slot_of: dict[int, int] = {}
    logits = torch.empty(0)
    stepped: set[int] = set()  # rows whose logits come from the last decoding pass …
    depth = torch.empty(0, dtype=torch.long)  # … and that pass's loop depth per row
    with torch.no_grad():
        while queue or rows:
            if not rows:  # a new batch: the next ``slots`` requests
                rows = [_Row(*queue.popleft()) for _ in range(min(slots, len(queue)))]
                cache = RaggedKVCache(context, len(rows))
                slot_of = {row.index: b for b, row in enumerate(rows)}
                logits = torch.cat([prefill(row, context) for row in rows])
                stepped = set()
            fresh: set[int] = set()  # rows whose logits come from a prefill this step
            for b, row in enumerate(rows):  # one token for every live sequence
                if row.done:
                    continue
                r = row.request
                tok = int(_sample(logits[b : b + 1], r.temperature, r.top_k, row.generator))
                row.tokens.append(tok)
                row.out.tokens.append(tok)
                row.out.loops.append(int(depth[b]) if b in stepped else loops)
                bar.update(1)
                if len(row.out.tokens) == r.max_new or tok == eot_id:
                    row.done = True
                    completions[row.index] = row.out
                    bar.update(r.max_new - len(row.out.tokens))
            if schedule == "continuous":
                keep_rows = []
                for b, row in enumerate(rows):
                    if row.done and queue:  # refill the slot with the next prompt
                        new = _Row(*queue.popleft())
                        slot_of[new.index] = b
                        rows[b] = new
                        logits[b] = prefill(new, context)[0]
                        fresh.add(b)
                    if not rows[b].done:
                        keep_rows.append(b)
                if len(keep_rows) < len(rows):  # ended and nothing to refill: drop the rows
                    rows = [rows[b] for b in keep_rows]
                    cache.index_rows(torch.tensor(keep_rows, dtype=torch.long))
                    slot_of = {row.index: b for b, row in enumerate(rows)}
                    logits = logits[keep_rows]
                    fresh = {keep_rows.index(b) for b in fresh}
            elif all(row.done for row in rows):
                rows = []
                continue
            for b, row in enumerate(rows):  # the window is full: prefill the slot again
                if not row.done and b not in fresh and int(cache._length[b]) >= context:
                    logits[b] = prefill(row, context - slide + 1)[0]
                    fresh.add(b)
            if not rows:
                continue
            step = [b for b in range(len(rows)) if b not in fresh]
            stepped = set(step)
            depth = torch.full((len(rows),), loops, dtype=torch.long)
            if not step:
                continue
            idx = torch.tensor(step, dtype=torch.long)
            last = torch.tensor([[rows[b].tokens[-1]] for b in step], device=device)
            ended = torch.tensor([rows[b].done for b in step])  # static: ended rows compute too
            if bool(ended.any()):  # … in place, at a position the window still has
                cache._length[idx[ended]] = cache._length[idx[ended]].clamp(max=context - 1)
            before = cache._length[idx].clone()
            cache.using(idx)
            if halting.rule == "none":
                out = next_logits(model, last, loops, cache)
            else:
                out, d = adaptive_next_logits(model, last, loops, cache, halting)
                depth[idx] = d[:, -1].cpu()
            cache.using(None)
            if bool(ended.any()):  # their positions do not advance (their tokens are not kept)
                cache._length[idx[ended]] = before[ended]
            logits[idx] = out
            steps += 1
            row_steps += len(step)
    bar.close()
    seconds = time.perf_counter() - t0
    return BatchResult([c for c in completions if c is not None], seconds, steps, row_steps)
