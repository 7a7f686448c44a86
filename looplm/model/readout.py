"""Readout statistics over many positions without an (N, V) logits table.

Evaluation and diagnostics read the recurrent state out at many positions and loop steps; with
the GPT-2 vocabulary a full table of fp32 (or fp64) logits for a few thousand positions is
gigabytes. The helpers here take ``readout`` (``model.readout``: ``(n, d) → (n, V)``) and work
through the rows in chunks of :func:`~looplm.model.loss.chunk_rows` rows, as the training loss
and the depth sweep do, so at most one chunk of logits is alive at a time.

:func:`readout_kl` is the one definition of the successive-readout divergence
``KL(p_t ‖ p_{t−1}) = Σ_v p_t(v) (log p_t(v) − log p_{t−1}(v))`` that the KL halting rule, the
router's convergence labels and the convergence diagnostics all use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from looplm.model.loss import chunk_rows
from looplm.targets import IGNORE_INDEX

Readout = Callable[[torch.Tensor], torch.Tensor]


def readout_nll_static(
    readout: Readout, h: torch.Tensor, targets: torch.Tensor, hits: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Σ NLL, argmax hits or None) of ``readout(h)`` (B, L, d) against ``targets`` (B, L) inside a
    compiled graph: every row is read out and unscored rows (``IGNORE_INDEX``) weigh 0, so no
    shape depends on the targets' values (indexing the scored rows would end the graph). Inductor
    fuses the log-softmax and its backward into the (B·L, V) logits pass that the eager chunked
    loss makes by hand, but the whole fp32 logits table is kept for the backward. Hits are None
    with gradients or when not asked for."""
    logits = readout(h).float()  # (B, L, V)
    nll = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if (torch.is_grad_enabled() and logits.requires_grad) or not hits:
        return nll, None
    return nll, ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()


def readout_kl(logp: torch.Tensor, logp_prev: torch.Tensor) -> torch.Tensor:
    """``KL(p_t ‖ p_{t−1})`` over the last axis from log-probabilities: (…, V) × 2 → (…)."""
    return (logp.exp() * (logp - logp_prev)).sum(-1)


def row_chunks(n: int, vocab_size: int, rows: int | None = None) -> Iterator[slice]:
    """Slices covering ``range(n)`` in chunks of ``rows`` (default: :func:`chunk_rows`)."""
    step = rows or chunk_rows(vocab_size)
    for i in range(0, n, step):
        yield slice(i, min(i + step, n))


def log_probs(readout: Readout, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``log_softmax(readout(h))`` in ``dtype``: (n, d) → (n, V). Call it on one chunk."""
    return F.log_softmax(readout(h).to(dtype), dim=-1)


@torch.no_grad()
def readout_nll(
    readout: Readout,
    h: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    *,
    dtype: torch.dtype = torch.float32,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row NLL (float64) and argmax hits of ``readout(h)`` against ``targets``, chunked.

    h: (N, d), targets: (N,) → ((N,) float64, (N,) bool). Logits are cast to ``dtype`` before
    the log-softmax (float32 for evaluation, float64 for the diagnostics).
    """
    nll = torch.zeros(targets.shape, dtype=torch.float64, device=targets.device)
    correct = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    for c in row_chunks(h.shape[0], vocab_size, rows):
        logits = readout(h[c]).to(dtype)  # (n, V)
        nll[c] = F.cross_entropy(logits, targets[c], reduction="none").double()
        correct[c] = logits.argmax(-1) == targets[c]
    return nll, correct


@torch.no_grad()
def score_tokens(
    readout: Readout,
    h: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL (float64, 0 where unscored) and argmax hits (bool) of ``readout(h)`` at the
    positions whose target is not ``IGNORE_INDEX``: h (B, L, d), targets (B, L) → (B, L) each.
    Chunked over the scored rows (:func:`readout_nll`); ``vocab_size`` sizes the chunks (default:
    read from one row's readout)."""
    valid = targets != IGNORE_INDEX
    nll = torch.zeros(targets.shape, dtype=torch.float64, device=targets.device)
    correct = torch.zeros(targets.shape, dtype=torch.bool, device=targets.device)
    if bool(valid.any()):
        rows = h[valid]  # (N, d)
        V = vocab_size or readout(rows[:1]).shape[-1]
        nll[valid], correct[valid] = readout_nll(readout, rows, targets[valid], V, dtype=dtype)
    return nll, correct


@torch.no_grad()
def successive_kl_rows(
    readout: Readout,
    states: list[torch.Tensor],
    vocab_size: int,
    *,
    dtype: torch.dtype = torch.float64,
    rows: int | None = None,
) -> torch.Tensor:
    """``KL(p_t ‖ p_{t−1})`` for t = 1 … T over the rows of ``states`` (T + 1 tensors (N, d)):
    (T, N) in ``dtype``. Chunks go over rows, loop steps inside a chunk, so every readout is
    computed once and two chunks of log-probabilities are alive at a time."""
    T, n = len(states) - 1, states[0].shape[0]
    out = torch.empty(T, n, dtype=dtype, device=states[0].device)
    for c in row_chunks(n, vocab_size, rows):
        prev = log_probs(readout, states[0][c], dtype)  # (n_c, V)
        for t in range(1, T + 1):
            cur = log_probs(readout, states[t][c], dtype)
            out[t - 1, c] = readout_kl(cur, prev)
            prev = cur
    return out
