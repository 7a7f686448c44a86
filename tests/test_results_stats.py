"""Aggregation and paired statistics against numbers computed independently in the test."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from looplm.errors import LoopLMError
from looplm.results.stats import (
    DEFAULT_SEEDS,
    EXPANDED_SEEDS,
    NLLAccumulator,
    check_seed_set,
    paired_bootstrap_ci,
    paired_deltas,
    resolve_seed_set,
    summarize,
    t_halfwidth,
    token_weighted_ppl,
)
from looplm.results.store import EvalRecord

# Two-sided 95 % Student-t critical values from a printed table (df = 2, 4).
T975_DF2 = 4.302652730
T975_DF4 = 2.776445105


def rec(ppl: float, seed: int, *, method: str = "scse", depth: int = 8, n: int = 1000, **kw):
    """A record whose token-weighted PPL is exactly ``ppl`` (up to float rounding)."""
    return EvalRecord(
        method=method, depth=depth, seed=seed, n_tokens=n, sum_nll=math.log(ppl) * n, **kw
    )


# ----------------------------------------------------------------------------- token weighting
def test_token_weighted_ppl_is_not_the_mean_of_batch_ppls():
    # batch A: 10 tokens with mean NLL 2.0; batch B: 1000 tokens with mean NLL 3.0
    sums, counts = [20.0, 3000.0], [10, 1000]
    expected = math.exp(3020.0 / 1010.0)  # = exp(2.990099...) = 19.8876...
    assert token_weighted_ppl(sums, counts) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(19.8876, abs=1e-3)
    mean_of_batch_ppls = (math.exp(2.0) + math.exp(3.0)) / 2  # 13.737...: the wrong way
    exp_of_mean_batch_nll = math.exp(2.5)  # 12.18...: also wrong
    assert abs(token_weighted_ppl(sums, counts) - mean_of_batch_ppls) > 6.0
    assert abs(token_weighted_ppl(sums, counts) - exp_of_mean_batch_nll) > 7.0

    acc = NLLAccumulator()
    acc.add_mean(2.0, 10)
    acc.add(3000.0, 1000)
    assert acc.n_tokens == 1010
    assert acc.ppl == pytest.approx(expected, rel=1e-12)
    # The stored record carries the totals, and its PPL is the token-weighted one.
    r = EvalRecord(method="scse", depth=8, seed=0, n_tokens=acc.n_tokens, sum_nll=acc.sum_nll)
    assert r.ppl == pytest.approx(expected, rel=1e-12)


def test_token_weighted_ppl_rejects_bad_input():
    with pytest.raises(LoopLMError):
        token_weighted_ppl([1.0], [1, 2])
    with pytest.raises(LoopLMError):
        token_weighted_ppl([0.0], [0])
    assert math.isnan(NLLAccumulator().ppl)


# ----------------------------------------------------------------------------- summaries
def test_summary_mean_and_sample_std_over_seeds():
    s = summarize([rec(100.0, 0), rec(102.0, 1), rec(107.0, 2)])
    assert s.mean == pytest.approx(103.0, abs=1e-9)
    # sample std (ddof = 1): sqrt((9 + 1 + 16) / 2) = sqrt(13)
    assert s.std == pytest.approx(math.sqrt(13.0), abs=1e-9)
    assert abs(s.std - math.sqrt(26.0 / 3.0)) > 0.5  # not the population std
    assert s.n == 3 and s.seeds == (0, 1, 2) and s.complete
    assert s.values == pytest.approx((100.0, 102.0, 107.0))


def test_summary_uses_only_the_required_seed_set():
    recs = [rec(100.0 + 10 * s, s) for s in range(5)]
    s3 = summarize(recs, required_seeds="default")
    assert s3.seeds == (0, 1, 2) and s3.ignored == (3, 4)
    assert s3.mean == pytest.approx(110.0)
    s5 = summarize(recs, required_seeds="expanded")
    assert s5.seeds == EXPANDED_SEEDS and s5.mean == pytest.approx(120.0)
    # auto: expanded when all five are present, else the default three
    assert summarize(recs, required_seeds="auto").n == 5
    assert summarize(recs[:4], required_seeds="auto").seeds == DEFAULT_SEEDS
    assert summarize(recs, required_seeds=[1, 3]).mean == pytest.approx(120.0)


def test_integrity_missing_and_duplicate_seeds():
    with pytest.raises(LoopLMError, match=r"missing seed\(s\) \[2\]"):
        summarize([rec(100.0, 0), rec(101.0, 1)])
    with pytest.raises(LoopLMError, match=r"missing seed\(s\) \[3, 4\]"):
        summarize([rec(100.0, s) for s in range(3)], required_seeds="expanded")
    dup = [rec(100.0, 0), rec(101.0, 1), rec(102.0, 1), rec(103.0, 2)]
    with pytest.raises(LoopLMError, match=r"duplicate evaluation\(s\) for seed\(s\) \[1\]"):
        summarize(dup)
    # "mark" instead of raising: duplicated seeds are never used
    s = summarize(dup, on_incomplete="mark")
    assert not s.complete and s.duplicates == (1,) and s.seeds == (0, 2)
    assert s.mean == pytest.approx(101.5)
    s = summarize([rec(100.0, 0)], on_incomplete="mark")
    assert s.missing == (1, 2) and s.n == 1 and math.isnan(s.std)
    check = check_seed_set([0, 1, 1, 5], [0, 1, 2], on_incomplete="mark")
    assert check.missing == (2,) and check.duplicates == (1,) and check.ignored == (5,)


def test_summary_refuses_mixed_evaluations_and_bad_seed_specs():
    with pytest.raises(LoopLMError, match="depth"):
        summarize([rec(100.0, 0), rec(101.0, 1, depth=16), rec(102.0, 2)])
    with pytest.raises(LoopLMError, match="unknown seed set"):
        resolve_seed_set("five")
    with pytest.raises(LoopLMError, match="more than once"):
        resolve_seed_set([0, 1, 1])
    with pytest.raises(LoopLMError, match="unknown metric"):
        summarize([rec(100.0, s) for s in range(3)], "bleu")


def test_accuracy_and_mean_depth_metrics():
    recs = [
        rec(100.0, s, extra={"n_correct": c, "n_examples": 200, "mean_depth": d})
        for s, c, d in ((0, 20, 8.1), (1, 30, 7.9), (2, 40, 8.3))
    ]
    acc = summarize(recs, "accuracy")
    assert acc.mean == pytest.approx(0.15) and acc.std == pytest.approx(0.05)
    assert summarize(recs, "mean_depth").mean == pytest.approx(8.1)
    with pytest.raises(LoopLMError, match="n_correct"):
        summarize([rec(100.0, s) for s in range(3)], "accuracy")


# ----------------------------------------------------------------------------- intervals
def test_t_halfwidth_matches_hand_computation():
    deltas = [-1.5, -2.0, -1.9]  # mean -1.8, sd = sqrt(0.14 / 2)
    sd = math.sqrt(((0.3) ** 2 + (0.2) ** 2 + (0.1) ** 2) / 2)
    assert t_halfwidth(deltas) == pytest.approx(T975_DF2 * sd / math.sqrt(3), rel=1e-8)
    five = [1.0, 2.0, 3.0, 4.0, 5.0]  # sd = sqrt(2.5)
    assert t_halfwidth(five) == pytest.approx(T975_DF4 * math.sqrt(2.5) / math.sqrt(5), rel=1e-8)
    assert math.isnan(t_halfwidth([1.0]))


def _manual_percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolation percentile written out by hand (numpy's default method)."""
    pos = q / 100.0 * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (pos - lo) * (sorted_vals[hi] - sorted_vals[lo])


