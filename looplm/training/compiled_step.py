"""``train.compile``: the training loss compiled whole, one graph per loop depth T."""

from __future__ import annotations

from typing import Any

import torch

from looplm.model.block import Block
from looplm.settings.config import RunConfig

#: The compiler backend of ``train.compile`` (tests trace with ``aot_eager``: no C++ build).
COMPILE_BACKEND = "inductor"


class CompiledLoss:
    """``train.compile`` in a single process: the training loss — embedding, prelude, the whole
    unroll of T steps, coda, readout and cross-entropy — as one ``torch.compile(fullgraph=True)``
    graph per loop depth T, whose backward AOT autograd compiles with it (``loss.backward()``
    runs the compiled backward graph).

    Why the whole step and not the blocks: on a CPU (22m, T = 8, batch 2 × 128, measured
    alternately in ``benchmarks/compiled_step.py``) compiling only the blocks gained nothing,
    since the recurrence update, norms, Eq. 4's mask, the readout and the loss still ran eager,
    one kernel each; one graph over the unroll lets the compiler fuse those elementwise passes
    into the blocks' and the loss's. A graph per T, not one symbolic in T, because the unroll is
    a Python loop (every step's kernels are laid out in the graph): each T in the training depth
    range is compiled once, the first time it is drawn, and reused (``dynamic=False``; the
    compiler's cache keeps one entry per T, so its entry limit is raised to the range's size).

    The graph holds no host sync: token ids are checked on the host batch before it moves to the
    device, Eq. 4's per-example mask is an in-graph comparison, and the loss reads every row with
    unscored targets weighted 0 (so no shape depends on data).
    """

    def __init__(self, model: torch.nn.Module, n_depths: int, backend: Any = None) -> None:
        import torch._dynamo

        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, n_depths + 8)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * n_depths + 64)
        self.model = model
        self.depths: set[int] = set()
        backend = backend or COMPILE_BACKEND
        self.fn = torch.compile(self._loss, fullgraph=True, dynamic=False, backend=backend)

    def _loss(self, x, y, loops, objective, truncate_k, checkpoint_loops):
        return self.model.loss(
            x,
            y,
            loops,
            objective=objective,
            truncate_k=truncate_k,
            checkpoint_loops=checkpoint_loops,
            reduction="sum",
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor, *, loops: int, **kw) -> torch.Tensor:
        self.depths.add(loops)
        return self.fn(x, y, loops, kw["objective"], kw["truncate_k"], kw["checkpoint_loops"])


def compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` every Transformer block of ``model`` in place; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, Block):
            m.compile()
            n += 1
    return n


def compile_training(
    model: torch.nn.Module, cfg: RunConfig, distributed: bool
) -> CompiledLoss | None:
    """What ``train.compile`` compiles: the whole loss per T in a single process; in a distributed
    run each block in place (DDP's bucketed all-reduce would split a whole-step graph), returning
    None since the model itself is then what a step calls."""
    if distributed:
        compile_blocks(model)
        return None
    return CompiledLoss(model, cfg.train.depth_max - cfg.train.depth_min + 1)
