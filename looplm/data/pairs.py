"""Prompt/completion pairs for fine-tuning (``data.dataset=pairs:PATH``), the loss on the
completions only.

``PATH`` is a JSON-lines file whose every line is an object with string fields ``prompt`` and
``completion`` (the last 5% of lines are ``test``, the 5% before them ``validation``, the rest
``train``, as for a text file), or a folder of such files named by split (``train.jsonl``,
``valid.jsonl``, …). Each pair is tokenized with the model's own tokenizer (an imported
checkpoint's ``tokenizer.json``) as ``prompt ids + completion ids + end-of-text``; the targets of
positions that predict a prompt token are ``IGNORE_INDEX``, so only the completion (and its
end-of-text) is supervised. The pairs are packed one after another into rows of the context
length (a pair may continue into the next row; the last row is padded with ignored targets).
Training rows are drawn per step from the run seed and the step (so ``--resume`` replays them
exactly); validation reads every row once.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from looplm.errors import LoopLMError
from looplm.targets import IGNORE_INDEX

PREFIX = "pairs:"
FIELDS = ("prompt", "completion")


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The (prompt, completion) pairs of a JSON-lines file; one line names a bad record."""
    pairs = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise LoopLMError(f"could not read {str(path)!r}: {exc}") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LoopLMError(f"{str(path)!r} line {i} is not valid JSON: {exc}") from None
        bad = [f for f in FIELDS if not isinstance(rec, dict) or not isinstance(rec.get(f), str)]
        if bad:
            raise LoopLMError(
                f"{str(path)!r} line {i} has no string field {bad[0]!r}; each line needs "
                f"{' and '.join(FIELDS)}"
            )
        pairs.append((rec["prompt"], rec["completion"]))
    if not pairs:
        raise LoopLMError(f"{str(path)!r} holds no prompt/completion pairs")
    return pairs


def split_pairs(name: str, split: str) -> list[tuple[str, str]]:
    """The pairs of ``split`` of the source ``pairs:PATH``."""
    from looplm.data.corpora import canonical_split, text_split_slices
    from looplm.data.textfiles import _by_split

    path = Path(name.removeprefix(PREFIX)).expanduser()
    canon = canonical_split(split)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        by_split = _by_split(files)
        if canon not in by_split:
            raise LoopLMError(
                f"{name}: no {split} file (files named by split: {sorted(by_split) or 'none'})"
            )
        return [p for f in by_split[canon] for p in read_pairs(f)]
    if not path.is_file():
        raise LoopLMError(f"{name}: {path} is neither a .jsonl file nor a folder of them")
    pairs = read_pairs(path)
    slices = text_split_slices(len(pairs))
    if canon not in slices:
        raise LoopLMError(f"unknown split {split!r} for {name}; allowed: {', '.join(slices)}")
    a, b = slices[canon]
    return pairs[a:b]


def pack_pairs(
    pairs: list[tuple[str, str]], tok, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (rows, seq_len) int64: the pairs packed one after another, targets
    ``IGNORE_INDEX`` where the next token is part of a prompt (and in the last row's padding)."""
    xs: list[int] = []
    ys: list[int] = []
    for prompt, completion in pairs:
        p = tok.encode(prompt)
        seq = p + tok.encode(completion) + [tok.eot_id]
        xs += seq[:-1]
        # position i predicts seq[i + 1]: supervised when that token is the completion's
        ys += [t if i + 1 >= len(p) else IGNORE_INDEX for i, t in enumerate(seq[1:])]
    n_rows = -(-len(xs) // seq_len)
    x = np.zeros(n_rows * seq_len, dtype=np.int64)
    y = np.full(n_rows * seq_len, IGNORE_INDEX, dtype=np.int64)
    x[: len(xs)], y[: len(ys)] = xs, ys
    x, y = torch.from_numpy(x).view(n_rows, seq_len), torch.from_numpy(y).view(n_rows, seq_len)
    keep = (y != IGNORE_INDEX).any(dim=1)  # rows with nothing to learn are left out
    return x[keep], y[keep]
