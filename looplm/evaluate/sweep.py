"""Fixed-depth sweep: one set of weights evaluated at every loop depth T.

Language modelling: token-weighted mean NLL over every evaluated token, then PPL = exp(NLL).
Synthetic tasks: accuracy at the answer positions (argmax over the whole vocabulary), plus NLL.
All depths come from one unroll per batch (cost of the deepest T, not the sum of all T).

``compile=True``: every full batch (``batch_size`` × context) runs one ``torch.compile(fullgraph=
True, dynamic=False)`` graph of the whole unroll and every depth's readout, compiled once per
sweep; any other shape runs eager (see :class:`CompiledSweep`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from looplm.data.corpora import canonical_split
from looplm.data.sources import DataSource
from looplm.errors import LoopLMError
from looplm.model.loss import chunk_rows

#: The compiler backend of ``eval --compile`` (tests trace with ``aot_eager``: no C++ build).
COMPILE_BACKEND = "inductor"


def _depth_sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, depths: list[int]):
    """(len(depths), 3) float64: Σ NLL, scored tokens and argmax hits of each depth of
    ``depths`` (sorted) from one unroll of batch ``x`` against targets ``y``. Eager, it scores
    the scored rows through the chunked readout; inside a compiled graph ``model.score`` reads
    every row (unscored ones weigh 0), in slices of whole batch rows so no (B·L, V) logits
    table is made at once."""
    per = []
    step = max(1, chunk_rows(model.config.vocab_size) // max(1, x.shape[1]))
    compiling = torch.compiler.is_compiling()
    for _, h in model.iter_depths(x, depths):
        if not compiling:
            s = model.score(h, y)
            per.append(torch.stack([s.nll.double(), s.n_tokens.double(), s.correct.double()]))
            continue
        tot = []
        for i in range(0, x.shape[0], step):  # static slices: the shapes are fixed
            s = model.score(h[i : i + step], y[i : i + step])
            tot.append(torch.stack([s.nll.double(), s.n_tokens.double(), s.correct.double()]))
        per.append(torch.stack(tot).sum(0))
    return torch.stack(per)


class CompiledSweep:
    """The sweep's per-batch work — one unroll to the deepest T, then every depth's Σ NLL,
    scored tokens and hits stacked — as one ``torch.compile(fullgraph=True, dynamic=False)``
    graph for batches of ``shape`` (B, L). The graph holds no host sync (the sums stay on the
    device; the caller reads them once at the end) and is compiled on the first such batch and
    reused for every later one. Other shapes (the last partial batch, a task batch narrower than
    the context) run eager: a graph per shape would be compiled for one batch and not reused."""

    def __init__(
        self,
        model: torch.nn.Module,
        depths: list[int],
        shape: tuple[int, int],
        backend: Any = None,
    ) -> None:
        if not hasattr(model, "iter_depths"):
            raise LoopLMError(f"{type(model).__name__} has no iter_depths: it cannot be swept")
        self.model, self.depths, self.shape = model, sorted({int(d) for d in depths}), shape
        self.compiled_batches = 0
        fn = lambda x, y: _depth_sums(self.model, x, y, self.depths)  # noqa: E731
        backend = backend or COMPILE_BACKEND
        self.fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(len(depths), 3) float64 sums of batch ``x`` against ``y``, on their device."""
        if tuple(x.shape) == tuple(self.shape):
            self.compiled_batches += 1
            return self.fn(x, y)
        return _depth_sums(self.model, x, y, self.depths)  # eager: another shape, used once


