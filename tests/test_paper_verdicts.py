"""Verdicts computed from stored rows (looplm.experiments.paper.verdicts): each word's criterion, the
combination of parts, the claim schema's one-line errors, and every entry's claims load."""

from __future__ import annotations

import pytest

from looplm.errors import LoopLMError
from looplm.experiments import paper
from looplm.experiments.paper import verdicts as V


class Measured:
    """An entry's measured rows, as the report reads them: fixed-depth PPL per seed and
    diagnostics ``extra`` per seed."""

    def __init__(self, fixed: dict[tuple[str, int], dict[int, float]], diag=None) -> None:
        self._fixed, self._diag = fixed, diag or {}

    def fixed(self, method, scale, depth):
        return dict(self._fixed.get((method, depth), {}))

    def diagnostics(self, method, scale):
        return dict(self._diag.get(method, {}))


def ordering(**kw):
    base = {"text": "a beats b", "test": "ordering", "method": "a", "than": ["b"], "depths": [8]}
    return V.check_claim({**base, **kw}, "claim")


def test_an_ordering_is_reproduced_only_when_the_interval_excludes_zero() -> None:
    b = {0: 10.0, 1: 11.0, 2: 12.0}
    clear = Measured({("a", 8): {0: 9.0, 1: 10.1, 2: 10.9}, ("b", 8): b})  # Δ = −1, −.9, −1.1
    noisy = Measured({("a", 8): {0: 7.0, 1: 11.5, 2: 11.9}, ("b", 8): b})  # Δ = −3, +.5, −.1
    wrong = Measured({("a", 8): {0: 10.5, 1: 11.2, 2: 12.4}, ("b", 8): b})  # Δ > 0
    assert V.claim_verdict(ordering(), clear).word == V.REPRODUCED
    assert V.claim_verdict(ordering(), noisy).word == V.IN_DIRECTION
    assert V.claim_verdict(ordering(), wrong).word == V.NOT_REPRODUCED
    # "higher is better" flips the side
    assert V.claim_verdict(ordering(better="higher"), wrong).word == V.IN_DIRECTION
    v = V.claim_verdict(ordering(), clear)
    assert (
        "a − b T=8: -1.0000 ± 0.2484 " in v.evidence[0]
        and "(95% t half-width, 3 seeds)" in v.evidence[0]
    )


def test_every_depth_and_rival_must_pass_and_missing_rows_say_not_yet_run() -> None:
    b = {0: 10.0, 1: 11.0, 2: 12.0}
    rows = {("a", 8): {0: 9.0, 1: 10.1, 2: 10.9}, ("b", 8): b,
            ("a", 48): {0: 10.5, 1: 11.2, 2: 12.4}, ("b", 48): b}  # fmt: skip
    m = Measured(rows)
    assert V.claim_verdict(ordering(depths=[8, 48]), m).word == V.NOT_REPRODUCED
    assert V.claim_verdict(ordering(depths=[8, 24]), m).word == V.NOT_RUN
    assert V.claim_verdict(ordering(than=["b", "c"]), m).word == V.NOT_RUN
    one_seed = Measured({("a", 8): {0: 9.0}, ("b", 8): {0: 10.0}})
    assert V.claim_verdict(ordering(), one_seed).word == V.NOT_TESTABLE


