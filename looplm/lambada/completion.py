"""LAMBADA last-word completion at several loop depths (paper, "Out-of-Domain Completion").

Each passage is ``context + " " + target`` (target = last whitespace-separated word). Its token ids
and the target's token span come from :func:`looplm.data.locate_targets`; when the passage is
longer than the model context the **left** part of the context is dropped (the target and the
``context`` tokens just before it are kept), so every target is scored with as much context as the
model can take. Metrics per depth T, all over the held-out answer span:

* **target-token completion PPL** — ``exp(Σ NLL / Σ target tokens)`` over every target token,
  teacher-forced (token-weighted, as everywhere in looplm);
* **target-token accuracy** — fraction of target tokens whose argmax prediction is correct;
* **exact last-word accuracy** — fraction of passages whose target is reproduced exactly by greedy
  decoding from the context. Greedy decoding reproduces the target's k tokens iff the argmax at
  each of the k teacher-forced positions is the target token (each greedy step then sees exactly
  the teacher-forced prefix), so one forward pass gives it; a greedy output that spells the same
  word with a different tokenization counts as a miss (the usual LAMBADA ``is_greedy`` protocol).

The results go to the store as ``dataset='lambada'``, ``split='test'`` rows with ``n_tokens`` =
target tokens, ``extra['n_correct'] / extra['n_examples']`` = target-token accuracy (the report's
accuracy table), and ``extra['exact_word_correct'] / extra['n_passages']``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.model.readout import score_tokens
from looplm.targets import IGNORE_INDEX


@dataclass(frozen=True)
class LambadaItem:
    """One passage ready for the model: ``ids`` (≤ context + 1 tokens) and the target span
    ``ids[start:end]`` (start ≥ 1: at least one context token)."""

    ids: tuple[int, ...]
    start: int
    end: int
    truncated: bool


def lambada_items(examples, tokenizer, context: int) -> list[LambadaItem]:
    """Tokenize LAMBADA examples and left-truncate each to ``context`` input tokens."""
    from looplm.data.corpora import locate_targets

    if context < 2:
        raise LoopLMError(f"model context {context} is too short for LAMBADA (need >= 2)")
    items = []
    for i, span in enumerate(locate_targets(list(examples), tokenizer)):
        ids, start, end = list(span.ids), span.start, span.end
        k = end - start
        if k < 1 or start < 1:
            raise LoopLMError(f"LAMBADA example {i}: empty target or empty context")
        if k >= context:
            raise LoopLMError(
                f"LAMBADA example {i}: target has {k} tokens, longer than the context {context}"
            )
        cut = max(0, len(ids) - (context + 1))  # inputs are ids[:-1]: at most `context`
        items.append(LambadaItem(tuple(ids[cut:]), start - cut, end - cut, cut > 0))
    return items


def lambada_batches(
    items: Sequence[LambadaItem], batch_size: int, pad_id: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) int64 (B, Lmax): inputs ``ids[:-1]`` right-padded; ``y`` holds the target tokens at
    their predicting positions (``start−1 … end−2``) and ``IGNORE_INDEX`` everywhere else."""
    for b in range(0, len(items), batch_size):
        chunk = items[b : b + batch_size]
        L = max(len(it.ids) - 1 for it in chunk)
        x = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        y = torch.full((len(chunk), L), IGNORE_INDEX, dtype=torch.long)
        for i, it in enumerate(chunk):
            ids = torch.tensor(it.ids, dtype=torch.long)
            x[i, : len(ids) - 1] = ids[:-1]
            y[i, it.start - 1 : it.end - 1] = ids[it.start : it.end]
        yield x, y


@torch.no_grad()
def lambada_sweep(
    model: torch.nn.Module,
    items: Sequence[LambadaItem],
    depths: Sequence[int],
    *,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One dict per depth: ``depth, n_tokens, sum_nll, nll, ppl, n_correct, n_examples,
    token_accuracy, exact_word_correct, n_passages, exact_word_accuracy``."""
    from tqdm.auto import tqdm

    if not items:
        raise LoopLMError("no LAMBADA passages to evaluate")
    model.eval()
    depths = sorted({int(d) for d in depths})
    acc = {T: {"sum_nll": 0.0, "n_tokens": 0, "n_correct": 0, "exact": 0} for T in depths}
    t0 = time.perf_counter()
    n_batches = math.ceil(len(items) / batch_size)
    for x, y in tqdm(
        lambada_batches(items, batch_size),
        total=n_batches,
        disable=not progress,
        desc="lambada",
        leave=False,
    ):
        x, y = x.to(device), y.to(device)
        valid = y != IGNORE_INDEX  # (B, L) target positions
        for T, h in model.iter_depths(x, depths):
            nll, correct = score_tokens(model.readout, h, y)  # (B, L) each, chunked
            a = acc[T]
            a["sum_nll"] += float(nll.sum())
            a["n_tokens"] += int(valid.sum())
            a["n_correct"] += int(correct.sum())
            a["exact"] += int((correct | ~valid).all(dim=1).sum())  # every target token right
    wall = time.perf_counter() - t0
    out = []
    for T in depths:
        a = acc[T]
        nll = a["sum_nll"] / max(a["n_tokens"], 1)
        out.append(
            {
                "depth": T,
                "n_tokens": a["n_tokens"],
                "sum_nll": a["sum_nll"],
                "nll": nll,
                "ppl": math.exp(min(nll, 700.0)),
                "n_correct": a["n_correct"],
                "n_examples": a["n_tokens"],
                "token_accuracy": a["n_correct"] / max(a["n_tokens"], 1),
                "exact_word_correct": a["exact"],
                "n_passages": len(items),
                "exact_word_accuracy": a["exact"] / len(items),
                "n_truncated": sum(it.truncated for it in items),
                "sweep_wall_s": wall,
            }
        )
    return out


def evaluate_lambada_checkpoint(
    path: str,
    lambada_path: str,
    depths: Sequence[int],
    *,
    max_examples: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    progress: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint and evaluate LAMBADA (a ``lambada_test.jsonl`` file or its folder)."""
    from looplm.data.corpora import lambada_examples
    from looplm.data.tokenizers import get_tokenizer
    from looplm.device import resolve_device
    from looplm.model.checkpoint import load_checkpoint

    dev = resolve_device(device)
    model, cfg, meta = load_checkpoint(path, map_location=dev)
    if max_examples is not None and max_examples < 1:
        raise LoopLMError(f"max_examples={max_examples} must be >= 1")
    examples = lambada_examples(lambada_path)[:max_examples]
    items = lambada_items(examples, get_tokenizer(cfg.model.tokenizer), cfg.model.context)
    rows = lambada_sweep(
        model,
        items,
        depths,
        batch_size=batch_size or cfg.eval.batch_size,
        device=dev,
        progress=progress,
    )
    return {
        "checkpoint": str(path),
        "method": cfg.method_label,
        "preset": cfg.model.preset,
        "dataset": "lambada",
        "split": "test",
        "seed": cfg.train.seed,
        "step": meta["state"].get("step"),
        "max_examples": max_examples,
        "results": rows,
        "config": cfg,
    }
