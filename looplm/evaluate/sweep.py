"""Fixed-depth sweep: one set of weights evaluated at every loop depth T.

Language modelling: token-weighted mean NLL over every evaluated token, then PPL = exp(NLL).
Synthetic tasks: accuracy at the answer positions (argmax over the whole vocabulary), plus NLL.
All depths come from one unroll per batch (cost of the deepest T, not the sum of all T).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from looplm.data.corpora import canonical_split
from looplm.data.sources import DataSource


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
) -> list[dict[str, Any]]:
    """One result dict per depth: ``depth, n_tokens, sum_nll, nll, ppl`` (+ accuracy for tasks)."""
    from tqdm.auto import tqdm

    model.eval()
    depths = sorted({int(d) for d in depths})
    # Sums stay on the device (float64 / int64) and are read once at the end: no host sync per
    # depth and batch. The sweep itself stays eager: batch shapes vary (the last batch, task rows)
    # and one unroll serves every depth, so a graph per (shape, depth set) would rarely be reused.
    sums = torch.zeros(len(depths), 3, dtype=torch.float64, device=device)  # Σ NLL, tokens, hits
    slot = {T: i for i, T in enumerate(depths)}
    t0 = time.perf_counter()
    batches = source.eval_batches(batch_size, max_tokens, n_examples)
    # counted in loop steps, not batches: a deep sweep spends minutes inside one batch
    bar = tqdm(disable=not progress, desc="eval (loop steps)", unit="step", leave=False)
    for i, (x, y) in enumerate(batches, 1):
        x, y = x.to(device), y.to(device)
        done = 0
        for T, h in model.iter_depths(x, depths):
            bar.update(T - done)
            done = T
            s = model.score(h, y)  # chunked: no (N, V) logits table for the GPT-2 vocabulary
            sums[slot[T]] += torch.stack([s.nll.double(), s.n_tokens.double(), s.correct.double()])
        bar.set_postfix(batch=i, T=done)
    bar.close()
    wall = time.perf_counter() - t0
    out = []
    for T, (sum_nll, n_tokens, n_correct) in zip(depths, sums.tolist()):
        a = {"sum_nll": sum_nll, "n_tokens": int(n_tokens), "n_correct": int(n_correct)}
        nll = a["sum_nll"] / max(a["n_tokens"], 1)
        row: dict[str, Any] = {"depth": T, **a, "nll": nll, "ppl": math.exp(min(nll, 700.0))}
        if source.is_task:
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
) -> dict[str, Any]:
    """Load a checkpoint and sweep ``depths`` on its evaluation data (or another dataset/split)."""
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
