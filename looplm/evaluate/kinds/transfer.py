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
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, check_settings, register_kind
from looplm.evaluate.kinds.fixed import Sweep


@dataclass
class TransferSettings:
    """One entry of ``evaluate.transfer`` (a list: one fixed-depth sweep per corpus)."""

    dataset: str  # the held-out corpus (no training on it), e.g. c4
    split: str = "test"  # its split
    max_tokens: int | None = None  # cap on scored tokens (default: evaluate.max_tokens)
    depths: list[int] | str | None = None  # loop depths (default: evaluate.depths)
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
        from looplm.settings import depth_list

        entries = evaluate.get("transfer") or []
        if not isinstance(entries, list):
            raise LoopLMError("evaluate.transfer must be a list of {dataset, split, …} entries")
        sweeps = []
        for i, t in enumerate(entries):
            check_settings(TransferSettings, t, f"evaluate.transfer[{i}]")
            depths = depth_list(t.get("depths", evaluate.get("depths")), "transfer.depths")
            cap = t.get("max_tokens", evaluate.get("max_tokens"))
            counts = t.get("counts")
            if counts is not None:
                from looplm.data.corpora import SplitCounts

                c = SplitCounts.parse(str(counts))
                counts = f"{c.train},{c.validation},{c.test}"
            label = f"docs={counts.replace(',', '/')}" if counts else ""
            sweeps.append(
                Sweep(t["dataset"], t.get("split", "test"), cap, tuple(depths), label, counts)
            )
        return cls(sweeps) if sweeps else None

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        return [i for s in self.sweeps for i in s.identities(job)]

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        return [r for s in self.sweeps for r in s.run(job, todo)]
