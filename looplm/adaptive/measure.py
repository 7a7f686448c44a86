"""What the adaptive-depth rules share: checks, timing, per-token NLL and result totals.

:mod:`looplm.adaptive.depth` (the per-example max-token rule and the driver) and
:mod:`looplm.adaptive.halting` (per-token KL halting and the linear router) both build on these.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from looplm.errors import LoopLMError

Batch = tuple[torch.Tensor, torch.Tensor]


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
    """The loop ceiling C, checked: an integer >= 1."""
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 1:
        raise LoopLMError(f"ceiling={ceiling!r}: the loop ceiling must be an integer >= 1")
    return ceiling


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall clocks measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nll_rows(model: torch.nn.Module, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-token NLL (float64, 0 where unscored) and argmax-correct flags: (B, L) each — the
    model's scorer per token (:meth:`~looplm.model.lm.LanguageModelBase.score`)."""
    s = model.score(h, y, per_token=True)
    return s.nll, s.correct


def timed_batches(
    fn: Callable[[torch.Tensor, torch.Tensor], Any],
    batches: Iterable[Batch],
    device: torch.device,
    *,
    progress: bool = False,
    desc: str = "",
) -> tuple[float, list[tuple[torch.Tensor, Any]]]:
    """``fn(x, y)`` on every batch (moved to ``device``), timed: (summed wall clock, [(y, out)])."""
    from tqdm.auto import tqdm

    wall, outs = 0.0, []
    for x, y in tqdm(batches, disable=not progress, desc=desc, leave=False):
        x, y = x.to(device), y.to(device)
        sync(device)
        t0 = time.perf_counter()
        out = fn(x, y)
        sync(device)
        wall += time.perf_counter() - t0
        outs.append((y, out))
    return wall, outs


def timed_min(fn, batches: Iterable[Batch], device: torch.device, repeats: int) -> float:
    """Min over ``repeats`` passes of the summed wall clock of ``fn(x, y)`` over ``batches``
    (the minimum is the usual noise-robust estimate on a shared machine); inf if repeats < 1."""
    best = math.inf
    for _ in range(repeats):
        best = min(best, timed_batches(fn, batches, device)[0])
    return best


def nll_totals(
    sum_nll: float, n_tokens: int, n_correct: int, mean_depth: float
) -> dict[str, float | int]:
    """The NLL totals every rule reports, in the order of the stored rows."""
    nll = sum_nll / max(n_tokens, 1)
    return {
        "sum_nll": sum_nll,
        "n_tokens": n_tokens,
        "n_correct": n_correct,
        "nll": nll,
        "ppl": math.exp(min(nll, 700.0)),
        "mean_depth": mean_depth,
    }


def flops_fields(flops_cfg: dict[str, Any] | None, mean_depth: float) -> dict[str, float]:
    """Eq. 20/21 per-token FLOPs at the achieved mean depth (empty without a config)."""
    if not flops_cfg:
        return {}
    from looplm.evaluate.records import flops_per_token

    return flops_per_token(mean_depth=mean_depth, **flops_cfg)
