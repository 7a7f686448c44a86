"""The key/value cache of loop-level batching (:mod:`looplm.decoding.loop_batching`): rows at different
loop steps in one block call, each reading and writing the slot of its own step."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from looplm.decoding.decoder import StaticKVCache, next_logits
from looplm.errors import LoopLMError
from looplm.model.kv import KVCache

__all__ = ["LoopKVCache", "slot_layout"]

_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # slot_layout per model


def slot_layout(model: nn.Module) -> tuple[int, int, int]:
    """(prelude slots, slots per loop step, coda slots) of a cached pass of ``model``, counted
    once per model on a one-token pass at depths 1 and 2."""
    if model in _SLOTS:
        return _SLOTS[model]
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.tok_emb.weight.device)
    n = []
    for T in (1, 2):
        cache = StaticKVCache(model.config.context)
        next_logits(model, ids, T, cache)
        n.append(len(cache.buffers))
    per_step = n[1] - n[0]
    prelude, coda = len(model.prelude), len(model.coda)
    if n[0] != prelude + per_step + coda:
        raise LoopLMError("this model's cached pass does not take slots per loop step")
    _SLOTS[model] = prelude, per_step, coda
    return _SLOTS[model]


class LoopKVCache:
    """Keys/values of every slot (block application) for every cache row, in one
    (slots, rows, kv heads, capacity, head size) buffer pair, and each row's cached positions.

    A pass reads and writes it through a :meth:`view`: its rows, and per row a slot offset (the
    row's loop step × slots per step), so rows at different loop steps share one block call."""

    def __init__(self, capacity: int, n_slots: int, rows: int) -> None:
        self.capacity, self.n_slots = int(capacity), int(n_slots)
        self.length = torch.zeros(rows, dtype=torch.long)
        self.K: torch.Tensor | None = None
        self.V: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        return self.length.shape[0]

    def grow(self, rows: int) -> None:
        """At least ``rows`` rows (new rows empty)."""
        n = rows - self.n_rows
        if n <= 0:
            return
        self.length = torch.cat([self.length, self.length.new_zeros(n)])
        if self.K is not None:
            pad = lambda z: torch.cat([z, z.new_zeros(z.shape[0], n, *z.shape[2:])], 1)  # noqa: E731
            self.K, self.V = pad(self.K), pad(self.V)

    def view(
        self, rows: torch.Tensor, offset: torch.Tensor | None = None, *, full: bool = False
    ) -> _LoopView:
        """The rows ``rows`` of a pass, slot i of row b being slot ``i + offset[b]``."""
        return _LoopView(self, rows, offset, full)

    def fill_steps(
        self, rows: torch.Tensor, t: torch.Tensor, loops: int, per_step: int, first: int
    ) -> None:
        """Rows ``rows`` (their position ``length``) whose token halted after step t: the slots of
        steps t+1 … T get the keys/values of step t+1's slots (written by the keys/values-only
        call)."""
        if not len(rows) or self.K is None:
            return
        u = torch.arange(loops)
        later = u[None, :] > t[:, None]  # (n, T): later steps (0-based slots of steps u + 1)
        li, uu = later.nonzero(as_tuple=True)
        if not len(li):
            return
        j = torch.arange(per_step)
        dst = first + uu[:, None] * per_step + j  # (m, per_step)
        src = first + t[li][:, None] * per_step + j
        row = rows[li][:, None].expand_as(dst)
        pos = self.length[rows][li][:, None].expand_as(dst)
        dev = self.K.device
        dst, src, row, pos = (z.to(dev) for z in (dst, src, row, pos))
        for buf in (self.K, self.V):
            buf[dst, row, :, pos] = buf[src, row, :, pos]


class _LoopView(KVCache):
    """One pass's rows of a :class:`LoopKVCache`: slot ``i`` of pass row b is the cache's slot
    ``i + offset[b]``; new positions go after the row's own cached ones. ``full``: reads span the
    whole capacity (a static shape; positions past a row's own are masked by attention)."""

    row_subsets = False

    def __init__(
        self, cache: LoopKVCache, rows: torch.Tensor, offset: torch.Tensor | None, full: bool
    ) -> None:
        self.cache, self.rows, self.offset, self.full = cache, rows, offset, full
        self.lengths: torch.Tensor | None = None  # given lengths (a compiled step's input)
        self.K: torch.Tensor | None = None  # given buffers (a compiled step's inputs)
        self.V: torch.Tensor | None = None
        self.write_only = False  # a keys/values-only pass: nothing is read back

    @property
    def length(self) -> torch.Tensor:
        """(B,) cached positions of the pass's rows (read once: a pass does not change them)."""
        if self.lengths is None:
            self.lengths = self.cache.length[self.rows]
        return self.lengths

    @length.setter
    def length(self, value: torch.Tensor) -> None:  # a whole pass's positions appended
        self.cache.length[self.rows] = value
        self.lengths = None

    def copy_new(self, src: int, dst: int, n: int) -> None:
        """Slot ``dst`` of every pass row gets slot ``src``'s keys/values of the ``n`` positions
        being added (a halted token's later steps: :class:`looplm.model.halting.KeysValuesOnly`)."""
        K, V = (self.cache.K, self.cache.V) if self.K is None else (self.K, self.V)
        S, N = K.shape[:2]
        dev = K.device
        rows = self.rows.to(dev)[:, None]
        pos = self.length.to(dev)[:, None] + torch.arange(n, device=dev)  # (B, n)
        off = 0 if self.offset is None else self.offset.to(dev)[:, None]
        to, frm = ((dst + off) * N + rows).expand_as(pos), ((src + off) * N + rows).expand_as(pos)
        for buf in (K, V):
            flat = buf.view(S * N, *buf.shape[2:])
            flat[to, :, pos] = flat[frm, :, pos]

    def append(
        self, index: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rows is not None:
            raise LoopLMError("a loop-level cache view serves whole passes only")
        c = self.cache
        B, nh, L, hs = k.shape
        if c.K is None and self.K is None:
            shape = (c.n_slots, c.n_rows, nh, c.capacity, hs)
            c.K, c.V = k.new_zeros(shape), v.new_zeros(shape)
        K, V = (c.K, c.V) if self.K is None else (self.K, self.V)
        S, N = K.shape[:2]
        dev = k.device
        rows = self.rows.to(dev)
        slot = torch.full_like(rows, index) if self.offset is None else self.offset.to(dev) + index
        sr = slot * N + rows  # rows of the (slots × rows) flattened buffers
        Kf, Vf = K.view(S * N, *K.shape[2:]), V.view(S * N, *V.shape[2:])
        if L == 1:  # decoding: one position per row
            pos = self.length.to(dev)
            Kf[sr, :, pos] = k[:, :, 0]
            Vf[sr, :, pos] = v[:, :, 0]
        else:
            pos = self.length.to(dev)[:, None] + torch.arange(L, device=dev)  # (B, L)
            r = sr[:, None].expand(B, L)
            Kf[r, :, pos] = k.transpose(1, 2)
            Vf[r, :, pos] = v.transpose(1, 2)
        if self.write_only:
            return k, v
        if not self.full:  # reads span the rows' longest (index_select: one copy of each row)
            end = int(pos.max()) + 1
            Kf, Vf = Kf[:, :, :end], Vf[:, :, :end]
            if B == 1:  # one row: its buffer itself, no copy
                i = int(sr[0])
                return Kf[i : i + 1], Vf[i : i + 1]
        return Kf.index_select(0, sr), Vf.index_select(0, sr)