def test_thresholds_and_construction_checks() -> None:
    diag = {"scse": {s: {"R_per_step": [0.0, 0.0], "gain_per_step": [1.2, g]}
                     for s, g in ((0, 0.99990), (1, 0.99997), (2, 0.99999))},
            "looped": {s: {"R_per_step": [1.0, r]} for s, r in ((0, 100.0), (1, 2e-9))}}  # fmt: skip
    m = Measured({}, diag)
    gain = {"text": "late gain above 1", "test": "threshold", "method": "scse",
            "metric": "gain", "steps": [1], "op": ">", "value": 1.0}  # fmt: skip
    assert V.claim_verdict(V.check_claim(gain, "c"), m).word == V.NOT_REPRODUCED
    # below 1 on average, but 3 seeds' 95% interval reaches above 1: only the direction holds
    assert V.claim_verdict(V.check_claim({**gain, "op": "<"}, "c"), m).word == V.IN_DIRECTION
    assert V.claim_verdict(V.check_claim({**gain, "value": 0.9}, "c"), m).word == V.REPRODUCED
    zero = {"text": "R is 0", "test": "construction", "method": "scse", "metric": "R",
            "steps": [0, 1], "equals": 0}  # fmt: skip
    assert V.claim_verdict(V.check_claim(zero, "c"), m).word == V.BY_CONSTRUCTION
    # a single non-zero seed (even a tiny one) is not "by construction"
    looped = V.check_claim({**zero, "method": "looped", "steps": [1]}, "c")
    assert V.claim_verdict(looped, m).word == V.NOT_REPRODUCED
    # the weakest part decides: by construction + reproduced → by construction
    both = V.check_claim({**zero, "steps": [0]}, "c")
    assert V._combine([V.REPRODUCED, V.BY_CONSTRUCTION]) == V.BY_CONSTRUCTION
    assert V.claim_verdict(both, m).word == V.BY_CONSTRUCTION
    why = V.check_claim({"text": "latency", "test": "untestable", "reason": "a GPU timing"}, "c")
    v = V.claim_verdict(why, m)
    assert v.word == V.NOT_TESTABLE and v.evidence == ["a GPU timing"]


@pytest.mark.parametrize(
    "claim, message",
    [
        ({"text": "x", "test": "guess"}, "claim.test='guess'; allowed: ordering"),
        ({"test": "ordering", "method": "a", "than": ["b"], "depths": [8]}, "needs a text"),
        ({"text": "x", "test": "ordering", "method": "a", "depths": [8]}, "needs than"),
        ({"text": "x", "test": "ordering", "method": "a", "than": ["b"]}, "needs the points"),
        ({"text": "x", "test": "threshold", "method": "a", "steps": [1]}, "needs op"),
        ({"text": "x", "test": "construction", "method": "a", "steps": [1]}, "needs equals"),
        ({"text": "x", "test": "untestable"}, "needs a reason"),
        (
            {
                "text": "x",
                "test": "ordering",
                "method": "a",
                "than": ["b"],
                "depths": [8],
                "scale": "7b",
            },
            "claim.scale='7b'; allowed: 22m",
        ),  # fmt: skip
        ({"text": "x", "test": "untestable", "reason": "r", "colour": 1}, "colour"),
    ],
)
def test_bad_claims_are_one_line_errors(claim, message) -> None:
    with pytest.raises(LoopLMError, match=message.replace("(", r"\(").replace("[", r"\[")):
        V.check_claim(claim, "claim")


def test_every_word_has_a_criterion_and_the_tier_names_match_the_catalogue() -> None:
    from looplm.experiments.paper.metrics import TIER_NAMES

    assert set(V.VERDICTS) == set(V._ORDER)
    assert all(len(c) > 30 for c in V.VERDICTS.values())
    assert tuple(paper.TIERS) == TIER_NAMES


def test_every_catalogue_claim_loads() -> None:
    entries = paper.catalogue()
    claims = [c for e in entries for c in e.claims]
    assert claims, "the catalogue states its claims as data"
    for e in entries:
        for c in e.claims:
            assert c["test"] in V.TESTS, (e.id, c)


def test_verdict_table_escapes_and_names_each_claim() -> None:
    m = Measured({("a", 8): {0: 9.0, 1: 10.1, 2: 10.9}, ("b", 8): {0: 10.0, 1: 11.0, 2: 12.0}})
    rows = V.verdict_table([ordering(text="a | b")], m)
    assert rows[2].startswith("| a \\| b | **reproduced** | a − b T=8: ")


