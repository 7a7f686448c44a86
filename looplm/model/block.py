"""The one shared Transformer block: pre-RMSNorm, causal self-attention, SwiGLU, bias-free.

``Block(x)`` returns the *update* ``G(x)`` (not ``x + G(x)``):

    a = Attn(RMSNorm(x))            # causal self-attention
    m = SwiGLU(RMSNorm(x + a))
    G(x) = a + m                    # so x + G(x) is a standard pre-norm block

Every projection is bias-free and RMSNorm maps 0 to 0, so ``G(0) = 0`` exactly (attention over an
all-zero value matrix returns zeros whatever the softmax weights; SwiGLU(0) = silu(0)·0 = 0).
Dropout multiplies, so it keeps zeros zero in training mode too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)  # 3 × (B, L, d)
        q, k, v = (z.view(B, L, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(  # (B, nh, L, hs)
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, L, d)  # (B, L, d)
        return self.resid_drop(self.proj(y))


class SwiGLU(nn.Module):
    """``W_down(silu(W_gate x) * W_up x)``, bias-free."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 × (B, L, d_ff)
        return self.drop(self.down(F.silu(gate) * up))


class Block(nn.Module):
    """The shared update ``G``; ``block(x)`` returns ``G(x)`` with ``G(0) = 0``."""

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, eps: float = 1e-6
    ) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(d_model, eps=eps)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.norm2 = nn.RMSNorm(d_model, eps=eps)
        self.mlp = SwiGLU(d_model, d_ff, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d) → G(x): (B, L, d)."""
        a = self.attn(self.norm1(x))
        m = self.mlp(self.norm2(x + a))
        return a + m
