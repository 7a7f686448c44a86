"""Typed views of the metric fields evaluation rows carry in ``EvalRecord.extra``.

The store keeps metric-specific numbers as a JSON object (``extra``), so new evaluation kinds need
no schema change. Readers should not pick keys out of it by name: :class:`AdaptiveFields` (an
adaptive-depth row), :class:`RouterFit` (the learned router's fit) and :class:`CompletionFields`
(a LAMBADA row) name each field once, with its type and meaning; the evaluation kinds write
exactly these keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from looplm.results.store import EvalRecord


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


@dataclass(frozen=True)
class RouterFit:
    """The linear router's fit on its calibration data (per seed)."""

    n_samples: int
    positive_rate: float  # fraction of "converged" labels
    train_accuracy: float
    train_bce: float
    majority_accuracy: float  # accuracy of always answering the majority label

    @classmethod
    def of(cls, d: dict[str, Any]) -> RouterFit:
        return cls(
            int(d.get("n_samples", 0)),
            float(d["positive_rate"]),
            float(d["train_accuracy"]),
            float(d.get("train_bce", math.nan)),
            float(d["majority_accuracy"]),
        )


@dataclass(frozen=True)
class AdaptiveFields:
    """An adaptive-depth row (``adaptive_mode`` set; ``depth`` is the loop ceiling)."""

    rule: str  # maxtoken | kl | router (the mode's family)
    mean_depth: float  # achieved mean active loops per scored token
    wall_clock_s: float | None = None  # measured, min over timing repeats
    wall_clock_dense_s: float | None = None  # per-token rules run without work skipping
    target: float | None = None  # maxtoken: the calibrated mean budget
    flops_per_token_body: float | None = None  # Eq. 20 at the achieved mean depth
    uniform_wall_clock_s: dict[int, float] = field(default_factory=dict)  # T → seconds
    router: RouterFit | None = None

    @classmethod
    def of(cls, rec: EvalRecord) -> AdaptiveFields:
        ex = rec.extra
        return cls(
            rule=str(ex.get("rule") or rec.adaptive_mode.split(":", 1)[0]),
            mean_depth=float(ex["mean_depth"]),
            wall_clock_s=_num(ex.get("wall_clock_s")),
            wall_clock_dense_s=_num(ex.get("wall_clock_dense_s")),
            target=_num(ex.get("target")),
            flops_per_token_body=_num(ex.get("flops_per_token_body")),
            uniform_wall_clock_s={
                int(T): float(v) for T, v in (ex.get("uniform_wall_clock_s") or {}).items()
            },
            router=RouterFit.of(ex["router"]) if "router" in ex else None,
        )


@dataclass(frozen=True)
class CompletionFields:
    """A LAMBADA row: target-token accuracy and exact last-word accuracy counts."""

    n_correct: int  # target tokens predicted correctly (argmax, teacher-forced)
    n_examples: int  # target tokens
    exact_word_correct: int  # passages whose whole target word greedy decoding reproduces
    n_passages: int

    @property
    def token_accuracy(self) -> float:
        return self.n_correct / self.n_examples

    @property
    def exact_word_accuracy(self) -> float:
        return self.exact_word_correct / self.n_passages

    @classmethod
    def of(cls, rec: EvalRecord) -> CompletionFields:
        ex = rec.extra
        return cls(
            int(ex["n_correct"]),
            int(ex["n_examples"]),
            int(ex["exact_word_correct"]),
            int(ex["n_passages"]),
        )
