"""A two-hop knowledge task: a seeded random knowledge base learned from text.

The knowledge base has ``n_entities`` entities (single letters ``A``–``Z``, ``a``–``z``) and
``n_relations`` relations (single digits ``0``–``9``); every relation is a function: entity ``e``
and relation ``r`` give one entity ``r(e) ≠ e``. Everything is one byte, so an entity is one token
of the byte tokenizer and a lens can rank it among the whole vocabulary.

* **one-hop facts** (difficulty 1): ``"A1="`` → ``r1(A)``, e.g. ``A1=Q;``. All
  ``n_entities · n_relations`` facts are training text.
* **two-hop queries** (difficulty 2): ``"A12="`` → ``r2(r1(A))``. The *bridge* entity ``r1(A)``
  never appears in the prompt (``r(e) ≠ e`` and the prompt holds only ``A`` and two digits).
* **held-out compositions**: a seeded fraction ``holdout`` of the ``(e, r1, r2)`` triples is never
  trained on; every one of their one-hop facts is. Accuracy on them tells composition (the model
  chains two facts it knows) from memorisation (it stored the two-hop answer itself).

The knowledge base is a pure function of ``(n_entities, n_relations, holdout, kb_seed)``
(``data.task_args``), so every training seed of a grid learns the same facts; the run's seed only
changes the order in which examples are drawn.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from looplm.errors import LoopLMError

ENTITY_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
RELATION_CHARS = "0123456789"
SPLITS = ("train", "heldout")
DEFAULTS: dict[str, Any] = {"n_entities": 32, "n_relations": 4, "holdout": 0.25, "kb_seed": 0}
TASK_ARG_KEYS = frozenset(DEFAULTS)


@dataclass(frozen=True)
class KnowledgeBase:
    """``table[r][e]``: the entity index relation ``r`` maps entity ``e`` to; ``heldout``: the
    ``(e, r1, r2)`` index triples never trained as two-hop queries."""

    n_entities: int
    n_relations: int
    holdout: float
    kb_seed: int
    table: tuple[tuple[int, ...], ...]
    heldout: frozenset[tuple[int, int, int]]

    @property
    def entities(self) -> str:
        return ENTITY_CHARS[: self.n_entities]

    @property
    def relations(self) -> str:
        return RELATION_CHARS[: self.n_relations]

    def hop(self, e: int, r: int) -> int:
        return self.table[r][e]

    def bridge(self, e: int, r1: int) -> int:
        """The entity a two-hop query ``(e, r1, r2)`` passes through."""
        return self.table[r1][e]

    def two_hop(self, e: int, r1: int, r2: int) -> int:
        return self.table[r2][self.table[r1][e]]

    def compositions(self, split: str = "train") -> list[tuple[int, int, int]]:
        """The ``(e, r1, r2)`` triples of ``split`` (``train`` or ``heldout``), sorted."""
        _check_split(split)
        every = [
            (e, a, b)
            for e in range(self.n_entities)
            for a in range(self.n_relations)
            for b in range(self.n_relations)
        ]
        return [t for t in every if (t in self.heldout) == (split == "heldout")]

    def fact_prompt(self, e: int, r: int) -> str:
        return f"{ENTITY_CHARS[e]}{RELATION_CHARS[r]}="

    def query_prompt(self, e: int, r1: int, r2: int) -> str:
        return f"{ENTITY_CHARS[e]}{RELATION_CHARS[r1]}{RELATION_CHARS[r2]}="

    def example(self, rng: random.Random, hops: int, split: str = "train") -> tuple[str, str]:
        """(prompt ending in ``=``, answer character): a random one-hop fact (``hops=1``) or a
        two-hop query of ``split`` (``hops=2``)."""
        if hops == 1:
            e, r = rng.randrange(self.n_entities), rng.randrange(self.n_relations)
            return self.fact_prompt(e, r), ENTITY_CHARS[self.hop(e, r)]
        if hops == 2:
            e, a, b = rng.choice(self._split(split))
            return self.query_prompt(e, a, b), ENTITY_CHARS[self.two_hop(e, a, b)]
        raise LoopLMError(f"twohop difficulty {hops}; allowed: 1 (one-hop fact), 2 (two-hop)")

    @functools.cached_property
    def _cache(self) -> dict[str, list[tuple[int, int, int]]]:
        return {s: self.compositions(s) for s in SPLITS}

    def _split(self, split: str) -> list[tuple[int, int, int]]:
        _check_split(split)
        return self._cache[split]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise LoopLMError(f"twohop split {split!r}; allowed: {', '.join(SPLITS)}")


def task_settings(task_args: dict[str, Any] | None) -> dict[str, Any]:
    """The knowledge-base settings of ``data.task_args`` (defaults filled in, checked)."""
    s = {**DEFAULTS, **{k: v for k, v in (task_args or {}).items() if k in TASK_ARG_KEYS}}
    n_e, n_r, hold = s["n_entities"], s["n_relations"], s["holdout"]
    if not isinstance(n_e, int) or not 2 <= n_e <= len(ENTITY_CHARS):
        raise LoopLMError(f"data.task_args.n_entities={n_e!r}; allowed: 2 … {len(ENTITY_CHARS)}")
    if not isinstance(n_r, int) or not 1 <= n_r <= len(RELATION_CHARS):
        raise LoopLMError(f"data.task_args.n_relations={n_r!r}; allowed: 1 … {len(RELATION_CHARS)}")
    if not isinstance(hold, (int, float)) or not 0.0 <= hold < 1.0:
        raise LoopLMError(f"data.task_args.holdout={hold!r}; allowed: 0 <= holdout < 1")
    if not isinstance(s["kb_seed"], int):
        raise LoopLMError(f"data.task_args.kb_seed={s['kb_seed']!r} must be an integer")
    return s


@functools.lru_cache(maxsize=16)
def _build(n_entities: int, n_relations: int, holdout: float, kb_seed: int) -> KnowledgeBase:
    rng = random.Random(f"twohop/{n_entities}/{n_relations}/{kb_seed}")
    table = tuple(
        tuple(rng.choice([x for x in range(n_entities) if x != e]) for e in range(n_entities))
        for _ in range(n_relations)
    )
    triples = [
        (e, a, b) for e in range(n_entities) for a in range(n_relations) for b in range(n_relations)
    ]
    held = random.Random(f"twohop-holdout/{holdout}/{kb_seed}").sample(
        triples, round(holdout * len(triples))
    )
    return KnowledgeBase(n_entities, n_relations, float(holdout), kb_seed, table, frozenset(held))


def knowledge_base(task_args: dict[str, Any] | None = None) -> KnowledgeBase:
    """The knowledge base ``data.task_args`` describes (built once per setting)."""
    s = task_settings(task_args)
    return _build(s["n_entities"], s["n_relations"], float(s["holdout"]), s["kb_seed"])
