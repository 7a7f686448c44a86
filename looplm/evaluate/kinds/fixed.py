"""Fixed-depth sweep on the run's own corpus: one store row per loop depth of
``evaluate.depths`` (token-weighted NLL → PPL; task accuracy for synthetic tasks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind


class _ListSource:
    """A DataSource over precomputed evaluation batches (for ``depth_sweep``)."""

    def __init__(self, batches: list, is_task: bool) -> None:
        self.batches, self.is_task = batches, is_task

    def eval_batches(self, batch_size, max_tokens=None, n_examples=0):
        yield from self.batches


def _key(identity: dict[str, Any]) -> tuple:
    return tuple(sorted(identity.items()))


@dataclass(frozen=True)
class Sweep:
    """A fixed-depth sweep of one corpus split (``dataset`` None: the run's training corpus)."""

    dataset: str | None
    split: str
    max_tokens: int | None
    depths: tuple[int, ...]
    label: str = ""  # added to the eval tag (a kind whose rows must not share fixed's identity)
    counts: str | None = None  # OpenWebText / C4 split document counts (default: the paper's)

    def tag(self, job: EvalJob) -> str:
        from looplm.evaluate.records import eval_tag

        base = job.tag(max_tokens=self.max_tokens)
        return eval_tag(",".join(x for x in (self.label, base) if x))

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.evaluate.records import fixed_depth_identities

        return fixed_depth_identities(
            job.cfg,
            list(self.depths),
            dataset=self.dataset or job.cfg.data.dataset,
            split=self.split,
            tag=self.tag(job),
            protocol=job.protocol,
        )

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        """Records of the depths of this sweep that ``todo`` asks for (one unroll per batch)."""
        from looplm.data.synthetic import TASKS
        from looplm.evaluate.batches import evaluation_batches
        from looplm.evaluate.records import fixed_depth_records
        from looplm.evaluate.sweep import depth_sweep

        wanted = {_key(i) for i in todo}
        depths = sorted(i["depth"] for i in self.identities(job) if _key(i) in wanted)
        if not depths:
            return []
        dataset = self.dataset or job.cfg.data.dataset
        model = job.model()
        data = evaluation_batches(
            job.cfg, self.split, self.max_tokens, job.batch_size, dataset, counts=self.counts
        )
        rows = depth_sweep(
            model,
            _ListSource(data, dataset in TASKS),
            depths,
            batch_size=job.batch_size,
            device=job.device,
            progress=job.progress,
        )
        return fixed_depth_records(
            rows,
            job.cfg,
            dataset=dataset,
            split=self.split,
            tag=self.tag(job),
            protocol=job.protocol,
            extra=job.extra,
        )


@register_kind
class FixedDepth(EvaluationKind):
    """PPL (or accuracy) at every depth of ``evaluate.depths`` on ``evaluate.split``."""

    name = "fixed"
    order = 10

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> FixedDepth:
        return cls()

    def _sweep(self, job: EvalJob) -> Sweep:
        return Sweep(None, job.split, job.max_tokens, tuple(job.depths))

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        return self._sweep(job).identities(job)

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        return self._sweep(job).run(job, todo)
