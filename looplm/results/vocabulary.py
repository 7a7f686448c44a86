"""The verdict vocabulary, defined once: each word with the criterion it needs.

The SCSE paper's claims (:mod:`looplm.experiments.paper.verdicts`) and the lens study's pre-registered
criteria (:mod:`looplm.lens.section`) speak these words; it lives in the results layer so that
both can (the results layer imports nothing above it).
"""

from __future__ import annotations

REPRODUCED = "reproduced"
IN_DIRECTION = "reproduced in direction"
BY_CONSTRUCTION = "holds by construction"
NOT_REPRODUCED = "not reproduced"
NOT_TESTABLE = "not testable at this scale"
NOT_RUN = "not yet run"

# Each verdict word and the criterion it needs (printed with the report).
VERDICTS: dict[str, str] = {
    REPRODUCED: "the claimed sign holds at every named point and rival with the paired 95% "
    "t-interval over seeds excluding 0 (at least 2 seeds)",
    IN_DIRECTION: "the mean has the claimed sign at every named point and rival, but the 95% "
    "t-interval includes 0 at one or more",
    BY_CONSTRUCTION: "the quantity equals the claimed value exactly in every seed because the "
    "method's equations force it: a check of the implementation, not a reproduction",
    NOT_REPRODUCED: "the mean has the opposite sign (or the fixed quantity is not exactly the "
    "claimed value) at one or more named points",
    NOT_TESTABLE: "this grid cannot measure the claim (the reason is stated), or fewer than 2 "
    "seeds were measured",
    NOT_RUN: "a named point has no stored rows yet",
}
# When parts disagree, the claim takes the weakest part's word, in this order.
ORDER = (NOT_RUN, NOT_TESTABLE, NOT_REPRODUCED, IN_DIRECTION, BY_CONSTRUCTION, REPRODUCED)


def weakest(words: list[str]) -> str:
    """The word of a claim made of parts: its weakest part's (:data:`ORDER`); no parts: not yet
    run."""
    return min(words, key=ORDER.index) if words else NOT_RUN
