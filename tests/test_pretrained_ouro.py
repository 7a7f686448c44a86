"""Ouro checkpoints load natively: parity with the reference implementation on a tiny
published-layout fixture (logits, per-step states and exit-gate values), the gate as a halting
rule, the decoding invariants, and the published sizes' parameter counts."""

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
from looplm.model.halting import TokenHalting
from looplm.model.halting_rules import GateHalt

REF = reference("ouro")


@pytest.fixture(scope="module")
def model():
    return load("ouro")


@pytest.fixture(scope="module")
def steps(model):
    ctx = model.prepare(REF["input_ids"])
    with torch.no_grad():
        return [st.hidden for st in model.unroll(ctx, 6)]


@pytest.mark.parametrize("loops", [1, 2, 4, 6])
def test_pretrained_ouro_logits_match_the_reference(model, loops):
    # published early_exit_threshold = 1.0: the last step's logits (every token exits at T here)
    assert (REF[f"ut{loops}_exit_step_default"] == loops - 1).all()
    close(logits_at(model, REF["input_ids"], loops), REF[f"ut{loops}_logits_default"])
    # docs/pretrained.md says bit-identical for Ouro: pinned exactly, not within the tolerance
    assert torch.equal(logits_at(model, REF["input_ids"], loops), REF[f"ut{loops}_logits_default"])


@pytest.mark.parametrize("loops", [4, 6])
def test_pretrained_ouro_states_logits_and_gates_per_step_match(model, steps, loops):
    states = torch.stack(steps[1 : loops + 1])
    close(states, REF[f"ut{loops}_hidden_per_step"])
    close(model.readout(states), REF[f"ut{loops}_logits_per_step"])
    gate_logits = model.recurrence.exit_gate(states).squeeze(-1)
    close(gate_logits, REF[f"ut{loops}_gate_logits_per_step"])


@pytest.mark.parametrize("loops", [1, 2, 4, 6])
def test_pretrained_ouro_gate_rule_exits_where_the_reference_does(model, steps, loops):
    """The halting rule's decisions over the full unroll equal the reference's exit steps at
    threshold 0.5, and the logits read at those steps equal its threshold logits."""
    rule = GateHalt(model, 0.5)
    B, L = REF["input_ids"].shape
    rule.start(B * L, torch.device("cpu"))
    exit_step = torch.full((B * L,), loops - 1)
    done = torch.zeros(B * L, dtype=torch.bool)
    for t in range(1, loops):
        halt = rule(t, steps[t].reshape(B * L, -1), torch.arange(B * L), None)
        exit_step[halt & ~done] = torch.minimum(exit_step, torch.tensor(t - 1))[halt & ~done]
        done |= halt
    assert torch.equal(exit_step.view(B, L), REF[f"ut{loops}_exit_step_threshold_0p5"])
    chosen = torch.stack(steps[1 : loops + 1])[exit_step.view(B, L), torch.arange(B)[:, None],
                                               torch.arange(L)]  # fmt: skip
    close(model.readout(chosen), REF[f"ut{loops}_logits_threshold_0p5"])


def test_pretrained_ouro_gate_halting_in_the_unroll(model):
    """Per-token halting by the gate inside the unroll: every token's depth is at most the
    ceiling, and at threshold 0 every token stops after its first step."""
    for thr, want_max in ((0.0, 1), (1.0, 4)):
        halting = TokenHalting(GateHalt(model, thr))
        ctx = model.prepare(REF["input_ids"])
        with torch.no_grad():
            for _ in model.unroll(ctx, 4, halting=halting):
                pass
        assert int(halting.depth.max()) == want_max


def test_pretrained_ouro_greedy_tokens_cached_and_uncached(model):
    for cache, key in ((True, "greedy_ut4_cached"), (False, "greedy_ut4_uncached")):
        out = decode(model, REF["input_ids"], 6, loops=4, use_cache=cache)
        assert torch.equal(out.tokens[:, 12:], REF[key])


def test_pretrained_ouro_cached_equals_uncached_at_other_depths(model):
    check_cached_equals_uncached(model, REF["input_ids"][:, :5], loops=2)


def test_pretrained_ouro_batched_equals_one_by_one(model):
    ids = REF["input_ids"].tolist()
    check_batched_equals_one_by_one(model, [ids[0][:9], ids[1][:4], ids[0][3:6]], loops=4)


def test_pretrained_ouro_padded_row_equals_its_unpadded_run(model):
    """The reference's left-padded row (mask and positions given) equals looplm's run of the
    unpadded tokens alone."""
    row = REF["padded_input_ids"][1:, 4:]
    close(logits_at(model, row, 4), REF["padded_ut4_logits_default"][1:, 4:])


COUNTS = json.loads((fixture("ouro") / "published" / "param_counts.json").read_text())


@pytest.mark.parametrize("size", ["1.4B", "2.6B"])
def test_pretrained_ouro_published_sizes_have_the_published_parameter_counts(size):
    assert (
        meta_parameter_count(published("ouro", f"{size}.json")) == COUNTS[size]["parameters_total"]
    )
