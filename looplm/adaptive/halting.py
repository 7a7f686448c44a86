"""Per-token halting (rules 2 and 3 of :mod:`looplm.adaptive.depth`): the training-free KL
rule and the learned linear router of the per-token convergence study ("reading per-token
convergence outperforms learning to predict it").

Both run through the one per-token halting mechanism of the model's unroll
(:class:`looplm.model.halting.TokenHalting`, also used by adaptive decoding): a halted token's
recurrent state is frozen and later, still active tokens keep attending to it; the shared block
runs for active query rows only (the block's active-row mode; keys and values for every token).
The previous readout ``log p_{t−1}`` of every token is the one (N, V) table the KL rule keeps; the
current readout, the divergence and the decision go through the active rows in chunks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

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
from looplm.adaptive.settings import DEFAULT_CEILING, DEFAULT_LABEL_THRESHOLD
from looplm.errors import LoopLMError
from looplm.model.halting import PreviousReadout, TokenHalting
from looplm.model.readout import readout_kl
from looplm.targets import IGNORE_INDEX


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


@torch.no_grad()
def per_token_halting(
    model: torch.nn.Module,
    x: torch.Tensor,
    decide,
    ceiling: int = DEFAULT_CEILING,
    *,
    skip: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token halting with frozen states: ``(h_final (B, L, d), depth (B, L) int64)``;
    ``h_final`` is what the readout reads (the frozen states through the model's coda, if any).

    ``decide(t, h_act, logp_act, logp_prev_act) -> (N_active,) bool`` is asked after every loop
    t < C about the tokens still active (``logp`` are log-softmax outputs, None when
    ``decide.needs_logits`` is False). A decision that reads the logits must be row-wise: it is
    asked chunk by chunk of active rows. A halted token keeps its recurrent state for the rest of
    the unroll (later tokens still attend to it). ``skip`` computes the block for active rows
    only (the block's active-row mode) once some token has halted; results equal the dense path
    up to floating-point rounding.
    """
    require_looped(model)
    check_ceiling(ceiling)
    # stays eager: the active rows shrink as tokens halt (data-dependent shapes); one host
    # sync per step, in TokenHalting.observe
    halting = TokenHalting(decide, skip=skip)
    for last in model.unroll(model.prepare(x), ceiling, halting=halting):  # noqa: B007
        pass
    return model.finish(last.hidden, last.context), halting.depth


@torch.no_grad()
def evaluate_per_token(
    model: torch.nn.Module,
    batches: Iterable[Batch],
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
    require_looped(model)
    device = torch.device(device)
    mode = getattr(decide, "mode", type(decide).__name__)

    def once(x, y, sk=skip):
        h, depth = per_token_halting(model, x, decide, ceiling, skip=sk)
        return nll_rows(model, h, y), depth

    wall, outs = timed_batches(once, batches, device, progress=progress, desc=mode)
    sum_nll, n_tok, n_correct, depth_sum = 0.0, 0, 0, 0
    hist = np.zeros(ceiling + 1, dtype=np.int64)
    for y, ((nll, correct), depth) in outs:
        valid = y != IGNORE_INDEX
        sum_nll += float(nll.sum())
        n_tok += int(valid.sum())
        n_correct += int(correct.sum())
        depth_sum += int(depth[valid].sum())
        hist += np.bincount(depth[valid].cpu().numpy(), minlength=ceiling + 1)
    md = depth_sum / max(n_tok, 1)
    wall = min(wall, timed_min(once, batches, device, repeats - 1))
    dense = {}
    if time_dense:
        dense["wall_clock_dense_s"] = timed_min(
            lambda x, y: once(x, y, False), batches, device, max(repeats, 1)
        )
    return {
        "rule": mode.split(":", 1)[0],
        "mode": mode,
        "ceiling": ceiling,
        **nll_totals(sum_nll, n_tok, n_correct, md),
        "frac_at_ceiling": float(hist[ceiling] / max(n_tok, 1)),
        "depth_hist": hist[1:].tolist(),
        "wall_clock_s": wall,
        "timing_repeats": repeats,
        **dense,
        "skip": skip,
        **flops_fields(flops_cfg, md),
    }


def _take(h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The tokens ``rows`` (flat indices) of states ``h``: (B, L, d) → (N, d)."""
    return h.reshape(-1, h.shape[-1])[rows]


@torch.no_grad()
def harvest_router_data(
    model: torch.nn.Module,
    batches: Iterable[Batch],
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
    feats, labels = [], []
    for x, y in tqdm(batches, disable=not progress, desc="harvest", leave=False):
        x, y = x.to(device), y.to(device)
        # the scored tokens' flat indices, once per batch: each step gathers by them (a boolean
        # mask would read the host twice a step); the per-step .cpu() keeps device memory flat
        rows = (y != IGNORE_INDEX).view(-1).nonzero().squeeze(1)
        ctx = model.prepare(x)
        steps = model.unroll(ctx, max(ceiling - 1, 1))  # decisions at t = 1 … C−1

        # the labels read out what the readout reads (through any coda); the features read h_t
        prev = PreviousReadout(model, _take(model.finish(next(steps).hidden, ctx), rows))
        for st in steps if ceiling > 1 else ():
            h = _take(st.hidden, rows)  # (N, d)
            read = _take(model.finish(st.hidden, ctx), rows)
            kl = prev.advance(read, lambda _c, lp, lpp: readout_kl(lp, lpp))  # (N,)
            feats.append(LinearRouter.features(h).cpu())
            labels.append((kl < label_threshold).float().cpu())
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


__all__ = [
    "LinearRouter",
    "evaluate_per_token",
    "fit_router",
    "harvest_router_data",
    "per_token_halting",
]
