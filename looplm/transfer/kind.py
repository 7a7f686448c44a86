"""Held-out transfer: the fixed-depth sweep of a trained run on other corpora (no training on
them), one entry per corpus under ``evaluate.transfer``::

    transfer:
      - {dataset: c4, split: train, max_tokens: 4096, depths: [1, 2, 4, 8, 16, 32, 48]}

``split`` defaults to test, ``max_tokens`` and ``depths`` to the common ``evaluate`` settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from looplm.errors import LoopLMError
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind
from looplm.evaluate.kinds.fixed import Sweep
from looplm.settings import build_settings, depth_list, setting


@dataclass
class TransferSettings:
    """One entry of ``evaluate.transfer`` (a list: one fixed-depth sweep per corpus)."""

    dataset: str  # the held-out corpus (no training on it), e.g. c4
    split: str = "test"  # its split
    # cap on scored tokens (default: evaluate.max_tokens)
    max_tokens: int | None = setting(None, lo=1)
    # loop depths (default: evaluate.depths)
    depths: list[int] | str | None = setting(None, lo=1, cap=4096)
    # OpenWebText / C4 document counts "TRAIN,VALIDATION,TEST" of a contiguous split (default:
    # the paper's 200,000 / 4,096 / 4,096 and 100,000 / 4,096 / 4,096; a small sample needs fewer)
    counts: str | None = None


@register_kind
class Transfer(EvaluationKind):
    """Fixed-depth sweeps of the corpora listed under ``evaluate.transfer``."""

    name = "transfer"
    section = "transfer"
    Settings = TransferSettings
    order = 30

    def __init__(self, sweeps: list[Sweep]) -> None:
        self.sweeps = sweeps

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> Transfer | None:

        entries = evaluate.get("transfer") or []
        if not isinstance(entries, list):
            raise LoopLMError("evaluate.transfer must be a list of {dataset, split, …} entries")
        sweeps = []
        for i, raw in enumerate(entries):
            t = build_settings(TransferSettings, raw, f"evaluate.transfer[{i}]")
            depths = depth_list(t.depths or evaluate.get("depths"), "transfer.depths")
            cap = t.max_tokens if t.max_tokens is not None else evaluate.get("max_tokens")
            counts = t.counts
            if counts is not None:
                from looplm.data.corpora import SplitCounts

                c = SplitCounts.parse(str(counts))
                counts = f"{c.train},{c.validation},{c.test}"
            label = f"docs={counts.replace(',', '/')}" if counts else ""
            sweeps.append(Sweep(t.dataset, t.split, cap, tuple(depths), label, counts))
        return cls(sweeps) if sweeps else None

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        return [i for s in self.sweeps for i in s.identities(job)]

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        return [r for s in self.sweeps for r in s.run(job, todo)]
