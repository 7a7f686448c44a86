"""Text generation for looped models: an exact key/value cache, per-token adaptive depth and a
sliding context window.

**Cache.** The shared block is applied at every loop step (twice per step for the subtractive
controls) to a *different* input, so its keys and values differ per application. The cache holds
one K/V slot per block application within a forward pass: slot ``i`` is the i-th call of the block
(loop step t, body call c), identical in order for the prompt and every new token. Decoding one
token runs the loop over that token only, attending to the cached K/V of its own slot. Positions
continue from the prompt. :func:`decode` keeps the slots in preallocated buffers
(:class:`StaticKVCache`: a new position is written in place rather than concatenated).

**Adaptive depth** (``halt="kl"``, ``"update"`` or ``"gate"``, :func:`adaptive_next_logits`). The prompt
(prefill) runs the full T, or with ``prefill_halt=True`` halts token by token by the same rule and
frozen-state semantics (the per-token halting evaluation over the prompt, tested). Each decoded
token then runs loop steps t = 1, 2, … and after every step t < T a halting rule looks at each
still-active token of the batch:

* ``kl``: halt when ``KL(p_t ‖ p_{t−1}) < threshold`` with ``p_t = softmax(readout(h_t))`` and
  ``p_0`` the readout of the initial state — :class:`looplm.model.halting_rules.KLHalt`, the rule
  the adaptive evaluation uses;
* ``update``: halt when the relative hidden update ``‖h_t − h_{t−1}‖ / ‖h_{t−1}‖ < threshold``
  (:class:`looplm.model.halting_rules.UpdateHalt`; with one new token per prompt the paper's
  per-example max over tokens is this token's value).

A halted token's recurrent state is **frozen** and its logits are read out from it. Halted rows
skip the work: the block runs in its active-row mode (``Block(x, active=…)``), which computes the
queries, attention output and SwiGLU for active rows only, and batch rows without an active token
leave the block call altogether (row compaction over :class:`StaticKVCache`'s row subsets). **Keys/values rule:** at every loop step
the token skipped, the cache slot still receives the keys/values of the block input the recurrence
builds from the token's frozen state at that step (with the block's update taken as 0) — the K/V
projection only. For SCSE the block input is the frozen deviation itself, so every skipped slot
gets the keys/values of the last state. This is the rule the per-token halting evaluation uses
(halted tokens stay visible to later tokens), so tokens decoded later attend to halted tokens
exactly as in :func:`looplm.adaptive.halting.per_token_halting` — both run the model's unroll with
the same :class:`looplm.model.halting.TokenHalting`. When every row has halted the
remaining steps do only that K/V work, and a slot whose block input equals the previous step's
(SCSE's frozen deviation) gets those keys/values copied, not recomputed. Threshold 0 never halts
(a rounding-negative KL cannot stop a token), and the pass is then the fixed-depth pass operation
for operation: token-identical output and equal logits (tested). Prelude layers run once per token
before the loop and coda layers once after it, on the final (possibly frozen) state. ``kl`` on a
model with coda layers reads every step through the coda, as the uncached evaluation does: the
coda's keys/values of every step are kept for the later tokens' reads (:class:`StepCoda`; the
prompt's too, so the prefill runs that path at threshold 0 when it does not halt).

**Sliding window.** Positions are learned absolute positions 0 … context−1 by default, so cached
keys cannot be shifted (the same rule is used for rotary and position-free models). When the next
token has no position left, the last ``context − slide + 1`` tokens are
re-prefilled from position 0 into a fresh cache (full T) and decoding continues. ``slide=1`` (the
default) predicts every token from exactly the last ``context`` tokens, the same as the uncached
path (tested); a larger ``slide`` re-prefills once every ``slide`` tokens.

One caveat: SCSE-family masks are per example over the whole sequence (Eq. 4). During cached
decoding a new token's mask uses that token's deviation alone; the two differ only when the new
token's ‖Δ_t‖² is ≤ ε (1e-8) while the sequence's is not, i.e. essentially only for anchor-started
states. Ordinary generation gives identical tokens with and without the cache (tested).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.block import KVCache
from looplm.model.halting import TokenHalting
from looplm.model.halting_rules import RENAMED, RuleNames, decoding_rule, halting_rule

__all__ = [
    "HALT_RULES",
    "Generation",
    "Halting",
    "KVCache",
    "RaggedKVCache",
    "StaticKVCache",
    "adaptive_next_logits",
    "cached_hidden",
    "decode",
    "generate",
    "next_logits",
]

# "none" and the rules decoding can use (:mod:`looplm.model.halting_rules`)
HALT_RULES = RuleNames(extra=("none",), decoding=True)


@dataclass(frozen=True)
class Halting:
    """Per-token halting during decoding: ``rule`` (none | kl | update | gate: a learned exit
    gate's cumulative probability, Ouro) and its ``threshold``."""

    rule: str = "none"
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.rule not in HALT_RULES and self.rule not in RENAMED:
            raise LoopLMError(f"halting rule {self.rule!r}; allowed: {', '.join(HALT_RULES)}")
        object.__setattr__(self, "rule", decoding_rule(self.rule))
        if not self.threshold >= 0:  # also rejects NaN
            raise LoopLMError(f"halting threshold {self.threshold!r} must be >= 0")

    @property
    def enabled(self) -> bool:
        """Whether any token can halt early (threshold 0 never halts)."""
        return self.rule != "none" and self.threshold > 0


@dataclass
class Generation:
    """Result of :func:`decode`.

    tokens: (B, L + n) prompt and continuation; loops: (B, n) int64, the loop depth of the pass
    whose readout chose each generated token (for a token predicted from a prefill, T — or with
    prefill halting the depth of the last prompt token); prompt_loops: (B, L_prefill) the depth of
    every token of the first prefill with prefill halting, else None.
    """

    tokens: torch.Tensor
    loops: torch.Tensor
    prompt_loops: torch.Tensor | None = None

    @property
    def mean_loops(self) -> float:
        return float(self.loops.double().mean()) if self.loops.numel() else math.nan


class StaticKVCache(KVCache):
    """A :class:`KVCache` whose slots are preallocated (B, nh, capacity, hs) buffers: a new
    position is written in place, where the list cache copies every slot's whole history per
    token (``torch.cat``; on the CPU that copy was ~40% of a decoding step of the tiny model).
    Attention reads the first ``length + new`` positions of a buffer as a view."""

    row_subsets = True

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.length = 0
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.batch = 0  # rows of every buffer (from the first, written by all rows)

    @property
    def slots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached (k, v) of every slot: views (B, nh, length, hs) of the buffers."""
        n = self.length
        return [(k[:, :, :n], v[:, :, :n]) for k, v in self.buffers]

    def append(
        self, index: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise LoopLMError(f"KV cache holds {self.capacity} positions; {end} were asked for")
        if index == len(self.buffers):
            _, nh, _, hs = k.shape
            if not self.buffers:
                self.batch = k.shape[0] if rows is None else int(rows.max()) + 1
            B = self.batch
            self.buffers.append(
                (k.new_empty(B, nh, self.capacity, hs), v.new_empty(B, nh, self.capacity, hs))
            )
        elif index > len(self.buffers):
            raise IndexError(f"KV slot {index} used before slot {len(self.buffers)}")
        K, V = self.buffers[index]
        if rows is None:
            K[:, :, start:end] = k
            V[:, :, start:end] = v
            return K[:, :, :end], V[:, :, :end]
        K[rows, :, start:end] = k
        V[rows, :, start:end] = v
        return K[rows, :, :end], V[rows, :, :end]  # (rows, nh, end, hs): copies

    def copy_new(self, src: int, dst: int, n: int) -> None:
        """Slot ``dst`` gets slot ``src``'s keys/values of the ``n`` positions being added."""
        a, b = self.length, self.length + n
        if dst == len(self.buffers):
            k, v = self.buffers[src]
            self.buffers.append((torch.empty_like(k), torch.empty_like(v)))
        for to, frm in zip(self.buffers[dst], self.buffers[src]):
            to[:, :, a:b] = frm[:, :, a:b]

    def index_rows(self, rows: torch.Tensor) -> None:
        """Keep the batch rows ``rows`` (in that order), e.g. to reorder beams."""
        self.buffers = [(k[rows], v[rows]) for k, v in self.buffers]
        self.batch = len(rows)


class RaggedKVCache(KVCache):
    """A KV cache whose rows each hold their own number of positions (continuous batching):
    ``length`` is a (B,) tensor, a row's new keys/values go after its own cached ones, and
    attention masks out every position past a row's own (:mod:`looplm.model.block`).

    Rows are filled from a one-sequence :class:`StaticKVCache` (:meth:`load_row`: a prompt
    prefilled alone), dropped (:meth:`index_rows`), and a pass may run on a subset of them
    (:meth:`using`): the others' keys, values and lengths stay as they are."""

    row_subsets = True

    def __init__(self, capacity: int, rows: int) -> None:
        self.capacity = int(capacity)
        self._length = torch.zeros(rows, dtype=torch.long)
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rows: torch.Tensor | None = None  # the rows of the current pass (None: all)

    @property
    def length(self) -> torch.Tensor:
        """(B,) cached positions of the rows of the current pass."""
        return self._length if self.rows is None else self._length[self.rows]

    @length.setter
    def length(self, value: torch.Tensor) -> None:
        if self.rows is None:
            self._length = value
        else:
            self._length[self.rows] = value

    @property
    def n_rows(self) -> int:
        return self._length.shape[0]

    def using(self, rows: torch.Tensor | None) -> RaggedKVCache:
        """Let the next passes run on ``rows`` only (None: every row); returns the cache."""
        self.rows = None if rows is None or len(rows) == self.n_rows else rows
        return self

    def append(
        self, index: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, nh, L, hs = k.shape
        if index == len(self.buffers):
            n = self.n_rows
            self.buffers.append(
                (k.new_zeros(n, nh, self.capacity, hs), v.new_zeros(n, nh, self.capacity, hs))
            )
        elif index > len(self.buffers):
            raise IndexError(f"KV slot {index} used before slot {len(self.buffers)}")
        if rows is not None:  # rows of the pass's rows
            rows = rows if self.rows is None else self.rows.to(rows.device)[rows]
        else:
            rows = self.rows
        length = self._length if rows is None else self._length[rows.to(self._length.device)]
        pos = length.to(k.device)[:, None] + torch.arange(L, device=k.device)  # (B, L)
        end = int(pos.max()) + 1 if pos.numel() else 0
        if end > self.capacity:
            raise LoopLMError(f"KV cache holds {self.capacity} positions; {end} were asked for")
        K, V = self.buffers[index]
        if rows is None:
            idx = pos[:, None, :, None].expand(B, nh, L, hs)
            K.scatter_(2, idx, k)
            V.scatter_(2, idx, v)
            return K[:, :, :end], V[:, :, :end]
        rows = rows.to(k.device)
        r = rows[:, None].expand(B, L)
        K[r, :, pos] = k.transpose(1, 2)  # (B, L, nh, hs) into rows × positions
        V[r, :, pos] = v.transpose(1, 2)
        return K[rows, :, :end], V[rows, :, :end]

    def copy_new(self, src: int, dst: int, n: int) -> None:
        """Slot ``dst`` gets slot ``src``'s keys/values of the ``n`` positions being added to each
        row of the pass (after the row's own cached ones)."""
        rows = self.rows if self.rows is not None else torch.arange(self.n_rows)
        if dst == len(self.buffers):
            k, v = self.buffers[src]
            self.buffers.append((torch.zeros_like(k), torch.zeros_like(v)))
        pos = self._length[rows][:, None] + torch.arange(n)  # (B, n)
        r = rows[:, None].expand_as(pos)
        for to, frm in zip(self.buffers[dst], self.buffers[src]):
            to[r, :, pos] = frm[r, :, pos]

    def load_row(self, row: int, src: StaticKVCache, length: int | None = None) -> None:
        """Row ``row`` takes the keys/values of the first ``length`` positions (default: all) of
        the one-sequence cache ``src``, and of its per-step coda cache (:class:`StepCoda`) when
        it has one."""
        n = src.length if length is None else length
        if getattr(src, "step_coda", None) is not None:
            if getattr(self, "step_coda", None) is None:
                self.step_coda = RaggedKVCache(self.capacity, self.n_rows)
            self.step_coda.load_row(row, src.step_coda, n)  # its length follows the main cache
        if n > self.capacity:
            raise LoopLMError(f"KV cache holds {self.capacity} positions; {n} were asked for")
        for i, (k, v) in enumerate(src.buffers):
            if i == len(self.buffers):
                _, nh, _, hs = k.shape
                shape = (self.n_rows, nh, self.capacity, hs)
                self.buffers.append((k.new_zeros(shape), v.new_zeros(shape)))
            K, V = self.buffers[i]
            K[row, :, :n] = k[0, :, :n]
            V[row, :, :n] = v[0, :, :n]
        self._length[row] = n

    def index_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` (in that order)."""
        if getattr(self, "step_coda", None) is not None:
            self.step_coda.index_rows(rows)
        self.buffers = [(k[rows], v[rows]) for k, v in self.buffers]
        self._length = self._length[rows.to(self._length.device)]
        self.rows = None

    def add_rows(self, n: int) -> None:
        """``n`` more, empty rows after the others (sequences joining a running batch). The
        buffers grow by ``n`` rows in one copy: memory stays rows × capacity."""
        if n <= 0:
            return
        if getattr(self, "step_coda", None) is not None:
            self.step_coda.add_rows(n)
        self.buffers = [
            (
                torch.cat([k, k.new_zeros(n, *k.shape[1:])]),
                torch.cat([v, v.new_zeros(n, *v.shape[1:])]),
            )
            for k, v in self.buffers
        ]
        self._length = torch.cat([self._length, self._length.new_zeros(n)])
        self.rows = None


def _require_cacheable(model: nn.Module) -> None:
    if not getattr(model, "is_looped", False):
        raise LoopLMError("cached generation needs a looped model (recurrence != unshared)")


def _cached_context(model: nn.Module, ids: torch.Tensor, cache: KVCache):
    """The loop context of the new tokens (the prelude, if any, writes its slots)."""
    _require_cacheable(model)
    ctx = model.prepare(ids, cache=cache, pos_offset=cache.length)
    if "attn_mask" in ctx.extra:
        raise LoopLMError("a KV cache cannot serve a data-given attention mask (model.attention)")
    return ctx


def cached_hidden(model: nn.Module, ids: torch.Tensor, loops: int, cache: KVCache) -> torch.Tensor:
    """What the readout reads (B, L, d) for the new tokens ``ids`` (B, L) at positions
    ``cache.length …``: they attend to the cached positions and append their own keys/values."""
    ctx = _cached_context(model, ids, cache)
    core = model.core_call(ctx, cache=cache)
    for last in model.unroll(ctx, loops, core=core):  # noqa: B007 — only h_T is read
        pass
    h = model.finish(last.hidden, ctx, cache=cache, first_slot=core.slot)
    cache.length += ids.shape[1]
    return h


@torch.no_grad()
def next_logits(
    model: nn.Module, ids: torch.Tensor, loops: int, cache: KVCache | None
) -> torch.Tensor:
    """Logits (B, V) of the last position. With ``cache``, ``ids`` are only the new tokens."""
    if cache is None:
        return model(ids, loops=loops)[:, -1]
    return model.readout(cached_hidden(model, ids, loops, cache)[:, -1])


def step_readouts(model: nn.Module) -> bool:
    """Whether KL halting reads through coda layers (which attend across positions)."""
    return len(getattr(model, "coda", ())) > 0


class StepCoda:
    """``finish(h_t)`` for the KL reads of one cached pass of a model with coda layers.

    The uncached per-token evaluation reads step t of every position through the coda over the
    whole sequence, so a token's step-t read attends to the earlier positions' step-t coda
    inputs. A cached pass keeps those: the coda's keys/values of every read step t = 0 … T − 1 go
    to a cache of their own (``cache.step_coda``, of the main cache's kind, rows and lengths:
    slot t·c + j for coda layer j), written for all
    of the pass's positions (halted ones from their frozen state); steps after every token halted
    are not read and get the last read step's keys/values (the states no longer change)."""

    def __init__(self, model: nn.Module, cache: KVCache, loops: int, n_new: int) -> None:
        ragged = isinstance(cache, RaggedKVCache)
        rc = getattr(cache, "step_coda", None)
        if rc is None:
            if bool((cache._length > 0).any()) if ragged else cache.length:
                raise LoopLMError(
                    "this KV cache was filled without the coda's per-step keys/values that "
                    "halt=kl reads on a model with coda layers; prefill it through decode()"
                )
            rc = (
                RaggedKVCache(cache.capacity, cache.n_rows)
                if ragged
                else StaticKVCache(model.config.context)
            )
            cache.step_coda = rc
        if ragged:  # the main cache's rows and lengths (a pass may run on a subset of rows)
            rc._length, rc.rows = cache._length.clone(), cache.rows
        else:
            rc.length = cache.length
        self.model, self.cache, self.loops, self.n_new = model, rc, loops, n_new
        self.c, self.read = len(model.coda), 0

    def __call__(self, h: torch.Tensor, context) -> torch.Tensor:
        out = self.model.finish(h, context, cache=self.cache, first_slot=self.read * self.c)
        self.read += 1
        return out

    def close(self) -> None:
        """Steps never read (every token had halted): the last read step's keys/values."""
        last = (self.read - 1) * self.c
        for t in range(self.read, self.loops):
            for j in range(self.c):
                self.cache.copy_new(last + j, t * self.c + j, self.n_new)


@torch.no_grad()
def adaptive_next_logits(
    model: nn.Module, ids: torch.Tensor, loops: int, cache: KVCache, halting: Halting
) -> tuple[torch.Tensor, torch.Tensor]:
    """One cached pass over the new tokens ``ids`` (B, L) with per-token halting.

    Returns the last position's logits (B, V) and the loop depth of every new token (B, L) int64
    (between 1 and ``loops``). Decisions are per token and independent of the other rows of the
    batch (each row attends to its own cache only), so batched and unbatched decoding halt alike.
    """
    if model.training:
        raise LoopLMError("adaptive decoding needs the model in eval mode (call model.eval())")
    rule = None if halting.rule == "none" else halting_rule(halting.rule)
    kl = rule is not None and rule.needs_logits
    B, L = ids.shape
    # a coda model's KL reads go through the coda at every step: their keys/values per step are
    # kept (also at threshold 0, so that later tokens' reads find these positions')
    steps = StepCoda(model, cache, loops, L) if kl and step_readouts(model) else None
    ctx = _cached_context(model, ids, cache)
    core = model.core_call(ctx, cache=cache)  # one binding: the slots follow the block calls
    tokens = None
    if halting.enabled or steps is not None:
        decide = rule.build(halting.threshold, model=model)
        tokens = TokenHalting(decide, finish=steps)
    for last in model.unroll(ctx, loops, core=core, halting=tokens):  # noqa: B007
        pass
    if steps is not None:
        steps.close()
    h = model.finish(last.hidden, ctx, cache=cache, first_slot=core.slot)
    cache.length += L
    depth = tokens.depth if tokens is not None else ids.new_full((B, L), loops, dtype=torch.long)
    return model.readout(h[:, -1]), depth


def _sample(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, V) → next tokens (B, 1); temperature 0 is greedy."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


def _prefill(model: nn.Module, ids: torch.Tensor, loops: int, halting: Halting, halt: bool):
    """A fresh cache holding ``ids`` (B, L): (cache, last logits (B, V), depth of every token
    (B, L) when ``halt`` — prefill halting, T for all at threshold 0 — else None)."""
    # stays eager: prompt lengths vary per call (a graph per length, each run once per prompt)
    cache = StaticKVCache(model.config.context)
    if halting.rule == "kl" and step_readouts(model):  # the prompt's per-step coda keys/values
        h = halting if halt else Halting("kl", 0.0)  # threshold 0: the fixed-depth pass
        logits, depth = adaptive_next_logits(model, ids, loops, cache, h)
        return cache, logits, depth if halt else None
    if halt and halting.enabled:
        logits, depth = adaptive_next_logits(model, ids, loops, cache, halting)
        return cache, logits, depth
    logits = next_logits(model, ids, loops, cache)
    return cache, logits, torch.full_like(ids, loops) if halt else None


# long: one decoding loop over its four paths (uncached, prefill, cached, adaptive), top to bottom
@torch.no_grad()
def decode(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    loops: int = 8,
    *,
    halt: str = "none",
    threshold: float = 0.0,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
    slide: int = 1,
    generator: torch.Generator | None = None,
    prefill_halt: bool = False,
    on_token: Callable[[torch.Tensor], object] | None = None,
) -> Generation:
    """Continue ``ids`` (B, L) by ``max_new_tokens`` tokens (see the module docstring).

    ``loops`` is the depth T (the ceiling when ``halt`` is a rule); ``slide`` how many
    tokens the window advances when it is full (cached path). Prompts of one batch share a length
    (the model has no padding mask). ``prefill_halt``: the prompt's tokens halt by the same rule
    as generated ones (frozen states, as the per-token evaluation), instead of all running T.
    ``on_token(next)`` is called with each new (B, 1) token as soon as it is chosen (streaming);
    memory grows with the tokens made, not with ``max_new_tokens``.
    """
    from looplm.model.lm import check_loops

    check_loops(loops)
    halting = Halting(halt, float(threshold))
    if max_new_tokens < 0:
        raise LoopLMError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise LoopLMError(f"ids must be a non-empty (batch, length) tensor, got {tuple(ids.shape)}")
    context = model.config.context
    if not 1 <= slide <= context:
        raise LoopLMError(f"slide={slide} must be in [1, context={context}]")
    model.eval()
    cached = use_cache and getattr(model, "is_looped", False)
    if halting.enabled and not cached:
        raise LoopLMError(
            "adaptive depth in generation runs on the KV-cached path of a looped model "
            "(use_cache=True, recurrence != unshared)"
        )
    B = ids.shape[0]
    window = ids[:, -context:]  # the last `context` tokens: all any next prediction reads
    new: list[torch.Tensor] = []  # (B, 1) each; grown as tokens are made
    depths: list[torch.Tensor] = []
    cache, logits, prompt_loops = None, None, None
    for _ in range(max_new_tokens):
        depth = torch.full((B,), loops, dtype=torch.long, device=ids.device)
        if not cached:
            logits = next_logits(model, window, loops, None)
        elif logits is None or cache.length >= context:  # (re-)prefill the window
            keep, first = (context, True) if logits is None else (context - slide + 1, False)
            cache, logits, d = _prefill(model, window[:, -keep:], loops, halting, prefill_halt)
            if d is not None:
                depth = d[:, -1]
                prompt_loops = d if first else prompt_loops
        elif halting.rule == "none":
            logits = next_logits(model, window[:, -1:], loops, cache)
        else:
            logits, d = adaptive_next_logits(model, window[:, -1:], loops, cache, halting)
            depth = d[:, -1]
        token = _sample(logits, temperature, top_k, generator)
        window = torch.cat([window, token], dim=1)[:, -context:]
        new.append(token)
        depths.append(depth)
        if on_token is not None:
            on_token(token)
    out = torch.cat([ids, *new], dim=1)
    loops_made = (
        torch.stack(depths, dim=1)
        if depths
        else torch.zeros((B, 0), dtype=torch.long, device=ids.device)
    )
    return Generation(out, loops_made, prompt_loops)


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    loops: int = 8,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    halt: str = "none",
    threshold: float = 0.0,
    slide: int = 1,
    prefill_halt: bool = False,
) -> torch.Tensor:
    """Continue ``ids`` (B, L) by ``max_new_tokens`` tokens: (B, L + max_new_tokens).

    Temperature 0 is greedy decoding; see :func:`decode` for ``halt``/``threshold``/``slide``.
    """
    return decode(
        model,
        ids,
        max_new_tokens,
        loops,
        halt=halt,
        threshold=threshold,
        temperature=temperature,
        top_k=top_k,
        use_cache=use_cache,
        slide=slide,
        generator=generator,
        prefill_halt=prefill_halt,
    ).tokens
