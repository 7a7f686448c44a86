"""Section ``matmul``: the measured dense bf16 matrix rate (8192³ products), the MFU denominator."""

from __future__ import annotations

import time
from typing import Any

from gpubench.common import Budget, sync


def matmul_rate(smoke: bool) -> float:
    """Measured TFLOP/s of a dense product (bf16 8192³ on GPU; fp32 512³ on CPU for --smoke)."""
    import torch

    if torch.cuda.is_available() and not smoke:
        n, dtype, dev, reps = 8192, torch.bfloat16, "cuda", 10
    else:
        n, dtype, dev, reps = 512, torch.float32, "cpu", 3
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def run(args, out: dict[str, Any], budget: Budget) -> None:
    out["matmul_tflops"] = matmul_rate(args.smoke)


def rate(args, out: dict[str, Any]) -> float:
    """The measured rate, measured now if the section was skipped or failed."""
    return out.get("matmul_tflops") or matmul_rate(args.smoke)


def summarize(out: dict[str, Any], args) -> list[str]:
    if "matmul_tflops" not in out:
        return []
    return [
        f"**Measured dense matrix rate**: {out['matmul_tflops']:.3g} TFLOP/s "
        f"({'fp32 512³, CPU' if args.smoke else 'bf16 8192³'}); MFU below is against it, "
        "FLOPs = 3 × Eq. 21 (body + head) per token at T = 8.",
        "",
    ]
