"""Measured batches for ``looplm diagnose``: fixed-shape (B, L) windows from a corpus, or held-out
examples of a synthetic task padded to one length.

The data layer does the work: corpora through ``looplm.data.get_split_tokens`` + ``eval_windows``
(the token cache), synthetic tasks through ``looplm.data.sources.TaskSource.eval_batches`` (the
evaluation seeds, disjoint from training).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.evaluate.settings import DataSettings
from looplm.settings.config import RunConfig
from looplm.targets import IGNORE_INDEX


# long: corpus and task inputs with their padding rules in one place
def load_batches(
    cfg: RunConfig,
    *,
    dataset: str | None = None,
    split: str | None = None,
    data_dir: str | None = None,
    cache_dir: str | None = None,
    batch_size: int = 4,
    seq_len: int | None = None,
    n_batches: int = 2,
    seed: int = 0,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict, int | None]:
    """``n_batches`` batches of one shape, a description of the data, and the pad id (or None).

    ``dataset``/``split``/``data_dir`` default to the checkpoint's own data config.
    """
    from looplm.data.synthetic import PAD_ID, TASKS

    if batch_size < 1 or n_batches < 1:
        raise LoopLMError(f"batch_size={batch_size} and batches={n_batches} must be >= 1")
    data = dataclasses.replace(cfg.data)
    if dataset:
        data.dataset = dataset
    if split:
        data.eval_split = split
    if data_dir:
        data.data_dir = data_dir
    if cache_dir:
        data.cache_dir = cache_dir
    info = {"dataset": data.dataset, "split": data.eval_split}
    if seq_len is not None and (data.dataset in TASKS or seq_len < 1):
        why = (
            f"it applies to text checkpoints only ({data.dataset} is a synthetic task whose "
            "examples set their own length); drop it"
            if data.dataset in TASKS
            else "the window length must be >= 1"
        )
        raise LoopLMError(f"--seq-len {seq_len}: {why}")
    if data.dataset in TASKS:
        from looplm.data.sources import TaskSource

        src = TaskSource(data, cfg.model, seed)
        raw = list(src.eval_batches(batch_size, None, n_examples=batch_size * n_batches))
        raw = raw[:n_batches]
        L = max(x.shape[1] for x, _ in raw)
        batches = []
        for x, y in raw:
            xp = torch.full((x.shape[0], L), PAD_ID, dtype=x.dtype)
            yp = torch.full((y.shape[0], L), IGNORE_INDEX, dtype=y.dtype)
            xp[:, : x.shape[1]], yp[:, : y.shape[1]] = x, y
            batches.append((xp, yp))
        info.update(split="eval", difficulty=list(data.eval_difficulty), kind="task")
        return batches, info, PAD_ID
    from looplm.data import eval_windows, get_split_tokens

    L = seq_len or cfg.model.context
    if L > cfg.model.context:
        raise LoopLMError(f"--seq-len {L} is longer than the model's context {cfg.model.context}")
    tokens = get_split_tokens(
        data.dataset, data.eval_split, cfg.model.tokenizer, data.data_dir, data.cache_dir
    )
    batches = []
    for x, y in eval_windows(tokens, batch_size, L, max_tokens=batch_size * L * n_batches):
        if x.shape[0] == batch_size and bool(
            (y != IGNORE_INDEX).all()
        ):  # fixed shapes, full windows
            batches.append((x, y))
        if len(batches) == n_batches:
            break
    if not batches:
        raise LoopLMError(
            f"{data.dataset}/{data.eval_split} has too few tokens for one {batch_size}×{L} batch"
        )
    info.update(kind="corpus", seq_len=L, tokenizer=cfg.model.tokenizer)
    return batches, info, None


def data_batches(
    cfg: RunConfig, data: DataSettings, *, batch_size: int, n_batches: int, seed: int
) -> tuple[list, dict, int | None]:
    """:func:`load_batches` of the data ``data`` selects (default: the checkpoint's own)."""
    return load_batches(
        cfg,
        dataset=data.data,
        split=data.split,
        data_dir=data.data_dir,
        cache_dir=data.cache_dir,
        batch_size=batch_size,
        seq_len=data.seq_len,
        n_batches=n_batches,
        seed=seed,
    )


def checkpoint_tokenizer(cfg: RunConfig) -> tuple[Any, str | None]:
    """The checkpoint's tokenizer and None, or None and why it could not be loaded."""
    from looplm.data import get_tokenizer

    try:
        return get_tokenizer(cfg.model.tokenizer), None
    except LoopLMError as exc:
        return None, str(exc)


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads for torch (None: torch's default)."""
    if threads is not None:
        torch.set_num_threads(threads)
