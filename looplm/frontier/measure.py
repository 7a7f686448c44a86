"""The computational frontier on synthetic tasks (Chen 2026, "Thinking Deeper, Not Longer").

* :func:`frontier_accuracy` — accuracy (and NLL) of one model over thinking steps T × task
  difficulty, one unroll per batch for all T, each difficulty on its own evaluation examples (a
  seed disjoint from training). Inside and beyond the training difficulty range.
* :func:`propagation_steps` — on the adjacency-masked graph task, the loop step from which each
  query's answer is correct (and stays correct up to the deepest step), next to the query's true
  shortest-path distance from the source: with one hop per loop step a node at distance d cannot be
  known reachable before step d.
* the climb shape of an accuracy curve lives with the figures, in
  :func:`looplm.frontier.section.climb_shape` (it reads stored numbers only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from looplm.data.sources import EVAL_SEED_OFFSET
from looplm.data.synthetic import NODE_TASKS, make_batch
from looplm.errors import LoopLMError, check_positive_int
from looplm.targets import IGNORE_INDEX


def _check_counts(**counts: int) -> None:
    for name, v in counts.items():
        check_positive_int(name, v)


def _batches(
    task: str,
    difficulty: int,
    n_examples: int,
    batch_size: int,
    context: int,
    task_args: dict[str, Any] | None = None,
):
    """Evaluation batches of one difficulty: ``n_examples`` rows, seeds disjoint from training."""
    for i, start in enumerate(range(0, n_examples, batch_size)):
        n = min(batch_size, n_examples - start)
        seed = EVAL_SEED_OFFSET + 7919 * difficulty + i
        yield make_batch(
            task, n, (difficulty, difficulty), seed=seed, max_len=context, task_args=task_args
        )


@torch.no_grad()
def frontier_accuracy(
    model: torch.nn.Module,
    task: str,
    depths: Sequence[int],
    difficulties: Sequence[int],
    *,
    n_examples: int = 256,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
    task_args: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per (difficulty, T): ``{"difficulty", "depth", "n_correct", "n_examples",
    "sum_nll", "n_tokens"}``. ``n_examples`` rows of each difficulty are scored (a node task scores
    every query node of a row); correct = argmax over the whole vocabulary equals the answer.
    ``task_args``: the run's ``data.task_args`` (a ``twohop`` run's knowledge base)."""
    if not depths or not difficulties:
        raise LoopLMError("frontier evaluation needs at least one depth and one difficulty")
    _check_counts(n_examples=n_examples, batch_size=batch_size)
    model.eval()
    rows = []
    for d in sorted({int(x) for x in difficulties}):
        acc: dict[int, list[float]] = {}
        for b in _batches(task, d, n_examples, batch_size, model.config.context, task_args):
            x, y = b.input_ids.to(device), b.targets.to(device)
            for T, h in model.iter_depths(x, list(depths)):
                a = acc.setdefault(T, [0, 0, 0.0])
                s = model.score(h, y)  # correct = argmax over the whole vocabulary
                a[0] += int(s.correct)
                a[1] += int(s.n_tokens)
                a[2] += float(s.nll)
        for T, (c, n, nll) in sorted(acc.items()):
            rows.append(
                {
                    "difficulty": d,
                    "depth": T,
                    "n_correct": c,
                    "n_examples": n,
                    "sum_nll": nll,
                    "n_tokens": n,
                }
            )
    return rows


@torch.no_grad()
def propagation_steps(
    model: torch.nn.Module,
    difficulties: Sequence[int],
    max_loops: int,
    *,
    task: str = "graph_nodes",
    n_examples: int = 128,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> dict[str, np.ndarray]:
    """Per query node: its hop ``distance`` from the source (−1: unreachable), the example's
    ``difficulty``, ``first_correct``: the first loop step t ∈ 1 … max_loops from which the
    answer stays correct through ``max_loops`` (0: correct from the initial state on; −1: wrong at
    ``max_loops``), and ``min_step``: the first step at which the source's information can have
    reached the node — ⌈(d − outside) / k⌉ for a k-layer core with ``outside`` prelude + coda
    layers (d for today's single-block models; :meth:`hops_per_step`)."""
    if task not in NODE_TASKS:
        raise LoopLMError(
            f"propagation steps need a node task ({', '.join(NODE_TASKS)}), not {task!r}"
        )
    if model.config.attention != "adjacency":
        raise LoopLMError(
            f"propagation steps need model.attention=adjacency (one hop per layer); this model "
            f"has model.attention={model.config.attention!r}, whose first-correct steps say "
            "nothing about hop distances"
        )
    if not difficulties:
        raise LoopLMError("propagation steps need at least one difficulty")
    _check_counts(max_loops=max_loops, n_examples=n_examples, batch_size=batch_size)
    model.eval()
    dist, diff, first = [], [], []
    for d in sorted({int(x) for x in difficulties}):
        for b in _batches(task, d, n_examples, batch_size, model.config.context):
            x, y = b.input_ids.to(device), b.targets.to(device)
            valid = y != IGNORE_INDEX
            tgt = y[valid]
            out = model(x, loops=max_loops, return_states=True)
            correct = []
            for h in out.states:  # t = 0 … max_loops
                h = model.finish(h, out.context)
                correct.append(model.readout(h[valid]).argmax(-1) == tgt)
            ok = torch.stack(correct, dim=1).cpu().numpy()  # (N, max_loops + 1)
            # first t from which every later step is correct
            stays = np.flip(np.logical_and.accumulate(np.flip(ok, axis=1), axis=1), axis=1)
            f = np.where(stays.any(axis=1), stays.argmax(axis=1), -1)
            first.append(f)
            dist.append(b.distance[valid.cpu()].numpy())
            diff.append(b.difficulty[valid.cpu()].numpy())
    k, outside = model.hops_per_step()
    d = np.concatenate(dist)
    return {
        "distance": d,
        "difficulty": np.concatenate(diff),
        "first_correct": np.concatenate(first),
        "min_step": np.where(d > 0, np.ceil(np.maximum(d - outside, 0) / k), -1).astype(int),
    }


def propagation_summary(p: dict[str, np.ndarray]) -> dict[str, Any]:
    """Correlation of the first-correct step with the true distance over reachable queries that
    end correct, how often a query was right before information could have reached it
    (``first_correct < min_step``) and exactly when it could (``== min_step``)."""
    from scipy.stats import pearsonr, spearmanr

    reach = (p["distance"] > 0) & (p["first_correct"] >= 0)
    d, f = p["distance"][reach], p["first_correct"][reach]
    m = p.get("min_step", p["distance"])[reach]
    out: dict[str, Any] = {
        "n_reachable_correct": int(reach.sum()),
        "n_reachable": int((p["distance"] > 0).sum()),
        "early": float(np.mean(f < m)) if d.size else math.nan,
        "exact": float(np.mean(f == m)) if d.size else math.nan,
    }
    if d.size > 2 and np.unique(d).size > 1 and np.unique(f).size > 1:
        out["pearson_r"] = float(pearsonr(d, f)[0])
        out["spearman_rho"] = float(spearmanr(d, f)[0])
    by = {}
    for k in np.unique(d):
        sel = f[d == k]
        by[int(k)] = {
            "mean": float(sel.mean()),
            "median": float(np.median(sel)),
            "n": int(sel.size),
        }
    out["first_correct_by_distance"] = by
    return out
