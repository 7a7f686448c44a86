"""Cached ≡ uncached for every imported family through the plain list cache (``KVCache``, which
appends whatever a block call writes): a layer that wrote its keys/values twice per call would
double the cached positions and change the logits, which the preallocated cache of ``decode``
(it overwrites positions) does not show."""

from __future__ import annotations

import pytest
import torch

from looplm.decoding.decoder import next_logits
from looplm.model.block import KVCache
from tests.pretrained_common import load


@pytest.mark.parametrize("family", ["parcae", "huginn", "ouro"])
@torch.no_grad()
def test_pretrained_token_by_token_list_cache_equals_uncached(family: str) -> None:
    model = load(family).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(model.config.vocab_size, 100), (2, 7), generator=g)
    loops = 3
    cache = KVCache()
    next_logits(model, ids[:, :4], loops, cache)
    for i in range(4, ids.shape[1]):
        got = next_logits(model, ids[:, i : i + 1], loops, cache)
        want = next_logits(model, ids[:, : i + 1], loops, None)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.length == ids.shape[1]
    assert all(k.shape[2] == ids.shape[1] for k, _ in cache.slots)
