"""Adaptive depth under a loop ceiling (:mod:`looplm.evaluate.adaptive`): one row per rule
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

from dataclasses import dataclass, field
from typing import Any

from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, check_settings, register_kind


def _default(name: str) -> Any:
    """A default of :mod:`looplm.evaluate.adaptive` (imported when asked for: it needs torch)."""

    def make() -> Any:
        from looplm.evaluate import adaptive

        return list(getattr(adaptive, name))

    return field(default_factory=make)


@dataclass
class AdaptiveSettings:
    """``evaluate.adaptive``."""

    ceiling: int = 48  # the loop ceiling (the rows' depth)
    rules: list[str] = _default("RULES")  # stopping rules: maxtoken, kl, router
    # maxtoken: mean depths the threshold is calibrated to
    budgets: list[float] = _default("DEFAULT_BUDGETS")
    kl_thresholds: list[float] = _default("DEFAULT_KL_THRESHOLDS")  # kl: halting thresholds
    router_probs: list[float] = _default("DEFAULT_ROUTER_PROBS")  # router: probability thresholds
    label_threshold: float = 0.01  # router: KL under which a token counts as converged (its label)
    calib_split: str = "validation"  # split the max-token rule and the router are calibrated on
    calib_max_tokens: int | None = None  # cap on calibration tokens; null: the whole split
    # uniform fixed depths timed for comparison
    timing_depths: list[int] = field(default_factory=list)
    timing_repeats: int = 1  # wall clock = the minimum over this many passes
    time_dense: bool = False  # per-token rules: also time the path without work skipping
    skip: bool = True  # per-token rules: skip the work of halted tokens


@register_kind
class AdaptiveDepth(EvaluationKind):
    """The max-token, KL-halting and router rules, calibrated on ``calib_split``."""

    name = "adaptive"
    section = "adaptive"
    Settings = AdaptiveSettings
    order = 20

    def __init__(self, settings: dict[str, Any]) -> None:
        from looplm.evaluate import adaptive as ad

        a = settings
        self.rules = a.get("rules", list(ad.RULES))
        self.ceiling = int(a.get("ceiling", ad.DEFAULT_CEILING))
        self.values = {
            "budgets": a.get("budgets", list(ad.DEFAULT_BUDGETS)),
            "kl_thresholds": a.get("kl_thresholds", list(ad.DEFAULT_KL_THRESHOLDS)),
            "router_probs": a.get("router_probs", list(ad.DEFAULT_ROUTER_PROBS)),
        }
        self.label = float(a.get("label_threshold", ad.DEFAULT_LABEL_THRESHOLD))
        self.calib_split = a.get("calib_split", "validation")
        self.calib_cap = a.get("calib_max_tokens")
        self.timing = {
            "skip": bool(a.get("skip", True)),
            "timing_depths": a.get("timing_depths", []),
            "timing_repeats": int(a.get("timing_repeats", 1)),
            "time_dense": bool(a.get("time_dense", False)),
        }

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> AdaptiveDepth | None:
        if "adaptive" not in evaluate or evaluate["adaptive"] is None:
            return None
        return cls(
            dict(check_settings(AdaptiveSettings, evaluate["adaptive"], "evaluate.adaptive"))
        )

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.evaluate.adaptive import adaptive_modes
        from looplm.evaluate.records import adaptive_calibration, fixed_depth_identities

        if not job.cfg.model.is_looped:  # the unshared Transformer has no recurrence to stop
            return []
        base = fixed_depth_identities(
            job.cfg,
            [self.ceiling],
            dataset=job.cfg.data.dataset,
            split=job.split,
            tag=job.tag(max_tokens=job.max_tokens),
            protocol=job.protocol,
        )[0]
        out = []
        modes = adaptive_modes(self.rules, **self.values)
        for rule, ms in modes.items():
            cal = adaptive_calibration(rule, self.calib_split, self.calib_cap, self.label)
            out += [{**base, "adaptive_mode": m, "calibration": cal} for m in ms]
        return out

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        from looplm.evaluate.adaptive import evaluate_adaptive
        from looplm.evaluate.records import adaptive_records

        res = evaluate_adaptive(
            job.model(),
            job.cfg,
            rules=self.rules,
            ceiling=self.ceiling,
            label_threshold=self.label,
            split=job.split,
            calib_split=self.calib_split,
            max_tokens=job.max_tokens,
            calib_max_tokens=self.calib_cap,
            batch_size=job.batch_size,
            device=job.device,
            progress=job.progress,
            want={i["adaptive_mode"] for i in todo},
            **self.timing,
            **self.values,
        )
        tag = job.tag(max_tokens=job.max_tokens)
        return adaptive_records(res, job.cfg, tag=tag, protocol=job.protocol, extra=job.extra)
