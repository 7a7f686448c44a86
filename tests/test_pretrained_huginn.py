"""Huginn-0125 checkpoints load natively: parity with the reference implementation on a tiny
published-layout fixture (sharded safetensors), the decoding invariants, and the published
size's parameter count."""

from __future__ import annotations

import pytest
import torch
from pretrained_common import (
    check_batched_equals_one_by_one,
    check_cached_equals_uncached,
    close,
    load,
    logits_at,
    meta_parameter_count,
    published,
    reference,
)

from looplm.decoding.decoder import decode

REF = reference("huginn")


@pytest.fixture(scope="module")
def model():
    return load("huginn")


@pytest.mark.parametrize("loops", [1, 3, 8, 32])
def test_pretrained_huginn_logits_match_the_reference(model, loops):
    ids = REF["input_ids"]
    close(logits_at(model, ids, loops, REF["init_state"]), REF[f"logits_r{loops}"])
    close(logits_at(model, ids, loops), REF[f"logits_zero_init_r{loops}"])  # zero by default
    # docs/pretrained.md says bit-identical for Huginn: pinned exactly, not within the tolerance
    assert torch.equal(logits_at(model, ids, loops, REF["init_state"]), REF[f"logits_r{loops}"])


def test_pretrained_huginn_states_and_latents_match(model):
    ctx = model.prepare(REF["input_ids"])
    with torch.no_grad():
        steps = list(model.unroll(ctx, 8, state=REF["init_state"]))
    close(torch.stack([st.state for st in steps]), REF["states_per_step"])
    # the reference's latent output: the final norm of s_r (the coda's input)
    close(model.norm_f(steps[8].state), REF["latent_r8"])
    per_step = torch.stack([model.readout(model.finish(st.hidden, ctx)) for st in steps[1:]])
    close(per_step, REF["logits_per_step"])


def test_pretrained_huginn_greedy_tokens_cached_and_uncached(model):
    loops = int(REF["greedy_loops"])
    for cache in (True, False):
        out = decode(model, REF["input_ids"], 6, loops=loops, use_cache=cache)
        assert torch.equal(out.tokens[:, 12:], REF["greedy_tokens_zero_init"])


def test_pretrained_huginn_cached_equals_uncached_at_other_depths(model):
    check_cached_equals_uncached(model, REF["input_ids"][:, :5], loops=3)


def test_pretrained_huginn_batched_equals_one_by_one(model):
    ids = REF["input_ids"].tolist()
    check_batched_equals_one_by_one(model, [ids[0][:9], ids[1][:4], ids[0][3:6]], loops=3)


def test_pretrained_huginn_0125_has_the_published_parameter_count():
    entry = published("huginn", "huginn-0125.json")  # {config, parameter_count}
    count = entry["parameter_count"]["parameters_unique_tied_head_counted_once"]
    assert meta_parameter_count(entry["config"]) == count == 3_564_976_800
