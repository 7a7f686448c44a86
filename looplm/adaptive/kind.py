"""Adaptive depth under a loop ceiling (:mod:`looplm.adaptive.depth`): one row per rule
setting, shared-block models only::

    adaptive:
      ceiling: 48
      rules: [maxtoken, kl, router]
      budgets: [8, 16, 24]                 # maxtoken: calibrated mean budgets
      kl_thresholds: [0.1, 0.01, 0.001]    # kl: halting thresholds
      router_probs: [0.5, 0.7, 0.9]        # router: probability thresholds
      label_threshold: 0.01                # router: convergence label
      calib_split: validation
      calib_max_tokens: 8192
      timing_depths: [8, 16, 24, 48]       # uniform fixed-depth wall clock, for comparison
      timing_repeats: 3                    # wall clock = min over repeated passes
      time_dense: true                     # per-token rules: also time the no-skipping path
      skip: true                           # per-token rules: skip the work of halted tokens
"""

from __future__ import annotations

from typing import Any

from looplm.adaptive.settings import AdaptiveSettings
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind
from looplm.settings import build_settings


@register_kind
class AdaptiveDepth(EvaluationKind):
    """The max-token, KL-halting and router rules (and a model's own exit gate on request),
    calibrated on ``calib_split``."""

    name = "adaptive"
    section = "adaptive"
    Settings = AdaptiveSettings
    order = 20

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.settings = settings

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> AdaptiveDepth | None:
        if "adaptive" not in evaluate or evaluate["adaptive"] is None:
            return None
        return cls(build_settings(AdaptiveSettings, evaluate["adaptive"], "evaluate.adaptive"))

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.adaptive.depth import adaptive_modes
        from looplm.evaluate.records import adaptive_calibration, fixed_depth_identities

        if not job.cfg.model.is_looped:  # the unshared Transformer has no recurrence to stop
            return []
        base = fixed_depth_identities(
            job.cfg,
            [self.settings.ceiling],
            dataset=job.cfg.data.dataset,
            split=job.split,
            tag=job.tag(max_tokens=job.max_tokens),
            protocol=job.protocol,
        )[0]
        out = []
        s = self.settings
        modes = adaptive_modes(
            s.rules, s.budgets, s.kl_thresholds, s.router_probs, s.gate_thresholds
        )
        for rule, ms in modes.items():
            cal = adaptive_calibration(rule, s.calib_split, s.calib_max_tokens, s.label_threshold)
            out += [{**base, "adaptive_mode": m, "calibration": cal} for m in ms]
        return out

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        from looplm.adaptive.depth import evaluate_adaptive
        from looplm.evaluate.records import adaptive_records

        res = evaluate_adaptive(
            job.model(),
            job.cfg,
            self.settings,
            split=job.split,
            max_tokens=job.max_tokens,
            batch_size=job.batch_size,
            device=job.device,
            progress=job.progress,
            want={i["adaptive_mode"] for i in todo},
        )
        tag = job.tag(max_tokens=job.max_tokens)
        return adaptive_records(res, job.cfg, tag=tag, protocol=job.protocol, extra=job.extra)
