"""Aggregation and paired statistics exactly as the SCSE paper states them.

Paper, "Seed Protocol and Aggregation":

1. **Token-weighted PPL.** Within one evaluation (one seed), PPL = exp(Σ NLL / Σ tokens) over all
   batches — *not* the mean of per-batch PPLs, and not exp of the mean of per-batch mean NLLs
   (both are wrong when batches hold different numbers of tokens). :class:`NLLAccumulator` does
   the accounting for evaluation code; a stored :class:`~looplm.results.store.EvalRecord` holds the
   totals.
2. **Over seeds:** mean ± *sample* standard deviation (ddof = 1) across the required seed set.
3. **Integrity:** a summary must use the required seed set — the default three seeds
   (:data:`DEFAULT_SEEDS`) or the expanded five (:data:`EXPANDED_SEEDS`), or any list you pass —
   and must not count one seed twice. Violations raise :class:`~looplm.errors.LoopLMError` naming
   the missing / duplicate seeds, or (``on_incomplete="mark"``) give a summary marked incomplete.
4. **Paired deltas** ``a − b`` are matched by seed *and* loop depth (only seeds present in both);
   each is reported with a small-sample 95 % t half-width ``t.ppf(0.975, n−1)·sd/√n`` and a
   deterministic paired-bootstrap percentile interval (10,000 resamples, fixed seed).

The bootstrap resamples *seeds* (pairs) with replacement. It is deterministic and documented so
anyone can reproduce it: ``idx = numpy.random.default_rng(boot_seed).integers(0, n, size=(n_boot,
n))``, resample means ``deltas[idx].mean(axis=1)``, interval = ``numpy.percentile`` (linear
interpolation) at ``100·(1−c)/2`` and ``100·(1+c)/2``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.results.store import IDENTITY_FIELDS, EvalRecord

#: The default stochastic replication set (broad sweeps).
DEFAULT_SEEDS: tuple[int, ...] = (0, 1, 2)
#: The expanded replication set (primary direct comparisons).
EXPANDED_SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4)
SEED_SET_NAMES = ("default", "expanded", "auto", "all")

SeedSpec = str | Sequence[int] | None


# --------------------------------------------------------------------------- token weighting
class NLLAccumulator:
    """Token-weighted NLL accounting over batches of unequal size.

    Add each batch's *sum* of token NLLs and its token count; ``ppl`` is
    ``exp(Σ sum_nll / Σ n_tokens)``. Works with Python floats (call ``.item()`` on tensors).
    """

    def __init__(self) -> None:
        self._parts: list[float] = []
        self.n_tokens = 0

    def add(self, sum_nll: float, n_tokens: int) -> None:
        """Add one batch: the sum of its token NLLs (nats) and how many tokens were scored."""
        n_tokens = int(n_tokens)
        sum_nll = float(sum_nll)
        if n_tokens < 0 or not math.isfinite(sum_nll):
            raise LoopLMError(f"bad batch: sum_nll={sum_nll!r}, n_tokens={n_tokens!r}")
        self._parts.append(sum_nll)
        self.n_tokens += n_tokens

    def add_mean(self, mean_nll: float, n_tokens: int) -> None:
        """Add one batch given its *mean* token NLL (weighted by its token count)."""
        self.add(float(mean_nll) * int(n_tokens), n_tokens)

    @property
    def sum_nll(self) -> float:
        """Σ NLL over all batches (math.fsum: exact rounding)."""
        return math.fsum(self._parts)

    @property
    def mean_nll(self) -> float:
        """Token-weighted mean NLL; NaN before any token."""
        return self.sum_nll / self.n_tokens if self.n_tokens else math.nan

    @property
    def ppl(self) -> float:
        """``exp(Σ NLL / Σ tokens)``; NaN before any token."""
        return math.exp(self.mean_nll) if self.n_tokens else math.nan


def token_weighted_ppl(batch_sum_nll: Sequence[float], batch_n_tokens: Sequence[int]) -> float:
    """``exp(Σ sum_nll / Σ n_tokens)`` over batches (the paper's PPL)."""
    if len(batch_sum_nll) != len(batch_n_tokens):
        raise LoopLMError(
            f"token_weighted_ppl: {len(batch_sum_nll)} NLL sums but {len(batch_n_tokens)} counts"
        )
    acc = NLLAccumulator()
    for s, n in zip(batch_sum_nll, batch_n_tokens):
        acc.add(s, n)
    if acc.n_tokens == 0:
        raise LoopLMError("token_weighted_ppl: no tokens")
    return acc.ppl


# --------------------------------------------------------------------------- metrics
def _metric_ppl(rec: EvalRecord) -> float:
    if rec.n_tokens <= 0:
        raise LoopLMError(f"cannot compute PPL: record {_label(rec)} has n_tokens=0")
    return rec.ppl


def _metric_nll(rec: EvalRecord) -> float:
    if rec.n_tokens <= 0:
        raise LoopLMError(f"cannot compute NLL: record {_label(rec)} has n_tokens=0")
    return rec.mean_nll


def _metric_accuracy(rec: EvalRecord) -> float:
    try:
        n_correct, n_examples = rec.extra["n_correct"], rec.extra["n_examples"]
    except KeyError:
        raise LoopLMError(
            f"record {_label(rec)} has no accuracy: extra needs 'n_correct' and 'n_examples'"
        ) from None
    if not n_examples:
        raise LoopLMError(f"record {_label(rec)} has n_examples=0")
    return float(n_correct) / float(n_examples)


def _metric_mean_depth(rec: EvalRecord) -> float:
    if "mean_depth" in rec.extra:
        return float(rec.extra["mean_depth"])
    if not rec.adaptive_mode:
        return float(rec.depth)  # fixed depth: every token runs all T loops
    raise LoopLMError(f"adaptive record {_label(rec)} lacks extra['mean_depth']")


#: Named per-record metrics: ``ppl`` (token-weighted), ``nll`` (nats/token), ``accuracy``
#: (n_correct / n_examples from ``extra``), ``mean_depth`` (achieved mean active depth).
METRICS: dict[str, Callable[[EvalRecord], float]] = {
    "ppl": _metric_ppl,
    "nll": _metric_nll,
    "accuracy": _metric_accuracy,
    "mean_depth": _metric_mean_depth,
}

Metric = str | Callable[[EvalRecord], float]


def record_metric(rec: EvalRecord, metric: Metric = "ppl") -> float:
    """The value of ``metric`` (a name in :data:`METRICS` or a callable) for one record."""
    if callable(metric):
        return float(metric(rec))
    try:
        fn = METRICS[metric]
    except KeyError:
        raise LoopLMError(f"unknown metric {metric!r}; allowed: {', '.join(METRICS)}") from None
    return fn(rec)


def _metric_name(metric: Metric) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")


def _label(rec: EvalRecord, skip: Iterable[str] = ()) -> str:
    skip = set(skip)
    parts = [
        f"{f}={getattr(rec, f)}"
        for f in IDENTITY_FIELDS
        if f not in skip and getattr(rec, f) not in ("", None)
    ]
    return "[" + " ".join(parts) + "]"


# --------------------------------------------------------------------------- seed integrity
def resolve_seed_set(spec: SeedSpec, available: Iterable[int] = ()) -> tuple[int, ...] | None:
    """The required seed ids for a summary.

    ``spec`` is a list of seed ids, or one of ``"default"`` (:data:`DEFAULT_SEEDS`),
    ``"expanded"`` (:data:`EXPANDED_SEEDS`), ``"auto"`` (expanded when all of its seeds are in
    ``available``, else default) or ``"all"``/``None`` (no required set: use what is there).
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec == "default":
            return DEFAULT_SEEDS
        if spec == "expanded":
            return EXPANDED_SEEDS
        if spec == "auto":
            return EXPANDED_SEEDS if set(EXPANDED_SEEDS) <= set(available) else DEFAULT_SEEDS
        if spec == "all":
            return None
        raise LoopLMError(
            f"unknown seed set {spec!r}; allowed: {', '.join(SEED_SET_NAMES)} or a list of ints"
        )
    seeds = []
    for s in spec:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise LoopLMError(f"seed ids must be integers, got {s!r}")
        seeds.append(int(s))
    if not seeds:
        raise LoopLMError("the required seed set is empty")
    dup = sorted(s for s, c in Counter(seeds).items() if c > 1)
    if dup:
        raise LoopLMError(f"the required seed set lists seed(s) {dup} more than once")
    return tuple(sorted(seeds))


@dataclass(frozen=True)
class SeedCheck:
    """Result of the seed-set integrity check for one summary."""

    required: tuple[int, ...] | None
    used: tuple[int, ...]  # seeds that enter the summary
    missing: tuple[int, ...]  # required but absent
    duplicates: tuple[int, ...]  # present more than once (never used)
    ignored: tuple[int, ...]  # present but outside the required set

    @property
    def complete(self) -> bool:
        """True when every required seed is present exactly once."""
        return not self.missing and not self.duplicates

    def problem(self) -> str:
        """A human-readable description of what is wrong ('' when complete)."""
        parts = []
        if self.missing:
            parts.append(f"missing seed(s) {list(self.missing)}")
        if self.duplicates:
            parts.append(f"duplicate evaluation(s) for seed(s) {list(self.duplicates)}")
        return "; ".join(parts)


def check_seed_set(
    seeds: Sequence[int],
    required: Sequence[int] | None,
    *,
    label: str = "",
    on_incomplete: str = "raise",
) -> SeedCheck:
    """Check that ``seeds`` (one entry per evaluation) covers ``required`` once each.

    Duplicated seeds are never used. With ``on_incomplete="raise"`` (default) a missing or
    duplicated seed raises LoopLMError naming them; with ``"mark"`` the check is returned and
    ``complete`` is False.
    """
    if on_incomplete not in ("raise", "mark"):
        raise LoopLMError(f"unknown on_incomplete {on_incomplete!r}; allowed: raise, mark")
    counts = Counter(int(s) for s in seeds)
    duplicates = tuple(sorted(s for s, c in counts.items() if c > 1))
    present = set(counts)
    if required is None:
        req = None
        used = tuple(sorted(present - set(duplicates)))
        missing: tuple[int, ...] = ()
        ignored: tuple[int, ...] = ()
    else:
        req = tuple(sorted(int(s) for s in required))
        used = tuple(s for s in req if s in present and s not in duplicates)
        missing = tuple(s for s in req if s not in present)
        ignored = tuple(sorted(present - set(req)))
    check = SeedCheck(req, used, missing, duplicates, ignored)
    if not check.complete and on_incomplete == "raise":
        where = f" for {label}" if label else ""
        req_txt = f"required seed set {list(req)}" if req is not None else "no required seed set"
        raise LoopLMError(
            f"seed integrity check failed{where}: {check.problem()} "
            f"({req_txt}; seeds present {sorted(present)}); report the seeds there are with "
            "--seeds all (a sweep: report.seeds: all) or mark incomplete summaries with "
            "--allow-incomplete (report.allow_incomplete: true)"
        )
    return check


# --------------------------------------------------------------------------- summaries
def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1); std is NaN for fewer than two values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return math.nan, math.nan
    mean = float(arr.mean())
    std = float(arr.std(ddof=1)) if arr.size >= 2 else math.nan
    return mean, std


@dataclass
class Summary:
    """Mean ± sample std of one metric over the seeds of one evaluation group."""

    metric: str
    mean: float
    std: float
    n: int
    seeds: tuple[int, ...]
    values: tuple[float, ...]  # one per seed, in ``seeds`` order
    complete: bool
    missing: tuple[int, ...] = ()
    duplicates: tuple[int, ...] = ()
    ignored: tuple[int, ...] = ()
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for results.json)."""
        return asdict(self)


def _check_homogeneous(records: Sequence[EvalRecord], vary: Sequence[str], what: str) -> None:
    for f in IDENTITY_FIELDS:
        if f in vary:
            continue
        values = {getattr(r, f) for r in records}
        if len(values) > 1:
            raise LoopLMError(
                f"{what} got records of different evaluations: field {f!r} takes values "
                f"{sorted(values, key=str)}; only {', '.join(vary)} may differ"
            )


def summarize(
    records: Sequence[EvalRecord],
    metric: Metric = "ppl",
    *,
    required_seeds: SeedSpec = DEFAULT_SEEDS,
    on_incomplete: str = "raise",
    label: str | None = None,
) -> Summary:
    """Mean ± sample std (ddof=1) of ``metric`` across the seeds of one evaluation group.

    ``records`` must differ only in ``seed`` (one evaluation identity per seed). The per-seed
    value of ``"ppl"`` is the record's token-weighted ``exp(sum_nll / n_tokens)``. The seed set
    is checked with :func:`check_seed_set`; seeds outside the required set are ignored (listed in
    ``Summary.ignored``).
    """
    records = list(records)
    if not records:
        raise LoopLMError("summarize() got no records")
    _check_homogeneous(records, ("seed",), "summarize()")
    if label is None:
        label = _label(records[0], skip=("seed",))
    required = resolve_seed_set(required_seeds, (r.seed for r in records))
    check = check_seed_set(
        [r.seed for r in records], required, label=label, on_incomplete=on_incomplete
    )
    by_seed = {r.seed: r for r in records}
    values = tuple(record_metric(by_seed[s], metric) for s in check.used)
    mean, std = mean_std(values)
    return Summary(
        metric=_metric_name(metric),
        mean=mean,
        std=std,
        n=len(values),
        seeds=check.used,
        values=values,
        complete=check.complete,
        missing=check.missing,
        duplicates=check.duplicates,
        ignored=check.ignored,
        label=label,
    )


# --------------------------------------------------------------------------- paired deltas
def t_halfwidth(values: Sequence[float], confidence: float = 0.95) -> float:
    """Small-sample t half-width ``t.ppf((1+c)/2, n−1) · sd / √n`` (sd with ddof=1); NaN if n<2."""
    from scipy import stats as sps

    _check_confidence(confidence)
    arr = np.asarray(values, dtype=float)
    n = arr.size
    if n < 2:
        return math.nan
    return float(sps.t.ppf(0.5 + confidence / 2.0, n - 1) * arr.std(ddof=1) / math.sqrt(n))


def paired_bootstrap_ci(
    deltas: Sequence[float],
    *,
    n_boot: int = 10_000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Deterministic paired-bootstrap percentile interval of the mean paired delta.

    Resamples the ``n`` pairs with replacement: ``idx = default_rng(seed).integers(0, n,
    size=(n_boot, n))``; interval = percentiles (linear interpolation) of the resample means.
    Returns ``(nan, nan)`` for fewer than two pairs.
    """
    _check_confidence(confidence)
    if int(n_boot) < 1:
        raise LoopLMError(f"n_boot must be >= 1, got {n_boot}")
    arr = np.asarray(deltas, dtype=float)
    n = arr.size
    if n < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(int(n_boot), n))
    means = arr[idx].mean(axis=1)
    alpha = 1.0 - confidence
    lo, hi = np.percentile(means, [100.0 * alpha / 2.0, 100.0 * (1.0 - alpha / 2.0)])
    return float(lo), float(hi)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise LoopLMError(f"confidence must be in (0, 1), got {confidence}")


@dataclass
class PairedDelta:
    """Paired delta ``a − b`` of one metric at one loop depth, matched by seed."""

    metric: str
    depth: int
    n: int
    seeds: tuple[int, ...]
    deltas: tuple[float, ...]
    mean: float
    std: float
    t_halfwidth: float
    boot_lo: float
    boot_hi: float
    confidence: float = 0.95
    n_boot: int = 10_000
    boot_seed: int = 0
    a_only_seeds: tuple[int, ...] = field(default=())
    b_only_seeds: tuple[int, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for results.json)."""
        return asdict(self)


def delta_stats(
    deltas: Sequence[float],
    *,
    confidence: float = 0.95,
    n_boot: int = 10_000,
    boot_seed: int = 0,
) -> dict[str, float]:
    """Mean, sample std, t half-width and bootstrap interval of already-paired deltas."""
    mean, std = mean_std(deltas)
    lo, hi = paired_bootstrap_ci(deltas, n_boot=n_boot, seed=boot_seed, confidence=confidence)
    return {
        "mean": mean,
        "std": std,
        "t_halfwidth": t_halfwidth(deltas, confidence),
        "boot_lo": lo,
        "boot_hi": hi,
    }


def _index_by_depth_seed(records: Sequence[EvalRecord], side: str) -> dict[tuple[int, int], Any]:
    index: dict[tuple[int, int], EvalRecord] = {}
    dups = set()
    for r in records:
        key = (r.depth, r.seed)
        if key in index:
            dups.add(key)
        index[key] = r
    if dups:
        raise LoopLMError(
            f"paired_deltas: side {side} has duplicate evaluations for (depth, seed) "
            f"{sorted(dups)}; each seed may be counted once per depth"
        )
    return index


def paired_deltas(
    a: Sequence[EvalRecord],
    b: Sequence[EvalRecord],
    metric: Metric = "ppl",
    *,
    seeds: Sequence[int] | None = None,
    confidence: float = 0.95,
    n_boot: int = 10_000,
    boot_seed: int = 0,
) -> list[PairedDelta]:
    """Paired deltas ``metric(a) − metric(b)``, matched by seed and loop depth, one per depth.

    Only seeds present on both sides (and in ``seeds``, when given) are paired; depths with no
    common seed are left out. Within each side, records may differ only in depth and seed, and a
    (depth, seed) pair may occur once.
    """
    a, b = list(a), list(b)
    _check_homogeneous(a, ("depth", "seed"), "paired_deltas() side a")
    _check_homogeneous(b, ("depth", "seed"), "paired_deltas() side b")
    ia, ib = _index_by_depth_seed(a, "a"), _index_by_depth_seed(b, "b")
    allowed = None if seeds is None else {int(s) for s in seeds}
    out = []
    for depth in sorted({d for d, _ in ia} & {d for d, _ in ib}):
        sa = {s for d, s in ia if d == depth}
        sb = {s for d, s in ib if d == depth}
        if allowed is not None:
            sa, sb = sa & allowed, sb & allowed
        common = sorted(sa & sb)
        if not common:
            continue
        deltas = tuple(
            record_metric(ia[(depth, s)], metric) - record_metric(ib[(depth, s)], metric)
            for s in common
        )
        st = delta_stats(deltas, confidence=confidence, n_boot=n_boot, boot_seed=boot_seed)
        out.append(
            PairedDelta(
                metric=_metric_name(metric),
                depth=depth,
                n=len(common),
                seeds=tuple(common),
                deltas=deltas,
                confidence=confidence,
                n_boot=int(n_boot),
                boot_seed=int(boot_seed),
                a_only_seeds=tuple(sorted(sa - sb)),
                b_only_seeds=tuple(sorted(sb - sa)),
                **st,
            )
        )
    return out