def test_bootstrap_matches_an_independent_loop():
    deltas = [-1.49, -2.13, -1.80, -1.62, -1.96]
    lo, hi = paired_bootstrap_ci(deltas, n_boot=10_000, seed=0)
    # independent implementation of the documented scheme: same index draws, plain loops
    idx = np.random.default_rng(0).integers(0, len(deltas), size=(10_000, len(deltas)))
    means = sorted(sum(deltas[j] for j in row) / len(row) for row in idx.tolist())
    assert lo == pytest.approx(_manual_percentile(means, 2.5), abs=1e-12)
    assert hi == pytest.approx(_manual_percentile(means, 97.5), abs=1e-12)
    # deterministic, and seed-dependent
    assert paired_bootstrap_ci(deltas, seed=0) == (lo, hi)
    assert paired_bootstrap_ci(deltas, seed=1) != (lo, hi)
    # a fully independent bootstrap (Python's RNG, one resample at a time) agrees closely
    rnd = random.Random(12345)
    alt = sorted(sum(rnd.choice(deltas) for _ in deltas) / len(deltas) for _ in range(20_000))
    assert lo == pytest.approx(_manual_percentile(alt, 2.5), abs=0.03)
    assert hi == pytest.approx(_manual_percentile(alt, 97.5), abs=0.03)
    assert min(deltas) <= lo < hi <= max(deltas)
    # configurable resamples / confidence
    lo90, hi90 = paired_bootstrap_ci(deltas, n_boot=2000, seed=0, confidence=0.9)
    assert lo <= lo90 + 0.05 and hi90 <= hi + 0.05
    assert all(math.isnan(x) for x in paired_bootstrap_ci([1.0]))


