"""Recurrence-scaling points for the φ fit (:mod:`looplm.scaling.fit`)::

    scaling: {split: validation, max_tokens: 65536}

One row per run at its training recurrence count r (the run must train at a fixed depth:
``train.depth_min == train.depth_max == r``), with ``extra`` holding ``n_once``, ``n_rec`` (the
looped core's unique parameters; everything else — embeddings and head, prelude and coda, the
recurrence's own projections and gains — is ``n_once``; for the φ sweep's methods the in-loop
recurrence parameters are nil (looped) or a few dozen lane weights (hyper_looped)),
``train_tokens`` (steps × batch rows × accumulation × context: a single-process run; with
torchrun multiply by the world size), ``r`` and ``sweep_protocol`` (the grid's protocol without
the training variant's suffix: the report fits one law per method over every variant of a sweep),
so ``looplm report`` fits ``L = E + A (N_once + r^φ N_rec)^−α + B D^−β`` and prints φ with a
bootstrap interval.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from looplm.errors import LoopLMError
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind
from looplm.evaluate.kinds.fixed import Sweep
from looplm.settings import setting


@dataclass
class ScalingSettings:
    """``evaluate.scaling``."""

    split: str = "validation"  # split the NLL at the training depth r is measured on
    max_tokens: int | None = setting(None, lo=1)  # cap on scored tokens; null: the whole split


def scaling_extra(cfg: Any) -> dict[str, Any]:
    """``n_once``, ``n_rec``, ``train_tokens`` and ``r`` of a fixed-depth training run."""
    import torch

    from looplm.model.build import model_from_config

    t = cfg.train
    if t.depth_min != t.depth_max:
        raise LoopLMError(
            f"scaling points need a fixed training depth r: train.depth_min={t.depth_min} != "
            f"train.depth_max={t.depth_max}"
        )
    with torch.device("meta"):
        model = model_from_config(cfg.model)
    n_rec = sum(p.numel() for n, p in model.named_parameters() if n.startswith("block."))
    rows = t.batch_size * t.grad_accum
    return {
        "n_once": model.num_parameters() - n_rec,
        "n_rec": n_rec,
        "train_tokens": t.steps * rows * cfg.model.context,
        "r": t.depth_max,
    }


@register_kind
class Scaling(EvaluationKind):
    """Mean NLL at the training depth r, with the φ fit's inputs."""

    name = "scaling"
    section = "scaling"
    Settings = ScalingSettings
    order = 60

    def __init__(self, settings: ScalingSettings) -> None:
        self.settings = settings
        self.split, self.max_tokens = settings.split, settings.max_tokens

    def _sweep(self, job: EvalJob) -> Sweep:
        return Sweep(None, self.split, self.max_tokens, (job.cfg.train.depth_max,), "scaling")

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        return self._sweep(job).identities(job)

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        job.extra.update(scaling_extra(job.cfg), sweep_protocol=job.sweep_protocol)
        return self._sweep(job).run(job, todo)
