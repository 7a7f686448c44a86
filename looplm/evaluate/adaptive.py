"""Adaptive loop depth under a loop ceiling C (default 48): three stopping rules.

All three run one trained shared-block model (``LoopedLM``) and stop the recurrence early; every
rule runs at least one loop and at most C. Quality is token-weighted NLL → PPL over the scored
tokens (targets ≠ -100), exactly as the fixed-depth sweep; the achieved **mean active depth** is the
token-weighted mean number of loops the scored tokens received (for the per-example rule every
token of an example gets that example's depth; all evaluation windows are full-length except
possibly the last one, so this equals the per-example mean up to that window).

1. ``maxtoken`` — the paper's max-token hidden-update stopping rule, **per example** (Appendix
   "Adaptive-Depth Evaluation"). After loop t the per-token relative update is
   ``r_{b,l,t} = ‖h_t − h_{t−1}‖₂ / ‖h_{t−1}‖₂`` (hidden coordinates, float64); the example's
   statistic is its largest value over the scored tokens, ``u_{b,t} = max_l r_{b,l,t}``. Example b
   stops at the first t with ``u_{b,t} < τ`` (else at C) and is read out from ``h_t``. The paper
   names the rule but not the norm; the relative L2 change is scale-free (SCSE's states and the
   baseline's states have very different norms) and is what seed 003 (2) calls the per-token
   state change. ``τ = 0`` never stops early (→ the fixed-depth result at C); ``τ = inf`` stops
   after the first loop. Calibration: one ceiling-length unroll per validation example gives
   ``u_{b,1..C}`` (no readout needed); the stopping depth is monotone in τ, so the threshold for a
   target mean budget is found by bisection on log τ (:func:`calibrate_threshold`), then applied to
   test with a real early-exit implementation (:func:`maxtoken_forward`: finished examples are
   dropped from the batch, so the work really shrinks).

2. ``kl`` — the training-free per-token halting rule of seed 003 (2). With ``p_t =
   softmax(readout(h_t))``, token l halts after the first loop t with
   ``KL(p_t ‖ p_{t−1}) < τ`` (``p_0`` reads out the initial state). A halted token's recurrent state
   is **frozen**: it keeps its state, and its output is read from that state. Attention is causal
   and every token still attends to all earlier tokens, *including halted ones*: later, still
   active tokens see the halted tokens' frozen states as keys/values (the block input built from
   the frozen state at the current loop step). τ = 0 never halts, which reproduces full-depth
   logits bit for bit (the dense code path is used while every token is active).

3. ``router`` — the learned linear router baseline of seed 003 (2): a logistic regression on the
   RMS-normalised hidden state ``h_t`` of a token predicting "converged at this step", with labels
   harvested from the same model on validation: label 1 when ``KL(p_t ‖ p_{t−1}) < τ_label``
   (the same convergence criterion the KL rule reads). On test a token halts (and is frozen
   exactly as in rule 2) when the router's probability reaches ``p``.

Work skipping for per-token halting (rules 2 and 3): :func:`sparse_block_forward` computes the
shared block's output only for *active* query rows — query projection, attention rows, output
projection and SwiGLU — while keys and values are still computed for every token, because causal
attention needs the K/V of halted tokens (and for step-conditioned methods the block input of a
frozen token can change with t, so its K/V cannot be cached once). So a halted token still costs the
K/V projection (4d² of the 8d² + 6d·d_ff + 4Ld proxy per loop) and the work per loop is padded to
the example with the most active tokens. The FLOP proxy reported with each rule is the paper's
Eq. 20/21 at the achieved mean depth (``looplm.flops``), i.e. an idealised count; the wall-clock
figure is measured.

Public API: :func:`max_token_updates`, :func:`update_trace`, :func:`stopping_depths`,
:func:`calibrate_threshold`, :func:`maxtoken_forward`, :func:`evaluate_maxtoken`,
:func:`sparse_block_forward`, :func:`per_token_halting`, :class:`KLHalt`, :class:`RouterHalt`,
:class:`LinearRouter`, :func:`harvest_router_data`, :func:`fit_router`, :func:`evaluate_per_token`,
:func:`time_uniform`, :func:`evaluation_batches`, :func:`evaluate_adaptive`,
:func:`evaluate_adaptive_checkpoint`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from looplm.errors import LoopLMError
from looplm.model.block import BlockCall
from looplm.model.recurrences import LoopContext

DEFAULT_CEILING = 48
DEFAULT_BUDGETS = (8, 16, 24)
DEFAULT_KL_THRESHOLDS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3)
DEFAULT_ROUTER_PROBS = (0.5, 0.7, 0.9)
DEFAULT_LABEL_THRESHOLD = 1e-2
RULES = ("maxtoken", "kl", "router")


# ============================================================================ shared helpers
def require_looped(model: torch.nn.Module) -> None:
    """Adaptive depth needs a shared-block model (``model.recurrence``)."""
    if not getattr(model, "is_looped", False) or not hasattr(model, "recurrence"):
        raise LoopLMError(
            f"adaptive depth needs a shared-block looped model; got {type(model).__name__} "
            "(the unshared Transformer has no recurrence to stop)"
        )
    if model.training:
        raise LoopLMError("adaptive evaluation needs the model in eval mode (call model.eval())")


def check_ceiling(ceiling: int) -> int:
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 1:
        raise LoopLMError(f"ceiling={ceiling!r}: the loop ceiling must be an integer >= 1")
    return ceiling


def index_context(ctx: LoopContext, idx: torch.Tensor) -> LoopContext:
    """The context of the batch rows ``idx`` (every context tensor is batch-first)."""
    return LoopContext(
        e=ctx.e[idx], anchor=ctx.anchor[idx], extra={k: v[idx] for k, v in ctx.extra.items()}
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _token_mask_for(state: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """(B, L) token mask → broadcastable over a recurrent state shaped (B, …, L, d)."""
    B, L = active.shape
    if state.dim() < 3 or state.shape[0] != B or state.shape[-2] != L:
        raise LoopLMError(
            f"per-token halting needs recurrent states shaped (batch, ..., length, width); "
            f"got {tuple(state.shape)} for a ({B}, {L}) batch"
        )
    return active.view(B, *([1] * (state.dim() - 3)), L, 1)


def relative_update(h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
    """Per-token ``‖h − h_prev‖₂ / ‖h_prev‖₂``: (B, L, d) × 2 → (B, L) float64."""
    num = (h.double() - h_prev.double()).norm(dim=-1)
    den = h_prev.double().norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    return num / den


def max_token_updates(h: torch.Tensor, h_prev: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The per-example statistic of rule 1: max over scored tokens of the relative update, (B,)."""
    r = relative_update(h, h_prev).masked_fill(~valid, 0.0)  # (B, L)
    return r.amax(dim=1)


