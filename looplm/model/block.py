"""The one shared Transformer block: pre-RMSNorm, causal self-attention, SwiGLU, bias-free.

``Block(x)`` returns the *update* ``G(x)`` (not ``x + G(x)``):

    a = Attn(RMSNorm(x))            # causal self-attention
    m = SwiGLU(RMSNorm(x + a))
    G(x) = a + m                    # so x + G(x) is a standard pre-norm block

Every projection is bias-free and RMSNorm maps 0 to 0, so ``G(0) = 0`` exactly (attention over an
all-zero value matrix returns zeros whatever the softmax weights; SwiGLU(0) = silu(0)·0 = 0).
Dropout multiplies, so it keeps zeros zero in training mode too.

Options (keyword arguments; every default is the block above, computed by the same operations):

* ``n_kv_heads`` < ``n_heads``: grouped-query attention (each key/value head serves
  n_heads / n_kv_heads query heads; the KV cache stores the n_kv_heads).
* ``norm_placement``: ``pre`` (above); ``sandwich`` — the sublayer outputs are normalised before
  the residual add, ``a = N₃(Attn(N₁ x))``, ``m = N₄(MLP(N₂(x + a)))``, ``G = a + m``;
  ``sandwich_sum`` — the residual sums are normalised, ``y = N₃(x + Attn(N₁ x))``,
  ``G = N₄(y + MLP(N₂ y)) − x``. Both keep ``G(0) = 0``.
* ``qk_norm``: queries and keys RMS-normalised per head (no gain) after the rotation.
* ``qk_bias``: a learned bias added to the query and key projections; the values stay
  bias-free, so ``G(0) = 0`` still holds.
* ``mlp``: ``swiglu`` (above) or ``relu2``, ``W_down(½·relu(W_up x)²)``; both map 0 to 0.
* ``rope_layout``: ``half`` (rotate-half, above) or ``interleaved`` (pairs (2i, 2i+1) rotated).
* ``reference_rounding``: the operation order of the reference implementations, which changes
  rounding only: :meth:`Block.advance` sums the layer's output ``(x + a) + m`` left to right as
  a residual stream does (``x + G(x)`` otherwise), and RoPE's frequencies are ``1 / base^(2i/hs)``.
* ``attn_gate``: output-gated attention — each head's output is multiplied by
  ``σ(W_g x)`` (x the attention's normalised input, one gate per head and channel) before the
  output projection. Keeps ``G(0) = 0`` (the attention output is 0 there).
* ``norm_weight=False``: the block's RMSNorms carry no gain (``x / rms(x)``); keeps ``G(0) = 0``.
* ``value_embed`` = V > 0: value embeddings — the values get
  ``2σ(W_g x[:, :gate_width]) · VE[token]`` added per key/value head (the block then reads the
  pass's token ids). **Breaks** ``G(0) = 0``: a zero state still sees its tokens' values.

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

import torch
import torch.nn.functional as F
from torch import nn

from looplm.errors import LoopLMError

# the cache lives in looplm.model.kv; re-imported here so ``looplm.model.block.KVCache`` stays
from looplm.model.kv import KVCache as KVCache
from looplm.model.kv import KVSlot, _column, positions
from looplm.settings.config import MLPS, NORM_PLACEMENTS, ROPE_LAYOUTS


def rope(
    x: torch.Tensor, pos: torch.Tensor, base: float, layout: str = "half", reference: bool = False
) -> torch.Tensor:
    """Rotary position embedding (RoFormer): x (B, nh, L, hs) rotated by the angles
    ``pos · base^(−2i/hs)``; pos (L,) or (B, L) integer positions. The score of a rotated
    query at p and key at p' depends on p − p' only (relative positions).

    ``half``: dimension i pairs with i + hs/2 ("rotate half"). ``interleaved``: dimension 2i pairs
    with 2i + 1 (the complex-number form), computed in float32 and cast back as its reference
    implementations do. ``reference``: the frequencies rounded as ``1 / base^(2i/hs)`` (the
    reference implementations' order) instead of ``base^(−2i/hs)``."""
    hs = x.shape[-1]
    half = hs // 2
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    if layout == "interleaved":
        inv = 1.0 / base ** (torch.arange(0, 2 * half, 2, device=x.device, dtype=wide) / hs)
        ang = pos.to(wide)[..., None] * inv  # (…, L, half)
        if ang.dim() == 3:
            ang = ang[:, None]
        cos, sin = ang.cos(), ang.sin()
        pairs = x[..., : 2 * half].unflatten(-1, (half, 2)).to(wide)  # (…, half, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        return out if 2 * half == hs else torch.cat([out, x[..., 2 * half :]], dim=-1)
    if reference:
        inv = 1.0 / base ** (torch.arange(0, 2 * half, 2, device=x.device, dtype=wide) / hs)
    else:
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
    adjacency-masked attention of graph tasks). ``qkv`` holds the rows [q (nh·hs); k (nkv·hs);
    v (nkv·hs)]; the options are the block's (module docstring).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        rope_base: float = 0.0,
        *,
        n_kv_heads: int | None = None,
        qk_norm: bool = False,
        qk_bias: bool = False,
        rope_layout: str = "half",
        value_embed: int = 0,
        value_gate_width: int = 32,
        reference_rounding: bool = False,
        attn_gate: bool = False,
    ) -> None:
        super().__init__()
        self.reference_rounding = reference_rounding
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.rope_base = rope_base
        self.rope_layout = rope_layout
        self.qk_norm = qk_norm
        hs = d_model // n_heads
        self.q_dim, self.kv_dim = d_model, self.n_kv_heads * hs
        self.qkv = nn.Linear(d_model, self.q_dim + 2 * self.kv_dim, bias=False)
        # Bias of the query and key rows (the values stay bias-free).
        self.qk_bias = nn.Parameter(torch.zeros(self.q_dim + self.kv_dim)) if qk_bias else None
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.proj.residual_output = True  # model.init=depth_scaled scales it
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)
        self.value_embed = nn.Embedding(value_embed, self.kv_dim) if value_embed else None
        self.value_gate_width = value_gate_width
        # Output gate σ(W_g x) per head and channel (attn_gate); None: ungated
        self.gate = nn.Linear(d_model, d_model, bias=False) if attn_gate else None
        self.value_gate = (
            nn.Linear(value_gate_width, self.n_kv_heads, bias=False) if value_embed else None
        )

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        B, L, n = z.shape
        hs = self.q_dim // self.n_heads
        return z.view(B, L, n // hs, hs).transpose(1, 2)  # (B, nh | nkv, L, hs)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, A, d) → queries (B, nh, A, hs), before rotation."""
        z = F.linear(x, projection_weight(self.qkv)[: self.q_dim])
        if self.qk_bias is not None:
            z = z + self.qk_bias[: self.q_dim]
        return self._heads(z)

    def _keys_values(
        self, x: torch.Tensor, tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, L, d) → keys, values (B, nkv, L, hs), before rotation."""
        k, v = F.linear(x, projection_weight(self.qkv)[self.q_dim :]).split(self.kv_dim, dim=2)
        if self.qk_bias is not None:
            k = k + self.qk_bias[self.q_dim :]
        return self._heads(k), self._heads(self._value_embedding(x, v, tokens))

    def _value_embedding(
        self, x: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """v (B, L, kv) plus the gated value embedding of the tokens (identity without one)."""
        if self.value_embed is None:
            return v
        if tokens is None:
            raise LoopLMError("a block with value embeddings needs the pass's token ids")
        B, L, _ = v.shape
        gate = 2 * torch.sigmoid(self.value_gate(x[..., : self.value_gate_width]))  # (B, L, nkv)
        ve = self.value_embed(tokens).view(B, L, self.n_kv_heads, -1)
        return v + (gate[..., None] * ve).view(B, L, -1)

    def _rotate(self, z: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.rope_base > 0:
            z = rope(z, pos, self.rope_base, self.rope_layout, self.reference_rounding)
        if self.qk_norm:
            z = F.rms_norm(z, (z.shape[-1],))
        return z

    # long: one attention for every mode (plain, cached, ragged, active rows, data mask)
    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: KVSlot | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, L, d), already normalised → (B, L, d), or (N_active, d) with ``active``.

        The cache's ``length`` is the number of cached positions: an int shared by the rows, or a
        (B,) tensor when every row has its own (continuous batching; keys past a row's own length
        are masked out). ``tokens`` (B, L): the token ids (value embeddings only)."""
        B, L, d = x.shape
        past = kv.length if kv is not None else 0
        ragged = torch.is_tensor(past)
        if ragged:
            past = past.to(x.device)
        plain = self.qk_bias is None and self.value_embed is None and self.kv_dim == self.q_dim
        if active is None:
            if plain:
                q, k, v = (
                    self._heads(z) for z in self.qkv(x).split(d, dim=2)
                )  # 3 × (B, nh, L, hs)
            else:
                q = self._queries(x)
                k, v = self._keys_values(x, tokens)
            q_pos = None
        else:
            k, v = self._keys_values(x, tokens)
            counts = active.sum(dim=1)  # (B,)
            A = int(counts.max()) if B else 0
            # Active positions first (ascending), then the inactive ones: (B, A) query positions.
            q_pos = torch.argsort((~active).to(torch.int8), dim=1, stable=True)[:, :A]
            xq = x.gather(1, q_pos[..., None].expand(B, A, d))  # (B, A, d)
            q = self._queries(xq)  # (B, nh, A, hs)
        if self.rope_base > 0 or self.qk_norm:
            pos = positions(past, L, x.device)  # (L,) or per row (B, L)
            k = self._rotate(k, pos)
            q = self._rotate(q, pos if q_pos is None else q_pos + _column(past))
        if kv is not None:
            if mask is not None:
                raise LoopLMError("a KV cache cannot serve a data-given attention mask")
            k, v = kv.append(k, v)  # (B, nkv, past + L, hs)
        drop = self.dropout if self.training else 0.0
        gqa = {"enable_gqa": True} if self.kv_dim != self.q_dim else {}
        if q_pos is None and not ragged and past == 0 and mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop, **gqa)
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
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop, **gqa)
        y = y.transpose(1, 2)  # (B, Lq, nh, hs)
        if self.gate is not None:  # the gate reads the same rows as the queries
            y = torch.sigmoid(self.gate(x if active is None else xq)).view(y.shape) * y
        if active is not None:
            real = torch.arange(y.shape[1], device=x.device)[None, :] < counts[:, None]
            return self.resid_drop(self.proj(y.reshape(B, -1, d)[real]))  # (N_active, d)
        return self.resid_drop(self.proj(y.reshape(B, L, d)))

    def append_kv(self, x: torch.Tensor, kv: KVSlot, tokens: torch.Tensor | None = None) -> None:
        """Only the keys/values of x (B, L, d), already normalised, appended to ``kv``: what a
        call with no active row still owes the cache (later tokens attend to these positions)."""
        B, L, d = x.shape
        k, v = self._keys_values(x, tokens)
        if self.rope_base > 0 or self.qk_norm:  # as in forward: keys rotated by their positions
            k = self._rotate(k, positions(kv.length, L, x.device))
        kv.append(k, v)