@torch.no_grad()
def depth_sweep(
    model: torch.nn.Module,
    source: DataSource,
    depths: list[int],
    *,
    batch_size: int = 32,
    max_tokens: int | None = None,
    n_examples: int = 512,
    device: str | torch.device = "cpu",
    progress: bool = False,
    compile: bool | CompiledSweep = False,
) -> list[dict[str, Any]]:
    """One result dict per depth: ``depth, n_tokens, sum_nll, nll, ppl`` (+ accuracy for tasks).

    ``compile``: run every full batch (``batch_size`` × the model's context) through one compiled
    graph (:class:`CompiledSweep`; or pass one, e.g. with another backend); equal to the eager
    sweep within float32 summation order (the compiled readout reads every row, unscored ones
    weighted 0)."""
    from tqdm.auto import tqdm

    model.eval()
    depths = sorted({int(d) for d in depths})
    if not depths:
        raise LoopLMError("depth_sweep: no depths given")
    if compile is True:
        compile = CompiledSweep(model, depths, (batch_size, model.config.context))
    elif compile and compile.depths != depths:
        raise LoopLMError(f"the compiled sweep is for depths {compile.depths}, not {depths}")
    # Sums stay on the device (float64) and are read once at the end: no host sync per depth and
    # batch. Eager, one unroll serves every depth of a batch whatever its shape.
    sums = torch.zeros(len(depths), 3, dtype=torch.float64, device=device)  # Σ NLL, tokens, hits
    slot = {T: i for i, T in enumerate(depths)}
    t0 = time.perf_counter()
    batches = source.eval_batches(batch_size, max_tokens, n_examples)
    # counted in loop steps, not batches: a deep sweep spends minutes inside one batch
    bar = tqdm(disable=not progress, desc="eval (loop steps)", unit="step", leave=False)
    for i, (x, y) in enumerate(batches, 1):
        x, y = x.to(device), y.to(device)
        if compile:
            sums += compile(x, y)
            bar.update(depths[-1])
            bar.set_postfix(batch=i, T=depths[-1])
            continue
        done = 0
        for T, h in model.iter_depths(x, depths):
            bar.update(T - done)
            done = T
            s = model.score(h, y)  # chunked: no (N, V) logits table for the GPT-2 vocabulary
            sums[slot[T]] += torch.stack([s.nll.double(), s.n_tokens.double(), s.correct.double()])
        bar.set_postfix(batch=i, T=done)
    bar.close()
    return _rows(depths, sums.tolist(), time.perf_counter() - t0, source.is_task)


def _rows(depths: list[int], sums: list, wall: float, is_task: bool) -> list[dict[str, Any]]:
    """The sweep's result rows from each depth's (Σ NLL, tokens, hits)."""
    out = []
    for T, (sum_nll, n_tokens, n_correct) in zip(depths, sums):
        a = {"sum_nll": sum_nll, "n_tokens": int(n_tokens), "n_correct": int(n_correct)}
        nll = a["sum_nll"] / max(a["n_tokens"], 1)
        row: dict[str, Any] = {"depth": T, **a, "nll": nll, "ppl": math.exp(min(nll, 700.0))}
        if is_task:
            row["accuracy"] = a["n_correct"] / max(a["n_tokens"], 1)
            row["n_examples"] = a["n_tokens"]
            row["chance"] = 0.5
        else:
            row.pop("n_correct")
        row["sweep_wall_s"] = wall
        out.append(row)
    return out


def evaluate_checkpoint(
    path: str,
    depths: list[int],
    *,
    dataset: str | None = None,
    split: str | None = None,
    data_dir: str | None = None,
    max_tokens: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    progress: bool = False,
    compile: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint and sweep ``depths`` on its evaluation data (or another dataset/split);
    ``compile``: full batches through one compiled graph (:class:`CompiledSweep`)."""
    from looplm.data.sources import make_source
    from looplm.device import resolve_device
    from looplm.model.checkpoint import load_checkpoint

    dev = resolve_device(device)
    model, cfg, meta = load_checkpoint(path, map_location=dev)
    if dataset:
        cfg.data.dataset = dataset
    if split:
        cfg.data.eval_split = split
    if data_dir:
        cfg.data.data_dir = data_dir
    source = make_source(cfg.data, cfg.model, cfg.train.seed)
    max_tokens = max_tokens if max_tokens is not None else cfg.eval.max_tokens
    rows = depth_sweep(
        model,
        source,
        depths,
        batch_size=batch_size or cfg.eval.batch_size,
        max_tokens=max_tokens,
        n_examples=cfg.eval.n_examples,
        device=dev,
        progress=progress,
        compile=compile,
    )
    return {
        "checkpoint": str(path),
        "method": cfg.method_label,
        "preset": cfg.model.preset,
        "dataset": cfg.data.dataset,
        "split": canonical_split(cfg.data.eval_split),  # the store's name: validation
        "seed": cfg.train.seed,
        "step": meta["state"].get("step"),
        "max_tokens": max_tokens,
        "results": rows,
    }
