"""Devices: ``auto``/``cpu``/``cuda`` resolved the same way by training, evaluation, diagnostics,
the experiment runner and the commands (loop-depth lists are read by :mod:`looplm.settings`,
the progress switch is :mod:`looplm.progress`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from looplm.errors import LoopLMError

if TYPE_CHECKING:  # torch is imported when a device is resolved, not when the CLI starts
    import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` → CUDA when available, else CPU; ``cuda`` without a GPU is a one-line error."""
    import torch

    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LoopLMError("train.device=cuda but no CUDA GPU is available; use cpu or auto")
    return torch.device(name)


#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_MAX.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_reusing = False


def reuse_freed_host_memory() -> bool:
    """Keep host memory that tensors free inside the process, for the next step to reuse.

    By default glibc hands every block above 32 MB straight back to the kernel (``mmap``), so each
    training step's large temporaries — the (tokens × vocabulary) logits, the tied embedding's
    gradient — come back as fresh pages that fault in one 4 KiB page at a time: at 22m on the
    CPU about 50,000 page faults per step, 10% of an fp32 step and 30% of a bf16-autocast one
    (``benchmarks/compiled_step.py``). With mmap off and the heap never trimmed, freed blocks are
    reused: the heap settles on the step's working set within a few steps, after which a step
    faults almost no page (none in most runs; now and then one block anew, at most 5% of the
    system allocator's faults in tests/test_host_allocator.py's probe); the process keeps its
    peak resident set until it ends. Process-wide, once; glibc (Linux) only — elsewhere, or if
    ``mallopt`` is missing, a no-op returning False. ``train.cpu_allocator=system`` leaves the allocator alone.
    """
    global _reusing
    if _reusing:
        return True
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the largest int: never trim the heap; then no mmap, so large blocks come from the heap too
    _reusing = bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_MAX, 0))
    return _reusing
