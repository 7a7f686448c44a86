"""Parcae checkpoints load natively: parity with the reference implementation on a tiny
published-layout fixture, the decoding invariants, and the published sizes' parameter counts."""

from __future__ import annotations

import json

import pytest
import torch
from pretrained_common import (
    check_batched_equals_one_by_one,
    check_cached_equals_uncached,
    close,
    fixture,
    load,
    logits_at,
    meta_parameter_count,
    published,
    reference,
)

from looplm.decoding.decoder import decode

REF = reference("parcae")


@pytest.fixture(scope="module")
def model():
    return load("parcae")


@pytest.mark.parametrize("loops", [1, 3, 8, 12])
def test_pretrained_parcae_logits_match_the_reference(model, loops):
    ids, state = REF["input_ids"], REF["init_state"][:, :12]
    close(logits_at(model, ids, loops, state), REF[f"logits_loops{loops}"])


@pytest.mark.parametrize("loops", [1, 8])
def test_pretrained_parcae_zero_state_is_the_default(model, loops):
    close(logits_at(model, REF["input_ids"], loops), REF[f"logits_zero_state_loops{loops}"])


def test_pretrained_parcae_states_and_injection_match(model):
    ids = REF["input_ids"]
    ctx = model.prepare(ids)
    close(ctx.e, REF["prelude_injection_e"])
    with torch.no_grad():
        states = [st.state for st in model.unroll(ctx, 8, state=REF["init_state"][:, :12])][1:]
    close(torch.stack(states), REF["states_loops8"])


def test_pretrained_parcae_greedy_tokens_cached_and_uncached(model):
    prompt = REF["input_ids"]
    want = REF["greedy_tokens_zero_state_loops8"]
    for cache in (True, False):
        out = decode(model, prompt, 6, loops=8, use_cache=cache)
        assert torch.equal(out.tokens, want)


def test_pretrained_parcae_cached_equals_uncached_at_other_depths(model):
    check_cached_equals_uncached(model, REF["input_ids"][:, :5], loops=3)


def test_pretrained_parcae_batched_equals_one_by_one(model):
    ids = REF["input_ids"].tolist()
    check_batched_equals_one_by_one(model, [ids[0][:9], ids[1][:4], ids[0][3:6]], loops=3)


def test_pretrained_parcae_value_embeddings_sit_in_the_odd_layers(model):
    assert model.config.value_embed_layers == [1, 3, 5]
    assert model.block.layers[1].attn.value_embed is not None
    assert model.block.layers[0].attn.value_embed is None


COUNTS = json.loads((fixture("parcae") / "published" / "param_counts.json").read_text())


@pytest.mark.parametrize(
    "size", ["parcae-small-140m", "parcae-medium-370m", "parcae-large-770m", "parcae-xlarge-1_3b"]
)
def test_pretrained_parcae_published_sizes_have_the_published_parameter_counts(size):
    cfg = published("parcae", f"{size}.json")
    assert meta_parameter_count(cfg) == COUNTS[size]["params_unique_tied_head_once"]
