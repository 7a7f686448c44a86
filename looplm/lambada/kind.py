"""LAMBADA last-word completion at several depths (:mod:`looplm.lambada.completion`)::

    lambada: {path: lambada, max_examples: 200, depths: [1, 2, 4, 8, 16, 32, 48]}

``path`` (``lambada_test.jsonl`` or its folder) is resolved against the experiment's data folder
when it is not an existing path. Rows: ``dataset='lambada'``, ``split='test'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind
from looplm.settings import build_settings, depth_list, setting


@dataclass
class LambadaSettings:
    """``evaluate.lambada``."""

    path: str  # lambada_test.jsonl or its folder (resolved against data_dir when not a path)
    # evaluate the first N passages only; null: all 5,153
    max_examples: int | None = setting(None, lo=1)
    # loop depths (default: evaluate.depths)
    depths: list[int] | str | None = setting(None, lo=1, cap=4096)
    # evaluation batch size (default: evaluate.batch_size)
    batch_size: int | None = setting(None, lo=1, hi=65_536)


@register_kind
class Lambada(EvaluationKind):
    """Target-token PPL/accuracy and exact last-word accuracy on LAMBADA's test split."""

    name = "lambada"
    section = "lambada"
    Settings = LambadaSettings
    order = 40

    def __init__(self, settings: LambadaSettings) -> None:
        self.settings, self.depths = settings, list(settings.depths)

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> Lambada | None:
        lam = evaluate.get("lambada")
        if not lam:
            return None
        s = build_settings(LambadaSettings, lam, "evaluate.lambada")
        s.depths = depth_list(s.depths or evaluate.get("depths"), "lambada.depths")
        return cls(s)

    def _tag(self, job: EvalJob) -> str:
        return job.tag(max_examples=self.settings.max_examples)

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.evaluate.records import fixed_depth_identities

        return fixed_depth_identities(
            job.cfg,
            self.depths,
            dataset="lambada",
            split="test",
            tag=self._tag(job),
            protocol=job.protocol,
        )

    @staticmethod
    def evaluate_checkpoint(checkpoint: str, s: Any, *, progress: bool = True) -> dict[str, Any]:
        """``looplm eval --lambada PATH``: one checkpoint at the depths of the eval settings
        ``s`` (:class:`~looplm.evaluate.settings.EvalSettings`)."""
        from looplm.lambada.completion import evaluate_lambada_checkpoint

        return evaluate_lambada_checkpoint(
            checkpoint, s.lambada, s.depths, max_examples=s.max_examples,
            batch_size=s.batch_size, device=s.device, progress=progress,
        )  # fmt: skip

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        from looplm.data.corpora import lambada_examples
        from looplm.data.tokenizers import get_tokenizer
        from looplm.evaluate.records import fixed_depth_records
        from looplm.lambada.completion import lambada_items, lambada_sweep

        path = Path(self.settings.path)
        if not path.exists() and job.data_dir:
            path = Path(job.data_dir) / self.settings.path
        items = lambada_items(
            lambada_examples(path)[: self.settings.max_examples],
            get_tokenizer(job.cfg.model.tokenizer),
            job.cfg.model.context,
        )
        rows = lambada_sweep(
            job.model(),
            items,
            sorted(i["depth"] for i in todo),
            batch_size=int(self.settings.batch_size or job.batch_size),
            device=job.device,
            progress=job.progress,
        )
        return fixed_depth_records(
            rows,
            job.cfg,
            dataset="lambada",
            split="test",
            tag=self._tag(job),
            protocol=job.protocol,
            extra=job.extra,
        )