def projection_weight(linear: nn.Module) -> torch.Tensor:
    """The weight a projection applies: its own, plus the update ``α/r·B·A`` of each active LoRA
    adapter attached to it (``peft``; looplm.training.finetune), since the attention slices the fused
    query/key/value weight instead of calling the module."""
    w = linear.weight
    if hasattr(linear, "get_delta_weight") and not linear.merged and not linear.disable_adapters:
        for name in linear.active_adapters:
            w = w + linear.get_delta_weight(name)
    return w


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


class ReLU2MLP(nn.Module):
    """``W_down(½·relu(W_up x)²)``, bias-free (the squared-ReLU MLP, halved)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)
        self.down.residual_output = True
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.relu(self.up(x)).pow(2).mul(0.5)))


class Block(nn.Module):
    """The shared update ``G``; ``block(x)`` returns ``G(x)`` (``G(0) = 0`` unless the block has
    value embeddings; see the module docstring for the options)."""

    n_layers = 1  # block applications per call (KV-cache slots it takes)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        eps: float = 1e-6,
        rope_base: float = 0.0,
        *,
        n_kv_heads: int | None = None,
        norm_placement: str = "pre",
        qk_norm: bool = False,
        qk_bias: bool = False,
        mlp: str = "swiglu",
        rope_layout: str = "half",
        value_embed: int = 0,
        value_gate_width: int = 32,
        reference_rounding: bool = False,
        attn_gate: bool = False,
        norm_weight: bool = True,
    ) -> None:
        super().__init__()
        self.reference_rounding = reference_rounding
        if norm_placement not in NORM_PLACEMENTS or mlp not in MLPS:
            raise LoopLMError(
                f"norm_placement={norm_placement!r}, mlp={mlp!r}; allowed: "
                f"{', '.join(NORM_PLACEMENTS)} and {', '.join(MLPS)}"
            )
        if rope_layout not in ROPE_LAYOUTS:
            raise LoopLMError(f"rope_layout={rope_layout!r}; allowed: {', '.join(ROPE_LAYOUTS)}")
        self.norm_placement = norm_placement
        self.norm1 = nn.RMSNorm(d_model, eps=eps, elementwise_affine=norm_weight)
        self.attn = CausalSelfAttention(
            d_model,
            n_heads,
            dropout,
            rope_base,
            n_kv_heads=n_kv_heads,
            qk_norm=qk_norm,
            qk_bias=qk_bias,
            rope_layout=rope_layout,
            value_embed=value_embed,
            value_gate_width=value_gate_width,
            reference_rounding=reference_rounding,
            attn_gate=attn_gate,
        )
        self.norm2 = nn.RMSNorm(d_model, eps=eps, elementwise_affine=norm_weight)
        self.mlp = (SwiGLU if mlp == "swiglu" else ReLU2MLP)(d_model, d_ff, dropout)
        if norm_placement != "pre":  # N₃ (after attention) and N₄ (after the MLP)
            self.norm3 = nn.RMSNorm(d_model, eps=eps, elementwise_affine=norm_weight)
            self.norm4 = nn.RMSNorm(d_model, eps=eps, elementwise_affine=norm_weight)

    def _after_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """G from the block input x and the attention output a (the same rows)."""
        if self.norm_placement == "pre":
            return a + self.mlp(self.norm2(x + a))
        if self.norm_placement == "sandwich":
            a = self.norm3(a)
            return a + self.norm4(self.mlp(self.norm2(x + a)))
        y = self.norm3(x + a)  # sandwich_sum: the layer's output is a norm, G its difference
        return self.norm4(y + self.mlp(self.norm2(y))) - x

    def advance(self, x: torch.Tensor, **kw) -> torch.Tensor:
        """The layer's output ``x + G(x)`` (same arguments as :meth:`forward`). With
        ``reference_rounding`` it is summed in the order of the usual residual stream —
        ``(x + a) + m``, or the last norm itself for ``sandwich_sum`` — rather than through
        ``G``, so a checkpoint trained elsewhere gets its reference's rounding bit for bit.
        Otherwise (looplm's own models) and for active-row calls: ``x + G(x)``."""
        if kw.get("active") is not None or not self.reference_rounding:
            return x + self.forward(x, **kw)
        a = self.attn(self.norm1(x), kv=kw.get("kv"), mask=kw.get("mask"), tokens=kw.get("tokens"))
        if self.norm_placement == "pre":
            h = x + a
            return h + self.mlp(self.norm2(h))
        if self.norm_placement == "sandwich":
            h = x + self.norm3(a)
            return h + self.norm4(self.mlp(self.norm2(h)))
        y = self.norm3(x + a)
        return self.norm4(y + self.mlp(self.norm2(y)))

    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: KVSlot | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, L, d) → G(x): (B, L, d).

        ``kv``: cache slot of this application (x holds the new positions only). ``active``:
        (B, L) bool; G is computed on active rows and is 0 elsewhere (eval mode). ``mask``:
        (B, L, L) bool attention mask that replaces causality (graph adjacency). ``tokens``:
        (B, L) token ids of x's positions (read by value embeddings only).
        """
        if active is None:
            a = self.attn(self.norm1(x), kv=kv, mask=mask, tokens=tokens)
            return self._after_attention(x, a)
        out = torch.zeros_like(x)
        if not bool(active.any()):
            if kv is not None:  # keys/values only: later positions still attend to these rows
                self.attn.append_kv(self.norm1(x), kv, tokens)
            return out
        if kv is not None and getattr(kv.cache, "row_subsets", False):
            busy = active.any(dim=1)  # (B,) rows with an active token
            if not bool(busy.all()):  # compact: halted rows cost their keys/values only
                idle, busy = (~busy).nonzero().squeeze(1), busy.nonzero().squeeze(1)
                rows = (lambda r: None) if tokens is None else (lambda r: tokens[r])  # noqa: E731
                self.attn.append_kv(self.norm1(x[idle]), kv.subset(idle), rows(idle))
                sub = active[busy]  # (B_busy, L)
                out[busy] = self.forward(
                    x[busy],
                    kv=kv.subset(busy),
                    active=None if bool(sub.all()) else sub,
                    tokens=rows(busy),
                )
                return out
        a = self.attn(self.norm1(x), kv=kv, active=active, mask=mask, tokens=tokens)
        out[active] = self._after_attention(x[active], a)  # (N_active, d)
        return out


class Core(nn.Module):
    """A looped core of k > 1 layers used as one shared update ``G``:

        y_0 = x,   y_i = y_{i−1} + G_i(y_{i−1})  (i = 1 … k),   G(x) = y_k − x = Σ_i G_i(y_{i−1})

    i.e. k blocks in sequence, returned as an update. Where each G_i(0) = 0 (every option but
    value embeddings), y stays 0 from x = 0 and G(0) = 0 exactly. With a KV cache every layer
    takes a slot of its own (``kv``: a list of k slots).
    """

    def __init__(self, layers: list[Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.n_layers = len(layers)
        self._parts: dict[tuple[int, int], Core] = {}  # a plain dict: views stay unregistered

    def part(self, index: int, parts: int) -> Core:
        """Part ``index`` of ``parts`` equal runs of the layers, as a core of its own (the same
        layer modules, not registered again): for a recurrence whose step applies the stacks of
        its core separately (two stacks: ``parts=2``)."""
        if self.n_layers % parts or not 0 <= index < parts:
            raise LoopLMError(
                f"part {index} of {parts}: a core of {self.n_layers} layers splits into "
                f"{parts} equal stacks only when {parts} divides {self.n_layers}"
            )
        key = (index, parts)
        if key not in self._parts:
            size = self.n_layers // parts
            self._parts[key] = Core(list(self.layers[index * size : (index + 1) * size]))
        return self._parts[key]

    def forward(
        self,
        x: torch.Tensor,
        *,
        kv: list[KVSlot] | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y, total = x, None
        for i, layer in enumerate(self.layers):
            slot = kv[i] if kv is not None else None
            g = layer(y, kv=slot, active=active, mask=mask, tokens=tokens)
            y = y + g
            total = g if total is None else total + g
        return total

    def advance(self, x: torch.Tensor, *, kv: list[KVSlot] | None = None, **kw) -> torch.Tensor:
        """y_k = x + G(x), each layer's own :meth:`Block.advance` in turn (the reference order
        of the layers' sums, where :meth:`forward` returns Σ G_i)."""
        y = x
        for i, layer in enumerate(self.layers):
            y = layer.advance(y, kv=kv[i] if kv is not None else None, **kw)
        return y


