"""The KV cache of cached decoding: keys/values per block application (:class:`KVCache`), one
application's entry for all or some batch rows (:class:`KVSlot`), and the positions of new tokens
after the cached ones. :class:`looplm.model.block.Block` reads and appends through a slot."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looplm.errors import LoopLMError


@dataclass
class KVCache:
    """Keys/values per block application of a forward pass: ``slots[i] = (k, v)``, each
    (B, nh, L_past, hs); ``length`` is the number of cached positions."""

    slots: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    length: int = 0
    # Whether ``append`` takes ``rows`` (a subset of the batch rows): then a block call whose rows
    # have partly halted runs its active rows as a dense smaller batch (see ``Block.forward``).
    row_subsets = False

    def append(
        self, index: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' (k, v) of slot ``index`` after the cached ones; returns all
        of them. (A subclass may store them differently, e.g. in preallocated buffers, and may
        take ``rows``: k, v are those batch rows' and the rows' cached ones come back.)"""
        if rows is not None:
            raise LoopLMError(f"{type(self).__name__} stores whole batches only (rows=None)")
        slots = self.slots
        if index < len(slots):
            pk, pv = slots[index]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
            slots[index] = (k, v)
        elif index == len(slots):
            slots.append((k, v))
        else:
            raise IndexError(f"KV slot {index} used before slot {len(slots)}")
        return k, v


class KVSlot:
    """The cache entry of one block application (slot ``index`` of ``cache``), for all batch
    rows or for the subset ``rows``."""

    def __init__(self, cache: KVCache, index: int, rows: torch.Tensor | None = None) -> None:
        self.cache, self.index, self.rows = cache, index, rows

    @property
    def length(self) -> int | torch.Tensor:
        """Cached positions: an int, or a (B,) tensor when rows have lengths of their own."""
        n = self.cache.length
        return n[self.rows.to(n.device)] if torch.is_tensor(n) and self.rows is not None else n

    def subset(self, rows: torch.Tensor) -> KVSlot:
        """The same slot for the batch rows ``rows`` (indices into this slot's rows)."""
        return KVSlot(self.cache, self.index, rows if self.rows is None else self.rows[rows])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' (k, v) after the cached ones; returns all of them."""
        if self.rows is None:
            return self.cache.append(self.index, k, v)
        return self.cache.append(self.index, k, v, rows=self.rows)


def positions(past: int | torch.Tensor, L: int, device: torch.device) -> torch.Tensor:
    """Positions of L new tokens after ``past`` cached ones: (L,) for a shared int, (B, L) for
    per-row lengths (B,)."""
    new = torch.arange(L, device=device)
    return past.to(device)[:, None] + new if torch.is_tensor(past) else new + past


def _column(past: int | torch.Tensor) -> int | torch.Tensor:
    """``past`` broadcastable over (B, L) positions."""
    return past[:, None] if torch.is_tensor(past) else past
