"""The one shared Transformer block: pre-RMSNorm, causal self-attention, SwiGLU, bias-free.

``Block(x)`` returns the *update* ``G(x)`` (not ``x + G(x)``):

    a = Attn(RMSNorm(x))            # causal self-attention
    m = SwiGLU(RMSNorm(x + a))
    G(x) = a + m                    # so x + G(x) is a standard pre-norm block

Every projection is bias-free and RMSNorm maps 0 to 0, so ``G(0) = 0`` exactly (attention over an
all-zero value matrix returns zeros whatever the softmax weights; SwiGLU(0) = silu(0)·0 = 0).
Dropout multiplies, so it keeps zeros zero in training mode too.

This is the only implementation of the block's math. Besides the plain call it serves:

* **KV-cached decoding** (``kv``: a :class:`KVSlot` of a :class:`KVCache`): ``x`` holds only the new
  positions; their keys/values are appended to the slot and the queries attend to every cached
  position before them.
* **active-token-only evaluation** (``active``: (B, L) bool): keys and values are computed for every
  row (causal attention of an active token reads all earlier tokens, halted ones included), while
  queries, attention rows, the output projection and the SwiGLU run on active rows only; inactive
  rows return 0. With a cache that serves row subsets (``KVCache.row_subsets``), batch rows
  without an active token leave the call: they only write their keys/values, and the other rows
  run as a smaller batch (row compaction: a decoding step's work follows its active tokens).

A looped model applies the block many times per forward pass with the same per-pass arguments;
:class:`BlockCall` binds them once, so a recurrence calls ``block(x)`` whatever the mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

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


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding (RoFormer, "rotate half" layout): x (B, nh, L, hs) rotated by the
    angles ``pos · base^(−2i/hs)``; pos (L,) or (B, L) integer positions. The score of a rotated
    query at p and key at p' depends on p − p' only (relative positions)."""
    hs = x.shape[-1]
    half = hs // 2
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = base ** (-torch.arange(half, device=x.device, dtype=wide) * 2.0 / hs)  # (half,)
    ang = pos.to(wide)[..., None] * inv  # (…, L, half)
    if ang.dim() == 3:  # per-example positions (B, L, half) → broadcast over heads
        ang = ang[:, None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out if 2 * half == hs else torch.cat([out, x[..., 2 * half :]], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    ``rope_base`` > 0 rotates queries and keys by their positions (RoPE); ``mask`` (B, L, L_k)
    bool, when given, replaces causality: query i may attend to key j iff ``mask[b, i, j]`` (the
    adjacency-masked attention of graph tasks).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, rope_base: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.rope_base = rope_base
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.proj.residual_output = True  # model.init=depth_scaled scales it
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        B, L, d = z.shape
        return z.view(B, L, self.n_heads, d // self.n_heads).transpose(1, 2)  # (B, nh, L, hs)

    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: KVSlot | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, L, d), already normalised → (B, L, d), or (N_active, d) with ``active``.

        The cache's ``length`` is the number of cached positions: an int shared by the rows, or a
        (B,) tensor when every row has its own (continuous batching; keys past a row's own length
        are masked out)."""
        B, L, d = x.shape
        past = kv.length if kv is not None else 0
        ragged = torch.is_tensor(past)
        if ragged:
            past = past.to(x.device)
        w = self.qkv.weight  # (3d, d): rows [q; k; v]
        if active is None:
            q, k, v = (self._heads(z) for z in self.qkv(x).split(d, dim=2))  # 3 × (B, nh, L, hs)
            q_pos = None
        else:
            k, v = (self._heads(z) for z in F.linear(x, w[d:]).split(d, dim=2))
            counts = active.sum(dim=1)  # (B,)
            A = int(counts.max()) if B else 0
            # Active positions first (ascending), then the inactive ones: (B, A) query positions.
            q_pos = torch.argsort((~active).to(torch.int8), dim=1, stable=True)[:, :A]
            xq = x.gather(1, q_pos[..., None].expand(B, A, d))  # (B, A, d)
            q = self._heads(F.linear(xq, w[:d]))  # (B, nh, A, hs)
        if self.rope_base > 0:
            pos = positions(past, L, x.device)  # (L,) or per row (B, L)
            k = rope(k, pos, self.rope_base)
            q = rope(q, pos if q_pos is None else q_pos + _column(past), self.rope_base)
        if kv is not None:
            if mask is not None:
                raise LoopLMError("a KV cache cannot serve a data-given attention mask")
            k, v = kv.append(k, v)  # (B, nh, past + L, hs)
        drop = self.dropout if self.training else 0.0
        if q_pos is None and not ragged and past == 0 and mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        else:
            if mask is not None:  # (B, L, L): the data's mask replaces causality
                allowed = (
                    mask
                    if q_pos is None
                    else mask.gather(1, q_pos[..., None].expand(-1, -1, mask.shape[-1]))
                )
                allowed = allowed[:, None]  # (B, 1, Lq, Lk)
            else:  # query at position p sees keys 0 … p
                if q_pos is None:
                    q_pos = torch.arange(L, device=x.device)[None, :]  # (1, L)
                keys = torch.arange(k.shape[2], device=x.device)
                allowed = keys[None, None, None, :] <= (q_pos + _column(past))[:, None, :, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop)
        y = y.transpose(1, 2)  # (B, Lq, nh, hs)
        if active is not None:
            real = torch.arange(y.shape[1], device=x.device)[None, :] < counts[:, None]
            return self.resid_drop(self.proj(y.reshape(B, -1, d)[real]))  # (N_active, d)
        return self.resid_drop(self.proj(y.reshape(B, L, d)))

    def append_kv(self, x: torch.Tensor, kv: KVSlot) -> None:
        """Only the keys/values of x (B, L, d), already normalised, appended to ``kv``: what a
        call with no active row still owes the cache (later tokens attend to these positions)."""
        B, L, d = x.shape
        k, v = (self._heads(z) for z in F.linear(x, self.qkv.weight[d:]).split(d, dim=2))
        if self.rope_base > 0:  # as in forward: keys rotated by their positions
            k = rope(k, positions(kv.length, L, x.device), self.rope_base)
        kv.append(k, v)


class SwiGLU(nn.Module):
    """``W_down(silu(W_gate x) * W_up x)``, bias-free."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)
        self.down.residual_output = True
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 × (B, L, d_ff)
        return self.drop(self.down(F.silu(gate) * up))


class Block(nn.Module):
    """The shared update ``G``; ``block(x)`` returns ``G(x)`` with ``G(0) = 0``."""

    n_layers = 1  # block applications per call (KV-cache slots it takes)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        eps: float = 1e-6,
        rope_base: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=eps)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, rope_base)
        self.norm2 = nn.RMSNorm(d_model, eps=eps)
        self.mlp = SwiGLU(d_model, d_ff, dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: KVSlot | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, L, d) → G(x): (B, L, d).

        ``kv``: cache slot of this application (x holds the new positions only). ``active``:
        (B, L) bool; G is computed on active rows and is 0 elsewhere (eval mode). ``mask``:
        (B, L, L) bool attention mask that replaces causality (graph adjacency).
        """
        if active is None:
            a = self.attn(self.norm1(x), kv=kv, mask=mask)
            return a + self.mlp(self.norm2(x + a))
        out = torch.zeros_like(x)
        if not bool(active.any()):
            if kv is not None:  # keys/values only: later positions still attend to these rows
                self.attn.append_kv(self.norm1(x), kv)
            return out
        if kv is not None and getattr(kv.cache, "row_subsets", False):
            busy = active.any(dim=1)  # (B,) rows with an active token
            if not bool(busy.all()):  # compact: halted rows cost their keys/values only
                idle, busy = (~busy).nonzero().squeeze(1), busy.nonzero().squeeze(1)
                self.attn.append_kv(self.norm1(x[idle]), kv.subset(idle))
                sub = active[busy]  # (B_busy, L)
                out[busy] = self.forward(
                    x[busy], kv=kv.subset(busy), active=None if bool(sub.all()) else sub
                )
                return out
        a = self.attn(self.norm1(x), kv=kv, active=active, mask=mask)  # (N_active, d)
        out[active] = a + self.mlp(self.norm2(x[active] + a))
        return out


class Core(nn.Module):
    """A looped core of k > 1 layers used as one shared update ``G``:

        y_0 = x,   y_i = y_{i−1} + G_i(y_{i−1})  (i = 1 … k),   G(x) = y_k − x = Σ_i G_i(y_{i−1})

    i.e. k pre-norm blocks in sequence, returned as an update. Each G_i is bias-free with
    G_i(0) = 0, so y stays 0 from x = 0 and G(0) = 0 exactly. With a KV cache every layer takes a
    slot of its own (``kv``: a list of k slots).
    """

    def __init__(self, layers: list[Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.n_layers = len(layers)

    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: list[KVSlot] | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y, total = x, None
        for i, layer in enumerate(self.layers):
            g = layer(y, kv=kv[i] if kv is not None else None, active=active, mask=mask)
            y = y + g
            total = g if total is None else total + g
        return total


class BlockCall:
    """The shared block (or k-layer core) bound to one forward pass's attention arguments.

    Recurrences call ``block(x)`` once per body application; with a cache every call takes the
    next slot(s) (slot i = the i-th layer application of the pass, the same order for the prompt
    and for each decoded token), ``active`` restricts the work to active rows, and ``mask`` is the
    pass's data-given attention mask.
    """

    def __init__(
        self,
        block: nn.Module,
        *,
        cache: KVCache | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        first_slot: int = 0,
    ) -> None:
        self.block, self.cache, self.active, self.mask = block, cache, active, mask
        self.slot = first_slot

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kv = None
        n = getattr(self.block, "n_layers", 1)
        if self.cache is not None:
            slots = [KVSlot(self.cache, self.slot + i) for i in range(n)]
            kv = slots if isinstance(self.block, Core) else slots[0]
        self.slot += n
        return self.block(x, kv=kv, active=self.active, mask=self.mask)
