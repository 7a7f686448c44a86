"""Options and loading shared by the commands that analyse a checkpoint on its own data
(``diagnose``, ``lens``): the data options, the batches they select, the checkpoint's tokenizer
and the torch thread count."""

from __future__ import annotations

import argparse
from typing import Any

from looplm.errors import LoopLMError


def add_data_options(p: argparse.ArgumentParser, *, data_help: str, split_help: str) -> None:
    """``--data``, ``--data-dir``, ``--cache-dir``, ``--split`` and ``--seq-len``."""
    p.add_argument("--data", help=data_help)
    p.add_argument("--data-dir", help="folder with local corpora (e.g. ../shared/data)")
    p.add_argument("--cache-dir", help="token cache folder")
    p.add_argument("--split", help=split_help)
    p.add_argument("--seq-len", type=int, help="window length for corpora (default: context)")


def load_data_batches(
    cfg: Any, args: argparse.Namespace, *, batch_size: int, n_batches: int, seed: int
) -> tuple[list, dict, int | None]:
    """``n_batches`` batches of ``batch_size`` from the data the options of
    :func:`add_data_options` select (default: the checkpoint's own), with the data's description
    and pad id (see :func:`looplm.diagnostics.inputs.load_batches`)."""
    from looplm.diagnostics.inputs import load_batches

    return load_batches(
        cfg,
        dataset=args.data,
        split=args.split,
        data_dir=args.data_dir,
        cache_dir=args.cache_dir,
        batch_size=batch_size,
        seq_len=args.seq_len,
        n_batches=n_batches,
        seed=seed,
    )


def checkpoint_tokenizer(cfg: Any) -> tuple[Any, str | None]:
    """The checkpoint's tokenizer and None, or None and why it could not be loaded."""
    from looplm.data import get_tokenizer

    try:
        return get_tokenizer(cfg.model.tokenizer), None
    except LoopLMError as exc:
        return None, str(exc)


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads for torch (None: torch's default)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
