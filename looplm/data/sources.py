"""Batches for training and evaluation, from a synthetic task or a token cache: the one place
where tokens become batches. A corpus's token array (the cache's memmap, or any 1-D array) is cut
into windows — ``sample_windows`` draws random training windows, ``eval_windows`` walks a split
once — and a task's examples are packed into rows by :func:`looplm.data.synthetic.make_batch`.

Every training batch is a pure function of (seed, step) and the global batch size: step k's global
batch holds ``world_size · grad_accum · batch_size`` rows drawn from one seed, and the micro-batch
``micro`` of rank ``rank`` is the row slice ``(micro · world_size + rank) · batch_size`` onwards.
So ranks see disjoint rows, resuming at step k replays exactly the batches an uninterrupted run
would have seen, and 2 ranks × b rows, 1 process × 2b rows and 1 process × b rows × 2 accumulation
steps all train on the same rows. (A single process without accumulation gets the batch it always
got: the global batch is its batch.)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from looplm.data.synthetic import TASKS, make_batch, task_arg_keys
from looplm.errors import LoopLMError
from looplm.settings.config import DataConfig, ModelConfig
from looplm.targets import IGNORE_INDEX

EVAL_SEED_OFFSET = 1_000_003  # evaluation examples never coincide with training seeds


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """A distinct, reproducible 63-bit seed for (run seed, step, rank)."""
    return (seed * 6_364_136_223_846_793_005 + step * 1_442_695_040_888_963_407 + rank * 97) % (
        2**63 - 1
    )


# ----------------------------------------------------------------------------- token windows


def _as_array(tokens) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().cpu().numpy()
    return tokens


def sample_windows(
    tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows: ``x = tokens[s:s+L]``, ``y = tokens[s+1:s+L+1]``, int64 (B, L).

    Window starts are uniform over every valid position and come from ``generator`` only, so
    the same seed gives the same batches.
    """
    tokens = _as_array(tokens)
    n = len(tokens)
    if batch_size < 1 or seq_len < 1:
        raise LoopLMError(f"batch_size={batch_size} and seq_len={seq_len} must be >= 1")
    if n < seq_len + 1:
        raise LoopLMError(f"{n} tokens are too few for windows of seq_len={seq_len} (+1 target)")
    starts = (
        torch.randint(0, n - seq_len, (batch_size,), generator=generator, device=generator.device)
        .cpu()
        .numpy()
    )  # (B,)
    idx = starts[:, None] + np.arange(seq_len + 1)  # (B, L+1)
    chunk = torch.from_numpy(tokens[idx].astype(np.int64))  # (B, L+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, L), (B, L)