def test_a_difference_below_the_minimum_effect_is_not_a_direction() -> None:
    """The one margin policy: a PPL ordering needs a mean difference of at least 2% of the
    rival's level; the old rule called a 0.1-PPL lead at PPL 11 with an interval excluding 0
    reproduced."""
    b = {0: 10.0, 1: 11.0, 2: 12.0}
    tiny = Measured({("a", 8): {0: 9.9, 1: 10.89, 2: 11.9}, ("b", 8): b})  # Δ ≈ −0.1, tight
    v = V.claim_verdict(ordering(), tiny)
    assert v.word == V.NOT_DISTINGUISHABLE and "minimum effect 0.22" in v.evidence[0], v.evidence
    # the claim may state its own margin (here none at all): the old reading comes back
    assert V.claim_verdict(ordering(margin=0), tiny).word == V.REPRODUCED
    # a claimed tie (op ~): within ± the minimum effect
    assert V.claim_verdict(ordering(op="~"), tiny).word == V.REPRODUCED
    far = Measured({("a", 8): {0: 9.0, 1: 10.1, 2: 10.9}, ("b", 8): b})
    assert V.claim_verdict(ordering(op="~"), far).word == V.NOT_REPRODUCED
    with pytest.raises(LoopLMError, match=r"claim.op='>'; an ordering allows only ~"):
        ordering(op=">")


def test_a_threshold_on_a_change_needs_the_minimum_effect_a_stated_number_does_not() -> None:
    """A change ("PPL falls from T = 1 to 8", op < 0) is a difference; R_47 above 0.894 is judged
    against the paper's number alone."""
    fall = {"text": "falls", "test": "threshold", "method": "a", "metric": "ppl",
            "depths": [8], "from_depth": 1, "op": "<", "value": 0}  # fmt: skip
    t1 = {0: 400.0, 1: 410.0, 2: 390.0}
    small = Measured({("a", 1): t1, ("a", 8): {0: 396.0, 1: 405.0, 2: 387.0}})  # −1%
    assert V.claim_verdict(V.check_claim(fall, "c"), small).word == V.NOT_DISTINGUISHABLE
    big = Measured({("a", 1): t1, ("a", 8): {0: 380.0, 1: 390.0, 2: 371.0}})  # −5%
    assert V.claim_verdict(V.check_claim(fall, "c"), big).word == V.REPRODUCED
    stated = {**fall, "value": 399.0}
    del stated["from_depth"]
    close = Measured({("a", 8): {0: 396.5, 1: 397.0, 2: 397.5}})  # 2 below 399: no margin asked
    assert V.claim_verdict(V.check_claim(stated, "c"), close).word == V.REPRODUCED


def test_decide_is_the_one_rule_and_the_policy_names_its_margins() -> None:
    from looplm.results import vocabulary as voc

    assert voc.decide(0.5, 0.2, 0.8, +1, margin=0.0) == voc.REPRODUCED
    assert voc.decide(0.5, 0.2, 0.8, +1, margin=1.0) == voc.NOT_DISTINGUISHABLE
    assert voc.decide(-1.5, -2.0, -1.0, +1, margin=1.0) == voc.NOT_REPRODUCED
    assert voc.decide(1.5, -0.5, 3.5, +1, margin=1.0) == voc.IN_DIRECTION
    assert voc.decide(0.1, -0.5, 0.7, 0, margin=1.0) == voc.REPRODUCED
    assert voc.decide(0.1, -0.5, 0.7, 0, margin=0.0) == voc.NOT_TESTABLE
    assert voc.minimum_effect("accuracy") == 2.0 and voc.minimum_effect("ppl", 300.0) == 6.0
    assert voc.minimum_effect("kl_gain") == 0.02 and voc.minimum_effect("gain") == 0.0
    for number in ("2 percentage points", "2% of the compared level", "0.02 nats"):
        assert number in voc.MARGIN_POLICY
