"""The verdict engine: the vocabulary and the rule that turns a measured effect into a word,
defined once.

The SCSE paper's claims (:mod:`looplm.experiments.paper.verdicts`), the experiment grids' claims
(:mod:`looplm.experiments.findings`) and the lens study's pre-registered criteria (:mod:`looplm.lens.section`)
speak these words and judge every effect with :func:`decide` (per-seed values: :func:`judge`,
their minimum effect: :func:`claim_margin`), under one margin policy
(:data:`MARGIN_POLICY`): a difference counts as a direction only when its mean reaches the
metric's minimum effect (:func:`minimum_effect`); a smaller one is **not distinguishable**. It
lives in the results layer so that all three can (the results layer imports nothing above it).
"""

from __future__ import annotations

import math
from typing import Any

REPRODUCED = "reproduced"
IN_DIRECTION = "reproduced in direction"
BY_CONSTRUCTION = "holds by construction"
NOT_REPRODUCED = "not reproduced"
NOT_DISTINGUISHABLE = "not distinguishable"
NOT_TESTABLE = "not testable at this scale"
NOT_RUN = "not yet run"

# Each verdict word and the criterion it needs (printed with the report).
VERDICTS: dict[str, str] = {
    REPRODUCED: "the claimed sign holds at every named point and rival, the mean by at least the "
    "minimum effect, with the paired 95% t-interval over seeds excluding 0 (at least 2 seeds); a "
    "claimed tie: the interval lies within ± the minimum effect",
    IN_DIRECTION: "the mean has the claimed sign by at least the minimum effect at every named "
    "point and rival, but the 95% t-interval includes 0 at one or more; a claimed tie: the mean "
    "lies within ± the minimum effect, the interval does not",
    BY_CONSTRUCTION: "the quantity equals the claimed value exactly in every seed because the "
    "method's equations force it: a check of the implementation, not a reproduction",
    NOT_DISTINGUISHABLE: "the mean lies closer to the claimed number than the minimum effect at "
    "one or more named points: a tie at the stated margin, read as no direction",
    NOT_REPRODUCED: "the mean has the opposite sign (by at least the minimum effect where one is "
    "stated), the fixed quantity is not exactly the claimed value, or a claimed tie's mean lies "
    "outside ± the minimum effect, at one or more named points",
    NOT_TESTABLE: "this grid cannot measure the claim (the reason is stated), or fewer than 2 "
    "seeds were measured",
    NOT_RUN: "a named point has no stored rows yet",
}
# When parts disagree, the claim takes the weakest part's word, in this order.
ORDER = (NOT_RUN, NOT_TESTABLE, NOT_REPRODUCED, NOT_DISTINGUISHABLE, IN_DIRECTION, BY_CONSTRUCTION,
         REPRODUCED)  # fmt: skip


def weakest(words: list[str]) -> str:
    """The word of a claim made of parts: its weakest part's (:data:`ORDER`); no parts: not yet
    run."""
    return min(words, key=ORDER.index) if words else NOT_RUN


# The margin policy: the minimum effect a difference must reach before it is read as a direction.
POINTS = 2.0  # metrics in percent (accuracy, stability, swap success): 2 percentage points
RELATIVE = 0.02  # perplexity-like metrics and timings: 2% of the level compared against
NATS = 0.02  # losses and KL divergences in nats (≈ 2% of perplexity)
PERCENT_METRICS = frozenset({"accuracy", "min_accuracy", "stability", "lambada_acc_pct", "swap"})
RELATIVE_METRICS = frozenset({"ppl", "adaptive_ppl", "transfer_ppl_k", "lambada_ppl_k",
                              "ms_per_batch"})  # fmt: skip
