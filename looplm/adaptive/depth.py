"""Adaptive loop depth under a loop ceiling C (default 48): three stopping rules.

All three run one trained shared-block model (``LoopedLM``) and stop the recurrence early; every
rule runs at least one loop and at most C. Quality is token-weighted NLL → PPL over the scored
tokens (targets ≠ ``IGNORE_INDEX``), exactly as the fixed-depth sweep; the achieved **mean active depth** is the
token-weighted mean number of loops the scored tokens received (for the per-example rule every
token of an example gets that example's depth; all evaluation windows are full-length except
possibly the last one, so this equals the per-example mean up to that window).

1. ``maxtoken`` — the paper's max-token hidden-update stopping rule, **per example** (Appendix
   "Adaptive-Depth Evaluation"). After loop t the per-token relative update is
   ``r_{b,l,t} = ‖h_t − h_{t−1}‖₂ / ‖h_{t−1}‖₂`` (hidden coordinates, float64); the example's
   statistic is its largest value over the scored tokens, ``u_{b,t} = max_l r_{b,l,t}``. Example b
   stops at the first t with ``u_{b,t} < τ`` (else at C) and is read out from ``h_t``. The paper
   names the rule but not the norm; the relative L2 change is scale-free (SCSE's states and the
   baseline's states have very different norms) and is what the per-token convergence study calls
   the per-token state change. ``τ = 0`` never stops early (→ the fixed-depth result at C); ``τ = inf`` stops
   after the first loop. Calibration: one ceiling-length unroll per validation example gives
   ``u_{b,1..C}`` (no readout needed); the stopping depth is monotone in τ, so the threshold for a
   target mean budget is found by bisection on log τ (:func:`calibrate_threshold`), then applied to
   test with a real early-exit implementation (:func:`maxtoken_forward`: finished examples are
   dropped from the batch, so the work really shrinks).

2. ``kl`` — the training-free per-token halting rule of the per-token convergence study. With ``p_t =
   softmax(readout(h_t))``, token l halts after the first loop t with
   ``KL(p_t ‖ p_{t−1}) < τ`` (``p_0`` reads out the initial state). A halted token's recurrent state
   is **frozen**: it keeps its state, and its output is read from that state. Attention is causal
   and every token still attends to all earlier tokens, *including halted ones*: later, still
   active tokens see the halted tokens' frozen states as keys/values (the block input built from
   the frozen state at the current loop step). τ = 0 never halts, which reproduces full-depth
   logits bit for bit (the dense code path is used while every token is active).

3. ``router`` — the learned linear router baseline of the same study: a logistic regression on the
   RMS-normalised hidden state ``h_t`` of a token predicting "converged at this step", with labels
   harvested from the same model on validation: label 1 when ``KL(p_t ‖ p_{t−1}) < τ_label``
   (the same convergence criterion the KL rule reads). On test a token halts (and is frozen
   exactly as in rule 2) when the router's probability reaches ``p``.

4. ``gate`` — the model's own exit rule, for a model with a learned exit gate (Ouro): a token halts
   (frozen as in rule 2) when the gate's cumulative exit probability reaches the threshold
   (:class:`looplm.model.halting_rules.GateHalt`). Asked of a model without a gate it fails in one line.

Every rule reads out what the model's readout reads: intermediate states pass through the
recurrence's exit map and any coda layers (``model.finish``, run over the whole sequence at each
step for models with a coda: Parcae, Huginn).

Work skipping for per-token halting (rules 2 and 3): :meth:`Block.forward <looplm.model.block.Block.forward>` (``active=``) computes the
shared block's output only for *active* query rows — query projection, attention rows, output
projection and SwiGLU — while keys and values are still computed for every token, because causal
attention needs the K/V of halted tokens (and for step-conditioned methods the block input of a
frozen token can change with t, so its K/V cannot be cached once). So a halted token still costs the
K/V projection (4d² of the 8d² + 6d·d_ff + 4Ld proxy per loop) and the work per loop is padded to
the example with the most active tokens. The FLOP proxy reported with each rule is the paper's
Eq. 20/21 at the achieved mean depth (``looplm.flops``), i.e. an idealised count; the wall-clock
figure is measured.

Rules 2 and 3 live in :mod:`looplm.adaptive.halting`, the helpers all rules share in
:mod:`looplm.adaptive.measure`, the halting mechanics of the unroll (frozen tokens, dropped
examples, the update statistics) in :mod:`looplm.model.halting`; this module re-exports them. Public API: :func:`max_token_updates`, :func:`update_trace`, :func:`stopping_depths`,
:func:`calibrate_threshold`, :func:`maxtoken_forward`, :func:`evaluate_maxtoken`,
:func:`per_token_halting`, :class:`KLHalt`, :class:`RouterHalt`,
:class:`LinearRouter`, :func:`harvest_router_data`, :func:`fit_router`, :func:`evaluate_per_token`,
:func:`time_uniform`, :func:`evaluation_batches`, :func:`evaluate_adaptive`,
:func:`evaluate_adaptive_checkpoint`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from looplm.adaptive.halting import (
    LinearRouter,
    evaluate_per_token,
    fit_router,
    harvest_router_data,
    per_token_halting,
)
from looplm.adaptive.measure import (
    Batch,
    check_ceiling,
    flops_fields,
    nll_rows,
    nll_totals,
    require_looped,
    timed_batches,
    timed_min,
)
from looplm.adaptive.settings import (
    DEFAULT_BUDGETS,
    DEFAULT_CEILING,
    DEFAULT_GATE_THRESHOLDS,
    DEFAULT_KL_THRESHOLDS,
    DEFAULT_LABEL_THRESHOLD,
    DEFAULT_ROUTER_PROBS,
    RULES,
    AdaptiveSettings,
)
from looplm.errors import LoopLMError
from looplm.evaluate.batches import evaluation_batches
from looplm.model.halting import ExampleHalting, max_token_updates, relative_update
from looplm.model.halting_rules import GateHalt, KLHalt, MaxTokenHalt, RouterHalt
from looplm.targets import IGNORE_INDEX


# ============================================================================ rule 1: maxtoken
@dataclass
class UpdateTrace:
    """Rule-1 statistics of a ceiling-length unroll: ``updates[b, t-1] = u_{b,t}`` (N, C) float64
    and the number of scored tokens per example ``n_tokens`` (N,)."""

    updates: np.ndarray
    n_tokens: np.ndarray
    ceiling: int

    @property
    def n_examples(self) -> int:
        return int(self.updates.shape[0])


@torch.no_grad()
def update_trace(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    ceiling: int = DEFAULT_CEILING,
    *,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> UpdateTrace:
    """One ceiling-length unroll per batch recording ``u_{b,t}`` for t = 1..C (no readout)."""
    from tqdm.auto import tqdm

    require_looped(model)
    check_ceiling(ceiling)
    ups, ns = [], []
    for x, y in tqdm(batches, disable=not progress, desc="trace", leave=False):
        x, y = x.to(device), y.to(device)
        valid = y != IGNORE_INDEX
        keep = valid.any(dim=1)
        # eager: static shapes, but run once per checkpoint on the calibration split, next to the
        # rules' own passes (which compact rows); no host sync inside the unroll
        steps = model.unroll(model.prepare(x), ceiling)
        h_prev = next(steps).hidden
        cols = []
        for st in steps:
            cols.append(max_token_updates(st.hidden, h_prev, valid))  # (B,)
            h_prev = st.hidden
        ups.append(torch.stack(cols, dim=1)[keep].cpu().numpy())  # (B, C)
        ns.append(valid.sum(1)[keep].cpu().numpy())
    if not ups:
        raise LoopLMError("no evaluation batches to trace")
    return UpdateTrace(np.concatenate(ups), np.concatenate(ns).astype(np.int64), ceiling)


def stopping_depths(updates: np.ndarray, threshold: float) -> np.ndarray:
    """First t (1-based) with ``u_{b,t} < threshold``, else the ceiling: (N, C) → (N,) int."""
    below = np.asarray(updates) < threshold  # NaN compares False: never stops on NaN
    C = below.shape[1]
    return np.where(below.any(axis=1), below.argmax(axis=1) + 1, C)


def mean_depth(depths: np.ndarray, n_tokens: np.ndarray) -> float:
    """Token-weighted mean of per-example depths."""
    n = np.asarray(n_tokens, dtype=np.float64)
    return float((np.asarray(depths, dtype=np.float64) * n).sum() / max(n.sum(), 1.0))


@dataclass
class Calibration:
    """Result of :func:`calibrate_threshold`."""

    threshold: float
    target: float
    achieved: float  # mean depth on the calibration data
    n_examples: int
    iterations: int


def calibrate_threshold(trace: UpdateTrace, target: float, *, iterations: int = 100) -> Calibration:
    """Threshold τ whose token-weighted mean stopping depth on ``trace`` is closest to ``target``.

    Bisection on log τ: the mean stopping depth is a non-increasing step function of τ (equal to
    C for τ ≤ min u, and 1 for τ > max u_{·,1}), so the bracket [lo, hi] with depth(lo) ≥ target ≥
    depth(hi) shrinks onto the step that crosses the target; the closer of the two sides wins.
    """
    C = trace.ceiling
    if not (isinstance(target, (int, float)) and 1 <= target <= C):
        raise LoopLMError(f"target mean budget {target!r} must lie in [1, ceiling={C}]")
    u = trace.updates[np.isfinite(trace.updates) & (trace.updates > 0)]

    def depth_at(tau: float) -> float:
        return mean_depth(stopping_depths(trace.updates, tau), trace.n_tokens)

    if u.size == 0:  # every update is 0 (or not finite): any τ > 0 stops at t = 1
        tau = math.inf if target < (1 + C) / 2 else 0.0
        return Calibration(tau, float(target), depth_at(tau), trace.n_examples, 0)
    lo, hi = float(u.min()) / 2.0, float(u.max()) * 2.0  # depth(lo) = C-ish, depth(hi) = 1
    d_lo, d_hi = depth_at(lo), depth_at(hi)
    best = min(((abs(d_lo - target), lo, d_lo), (abs(d_hi - target), hi, d_hi)))
    it = 0
    for it in range(1, iterations + 1):  # noqa: B007
        mid = math.sqrt(lo * hi)
        d = depth_at(mid)
        best = min(best, (abs(d - target), mid, d))
        if d > target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-12:
            break
    return Calibration(float(best[1]), float(target), float(best[2]), trace.n_examples, it)


@torch.no_grad()
def maxtoken_forward(
    model: torch.nn.Module,
    x: torch.Tensor,
    valid: torch.Tensor,
    threshold: float,
    ceiling: int = DEFAULT_CEILING,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real early exit for rule 1: ``(h_final (B, L, d), depth (B,))``.

    Examples that have stopped are removed from the batch, so each loop costs only the examples
    still running.
    """
    require_looped(model)
    check_ceiling(ceiling)

    # stays eager: stopped examples leave the batch (data-dependent shapes), one host sync a step
    halting = ExampleHalting(MaxTokenHalt(threshold, valid))
    ctx = model.prepare(x)
    for _ in model.unroll(ctx, ceiling, halting=halting):
        pass
    return model.finish(halting.out, ctx), halting.depth


