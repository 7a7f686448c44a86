"""Text generation with a key/value cache that is exact for looped models.

Sharing rule: the shared block is applied at every loop step (and twice per step for the
subtractive controls) to a *different* input, so its keys and values differ per application.
The cache therefore holds one K/V slot per block application within a forward pass: slot
``i`` is the i-th call of the block (loop step t, body call c), identical in order for the prompt
and every new token. Decoding one token runs the full loop over that token only, attending to the
cached K/V of its own slot. Positions continue from the prompt.

One caveat: SCSE-family masks are per example over the whole sequence (Eq. 4). During cached
decoding a new token's mask uses that token's deviation alone; the two differ only when the new
token's ‖Δ_t‖² is ≤ ε (1e-8) while the sequence's is not, i.e. essentially only for anchor-started
states. Ordinary generation gives identical tokens with and without the cache (tested).
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.block import KVCache

__all__ = ["KVCache", "generate", "next_logits"]


@torch.no_grad()
def next_logits(
    model: nn.Module, ids: torch.Tensor, loops: int, cache: KVCache | None
) -> torch.Tensor:
    """Logits (B, V) of the last position. With ``cache``, ``ids`` are only the new tokens."""
    if cache is None:
        return model(ids, loops=loops)[:, -1]
    if not getattr(model, "is_looped", False):
        raise LoopLMError("cached generation needs a looped model (recurrence != unshared)")
    rec = model.recurrence
    ctx = model.prepare(ids, cache=cache, pos_offset=cache.length)
    if "attn_mask" in ctx.extra:
        raise LoopLMError("a KV cache cannot serve a data-given attention mask (model.attention)")
    block = model.core_call(ctx, cache=cache)
    s = rec.init_state(ctx)
    for t in range(loops):
        s = rec.step(block, s, ctx, t)
    h = model.finish(rec.to_hidden(s, ctx), ctx, cache=cache, first_slot=block.slot)
    cache.length += ids.shape[1]
    return model.readout(h[:, -1])


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    loops: int = 8,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue ``ids`` (B, L) by ``max_new_tokens`` tokens; temperature 0 is greedy decoding."""
    model.eval()
    if ids.shape[1] + max_new_tokens > model.config.context:
        raise LoopLMError(
            f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds the context "
            f"{model.config.context}"
        )
    cache = KVCache() if use_cache and getattr(model, "is_looped", False) else None
    out = ids
    step_in = ids
    for _ in range(max_new_tokens):
        logits = next_logits(model, step_in if cache is not None else out, loops, cache).float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        out = torch.cat([out, nxt], dim=1)
        step_in = nxt
    return out