NATS_METRICS = frozenset({"val_loss", "kl_excess_nll", "kl_gain"})
MARGIN_POLICY = (
    "A difference is read as a direction only when its mean reaches the metric's minimum effect: "
    f"{POINTS:g} percentage points for a metric in percent (accuracy, stability, swap success), "
    f"{100 * RELATIVE:g}% of the compared level for perplexities and timings, {NATS:g} nats for "
    "a loss or a KL divergence; a smaller mean difference is not distinguishable, whatever "
    'its interval. A claimed tie ("matches", "stable", "essentially tied") is judged '
    "against the same minimum effect: reproduced when the 95% interval lies within ± it. A "
    "threshold at a number the claim states (R_47 above 0.894, near-perfect above 98%) is judged "
    "against that number with no further margin, and so is a metric with no scale of its own "
    "(a ratio, a gain, a loop count): the stated number is the criterion."
)


def minimum_effect(metric: str, level: float | None = None) -> float:
    """The minimum effect of :data:`MARGIN_POLICY` for a difference of ``metric`` (a relative
    metric needs ``level``, the value it is compared against); 0 for a metric with no scale."""
    if metric in PERCENT_METRICS:
        return POINTS
    if metric in NATS_METRICS:
        return NATS
    if metric in RELATIVE_METRICS:
        return RELATIVE * abs(level) if level is not None and level == level else 0.0
    return 0.0


def decide(mean: float, lo: float, hi: float, sign: int, margin: float = 0.0) -> str:
    """The word for an effect (its mean and 95% interval ``[lo, hi]``) claimed to lie on side
    ``sign`` of 0 (+1 above, −1 below; 0: a claimed tie) under the minimum effect ``margin``
    (:data:`MARGIN_POLICY`)."""
    if sign == 0:
        if margin <= 0:
            return NOT_TESTABLE  # a tie with no margin cannot be told from a small difference
        if -margin < lo and hi < margin:
            return REPRODUCED
        return IN_DIRECTION if abs(mean) < margin else NOT_REPRODUCED
    if margin > 0 and abs(mean) < margin:
        return NOT_DISTINGUISHABLE
    if mean * sign <= 0:
        return NOT_REPRODUCED
    return REPRODUCED if (lo > 0 if sign > 0 else hi < 0) else IN_DIRECTION


def _interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95% t half-width (NaN below 2 values)."""
    from looplm.results.stats import t_halfwidth

    mean = sum(values) / len(values)
    return mean, t_halfwidth(values)


def _pm(mean: float, hw: float) -> str:
    """``mean ± hw`` with both to the same decimals, four significant digits of the half-width
    (so that a mean just inside or outside its interval reads so: +1.622 ± 1.624)."""
    if not hw > 0:
        return f"{mean:+.4g} ± 0"
    dec = max(0, 3 - math.floor(math.log10(hw)))
    return f"{mean:+.{dec}f} ± {hw:.{dec}f}"


def judge(values: list[float], sign: int, margin: float = 0.0) -> tuple[str, str]:
    """A verdict word for per-seed values that should lie on side ``sign`` of 0 (−1: below, +1:
    above, 0: within ± ``margin``), and the evidence text: the word of
    :func:`~looplm.results.vocabulary.decide` for their mean and 95% t-interval under the minimum
    effect ``margin`` (one value: not testable; none: not yet run)."""
    if not values:
        return NOT_RUN, "no rows"
    if len(values) < 2:
        return NOT_TESTABLE, f"{values[0]:+.4g} (1 seed: no interval)"
    mean, hw = _interval(values)
    need = f", minimum effect {margin:.3g}" if margin > 0 else ""
    text = f"{_pm(mean, hw)} (95% t half-width, {len(values)} seeds){need}"
    return decide(mean, mean - hw, mean + hw, sign, margin), text


def claim_margin(claim: dict[str, Any], level: float | None, target: float = 0.0) -> float:
    """The minimum effect a claim's difference must reach: the claim's own ``margin`` when it
    states one, none for a threshold at a stated non-zero number (the number is the criterion),
    else the metric's (:func:`~looplm.results.vocabulary.minimum_effect`, relative to ``level``)."""
    if claim.get("margin") is not None:
        return float(claim["margin"])
    change = claim.get("from_depth") is not None or claim.get("from_step") is not None
    if target != 0 and not change:
        return 0.0
    return minimum_effect(claim.get("metric", "ppl"), level)
