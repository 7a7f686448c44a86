"""What the GPU suite's sections share: the time budget, GPU memory probes, the toy sizes of
``--smoke``, formatting."""

from __future__ import annotations

import time

# Toy model used by --smoke in place of the 22m / 95.6m shapes (the WikiText-2 runs keep GPT-2's
# vocabulary; the random-token benchmarks also shrink it).
SMOKE_DIMS = {
    "22m": ["model.d_model=32", "model.n_heads=2", "model.d_ff=64"],
    "95.6m": ["model.d_model=48", "model.n_heads=2", "model.d_ff=96"],
}
SMOKE_VOCAB = ["model.vocab_size=512"]


class Budget:
    """Wall-clock budget measured from ``t0`` (the suite's start when given)."""

    def __init__(self, seconds: float, t0: float | None = None) -> None:
        self.t0 = t0 if t0 is not None else time.time()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gb(nbytes: float) -> float:
    return nbytes / 2**30


def mem_reset() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    sync()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def mem_now() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    sync()
    return torch.cuda.memory_allocated()


def mem_peak(base: int = 0) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    sync()
    return gb(torch.cuda.max_memory_allocated() - base)


def free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fmt(v: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


def time_steps(step_fn, n: int) -> float:
    """Seconds per call of ``step_fn`` over ``n`` calls (synchronised)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step_fn()
    sync()
    return (time.perf_counter() - t0) / n