# ----------------------------------------------------------------------------- paired deltas
def test_paired_deltas_match_by_seed_and_depth():
    a_ppl = {0: 97.0, 1: 96.5, 2: 97.4, 3: 96.9}  # the reference (e.g. scse)
    b_ppl = {1: 98.0, 2: 99.9, 3: 98.1, 4: 50.0}  # seed 4 has no partner
    a = [rec(v, s, method="scse") for s, v in a_ppl.items()]
    a += [rec(120.0, 0, method="scse", depth=48)]  # depth only on one side: no delta
    b = [rec(v, s, method="tuned_adapter") for s, v in b_ppl.items()]
    (pd,) = paired_deltas(a, b, n_boot=10_000, boot_seed=0)
    assert pd.depth == 8 and pd.seeds == (1, 2, 3) and pd.n == 3
    assert pd.a_only_seeds == (0,) and pd.b_only_seeds == (4,)
    hand = [96.5 - 98.0, 97.4 - 99.9, 96.9 - 98.1]  # -1.5, -2.5, -1.2
    assert pd.deltas == pytest.approx(hand, abs=1e-9)
    assert pd.mean == pytest.approx(sum(hand) / 3, abs=1e-9)
    sd = math.sqrt(sum((x - sum(hand) / 3) ** 2 for x in hand) / 2)
    assert pd.std == pytest.approx(sd, abs=1e-9)
    assert pd.t_halfwidth == pytest.approx(T975_DF2 * sd / math.sqrt(3), rel=1e-7)
    assert (pd.boot_lo, pd.boot_hi) == paired_bootstrap_ci(pd.deltas, n_boot=10_000, seed=0)
    # restricting to a seed set
    (pd2,) = paired_deltas(a, b, seeds=[1, 2])
    assert pd2.seeds == (1, 2)


def test_paired_deltas_reject_duplicates_and_mixed_sides():
    a = [rec(97.0, 0), rec(97.5, 0, eval_tag="x")]
    with pytest.raises(LoopLMError, match="eval_tag"):
        paired_deltas(a, [rec(98.0, 0, method="b")])
    dup = [rec(97.0, 0), rec(97.2, 0)]
    with pytest.raises(LoopLMError, match="duplicate"):
        paired_deltas(dup, [rec(98.0, 0, method="b")])