def eval_windows(
    tokens: np.ndarray,
    batch_size: int,
    seq_len: int,
    max_tokens: int | None = None,
    pad_id: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Non-overlapping windows that predict every token of the split exactly once.

    Window k holds inputs ``tokens[kL : kL+L]`` and targets ``tokens[kL+1 : kL+L+1]``; together
    they predict tokens 1..N-1 (token 0 has no context). The last window may be partial: its
    inputs are padded with ``pad_id`` and its targets with ``IGNORE_INDEX``, so summing the loss
    over targets != IGNORE_INDEX counts each predicted token once. Standard non-overlapping protocol:
    the first token of each window is predicted from a short context (position 0 sees one
    token), unlike a sliding-window evaluation. ``max_tokens`` caps the number of predicted
    tokens (the first ``max_tokens`` targets). Yields int64 (B, L) pairs; the last batch may
    have fewer rows, and a batch whose windows are all partial is only as wide as its longest.
    """
    tokens = _as_array(tokens)
    if batch_size < 1 or seq_len < 1:
        raise LoopLMError(f"batch_size={batch_size} and seq_len={seq_len} must be >= 1")
    n_pred = len(tokens) - 1
    if max_tokens is not None:
        if max_tokens < 1:
            raise LoopLMError(f"max_tokens={max_tokens} must be >= 1")
        n_pred = min(n_pred, max_tokens)
    if n_pred < 1:
        raise LoopLMError(f"{len(tokens)} tokens are too few to evaluate (need at least 2)")
    starts = np.arange(0, n_pred, seq_len)
    for b in range(0, len(starts), batch_size):
        rows = starts[b : b + batch_size]
        # a batch of partial windows only is as wide as its longest (causal attention: columns
        # after every row's last token change nothing — and a 64k-context model's one short
        # window would otherwise cost a 64k-wide pass)
        width = min(seq_len, n_pred - int(rows[0]))
        x = np.full((len(rows), width), pad_id, dtype=np.int64)  # (B, L)
        y = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)  # (B, L)
        for i, s in enumerate(rows):
            m = min(width, n_pred - int(s))
            seg = np.asarray(tokens[s : s + m + 1], dtype=np.int64)  # (m+1,)
            x[i, :m] = seg[:m]
            y[i, :m] = seg[1:]
        yield torch.from_numpy(x), torch.from_numpy(y)


class DataSource:
    """Training batches by step and evaluation batches covering the evaluation set."""

    is_task = False
    _cached: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def make_global_batch(self, step: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``n_rows`` rows of step ``step``: (x, y), each (n_rows, L). Subclasses define it."""
        raise NotImplementedError

    def global_batch(self, step: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`make_global_batch`, cached for the last (step, n_rows) asked for."""
        key = (step, n_rows)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self.make_global_batch(step, n_rows))
        return self._cached[1]

    def train_batch(
        self,
        step: int,
        micro: int,
        batch_size: int,
        rank: int = 0,
        *,
        world_size: int = 1,
        grad_accum: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s micro-batch ``micro`` of step ``step``: (x, y), each (batch_size, L)."""
        if not 0 <= rank < world_size or not 0 <= micro < grad_accum:
            raise LoopLMError(
                f"rank={rank}, micro={micro} out of range for world_size={world_size}, "
                f"grad_accum={grad_accum}"
            )
        x, y = self.global_batch(step, batch_size * world_size * grad_accum)
        i = (micro * world_size + rank) * batch_size
        return x[i : i + batch_size].contiguous(), y[i : i + batch_size].contiguous()

    def eval_batches(self, batch_size: int, max_tokens: int | None) -> Iterator[tuple]:
        raise NotImplementedError


class TaskSource(DataSource):
    """A synthetic task (``bool_logic``) generated on the fly."""

    is_task = True

    def __init__(self, data: DataConfig, model: ModelConfig, seed: int) -> None:
        self.task, self.data, self.seed, self.context = data.dataset, data, seed, model.context
        allowed = task_arg_keys(self.task)
        unknown = sorted(set(data.task_args) - allowed)
        if unknown:
            raise LoopLMError(
                f"unknown data.task_args key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}"
            )
        self.seq_len = int(data.task_args.get("seq_len", 0))  # >0 packs examples per row

    def make_global_batch(self, step, n_rows):
        b = make_batch(
            self.task,
            n_rows,
            tuple(self.data.train_difficulty),
            seed=step_seed(self.seed, step * 1024, 0),
            max_len=self.context,
            seq_len=self.seq_len,
            task_args=self.data.task_args,
        )
        return b.input_ids, b.targets

    def eval_batches(self, batch_size, max_tokens=None, n_examples: int = 512):
        n_batches = max(1, -(-n_examples // batch_size))
        for i in range(n_batches):
            b = make_batch(
                self.task,
                batch_size,
                tuple(self.data.eval_difficulty),
                seed=EVAL_SEED_OFFSET + i,
                max_len=self.context,
                seq_len=self.seq_len,
                task_args=self.data.task_args,
            )
            yield b.input_ids, b.targets


class CorpusSource(DataSource):
    """Fixed-length windows from a memory-mapped token cache (see looplm.data.cache)."""

    def __init__(self, data: DataConfig, model: ModelConfig, seed: int) -> None:
        from looplm.data.cache import get_split_tokens

        self.seed, self.context, self.data = seed, model.context, data
        self.train_tokens = get_split_tokens(
            data.dataset, data.train_split, model.tokenizer, data.data_dir, data.cache_dir
        )
        self._eval_tokens = None
        self.model_cfg = model

    @property
    def eval_tokens(self):
        if self._eval_tokens is None:
            from looplm.data.cache import get_split_tokens

            d = self.data
            self._eval_tokens = get_split_tokens(
                d.dataset, d.eval_split, self.model_cfg.tokenizer, d.data_dir, d.cache_dir
            )
        return self._eval_tokens

    def make_global_batch(self, step, n_rows):
        g = torch.Generator().manual_seed(step_seed(self.seed, step * 1024, 0))
        return sample_windows(self.train_tokens, n_rows, self.context, g)

    def eval_batches(self, batch_size, max_tokens=None, n_examples: int = 0):
        yield from eval_windows(self.eval_tokens, batch_size, self.context, max_tokens)


class PairSource(DataSource):
    """Packed prompt/completion rows, the loss on the completions only (looplm.data.pairs)."""

    def __init__(self, data: DataConfig, model: ModelConfig, seed: int) -> None:
        from looplm.data.pairs import pack_pairs, split_pairs
        from looplm.data.tokenizers import get_tokenizer

        self.seed, self.data = seed, data
        self.tok = get_tokenizer(model.tokenizer)
        self.seq_len = model.context
        pairs = split_pairs(data.dataset, data.train_split)
        self.x, self.y = pack_pairs(pairs, self.tok, model.context)
        if not len(self.x):
            raise LoopLMError(f"{data.dataset}: no completion tokens to train on")
        self._eval: tuple[torch.Tensor, torch.Tensor] | None = None

    def make_global_batch(self, step, n_rows):
        g = torch.Generator().manual_seed(step_seed(self.seed, step * 1024, 0))
        rows = torch.randint(0, len(self.x), (n_rows,), generator=g)
        return self.x[rows], self.y[rows]

    def eval_batches(self, batch_size, max_tokens=None, n_examples: int = 0) -> Iterator[tuple]:
        if self._eval is None:
            from looplm.data.pairs import pack_pairs, split_pairs

            pairs = split_pairs(self.data.dataset, self.data.eval_split)
            self._eval = pack_pairs(pairs, self.tok, self.seq_len)
        x, y = self._eval
        for i in range(0, len(x), batch_size):
            yield x[i : i + batch_size], y[i : i + batch_size]


def make_source(data: DataConfig, model: ModelConfig, seed: int) -> DataSource:
    """The DataSource for ``data.dataset`` (a synthetic task name, ``pairs:PATH`` or a corpus)."""
    if data.dataset in TASKS:
        return TaskSource(data, model, seed)
    if data.dataset.startswith("pairs:"):
        return PairSource(data, model, seed)
    return CorpusSource(data, model, seed)