class BlockCall:
    """The shared block (or k-layer core) bound to one forward pass's attention arguments.

    Recurrences call ``block(x)`` once per body application; with a cache every call takes the
    next slot(s) (slot i = the i-th layer application of the pass, the same order for the prompt
    and for each decoded token), ``active`` restricts the work to active rows, and ``mask`` is the
    pass's data-given attention mask; ``tokens`` the pass's token ids (for value embeddings).
    """

    def __init__(
        self,
        block: nn.Module,
        *,
        cache: KVCache | None = None,
        active: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        first_slot: int = 0,
        tokens: torch.Tensor | None = None,
    ) -> None:
        self.block, self.cache, self.active, self.mask = block, cache, active, mask
        self.slot = first_slot
        self.tokens = tokens

    def _slots(self) -> list[KVSlot] | KVSlot | None:
        kv = None
        n = getattr(self.block, "n_layers", 1)
        if self.cache is not None:
            slots = [KVSlot(self.cache, self.slot + i) for i in range(n)]
            kv = slots if isinstance(self.block, Core) else slots[0]
        self.slot += n
        return kv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """G(x)."""
        kv = self._slots()
        if self.tokens is None:
            return self.block(x, kv=kv, active=self.active, mask=self.mask)
        return self.block(x, kv=kv, active=self.active, mask=self.mask, tokens=self.tokens)

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        """x + G(x), in the layers' own order (:meth:`Block.advance`)."""
        if not hasattr(self.block, "advance"):
            return x + self(x)
        kv = self._slots()
        kw = {"kv": kv, "active": self.active, "mask": self.mask, "tokens": self.tokens}
        return self.block.advance(x, **kw)

    def part(self, index: int, parts: int) -> PartCall:
        """Part ``index`` of ``parts`` equal runs of the core's layers, bound as this call is
        and taking this call's next slots (see :func:`core_part`)."""
        return PartCall(self, self, core_part(self.block, index, parts))


def core_part(core: nn.Module, index: int, parts: int) -> nn.Module:
    """Part ``index`` of ``parts`` of a k-layer core (:meth:`Core.part`); a one-layer core is
    every one of its parts (the stacks then share its weights)."""
    if isinstance(core, Core):
        return core.part(index, parts)
    if not 0 <= index < parts:
        raise LoopLMError(f"part {index} of {parts} does not exist")
    return core


class PartCall:
    """A bound core (``owner``: a :class:`BlockCall` or a wrapper of one) applied with part of
    its layers: each call puts ``module`` in place of ``holder.block`` for its duration, so the
    bindings (cache slots in call order, active rows, mask) are the owner's own."""

    def __init__(self, owner, holder, module: nn.Module) -> None:
        self.owner, self.holder, self.module = owner, holder, module

    def _run(self, fn, x: torch.Tensor) -> torch.Tensor:
        whole = self.holder.block
        self.holder.block = self.module
        try:
            return fn(x)
        finally:
            self.holder.block = whole

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """G_part(x)."""
        return self._run(self.owner, x)

    def advance(self, x: torch.Tensor) -> torch.Tensor:
        """x + G_part(x), in the layers' own order."""
        return self._run(self.owner.advance, x)
