"""Random-direction gain (paper, "Beyond Pointwise Bias: Operating Regimes").

    gain_t = ‖T_t(Δ + ε v; e) − T_t(Δ; e)‖_F / ε,     ‖v‖_F = 1,  ε = ε_fd = 1e-3,

averaged over four random probe directions (and measured batches). ``v`` is drawn per example:
each example's (L, d) slice of ``v`` is a Gaussian matrix scaled to unit Frobenius norm, and the
gain is computed per example. Examples never interact in the model (attention is within a
sequence), so this is the paper's per-input map; it also keeps the perturbation of each entry
large enough to measure (a single unit vector spread over a whole batch would move each entry by
~ε/√(B·L·d)). The statistic is a sampled directional gain: it neither estimates the Jacobian's
largest singular value nor certifies contraction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from looplm.diagnostics.settings import EPS_FD


def unit_directions(
    shape: tuple[int, ...],
    n: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``n`` random directions of ``shape`` = (B, …): (n, B, …), each example slice ‖·‖_F = 1."""
    # Drawn on the CPU so one seed gives the same probes on every device.
    v = torch.randn((n, *shape), generator=generator, dtype=torch.float64)
    flat = v.reshape(n, shape[0], -1)  # (n, B, L·d)
    flat = flat / flat.norm(dim=-1, keepdim=True)
    return flat.reshape(n, *shape).to(device=device, dtype=dtype)


def per_example_norm(x: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each example: (B, …) → (B,) in float64."""
    return x.reshape(x.shape[0], -1).double().norm(dim=-1)


def random_direction_gain(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    directions: torch.Tensor,
    *,
    eps: float = EPS_FD,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Finite-difference gains ``‖fn(x + ε v) − fn(x)‖_F / ε`` per direction and example.

    Args:
        fn: the map (e.g. ``T_t(·; e)``), (B, …) → (B, …).
        x: the point Δ, (B, …).
        directions: (n, B, …) from :func:`unit_directions`.
        eps: the finite-difference step ε_fd.
        base: ``fn(x)`` if already computed.

    Returns:
        (n, B) float64 gains.
    """
    fx = fn(x) if base is None else base
    gains = []
    for v in directions:
        gains.append(per_example_norm(fn(x + eps * v) - fx) / eps)  # (B,)
    return torch.stack(gains)  # (n, B)
