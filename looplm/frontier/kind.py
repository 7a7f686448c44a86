"""The computational frontier on a synthetic task (:mod:`looplm.frontier.measure`)::

    frontier: {depths: [1, 2, 4, 8, 16, 32], difficulties: [1, 2, 3, 4, 6, 8], n_examples: 128}
    propagation: {difficulties: [2, 4, 6, 8], max_loops: 16, n_examples: 64}

``frontier`` writes one accuracy row per (difficulty, T): ``dataset`` = the task, ``split`` =
``difficulty=<d>``, with the run's training difficulty range in ``extra`` (the report marks it and
measures extrapolation beyond it). ``propagation`` (node tasks only) writes one row per run:
``split='propagation'``, ``depth`` = ``max_loops``, the per-query hop distances and first-correct
steps and their summary in ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from looplm.errors import LoopLMError
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind
from looplm.settings import check_fields, depth_list, setting

MAX_DEPTH = 4096  # soft cap on a loop depth: a batch costs the deepest T


@dataclass
class FrontierSettings:
    """``evaluate.frontier``."""

    # thinking steps T to evaluate, a list or a string like "1-32"
    depths: list[int] | str = setting(lo=1, cap=MAX_DEPTH)
    # task difficulties to test (e.g. nesting depths 1-8)
    difficulties: list[int] | str = setting(lo=1)
    n_examples: int = setting(128, lo=1, cap=1_000_000)  # examples per difficulty
    # evaluation batch size (default: evaluate.batch_size)
    batch_size: int | None = setting(None, lo=1, hi=65_536)

    def validate(self) -> None:
        self.depths = depth_list(self.depths, "frontier.depths")
        self.difficulties = depth_list(self.difficulties, "frontier.difficulties")
        check_fields(self, "evaluate.frontier.")


@dataclass
class PropagationSettings:
    """``evaluate.propagation`` (node tasks with adjacency attention)."""

    difficulties: list[int] | str = setting(lo=1)  # graph depths to test
    # loop steps unrolled per query (the row's depth)
    max_loops: int = setting(16, lo=1, cap=MAX_DEPTH, what="the loop depth T")
    n_examples: int = setting(64, lo=1, cap=1_000_000)  # graphs per difficulty
    # evaluation batch size (default: evaluate.batch_size)
    batch_size: int | None = setting(None, lo=1, hi=65_536)

    def validate(self) -> None:
        self.difficulties = depth_list(self.difficulties, "propagation.difficulties")


def _task(job: EvalJob) -> str:
    from looplm.data.synthetic import TASKS

    task = job.cfg.data.dataset
    if task not in TASKS:
        raise LoopLMError(
            f"frontier evaluation needs a synthetic task, not data.dataset={task!r}; "
            f"allowed: {', '.join(TASKS)}"
        )
    return task


@register_kind
class Frontier(EvaluationKind):
    """Accuracy over thinking steps T × difficulty."""

    name = "frontier"
    section = "frontier"
    Settings = FrontierSettings
    order = 50

    def __init__(self, settings: FrontierSettings) -> None:
        self.settings = settings
        self.depths, self.difficulties = settings.depths, settings.difficulties
        self.n_examples, self.batch_size = settings.n_examples, settings.batch_size

    def _tag(self, job: EvalJob) -> str:
        return job.tag(max_examples=self.n_examples)

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.evaluate.records import fixed_depth_identities

        task = _task(job)
        return [
            i
            for d in self.difficulties
            for i in fixed_depth_identities(
                job.cfg,
                self.depths,
                dataset=task,
                split=f"difficulty={d}",
                tag=self._tag(job),
                protocol=job.protocol,
            )  # fmt: skip
        ]

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        from looplm.evaluate.records import fixed_depth_records
        from looplm.frontier.measure import frontier_accuracy

        want = {(i["split"], i["depth"]) for i in todo}
        diffs = sorted({int(s.split("=")[1]) for s, _ in want})
        rows = frontier_accuracy(
            job.model(), _task(job), self.depths, diffs, n_examples=self.n_examples,
            batch_size=int(self.batch_size or job.batch_size), device=job.device,
            task_args=job.cfg.data.task_args,
        )  # fmt: skip
        extra = {**job.extra, "train_difficulty": list(job.cfg.data.train_difficulty)}
        if not job.cfg.model.is_looped:  # T beyond its layers changes nothing: no climb to read
            extra["fixed_depth"] = job.cfg.model.n_layers
        out = []
        for d in diffs:
            mine = [
                r for r in rows if r["difficulty"] == d and (f"difficulty={d}", r["depth"]) in want
            ]
            out += fixed_depth_records(
                mine, job.cfg, dataset=_task(job), split=f"difficulty={d}", tag=self._tag(job),
                protocol=job.protocol, extra=extra,
            )  # fmt: skip
        return out


@register_kind
class Propagation(EvaluationKind):
    """First-correct loop step vs true hop distance on a node task (adjacency attention)."""

    name = "propagation"
    section = "propagation"
    Settings = PropagationSettings
    order = 55

    def __init__(self, settings: PropagationSettings) -> None:
        self.settings = settings
        self.difficulties, self.max_loops = settings.difficulties, settings.max_loops
        self.n_examples, self.batch_size = settings.n_examples, settings.batch_size

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.evaluate.records import fixed_depth_identities

        return fixed_depth_identities(
            job.cfg, [self.max_loops], dataset=_task(job), split="propagation",
            tag=job.tag(max_examples=self.n_examples), protocol=job.protocol,
        )  # fmt: skip

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        from looplm.evaluate.records import fixed_depth_records
        from looplm.frontier.measure import propagation_steps, propagation_summary

        p = propagation_steps(
            job.model(), self.difficulties, self.max_loops, task=_task(job),
            n_examples=self.n_examples, batch_size=int(self.batch_size or job.batch_size),
            device=job.device,
        )  # fmt: skip
        row = {
            "depth": self.max_loops,
            "n_tokens": int(p["distance"].size),
            "sum_nll": 0.0,
            "propagation": propagation_summary(p),
            **{k: v.astype(int).tolist() for k, v in p.items()},
        }
        return fixed_depth_records(
            [row], job.cfg, dataset=_task(job), split="propagation",
            tag=job.tag(max_examples=self.n_examples), protocol=job.protocol, extra=job.extra,
        )  # fmt: skip
