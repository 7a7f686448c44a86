"""KV caches that serve a subset of the batch rows: a block call whose rows have partly halted
runs its active rows as a smaller dense batch and writes only keys/values for the others
(row compaction), with the same results as the call that computes every row."""

from __future__ import annotations

import pytest
import torch

from looplm.decoding.decoder import RaggedKVCache, StaticKVCache
from looplm.model.block import Block, KVSlot


def _block(rope: float) -> Block:
    torch.manual_seed(0)
    return Block(32, 4, 64, 0.0, 1e-6, rope).eval()


def _prefilled(block: Block, cache, x0: torch.Tensor):
    with torch.no_grad():
        block(x0, kv=KVSlot(cache, 0))
    cache.length += x0.shape[1]
    return cache


@pytest.mark.parametrize("rope", [0.0, 10000.0])
@pytest.mark.parametrize("L", [1, 3])
def test_compacted_rows_equal_the_all_rows_call(rope: float, L: int) -> None:
    block = _block(rope)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(5, 6, 32, generator=g)
    x = torch.randn(5, L, 32, generator=g)
    active = torch.rand(5, L, generator=g) < 0.5
    active[0] = False  # a row with nothing active
    active[1] = True  # a row with everything active
    active[2, 0] = True
    compact = _prefilled(block, StaticKVCache(16), x0)
    plain = _prefilled(block, StaticKVCache(16), x0)
    plain.row_subsets = False  # the block's all-rows path
    with torch.no_grad():
        a = block(x, kv=KVSlot(compact, 0), active=active)
        b = block(x, kv=KVSlot(plain, 0), active=active)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(a[~active], torch.zeros_like(a[~active]))
    for (ka, va), (kb, vb) in zip(compact.buffers, plain.buffers):
        torch.testing.assert_close(ka[:, :, : 6 + L], kb[:, :, : 6 + L], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(va[:, :, : 6 + L], vb[:, :, : 6 + L], rtol=1e-6, atol=1e-6)


def test_ragged_cache_rows_have_their_own_positions() -> None:
    """Each row of a ragged cache attends to its own cached positions only: a batch of rows of
    different lengths gives each row what it gets alone."""
    block = _block(10000.0)
    g = torch.Generator().manual_seed(2)
    prefixes = [torch.randn(1, n, 32, generator=g) for n in (2, 7, 4)]
    new = torch.randn(3, 1, 32, generator=g)
    ragged = RaggedKVCache(16, 3)
    alone = []
    for b, p in enumerate(prefixes):
        single = _prefilled(block, StaticKVCache(16), p)
        ragged.load_row(b, single)
        with torch.no_grad():
            alone.append(block(new[b : b + 1], kv=KVSlot(single, 0)))
    with torch.no_grad():
        got = block(new, kv=KVSlot(ragged, 0))
    torch.testing.assert_close(got, torch.cat(alone), rtol=1e-6, atol=1e-6)
    # a pass over rows 2 and 0 only leaves row 1 untouched
    ragged.length += 1
    before = [k[1].clone() for k, _ in ragged.buffers]
    ragged.using(torch.tensor([2, 0]))
    with torch.no_grad():
        block(new[[2, 0]], kv=KVSlot(ragged, 0))
    ragged.length += 1
    ragged.using(None)
    assert ragged.length.tolist() == [4, 8, 6]
    assert all(torch.equal(k[1], b) for (k, _), b in zip(ragged.buffers, before))