@torch.no_grad()
def evaluate_maxtoken(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    threshold: float,
    ceiling: int = DEFAULT_CEILING,
    *,
    device: str | torch.device = "cpu",
    progress: bool = False,
    flops_cfg: dict[str, Any] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Rule 1 on ``batches`` with a fixed threshold: NLL, mean depth, wall clock (the early-exit
    forward, readout and NLL, timed; the minimum over ``repeats`` passes)."""
    require_looped(model)
    device = torch.device(device)

    def once(x, y):
        h, depth = maxtoken_forward(model, x, y != IGNORE_INDEX, threshold, ceiling)
        return nll_rows(model, h, y), depth

    desc = f"maxtoken τ={threshold:.3g}"
    wall, outs = timed_batches(once, batches, device, progress=progress, desc=desc)
    sum_nll, n_tok, n_correct, depth_tok, n_ex = 0.0, 0, 0, 0, 0
    hist = np.zeros(ceiling + 1, dtype=np.int64)
    for y, ((nll, correct), depth) in outs:
        n_b = (y != IGNORE_INDEX).sum(1)
        sum_nll += float(nll.sum())
        n_tok += int(n_b.sum())
        n_correct += int(correct.sum())
        depth_tok += int((depth * n_b).sum())
        keep = n_b > 0
        n_ex += int(keep.sum())
        hist += np.bincount(depth[keep].cpu().numpy(), minlength=ceiling + 1)
    md = depth_tok / max(n_tok, 1)
    wall = min(wall, timed_min(once, batches, device, repeats - 1))
    return {
        "rule": "maxtoken",
        "threshold": threshold,
        "ceiling": ceiling,
        **nll_totals(sum_nll, n_tok, n_correct, md),
        "n_examples": n_ex,
        "depth_hist": hist[1:].tolist(),
        "wall_clock_s": wall,
        "timing_repeats": repeats,
        **flops_fields(flops_cfg, md),
    }


# ============================================================================ uniform timing
@torch.no_grad()
def time_uniform(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    depth: int,
    *,
    device: str | torch.device = "cpu",
    repeats: int = 1,
) -> float:
    """Wall-clock seconds of the plain fixed-depth forward + readout + NLL at ``depth`` over
    ``batches`` (minimum over ``repeats`` passes)."""
    return timed_min(
        lambda x, y: model.nll_sum(x, y, depth), batches, torch.device(device), max(repeats, 1)
    )


# ============================================================================ checkpoint driver
def _parse_rules(rules: Sequence[str]) -> list[str]:
    out = []
    for r in rules:
        if r not in RULES:
            raise LoopLMError(f"unknown adaptive rule {r!r}; allowed: {', '.join(RULES)}")
        out.append(r)
    return out


def adaptive_modes(
    rules: Sequence[str],
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    kl_thresholds: Sequence[float] = DEFAULT_KL_THRESHOLDS,
    router_probs: Sequence[float] = DEFAULT_ROUTER_PROBS,
    gate_thresholds: Sequence[float] = DEFAULT_GATE_THRESHOLDS,
) -> dict[str, list[str]]:
    """The ``adaptive_mode`` strings each rule's settings produce (store identities)."""
    out: dict[str, list[str]] = {}
    for r in _parse_rules(rules):
        if r == "maxtoken":
            out[r] = [f"maxtoken:budget={float(b):g}" for b in budgets]
        elif r == "kl":
            out[r] = [KLHalt(float(t)).mode for t in kl_thresholds]
        elif r == "gate":
            out[r] = [f"gate:thr={float(t):g}" for t in gate_thresholds]
        else:
            out[r] = [f"router:p={float(p):g}" for p in router_probs]
    return out


def todo_pairs(
    values: Sequence[float], modes: dict[str, list[str]], rule: str, want: set[str] | None
) -> list[tuple[float, str]]:
    """(setting, adaptive-mode string) of ``rule`` still to evaluate (all when ``want`` is None)."""
    pairs = list(zip([float(v) for v in values], modes.get(rule, [])))
    return [(v, m) for v, m in pairs if want is None or m in want]


@dataclass
class _AdaptiveRun:
    """One :func:`evaluate_adaptive` call: its settings and the evaluation batches, read once."""

    model: torch.nn.Module
    cfg: Any
    ceiling: int
    dataset: str | None
    split: str
    calib_split: str
    max_tokens: int | None
    calib_max_tokens: int | None
    batch_size: int
    label_threshold: float
    skip: bool
    timing_repeats: int
    time_dense: bool
    device: Any
    progress: bool
    cache: dict[str, list[Batch]] = field(default_factory=dict)

    def data(self) -> list[Batch]:
        if "test" not in self.cache:
            self.cache["test"] = evaluation_batches(
                self.cfg, self.split, self.max_tokens, self.batch_size, self.dataset
            )
        return self.cache["test"]

    def calib_data(self) -> list[Batch]:
        if "calib" not in self.cache:  # its own entry: the calibration cap may differ
            self.cache["calib"] = evaluation_batches(
                self.cfg, self.calib_split, self.calib_max_tokens, self.batch_size, self.dataset
            )
        return self.cache["calib"]

    def timing(self) -> dict[str, Any]:
        from looplm.evaluate.records import flops_config

        return {
            "device": self.device,
            "progress": self.progress,
            "flops_cfg": flops_config(self.cfg),
            "repeats": self.timing_repeats,
        }

    def maxtoken(self, todo: list[tuple[float, str]]) -> list[dict[str, Any]]:
        m, C = self.model, self.ceiling
        trace = update_trace(m, self.calib_data(), C, device=self.device, progress=self.progress)
        out = []
        for b, mode in todo:
            cal = calibrate_threshold(trace, b)
            r = evaluate_maxtoken(m, self.data(), cal.threshold, C, **self.timing())
            r.update(
                mode=mode, target=b, calib_mean_depth=cal.achieved, calib_examples=cal.n_examples
            )
            out.append(r)
        return out

    def per_token(self, decide) -> dict[str, Any]:
        return evaluate_per_token(
            self.model,
            self.data(),
            decide,
            self.ceiling,
            skip=self.skip,
            time_dense=self.time_dense,
            **self.timing(),
        )

    def router(self, todo: list[tuple[float, str]]) -> list[dict[str, Any]]:
        X, Y = harvest_router_data(
            self.model,
            self.calib_data(),
            self.ceiling,
            label_threshold=self.label_threshold,
            device=self.device,
            progress=self.progress,
        )
        router = fit_router(X, Y, label_threshold=self.label_threshold)
        out = []
        for p, _mode in todo:
            r = self.per_token(RouterHalt(router, p))
            r.update(router=router.stats, label_threshold=self.label_threshold)
            out.append(r)
        return out


# long: the driver of the three rules, its result assembled in one place
def evaluate_adaptive(
    model: torch.nn.Module,
    cfg,
    settings: AdaptiveSettings | None = None,
    *,
    dataset: str | None = None,
    split: str = "test",
    max_tokens: int | None = None,
    batch_size: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
    want: set[str] | None = None,
) -> dict[str, Any]:
    """Calibrate on ``settings.calib_split`` and evaluate the requested rules on ``split``.

    Returns ``{"method", "dataset", "split", "calib_split", "ceiling", "max_tokens",
    "calib_max_tokens", "results": [one dict per rule setting, with "mode"], "uniform_wall_clock_s":
    {T: seconds}}``. ``want`` (a set of adaptive-mode strings such as ``"maxtoken:budget=8"``)
    restricts the work to those settings (the resumable sweep passes what the store lacks).
    Wall clocks are minima over ``timing_repeats`` passes; ``time_dense`` also times the per-token
    rules without work skipping.
    """
    from looplm.data.corpora import canonical_split
    from looplm.settings import check_fields

    s = settings or AdaptiveSettings()
    check_fields(s)
    modes = adaptive_modes(s.rules, s.budgets, s.kl_thresholds, s.router_probs, s.gate_thresholds)
    check_ceiling(s.ceiling)
    require_looped(model)
    gates = [GateHalt(model, t) for t, _mode in todo_pairs(s.gate_thresholds, modes, "gate", want)]
    run = _AdaptiveRun(
        model, cfg, s.ceiling, dataset, split, s.calib_split, max_tokens, s.calib_max_tokens,
        batch_size or cfg.eval.batch_size, s.label_threshold, s.skip, s.timing_repeats,
        s.time_dense, device, progress,
    )  # fmt: skip

    def todo(rule: str, values: Sequence[float]) -> list[tuple[float, str]]:
        return todo_pairs(values, modes, rule, want)

    results: list[dict[str, Any]] = []
    if todo("maxtoken", s.budgets):
        results += run.maxtoken(todo("maxtoken", s.budgets))
    results += [run.per_token(KLHalt(thr)) for thr, _mode in todo("kl", s.kl_thresholds)]
    if todo("router", s.router_probs):
        results += run.router(todo("router", s.router_probs))
    results += [run.per_token(g) for g in gates]  # the model's own exit rule (Ouro's gate)
    uniform = {
        T: time_uniform(model, run.data(), T, device=device, repeats=s.timing_repeats)
        for T in sorted({int(t) for t in s.timing_depths})
    }
    return {
        "method": cfg.method_label,
        "dataset": dataset or cfg.data.dataset,
        "split": canonical_split(split),
        "calib_split": canonical_split(s.calib_split),
        "ceiling": s.ceiling,
        "max_tokens": max_tokens,
        "calib_max_tokens": s.calib_max_tokens,
        "results": results,
        "uniform_wall_clock_s": uniform,
    }


def evaluate_adaptive_checkpoint(
    path: str,
    settings: AdaptiveSettings | None = None,
    *,
    data_dir: str | None = None,
    device: str = "auto",
    **kw: Any,
) -> dict[str, Any]:
    """:func:`evaluate_adaptive` on a checkpoint folder; the result also carries ``checkpoint``
    and the run's ``config`` (a RunConfig, for the store records)."""
    from looplm.device import resolve_device
    from looplm.model.checkpoint import load_checkpoint

    dev = resolve_device(device)
    model, cfg, _ = load_checkpoint(path, map_location=dev)
    require_looped(model)
    if data_dir:
        cfg.data.data_dir = data_dir
    out = evaluate_adaptive(model, cfg, settings, device=dev, **kw)
    return {"checkpoint": str(path), **out, "config": cfg}


def store_adaptive(
    result: dict[str, Any], cfg: Any, store: str, *, tag: str = "", protocol: str | None = None
) -> int:
    """Write one results-store row per rule setting of ``result`` (depth = the ceiling,
    ``adaptive_mode`` = the rule setting, marked as the ``adaptive`` kind's); returns how many."""
    from looplm.evaluate.kinds import get_kind
    from looplm.evaluate.records import adaptive_records, eval_tag
    from looplm.results.store import ResultsStore

    records = get_kind("adaptive").stamp(
        adaptive_records(
            result,
            cfg,
            tag=eval_tag(tag, max_tokens=result.get("max_tokens")),
            protocol=protocol,
            extra={"checkpoint": str(result["checkpoint"])},
        )
    )
    with ResultsStore(store) as s:
        s.put_many(records)
    return len(records)


__all__ = [
    "AdaptiveSettings",
    "DEFAULT_BUDGETS",
    "DEFAULT_CEILING",
    "DEFAULT_KL_THRESHOLDS",
    "DEFAULT_LABEL_THRESHOLD",
    "DEFAULT_ROUTER_PROBS",
    "RULES",
    "Calibration",
    "LinearRouter",
    "UpdateTrace",
    "adaptive_modes",
    "calibrate_threshold",
    "check_ceiling",
    "evaluate_adaptive",
    "evaluate_adaptive_checkpoint",
    "evaluate_maxtoken",
    "evaluate_per_token",
    "evaluation_batches",
    "fit_router",
    "harvest_router_data",
    "max_token_updates",
    "maxtoken_forward",
    "mean_depth",
    "per_token_halting",
    "relative_update",
    "require_looped",
    "stopping_depths",
    "store_adaptive",
    "time_uniform",
    "update_trace",
]
