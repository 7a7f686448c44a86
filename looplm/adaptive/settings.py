"""The settings of adaptive depth, one dataclass read by ``looplm adaptive``, the ``adaptive``
sweep kind and :func:`looplm.adaptive.depth.evaluate_adaptive` alike (:mod:`looplm.settings.options`
makes the command line from it). Light on purpose (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.device import DEVICES
from looplm.model.halting_rules import RuleNames
from looplm.settings import setting

# the stopping rules (:mod:`looplm.model.halting_rules`): maxtoken, kl, gate, router
RULES = RuleNames(evaluation=True)
DEFAULT_RULES = ("maxtoken", "kl", "router")  # gate: only models with a learned exit gate (Ouro)
DEFAULT_CEILING = 48  # the loop ceiling C
DEFAULT_BUDGETS = (8, 16, 24)  # maxtoken: calibrated mean depths
DEFAULT_KL_THRESHOLDS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3)  # kl: halting thresholds
DEFAULT_ROUTER_PROBS = (0.5, 0.7, 0.9)  # router: probability thresholds
DEFAULT_GATE_THRESHOLDS = (0.5, 0.9)  # gate: cumulative exit probability thresholds
DEFAULT_LABEL_THRESHOLD = 1e-2  # router: KL under which a token counts as converged
MAX_CEILING = 4096  # soft cap: a ceiling costs up to C block applications per token


@dataclass
class AdaptiveSettings:
    """Adaptive depth under a loop ceiling: which rules, their settings, calibration, timing."""

    # the loop ceiling (the rows' depth)
    ceiling: int = setting(DEFAULT_CEILING, lo=1, loops=True, what="the loop ceiling C")
    # stopping rules: maxtoken, kl, router; gate (the model's own exit gate: Ouro) on request
    rules: list[str] = setting(list(DEFAULT_RULES), choices=RULES)
    # maxtoken: mean depths the threshold is calibrated to
    budgets: list[float] = setting(list(DEFAULT_BUDGETS), lo=1, cap=MAX_CEILING)
    # kl: halting thresholds
    kl_thresholds: list[float] = setting(list(DEFAULT_KL_THRESHOLDS), lo=0)
    # router: halt when P(converged) >= p
    router_probs: list[float] = setting(list(DEFAULT_ROUTER_PROBS), lo=0, hi=1)
    # gate: halt when the exit gate's cumulative exit probability reaches each of these
    gate_thresholds: list[float] = setting(list(DEFAULT_GATE_THRESHOLDS), lo=0, hi=1)
    # router: KL under which a token counts as converged (its label)
    label_threshold: float = setting(DEFAULT_LABEL_THRESHOLD, lo=0)
    calib_split: str = "validation"  # split the max-token rule and the router are calibrated on
    # cap on calibration tokens; null: the whole split
    calib_max_tokens: int | None = setting(None, lo=1)
    # uniform fixed depths timed for comparison
    timing_depths: list[int] = setting([], lo=1, loops=True)
    # wall clock = the minimum over this many passes
    timing_repeats: int = setting(1, lo=1, cap=1000)
    time_dense: bool = False  # per-token rules: also time the path without work skipping
    skip: bool = True  # per-token rules: skip the work of halted tokens


@dataclass
class AdaptiveInputs:
    """``looplm adaptive``: what it evaluates on and where the rows go."""

    dataset: str | None = None  # evaluate on another corpus (default: the run's)
    split: str = "test"  # evaluation split
    data_dir: str | None = None  # folder with local corpora
    max_tokens: int | None = setting(None, lo=1)  # cap on evaluated tokens
    batch_size: int | None = setting(None, lo=1, hi=65_536)  # default: the run's eval batch size
    device: str = setting("auto", choices=DEVICES)  # auto | cpu | cuda
    store: str | None = None  # results store (.sqlite) to write the rows into
    tag: str = ""  # evaluation tag (part of the evaluation identity)
    protocol: str | None = None  # training-protocol name (default: <train dataset>-<steps>)
    out: str | None = None  # also write the JSON here (atomically)
