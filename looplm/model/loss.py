"""Cross-entropy through the tied vocabulary head, chunked over rows.

``linear_cross_entropy(x, W, t)`` returns ``Σ_i CE(x_i Wᵀ, t_i)`` (summed NLL) for x: (N, d),
W: (V, d), t: (N,), without keeping an (N, V) logits tensor alive. Rows are processed in chunks of
about ``CHUNK_ELEMENTS / V`` rows; for each chunk the logits are formed, reduced to the loss, and —
when a gradient is needed — turned straight into the chunk's contributions to ``∂/∂x`` and
``∂/∂W`` (softmax − one-hot), which are kept instead of the logits. The backward pass only scales
those by the incoming gradient. Matrix-multiplication work equals the plain
``F.cross_entropy(F.linear(x, W).float(), t)`` path (three products); peak memory for the head
drops from several (N, V) fp32 buffers to one chunk's.

Numerics: in fp32 the result equals the plain path to rounding (~1e-7 relative). Under autocast
the products run in the autocast dtype, logits are rounded to it and promoted to fp32 for the
log-sum-exp, and the logit gradient is rounded to the autocast dtype before the two backward
products, as autograd does; it is rounded before (not after) the scaling by the incoming gradient
and ``∂/∂W`` is accumulated over chunks in fp32, so gradients differ from the plain path at the
bf16 rounding level (~3e-3 relative).
"""

from __future__ import annotations

import contextlib

import torch

CHUNK_ELEMENTS = 1 << 25  # logits per chunk (32M fp32 = 128 MiB): 667 rows at |V| = 50,257


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk for a vocabulary of ``vocab_size``."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def _compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def _chunk_logits(x_c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x_c @ w.t()  # (n, V) in the compute dtype


def _nll_rows(logits: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lf = logits.float()  # (n, V)
    lse = torch.logsumexp(lf, dim=-1)  # (n,)
    picked = lf.gather(1, t[:, None]).squeeze(1)  # (n,)
    return lse - picked, lse


def _softmax_and_nll(logits: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax (n, V) fp32, NLL (n,)) of one chunk, in place on a single fp32 buffer.

    One exponential pass over the chunk instead of two (log-sum-exp, then softmax again): the
    elementwise work over (n, V), not the products, dominates the head's time on a CPU.
    """
    p = logits.float() if logits.dtype != torch.float32 else logits  # (n, V), owned buffer
    picked = p.gather(1, t[:, None]).squeeze(1)  # (n,)
    m = p.amax(dim=-1, keepdim=True)  # (n, 1)
    p.sub_(m).exp_()
    s = p.sum(dim=-1, keepdim=True)  # (n, 1)
    p.div_(s)
    lse = m.squeeze(1) + s.squeeze(1).log()  # (n,)
    return p, lse - picked


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int):
        cdt = _compute_dtype(x)
        dev = x.device.type
        with torch.autocast(dev, enabled=False) if cdt is not None else contextlib.nullcontext():
            xc = x.to(cdt) if cdt is not None else x  # (N, d)
            w = weight.to(cdt) if cdt is not None else weight  # (V, d)
            if w.dtype != xc.dtype:
                w = w.to(xc.dtype)
            grad_x = torch.empty_like(x, dtype=torch.float32)  # (N, d)
            grad_w = torch.zeros_like(weight, dtype=torch.float32)  # (V, d)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for i in range(0, x.shape[0], rows):
                x_c, t_c = xc[i : i + rows], targets[i : i + rows]
                g, nll = _softmax_and_nll(_chunk_logits(x_c, w), t_c)  # (n, V) fp32, (n,)
                total += nll.sum()
                g[torch.arange(len(t_c), device=g.device), t_c] -= 1.0  # softmax − one-hot
                g = g.to(xc.dtype)
                grad_x[i : i + rows] = (g @ w).float()  # (n, d)
                grad_w += (g.t() @ x_c).float()  # (V, d)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (x.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        gx = (grad_x * grad_out).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gw = (grad_w * grad_out).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


@torch.no_grad()
def _forward_only(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, want_correct: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    cdt = _compute_dtype(x)
    dev = x.device.type
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device) if want_correct else None
    with torch.autocast(dev, enabled=False) if cdt is not None else contextlib.nullcontext():
        xc = x.to(cdt) if cdt is not None else x
        w = weight.to(xc.dtype)
        for i in range(0, x.shape[0], rows):
            t_c = targets[i : i + rows]
            logits = _chunk_logits(xc[i : i + rows], w)
            nll, _ = _nll_rows(logits, t_c)
            total += nll.sum()
            if correct is not None:
                correct += (logits.argmax(-1) == t_c).sum()
    return total, correct


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """Summed NLL of ``x @ weightᵀ`` against ``targets``: x (N, d), weight (V, d), targets (N,).

    Differentiable in ``x`` and ``weight``; never holds more than one chunk of logits.
    """
    rows = rows or chunk_rows(weight.shape[0])
    if x.shape[0] == 0:
        return (x.sum() * 0.0 + weight.sum() * 0.0).float()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets, rows)
    return _forward_only(x, weight, targets, rows, False)[0]


def linear_nll_and_correct(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ NLL, number of argmax hits) without gradients, chunked like :func:`linear_cross_entropy`."""
    rows = rows or chunk_rows(weight.shape[0])
    total, correct = _forward_only(x, weight, targets, rows, True)
    return total, correct
