"""The recurrence scaling law of the recurrence-equivalence study ("how much is one recurrence
worth to a looped transformer") and its fit.

    L(r, N_once, N_rec, D) = E + A · (N_once + r^φ · N_rec)^(−α) + B · D^(−β)

``N_once`` counts parameters applied once per token (embeddings, head, non-looped layers),
``N_rec`` the unique parameters inside the looped block(s), ``r`` the recurrence count and ``D``
the training tokens. The recurrence-equivalence exponent φ says what one extra loop is worth in
unique parameters: φ = 1 means looping a block r times equals r unique blocks, φ = 0 means no
capacity gain (that study reports φ = 0.46; truncated backprop 0.38; hyper-connections 0.65).

The fit follows the usual practice for such laws (Hoffmann et al. 2022): parameters ``E, A, B`` are
optimised as logs, the residual is ``log L_pred − log L_obs`` with ``L_pred`` computed by
log-sum-exp, the loss is Huber (δ = 1e-3) or plain least squares
(``scipy.optimize.least_squares``), inside bounds, from many deterministic starts; the best
optimum wins. Data come from an iso-depth sweep over r ∈ {1, 2, 4, 8} (several model sizes and
token budgets) — in the results store, records whose ``extra`` holds ``n_once``, ``n_rec`` and
``train_tokens`` (and optionally ``r``, else ``depth`` is taken as r); the loss is the record's
token-weighted mean NLL in nats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.results.sections import SCALING_KEYS
from looplm.results.store import EvalRecord

PARAM_NAMES: tuple[str, ...] = ("E", "A", "alpha", "B", "beta", "phi")
_LOG_PARAMS = ("E", "A", "B")  # optimised as logs (positive scale parameters)

#: default bounds in natural units
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {
    "E": (1e-4, 1e3),
    "A": (1e-6, 1e12),
    "alpha": (0.0, 3.0),
    "B": (1e-6, 1e12),
    "beta": (0.0, 3.0),
    "phi": (0.0, 2.0),
}


@dataclass
class ScalingFit:
    """Fitted parameters of ``L = E + A (N_once + r^φ N_rec)^−α + B D^−β`` and fit quality."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    phi: float
    n_points: int
    rmse_log: float  # root-mean-square of log L_pred − log L_obs
    max_abs_log_residual: float
    loss: str
    n_starts: int
    n_converged: int
    fixed: dict[str, float] = field(default_factory=dict)

    def effective_params(self, r: Any, n_once: Any, n_rec: Any) -> np.ndarray:
        """Equivalent unique parameters ``N_once + r^φ N_rec``."""
        r, n_once, n_rec = (np.asarray(x, dtype=float) for x in (r, n_once, n_rec))
        return n_once + r**self.phi * n_rec

    def predict(self, r: Any, n_once: Any, n_rec: Any, d: Any) -> np.ndarray:
        """Predicted loss for arrays (or scalars) of r, N_once, N_rec, D."""
        n_eff = self.effective_params(r, n_once, n_rec)
        d = np.asarray(d, dtype=float)
        return self.E + self.A * n_eff ** (-self.alpha) + self.B * d ** (-self.beta)

    def params(self) -> dict[str, float]:
        """The six law parameters by name."""
        return {k: float(getattr(self, k)) for k in PARAM_NAMES}

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for results.json)."""
        return asdict(self)


def _as_1d(name: str, x: Any) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    if arr.ndim != 1:
        raise LoopLMError(f"scaling fit: {name} must be a 1-D sequence, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise LoopLMError(f"scaling fit: {name} contains non-finite values")
    return arr


def _log_pred(full: dict[str, float], log_neff: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        terms = (
            np.full_like(log_neff, math.log(full["E"]) if full["E"] > 0 else -np.inf),
            (math.log(full["A"]) if full["A"] > 0 else -np.inf) - full["alpha"] * log_neff,
            (math.log(full["B"]) if full["B"] > 0 else -np.inf) - full["beta"] * log_d,
        )
    return np.logaddexp(np.logaddexp(terms[0], terms[1]), terms[2])


def _log_neff(phi: float, log_r: np.ndarray, log_once: np.ndarray, log_rec: np.ndarray):
    return np.logaddexp(log_once, phi * log_r + log_rec)


def _validated(
    arrays: dict[str, Sequence[float]],
    fixed: dict[str, float],
    bounds: dict[str, tuple[float, float]] | None,
    robust: str,
) -> tuple[list[np.ndarray], dict[str, tuple[float, float]], list[str]]:
    """The five inputs as arrays, the bounds, the free parameters; LoopLMError for bad input."""
    r_, once, rec, d_, y = (_as_1d(n, x) for n, x in arrays.items())
    n = y.size
    if not (r_.size == once.size == rec.size == d_.size == n):
        raise LoopLMError(
            f"scaling fit: inputs differ in length (r {r_.size}, n_once {once.size}, "
            f"n_rec {rec.size}, D {d_.size}, loss {n})"
        )
    unknown = sorted(set(fixed) - set(PARAM_NAMES))
    if unknown:
        raise LoopLMError(
            f"scaling fit: unknown fixed parameter(s) {unknown}; allowed: {PARAM_NAMES}"
        )
    bnds = dict(DEFAULT_BOUNDS)
    for k, v in (bounds or {}).items():
        if k not in PARAM_NAMES:
            raise LoopLMError(f"scaling fit: unknown bound {k!r}; allowed: {PARAM_NAMES}")
        lo, hi = float(v[0]), float(v[1])
        if not lo < hi or (k in _LOG_PARAMS and lo <= 0):
            raise LoopLMError(f"scaling fit: bad bounds for {k}: {v}")
        bnds[k] = (lo, hi)
    if robust not in ("huber", "linear"):
        raise LoopLMError(f"scaling fit: unknown robust loss {robust!r}; allowed: huber, linear")
    free = [p for p in PARAM_NAMES if p not in fixed]
    _check_design(free, n, r_, once, rec, d_, y)
    return [r_, once, rec, d_, y], bnds, free


def _check_design(free: list[str], n: int, r_, once, rec, d_, y) -> None:
    if n <= len(free):
        raise LoopLMError(
            f"scaling fit: need more points than free parameters ({len(free)}: "
            f"{', '.join(free)}), got {n} point(s)"
        )
    if np.any(r_ < 1) or np.any(once < 0) or np.any(rec <= 0) or np.any(d_ <= 0) or np.any(y <= 0):
        raise LoopLMError(
            "scaling fit: need r >= 1, n_once >= 0, n_rec > 0, D > 0 and loss > 0 for every point"
        )
    if "phi" in free and np.unique(r_).size < 2:
        raise LoopLMError(
            f"scaling fit: phi needs at least 2 distinct recurrence counts r, got {np.unique(r_)}"
        )
    if ("B" in free or "beta" in free) and np.unique(d_).size < 2:
        raise LoopLMError(
            "scaling fit: all points share one token budget D, so B·D^-beta cannot be separated "
            "from E; pass fixed={'B': 0.0, 'beta': 1.0} or add runs with other D"
        )
    if ("A" in free or "alpha" in free) and len(set(zip(r_, once, rec))) < 3:
        raise LoopLMError(
            "scaling fit: need at least 3 distinct (r, n_once, n_rec) model configurations"
        )


def _starts(free: list[str], y: np.ndarray, n_starts: int, seed: int) -> list[np.ndarray]:
    """Deterministic starts: one data-driven start, then uniform draws inside the bounds
    (log-scale params drawn in a plausible sub-range)."""
    rng = np.random.default_rng(seed)
    plausible = {
        "E": (math.log(0.3 * y.min()), math.log(0.95 * y.min())),
        "A": (0.0, 12.0),
        "alpha": (0.05, 0.8),
        "B": (0.0, 12.0),
        "beta": (0.05, 0.8),
        "phi": (0.1, 1.0),
    }
    first = {
        "E": math.log(0.8 * y.min()),
        "A": 5.0,
        "alpha": 0.3,
        "B": 5.0,
        "beta": 0.3,
        "phi": 0.5,
    }
    starts = [np.array([first[p] for p in free])]
    for _ in range(max(0, int(n_starts) - 1)):
        starts.append(np.array([rng.uniform(*plausible[p]) for p in free]))
    return starts


class _Problem:
    """The least-squares problem in log space over the free parameters (log-scale ones as logs)."""

    def __init__(self, free, fixed, bnds, r_, once, rec, d_, y, huber_delta: float) -> None:
        self.free, self.fixed, self.huber_delta = free, fixed, huber_delta
        self.log_r, self.log_d, self.log_y = np.log(r_), np.log(d_), np.log(y)
        with np.errstate(divide="ignore"):
            self.log_once = np.log(once)
        self.log_rec = np.log(rec)
        self.lo = np.array([self.to_x(p, bnds[p][0]) for p in free])
        self.hi = np.array([self.to_x(p, bnds[p][1]) for p in free])

    @staticmethod
    def to_x(p: str, v: float) -> float:
        return math.log(v) if p in _LOG_PARAMS else v

    @staticmethod
    def from_x(p: str, v: float) -> float:
        return math.exp(v) if p in _LOG_PARAMS else v

    def full_params(self, x: np.ndarray) -> dict[str, float]:
        full = dict(self.fixed)
        full.update({p: self.from_x(p, float(v)) for p, v in zip(self.free, x)})
        return full

    def residuals(self, x: np.ndarray) -> np.ndarray:
        full = self.full_params(x)
        neff = _log_neff(full["phi"], self.log_r, self.log_once, self.log_rec)
        return _log_pred(full, neff, self.log_d) - self.log_y

    def solve(self, x0: np.ndarray, loss_name: str):
        from scipy.optimize import least_squares

        lo, hi = self.lo, self.hi
        x0 = np.clip(x0, lo + 1e-9 * (hi - lo), hi - 1e-9 * (hi - lo))
        try:
            res = least_squares(
                self.residuals,
                x0,
                bounds=(lo, hi),
                loss=loss_name,
                f_scale=self.huber_delta if loss_name == "huber" else 1.0,
                x_scale="jac",
                max_nfev=2000,
            )
        except (ValueError, FloatingPointError):
            return None
        return res if np.all(np.isfinite(res.fun)) else None


# long: the fit's start grid, bounds and result fields together
def fit_recurrence_scaling(
    r: Sequence[float],
    n_once: Sequence[float],
    n_rec: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    *,
    fixed: dict[str, float] | None = None,
    bounds: dict[str, tuple[float, float]] | None = None,
    robust: str = "huber",
    huber_delta: float = 1e-3,
    n_starts: int = 48,
    seed: int = 0,
    extra_starts: Sequence[dict[str, float]] = (),
) -> ScalingFit:
    """Fit ``L = E + A (N_once + r^φ N_rec)^−α + B D^−β`` to sweep points; returns a ScalingFit.

    Args:
        r, n_once, n_rec, d, loss: one entry per trained model (r >= 1, N_once >= 0, N_rec > 0,
            D > 0, loss > 0 in nats).
        fixed: parameters held constant, in natural units (e.g. ``{"B": 0.0, "beta": 1.0}`` when
            every run used the same D, so the data term folds into E).
        bounds: per-parameter ``(low, high)`` in natural units, overriding :data:`DEFAULT_BOUNDS`.
        robust: ``"huber"`` (Huber loss on log residuals, scale ``huber_delta``) or ``"linear"``
            (ordinary least squares in log space).
        n_starts: number of deterministic starting points (seeded by ``seed``); the best optimum
            is kept. ``extra_starts``: further starting points in natural units (e.g. another
            fit's parameters), tried first.

    Raises LoopLMError for too few points, degenerate designs (one r, one D) or bad values.
    """
    fixed = dict(fixed or {})
    inputs = {"r": r, "n_once": n_once, "n_rec": n_rec, "D": d, "loss": loss}
    arrays, bnds, free = _validated(inputs, fixed, bounds, robust)
    y = arrays[-1]
    prob = _Problem(free, fixed, bnds, *arrays, huber_delta)
    starts = _starts(free, y, n_starts, seed)
    # given starting points (e.g. the full-data optimum when refitting a bootstrap resample) first
    warm = [[math.log(v) if p in _LOG_PARAMS else v for p, v in ((p, float(x0[p])) for p in free)]
            for x0 in extra_starts]  # fmt: skip
    starts = [np.array(w) for w in warm] + starts
    # Stage 1: plain least squares from every start (cheap). Stage 2 (huber): refine the few
    # best stage-1 optima under the Huber loss, which is slow to converge from far away.
    stage1 = [res for res in (prob.solve(x0, "linear") for x0 in starts) if res is not None]
    n_conv = sum(bool(res.success) for res in stage1)
    stage1.sort(key=lambda res: res.cost)
    if robust == "huber":
        candidates = [prob.solve(res.x, "huber") for res in stage1[:4]]
        candidates = [res for res in candidates if res is not None]
    else:
        candidates = stage1[:1]
    best = min(candidates, key=lambda res: res.cost) if candidates else None
    if best is None:
        raise LoopLMError("scaling fit failed from every starting point (check the inputs)")
    full = prob.full_params(best.x)
    resid = prob.residuals(best.x)
    return ScalingFit(
        **{p: float(full[p]) for p in PARAM_NAMES},
        n_points=int(y.size),
        rmse_log=float(np.sqrt(np.mean(resid**2))),
        max_abs_log_residual=float(np.max(np.abs(resid))),
        loss=robust,
        n_starts=len(starts),
        n_converged=int(n_conv),
        fixed={k: float(v) for k, v in fixed.items()},
    )


def is_scaling_record(rec: EvalRecord) -> bool:
    """True when ``rec.extra`` carries a scaling-sweep point (n_once, n_rec, train_tokens)."""
    return all(k in rec.extra for k in SCALING_KEYS)


def scaling_points(records: Sequence[EvalRecord]) -> dict[str, np.ndarray]:
    """Arrays ``r, n_once, n_rec, d, loss`` from scaling records (loss = mean NLL in nats).

    ``r`` is ``extra['r']`` when present, else the record's ``depth``.
    """
    rows = []
    for rec in records:
        if not is_scaling_record(rec):
            raise LoopLMError(
                f"record method={rec.method} depth={rec.depth} seed={rec.seed} is not a scaling "
                f"point: extra needs {', '.join(SCALING_KEYS)}"
            )
        if rec.n_tokens <= 0:
            raise LoopLMError(f"scaling record method={rec.method} seed={rec.seed} has no tokens")
        x = rec.extra
        rows.append(
            (
                float(x.get("r", rec.depth)),
                float(x["n_once"]),
                float(x["n_rec"]),
                float(x["train_tokens"]),
                rec.mean_nll,
            )
        )
    arr = np.array(rows, dtype=float).reshape(-1, 5)
    return {k: arr[:, i] for i, k in enumerate(("r", "n_once", "n_rec", "d", "loss"))}


def fit_records(records: Sequence[EvalRecord], **kwargs: Any) -> ScalingFit:
    """:func:`fit_recurrence_scaling` on the scaling points of ``records``."""
    pts = scaling_points(records)
    return fit_recurrence_scaling(
        pts["r"], pts["n_once"], pts["n_rec"], pts["d"], pts["loss"], **kwargs
    )


@dataclass
class BootstrapInterval:
    """Percentile interval of one law parameter over fits to resampled sweep points."""

    name: str
    estimate: float
    low: float
    high: float
    level: float
    n_boot: int
    n_failed: int
    samples: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("samples")
        return d


def bootstrap_interval(
    r: Sequence[float],
    n_once: Sequence[float],
    n_rec: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    *,
    param: str = "phi",
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
    n_starts: int = 8,
    fit: ScalingFit | None = None,
    **kwargs: Any,
) -> BootstrapInterval:
    """Percentile bootstrap interval of ``param`` (default φ): the sweep points are resampled with
    replacement ``n_boot`` times (deterministic with ``seed``), the law is refitted to each sample
    (``n_starts`` starts, the full-data optimum among them) and the ``level`` percentile interval
    of the refitted values is returned. Resamples whose design cannot identify the law (e.g. one
    distinct r) are counted in ``n_failed`` and skipped."""
    if param not in PARAM_NAMES:
        raise LoopLMError(f"bootstrap: unknown parameter {param!r}; allowed: {PARAM_NAMES}")
    if not 0.0 < level < 1.0 or n_boot < 2:
        raise LoopLMError(f"bootstrap: need 0 < level < 1 and n_boot >= 2, got {level}, {n_boot}")
    cols = [np.asarray(x, dtype=float) for x in (r, n_once, n_rec, d, loss)]
    full = fit or fit_recurrence_scaling(*cols, **kwargs)
    rng = np.random.default_rng(seed)
    n = cols[0].size
    vals, failed = [], 0
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        try:
            f = fit_recurrence_scaling(
                *(c[idx] for c in cols),
                n_starts=n_starts,
                seed=int(rng.integers(2**31)),
                extra_starts=[full.params()],
                **kwargs,
            )
        except LoopLMError:
            failed += 1
            continue
        vals.append(float(getattr(f, param)))
    if len(vals) < 2:
        raise LoopLMError(f"bootstrap: only {len(vals)} of {n_boot} resamples could be fitted")
    lo, hi = np.quantile(vals, [(1 - level) / 2, (1 + level) / 2])
    return BootstrapInterval(
        param, float(getattr(full, param)), float(lo), float(hi), level, n_boot, failed, vals
    )


def bootstrap_records(records: Sequence[EvalRecord], **kwargs: Any) -> BootstrapInterval:
    """:func:`bootstrap_interval` on the scaling points of ``records``."""
    pts = scaling_points(records)
    return bootstrap_interval(
        pts["r"], pts["n_once"], pts["n_rec"], pts["d"], pts["loss"], **kwargs
    )