def _nll_rows(model, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL (float64, 0 where y = -100) and argmax-correct flags: (B, L) each."""
    valid = y != -100
    nll = torch.zeros(y.shape, dtype=torch.float64, device=y.device)
    correct = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
    if valid.any():
        logits = model.readout(h[valid]).float()  # (N, V)
        tgt = y[valid]
        nll[valid] = F.cross_entropy(logits, tgt, reduction="none").double()
        correct[valid] = logits.argmax(-1) == tgt
    return nll, correct


def _timed_min(fn, batches, device: torch.device, repeats: int) -> float:
    """Min over ``repeats`` passes of the summed wall clock of ``fn(x, y)`` over ``batches``
    (the minimum is the usual noise-robust estimate on a shared machine); inf if repeats < 1."""
    best = math.inf
    for _ in range(repeats):
        total = 0.0
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            _sync(device)
            t0 = time.perf_counter()
            fn(x, y)
            _sync(device)
            total += time.perf_counter() - t0
        best = min(best, total)
    return best


def _flops_fields(flops_cfg: dict[str, Any] | None, mean_depth: float) -> dict[str, float]:
    if not flops_cfg:
        return {}
    from looplm.evaluate.records import flops_per_token

    return flops_per_token(mean_depth=mean_depth, **flops_cfg)


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
    rec = model.recurrence
    ups, ns = [], []
    for x, y in tqdm(batches, disable=not progress, desc="trace", leave=False):
        x, y = x.to(device), y.to(device)
        valid = y != -100
        keep = valid.any(dim=1)
        ctx = model.prepare(x)
        s = rec.init_state(ctx)
        h_prev = rec.to_hidden(s, ctx)
        cols = []
        for t in range(ceiling):
            s = rec.step(model.block, s, ctx, t)
            h = rec.to_hidden(s, ctx)
            cols.append(max_token_updates(h, h_prev, valid))  # (B,)
            h_prev = h
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
    rec = model.recurrence
    B = x.shape[0]
    ctx = model.prepare(x)
    s = rec.init_state(ctx)
    h_prev = rec.to_hidden(s, ctx)  # (B, L, d)
    out = torch.empty_like(h_prev)
    depth = torch.full((B,), ceiling, dtype=torch.long, device=x.device)
    rows = torch.arange(B, device=x.device)  # batch rows still running
    for t in range(1, ceiling + 1):
        s = rec.step(model.block, s, ctx, t - 1)
        h = rec.to_hidden(s, ctx)  # (A, L, d)
        if t == ceiling:
            out[rows] = h
            break
        stop = max_token_updates(h, h_prev, valid) < threshold  # (A,)
        if bool(stop.any()):
            out[rows[stop]] = h[stop]
            depth[rows[stop]] = t
            keep = ~stop
            if not bool(keep.any()):
                break
            rows, s, h, valid = rows[keep], s[keep], h[keep], valid[keep]
            ctx = index_context(ctx, keep)
        h_prev = h
    return out, depth


@torch.no_grad()
def evaluate_maxtoken(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
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
    from tqdm.auto import tqdm

    require_looped(model)
    device = torch.device(device)
    sum_nll, n_tok, n_correct, depth_tok, n_ex = 0.0, 0, 0, 0, 0
    hist = np.zeros(ceiling + 1, dtype=np.int64)
    wall = 0.0
    for x, y in tqdm(
        batches, disable=not progress, desc=f"maxtoken τ={threshold:.3g}", leave=False
    ):
        x, y = x.to(device), y.to(device)
        valid = y != -100
        _sync(device)
        t0 = time.perf_counter()
        h, depth = maxtoken_forward(model, x, valid, threshold, ceiling)
        nll, correct = _nll_rows(model, h, y)
        _sync(device)
        wall += time.perf_counter() - t0
        n_b = valid.sum(1)
        sum_nll += float(nll.sum())
        n_tok += int(n_b.sum())
        n_correct += int(correct.sum())
        depth_tok += int((depth * n_b).sum())
        keep = n_b > 0
        n_ex += int(keep.sum())
        hist += np.bincount(depth[keep].cpu().numpy(), minlength=ceiling + 1)
    md = depth_tok / max(n_tok, 1)

    def once(x, y):
        h, _ = maxtoken_forward(model, x, y != -100, threshold, ceiling)
        _nll_rows(model, h, y)

    wall = min(wall, _timed_min(once, batches, device, repeats - 1))
    return {
        "rule": "maxtoken",
        "threshold": threshold,
        "ceiling": ceiling,
        "sum_nll": sum_nll,
        "n_tokens": n_tok,
        "n_correct": n_correct,
        "nll": sum_nll / max(n_tok, 1),
        "ppl": math.exp(min(sum_nll / max(n_tok, 1), 700.0)),
        "mean_depth": md,
        "n_examples": n_ex,
        "depth_hist": hist[1:].tolist(),
        "wall_clock_s": wall,
        "timing_repeats": repeats,
        **_flops_fields(flops_cfg, md),
    }


# ============================================================================ per-token halting
def sparse_block_forward(
    block: torch.nn.Module, x: torch.Tensor, active: torch.Tensor
) -> torch.Tensor:
    """``G(x)`` computed for the active rows of ``x`` only (0 elsewhere): x (B, L, d), active (B, L)
    bool. The block's own active-row mode (:class:`~looplm.model.block.Block`): keys and values for
    every row, queries, attention rows, output projection and SwiGLU for active rows. Eval only."""
    return block(x, active=active)


class KLHalt:
    """Rule 2's decision: halt when ``KL(p_t ‖ p_{t−1}) < threshold`` (needs the logits)."""

    needs_logits = True

    def __init__(self, threshold: float) -> None:
        if not threshold >= 0:
            raise LoopLMError(f"KL threshold {threshold!r} must be >= 0")
        self.threshold = float(threshold)

    @property
    def mode(self) -> str:
        return f"kl:thr={self.threshold:g}"

    def __call__(self, t: int, h: torch.Tensor, logp: torch.Tensor, logp_prev: torch.Tensor):
        kl = (logp.exp() * (logp - logp_prev)).sum(-1)  # (N,)
        return kl < self.threshold


@dataclass
class LinearRouter:
    """Logistic regression on ``rms_norm(h)``: P(converged) = σ(w·rms_norm(h) + b)."""

    weight: torch.Tensor  # (d,)
    bias: float
    label_threshold: float
    stats: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def features(h: torch.Tensor) -> torch.Tensor:
        """(…, d) → (…, d) float32, RMS-normalised (scale-free across methods)."""
        return F.rms_norm(h.float(), (h.shape[-1],), eps=1e-6)

    def prob(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(h.device)
        return torch.sigmoid(self.features(h) @ w + self.bias)

    def to_dict(self) -> dict[str, Any]:
        return {
            "weight": self.weight.tolist(),
            "bias": self.bias,
            "label_threshold": self.label_threshold,
            "stats": self.stats,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinearRouter:
        return cls(
            torch.tensor(d["weight"]),
            float(d["bias"]),
            float(d["label_threshold"]),
            dict(d.get("stats", {})),
        )


class RouterHalt:
    """Rule 3's decision: halt when the router's P(converged | h_t) ≥ ``prob``."""

    needs_logits = False

    def __init__(self, router: LinearRouter, prob: float = 0.5) -> None:
        if not 0.0 < prob <= 1.0:
            raise LoopLMError(f"router probability threshold {prob!r} must be in (0, 1]")
        self.router, self.prob = router, float(prob)

    @property
    def mode(self) -> str:
        return f"router:p={self.prob:g}"

    def __call__(self, t, h, logp, logp_prev):
        return self.router.prob(h) >= self.prob


@torch.no_grad()
def per_token_halting(
    model: torch.nn.Module,
    x: torch.Tensor,
    decide,
    ceiling: int = DEFAULT_CEILING,
    *,
    skip: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token halting with frozen states: ``(h_final (B, L, d), depth (B, L) int64)``.

    ``decide(t, h_act, logp_act, logp_prev_act) -> (N_active,) bool`` is asked after every loop
    t < C about the tokens still active (``logp`` are log-softmax outputs, None when
    ``decide.needs_logits`` is False). A halted token keeps its recurrent state for the rest of the
    unroll (later tokens still attend to it). ``skip`` computes the block for active rows only
    (:func:`sparse_block_forward`) once some token has halted; results equal the dense path up to
    floating-point rounding.
    """
    require_looped(model)
    check_ceiling(ceiling)
    rec = model.recurrence
    block = model.block
    ctx = model.prepare(x)
    s = rec.init_state(ctx)
    h = rec.to_hidden(s, ctx)  # (B, L, d)
    B, L = x.shape
    active = torch.ones(B, L, dtype=torch.bool, device=x.device)
    depth = torch.zeros(B, L, dtype=torch.long, device=x.device)
    needs_logits = getattr(decide, "needs_logits", True)
    logp_prev = F.log_softmax(model.readout(h).float(), dim=-1) if needs_logits else None
    for t in range(1, ceiling + 1):
        all_active = bool(active.all())
        step_block = block if (all_active or not skip) else BlockCall(block, active=active)
        s_new = rec.step(step_block, s, ctx, t - 1)
        s = s_new if all_active else torch.where(_token_mask_for(s, active), s_new, s)
        depth += active
        h = rec.to_hidden(s, ctx)
        if t == ceiling:
            break
        h_act = h[active]  # (N, d)
        logp = logp_p = None
        if needs_logits:
            logp = F.log_softmax(model.readout(h_act).float(), dim=-1)  # (N, V)
            logp_p = logp_prev[active]
            logp_prev[active] = logp
        halt = decide(t, h_act, logp, logp_p)  # (N,)
        if bool(halt.any()):
            new_active = active.clone()
            new_active[active] = ~halt
            active = new_active
            if not bool(active.any()):
                break
    return h, depth


@torch.no_grad()
def evaluate_per_token(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    decide,
    ceiling: int = DEFAULT_CEILING,
    *,
    skip: bool = True,
    device: str | torch.device = "cpu",
    progress: bool = False,
    flops_cfg: dict[str, Any] | None = None,
    repeats: int = 1,
    time_dense: bool = False,
) -> dict[str, Any]:
    """Rules 2/3 on ``batches``: NLL, average loops per scored token, depth histogram, wall clock
    (minimum over ``repeats`` passes). ``time_dense`` also times the dense path (``skip=False``,
    no work skipped) on the same batches as ``wall_clock_dense_s``, to measure what skipping
    saves."""
    from tqdm.auto import tqdm

    require_looped(model)
    device = torch.device(device)
    mode = getattr(decide, "mode", type(decide).__name__)
    sum_nll, n_tok, n_correct, depth_sum = 0.0, 0, 0, 0
    hist = np.zeros(ceiling + 1, dtype=np.int64)
    wall = 0.0
    for x, y in tqdm(batches, disable=not progress, desc=mode, leave=False):
        x, y = x.to(device), y.to(device)
        valid = y != -100
        _sync(device)
        t0 = time.perf_counter()
        h, depth = per_token_halting(model, x, decide, ceiling, skip=skip)
        nll, correct = _nll_rows(model, h, y)
        _sync(device)
        wall += time.perf_counter() - t0
        sum_nll += float(nll.sum())
        n_tok += int(valid.sum())
        n_correct += int(correct.sum())
        depth_sum += int(depth[valid].sum())
        hist += np.bincount(depth[valid].cpu().numpy(), minlength=ceiling + 1)
    md = depth_sum / max(n_tok, 1)

    def once(x, y, sk=skip):
        h, _ = per_token_halting(model, x, decide, ceiling, skip=sk)
        _nll_rows(model, h, y)

    wall = min(wall, _timed_min(once, batches, device, repeats - 1))
    dense = {}
    if time_dense:
        dense["wall_clock_dense_s"] = _timed_min(
            lambda x, y: once(x, y, False), batches, device, max(repeats, 1)
        )
    return {
        "rule": mode.split(":", 1)[0],
        "mode": mode,
        "ceiling": ceiling,
        "sum_nll": sum_nll,
        "n_tokens": n_tok,
        "n_correct": n_correct,
        "nll": sum_nll / max(n_tok, 1),
        "ppl": math.exp(min(sum_nll / max(n_tok, 1), 700.0)),
        "mean_depth": md,
        "frac_at_ceiling": float(hist[ceiling] / max(n_tok, 1)),
        "depth_hist": hist[1:].tolist(),
        "wall_clock_s": wall,
        "timing_repeats": repeats,
        **dense,
        "skip": skip,
        **_flops_fields(flops_cfg, md),
    }


# ============================================================================ router training
@torch.no_grad()
def harvest_router_data(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    ceiling: int = DEFAULT_CEILING,
    *,
    label_threshold: float = DEFAULT_LABEL_THRESHOLD,
    max_samples: int = 200_000,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convergence labels from a full (no-halting) unroll: features ``rms_norm(h_t)`` (N, d) and
    labels ``1{KL(p_t ‖ p_{t−1}) < label_threshold}`` (N,) for scored tokens and t = 1..C−1
    (the steps at which a halting decision is taken). At most ``max_samples`` rows, drawn
    uniformly without replacement with ``seed``."""
    from tqdm.auto import tqdm

    require_looped(model)
    rec = model.recurrence
    feats, labels = [], []
    for x, y in tqdm(batches, disable=not progress, desc="harvest", leave=False):
        x, y = x.to(device), y.to(device)
        valid = y != -100
        ctx = model.prepare(x)
        s = rec.init_state(ctx)
        h = rec.to_hidden(s, ctx)
        logp_prev = F.log_softmax(model.readout(h[valid]).float(), dim=-1)  # (N, V)
        for t in range(1, ceiling):
            s = rec.step(model.block, s, ctx, t - 1)
            h = rec.to_hidden(s, ctx)[valid]  # (N, d)
            logp = F.log_softmax(model.readout(h).float(), dim=-1)
            kl = (logp.exp() * (logp - logp_prev)).sum(-1)
            feats.append(LinearRouter.features(h).cpu())
            labels.append((kl < label_threshold).float().cpu())
            logp_prev = logp
    if not feats:
        raise LoopLMError(f"no router training data (ceiling={ceiling} must be >= 2)")
    X, Y = torch.cat(feats), torch.cat(labels)
    if X.shape[0] > max_samples:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(X.shape[0], generator=g)[:max_samples]
        X, Y = X[idx], Y[idx]
    return X, Y


def fit_router(
    X: torch.Tensor,
    Y: torch.Tensor,
    *,
    label_threshold: float = DEFAULT_LABEL_THRESHOLD,
    l2: float = 1e-4,
    max_iter: int = 200,
) -> LinearRouter:
    """Logistic regression (full-batch L-BFGS, L2 penalty ``l2`` on the weights)."""
    X = X.float()
    Y = Y.float()
    d = X.shape[1]
    pos = float(Y.mean())
    w = torch.zeros(d, requires_grad=True)
    b0 = math.log(max(pos, 1e-6) / max(1 - pos, 1e-6))
    b = torch.tensor(b0, requires_grad=True)
    if 0.0 < pos < 1.0:
        opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(X @ w + b, Y) + l2 * w.pow(2).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
    with torch.no_grad():
        p = torch.sigmoid(X @ w + b)
        acc = float(((p >= 0.5).float() == Y).float().mean())
        bce = float(F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), Y))
    stats = {
        "n_samples": int(X.shape[0]),
        "positive_rate": pos,
        "train_accuracy": acc,
        "train_bce": bce,
        "majority_accuracy": max(pos, 1 - pos),
    }
    return LinearRouter(w.detach().clone(), float(b.detach()), float(label_threshold), stats)


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
    return _timed_min(
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


def evaluation_batches(
    cfg, split: str, max_tokens: int | None, batch_size: int, dataset: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches of ``dataset`` (default: the run's) ``split``, capped at ``max_tokens``
    scored tokens: non-overlapping context-length windows of the token cache, or a synthetic
    task's evaluation examples. Reads only the evaluated split (not the training split)."""
    import dataclasses

    from looplm.data.synthetic import TASKS

    data = dataclasses.replace(cfg.data, eval_split=split)
    if dataset:
        data.dataset = dataset
    if data.dataset in TASKS:
        from looplm.data.sources import TaskSource

        src = TaskSource(data, cfg.model, cfg.train.seed)
        return list(src.eval_batches(batch_size, max_tokens, cfg.eval.n_examples))
    from looplm.data.cache import eval_windows, get_split_tokens

    tokens = get_split_tokens(
        data.dataset, split, cfg.model.tokenizer, data.data_dir, data.cache_dir
    )
    return list(eval_windows(tokens, batch_size, cfg.model.context, max_tokens))


def adaptive_modes(
    rules: Sequence[str],
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    kl_thresholds: Sequence[float] = DEFAULT_KL_THRESHOLDS,
    router_probs: Sequence[float] = DEFAULT_ROUTER_PROBS,
) -> dict[str, list[str]]:
    """The ``adaptive_mode`` strings each rule's settings produce (store identities)."""
    out: dict[str, list[str]] = {}
    for r in _parse_rules(rules):
        if r == "maxtoken":
            out[r] = [f"maxtoken:budget={float(b):g}" for b in budgets]
        elif r == "kl":
            out[r] = [KLHalt(float(t)).mode for t in kl_thresholds]
        else:
            out[r] = [f"router:p={float(p):g}" for p in router_probs]
    return out


def evaluate_adaptive(
    model: torch.nn.Module,
    cfg,
    *,
    rules: Sequence[str] = RULES,
    ceiling: int = DEFAULT_CEILING,
    budgets: Sequence[float] = DEFAULT_BUDGETS,
    kl_thresholds: Sequence[float] = DEFAULT_KL_THRESHOLDS,
    router_probs: Sequence[float] = DEFAULT_ROUTER_PROBS,
    label_threshold: float = DEFAULT_LABEL_THRESHOLD,
    dataset: str | None = None,
    split: str = "test",
    calib_split: str = "validation",
    max_tokens: int | None = None,
    calib_max_tokens: int | None = None,
    batch_size: int | None = None,
    skip: bool = True,
    timing_depths: Sequence[int] = (),
    timing_repeats: int = 1,
    time_dense: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = False,
    want: set[str] | None = None,
) -> dict[str, Any]:
    """Calibrate on ``calib_split`` and evaluate the requested rules on ``split``.

    Returns ``{"method", "dataset", "split", "calib_split", "ceiling", "max_tokens",
    "calib_max_tokens", "results": [one dict per rule setting, with "mode"], "uniform_wall_clock_s":
    {T: seconds}}``. ``want`` (a set of adaptive-mode strings such as ``"maxtoken:budget=8"``)
    restricts the work to those settings (the resumable sweep passes what the store lacks).
    Wall clocks are minima over ``timing_repeats`` passes; ``time_dense`` also times the per-token
    rules without work skipping.
    """
    from looplm.data.corpora import canonical_split
    from looplm.evaluate.records import flops_config

    modes = adaptive_modes(rules, budgets, kl_thresholds, router_probs)
    check_ceiling(ceiling)
    require_looped(model)
    bs = batch_size or cfg.eval.batch_size
    fl = flops_config(cfg)
    cache: dict[str, list] = {}

    def data(sp: str, cap: int | None) -> list:
        if sp not in cache:
            cache[sp] = evaluation_batches(cfg, sp, cap, bs, dataset)
        return cache[sp]

    def todo(rule: str, values: Sequence[float]) -> list[tuple[float, str]]:
        pairs = list(zip([float(v) for v in values], modes.get(rule, [])))
        return [(v, m) for v, m in pairs if want is None or m in want]

    results: list[dict[str, Any]] = []

    def calib_data() -> list:
        key = "calib:" + calib_split  # its own cache entry: the calibration cap may differ
        if key not in cache:
            cache[key] = evaluation_batches(cfg, calib_split, calib_max_tokens, bs, dataset)
        return cache[key]

    if todo("maxtoken", budgets):
        trace = update_trace(model, calib_data(), ceiling, device=device, progress=progress)
        for b, mode in todo("maxtoken", budgets):
            cal = calibrate_threshold(trace, b)
            r = evaluate_maxtoken(
                model,
                data(split, max_tokens),
                cal.threshold,
                ceiling,
                device=device,
                progress=progress,
                flops_cfg=fl,
                repeats=timing_repeats,
            )
            r.update(
                mode=mode, target=b, calib_mean_depth=cal.achieved, calib_examples=cal.n_examples
            )
            results.append(r)
    for thr, _mode in todo("kl", kl_thresholds):
        results.append(
            evaluate_per_token(
                model,
                data(split, max_tokens),
                KLHalt(thr),
                ceiling,
                skip=skip,
                device=device,
                progress=progress,
                flops_cfg=fl,
                repeats=timing_repeats,
                time_dense=time_dense,
            )
        )
    if todo("router", router_probs):
        X, Y = harvest_router_data(
            model,
            calib_data(),
            ceiling,
            label_threshold=label_threshold,
            device=device,
            progress=progress,
        )
        router = fit_router(X, Y, label_threshold=label_threshold)
        for p, _mode in todo("router", router_probs):
            r = evaluate_per_token(
                model,
                data(split, max_tokens),
                RouterHalt(router, p),
                ceiling,
                skip=skip,
                device=device,
                progress=progress,
                flops_cfg=fl,
                repeats=timing_repeats,
                time_dense=time_dense,
            )
            r.update(router=router.stats, label_threshold=label_threshold)
            results.append(r)
    uniform: dict[int, float] = {}
    for T in sorted({int(t) for t in timing_depths}):
        uniform[T] = time_uniform(
            model, data(split, max_tokens), T, device=device, repeats=timing_repeats
        )
    return {
        "method": cfg.method_label,
        "dataset": dataset or cfg.data.dataset,
        "split": canonical_split(split),
        "calib_split": canonical_split(calib_split),
        "ceiling": ceiling,
        "max_tokens": max_tokens,
        "calib_max_tokens": calib_max_tokens,
        "results": results,
        "uniform_wall_clock_s": uniform,
    }


def evaluate_adaptive_checkpoint(
    path: str, *, data_dir: str | None = None, device: str = "auto", **kw: Any
) -> dict[str, Any]:
    """:func:`evaluate_adaptive` on a checkpoint folder; the result also carries ``checkpoint``
    and the run's ``config`` (a RunConfig, for the store records)."""
    from looplm.checkpoint import load_checkpoint
    from looplm.device import resolve_device

    dev = resolve_device(device)
    model, cfg, _ = load_checkpoint(path, map_location=dev)
    require_looped(model)
    if data_dir:
        cfg.data.data_dir = data_dir
    out = evaluate_adaptive(model, cfg, device=dev, **kw)
    return {"checkpoint": str(path), **out, "config": cfg}
