"""The batches an evaluation reads: context-length windows of one split of a corpus, or a
synthetic task's evaluation examples (the fixed-depth sweep and the adaptive rules alike)."""

from __future__ import annotations

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def evaluation_batches(
    cfg,
    split: str,
    max_tokens: int | None,
    batch_size: int,
    dataset: str | None = None,
    *,
    counts: str | None = None,
) -> list[Batch]:
    """Evaluation batches of ``dataset`` (default: the run's) ``split``, capped at ``max_tokens``
    scored tokens: non-overlapping context-length windows of the token cache, or a synthetic
    task's evaluation examples. Reads only the evaluated split (not the training split)."""
    import dataclasses

    from looplm.data.synthetic import TASKS

    data = dataclasses.replace(cfg.data, eval_split=split)
    if dataset:
        data.dataset = dataset
    if data.dataset in TASKS:
        from looplm.data.sources import TaskSource

        src = TaskSource(data, cfg.model, cfg.train.seed)
        return list(src.eval_batches(batch_size, max_tokens, cfg.eval.n_examples))
    from looplm.data.cache import get_split_tokens
    from looplm.data.sources import eval_windows

    tokens = get_split_tokens(
        data.dataset, split, cfg.model.tokenizer, data.data_dir, data.cache_dir, counts=counts
    )
    return list(eval_windows(tokens, batch_size, cfg.model.context, max_tokens))
