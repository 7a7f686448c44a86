"""Adaptive per-token depth in cached generation (looplm.decoding.decoder).

Pinned here: threshold 0 is fixed-depth generation exactly; the cached adaptive pass equals an
independent uncached computation of the same halting semantics (the evaluation's per-token halting
with the same per-token depths forced); batched and unbatched decoding halt alike.
"""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.adaptive.halting import per_token_halting
from looplm.decoding.decoder import (
    Halting,
    KVCache,
    StaticKVCache,
    adaptive_next_logits,
    decode,
    generate,
    next_logits,
)
from looplm.errors import LoopLMError
from looplm.model.halting import relative_update

METHODS = [
    "scse",
    "looped",
    "tuned_adapter",
    "step_conditioned",
    "sc_cond_subtractive",
    "hyper_scse",
]


def _model(name: str, **kw):
    torch.manual_seed(0)
    return looplm.build_model("tiny", name, dropout=0.0, **kw).eval()


def _prompts(B: int = 3, L: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 257, (B, L), generator=torch.Generator().manual_seed(seed))


def _decode_stepwise(model, prompt, tokens, T, halting):
    """Feed ``tokens`` after ``prompt`` one at a time through the cached adaptive step: the
    logits and the loop depth of each new token."""
    cache = KVCache()
    next_logits(model, prompt, T, cache)
    got, depths = [], []
    for n in range(prompt.shape[1], tokens.shape[1]):
        logits, d = adaptive_next_logits(model, tokens[:, n : n + 1], T, cache, halting)
        got.append(logits)
        depths.append(d[:, 0])
    return got, depths


def _mixed_threshold(model, prompt, loops: int, rule: str = "kl") -> float:
    """A threshold at which decoded tokens halt at more than one depth (so the test means
    something for this random-weight model): a quantile of the rule's statistic over the prompt's
    positions and loop steps (from one uncached unroll), checked by a short decoding run."""
    with torch.no_grad():
        hs = model(prompt, loops=loops, return_states=True).states  # [h_0 … h_T]
        if rule == "kl":
            lps = [torch.log_softmax(model.readout(h).float(), -1) for h in hs[:-1]]
            stat = torch.stack([(q.exp() * (q - p)).sum(-1) for p, q in zip(lps, lps[1:])])
        else:
            stat = torch.stack([relative_update(b, a) for a, b in zip(hs[:-2], hs[1:-1])])
    for q in (0.5, 0.3, 0.7, 0.15, 0.85, 0.05, 0.95, 0.01, 0.99):
        thr = float(torch.quantile(stat.double().flatten(), q))
        g = decode(model, prompt, 10, loops, halt=rule, threshold=thr)
        if len(g.loops[:, 1:].unique()) >= 2 and bool((g.loops[:, 1:] < loops).any()):
            return thr
    pytest.fail(f"no {rule} threshold gives mixed depths")


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("rule", ["kl", "maxtoken"])
def test_threshold_zero_is_fixed_depth_generation(name: str, rule: str) -> None:
    model, prompt = _model(name), _prompts()
    fixed = generate(model, prompt, 12, loops=5)
    g = decode(model, prompt, 12, loops=5, halt=rule, threshold=0.0)
    assert torch.equal(g.tokens, fixed)
    assert torch.all(g.loops == 5)
    # The logits of each pass are those of the fixed-depth pass.
    c1, c2 = KVCache(), KVCache()
    a, b = next_logits(model, prompt, 5, c1), next_logits(model, prompt, 5, c2)
    for n in range(7, 12):
        tok = fixed[:, n : n + 1]
        a = next_logits(model, tok, 5, c1)
        b, depth = adaptive_next_logits(model, tok, 5, c2, Halting(rule, 0.0))
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert torch.all(depth == 5)


class _ForcedDepth:
    """A per_token_halting decision that halts token (b, l) after loop ``target[b, l]``."""

    needs_logits = False

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.active = torch.ones_like(target, dtype=torch.bool)

    def __call__(self, t, h, logp, logp_prev):
        halt = self.target[self.active] == t  # per_token_halting's order: active tokens, row-major
        new = self.active.clone()
        new[self.active] = ~halt
        self.active = new
        return halt


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("rule", ["kl", "maxtoken"])
def test_cached_adaptive_pass_equals_uncached_per_token_halting(name: str, rule: str) -> None:
    """The keys/values rule: a halted token's cache slots hold what the uncached per-token
    halting evaluation attends to (the block input of its frozen state at every later step)."""
    T = 6
    model, prompt = _model(name), _prompts()
    halting = Halting(rule, _mixed_threshold(model, prompt, T, rule))
    tokens = decode(model, prompt, 10, T, halt=rule, threshold=halting.threshold).tokens
    got, depths = _decode_stepwise(model, prompt, tokens, T, halting)
    depth = torch.stack(depths, dim=1)  # (B, n_fed)
    assert len(depth.unique()) >= 2
    target = torch.full(tokens.shape, T, dtype=torch.long)
    target[:, prompt.shape[1] :] = depth
    h, ref_depth = per_token_halting(model, tokens, _ForcedDepth(target), T)
    assert torch.equal(ref_depth, target)
    ref = model.readout(h[:, prompt.shape[1] :])  # (B, n_fed, V)
    torch.testing.assert_close(torch.stack(got, dim=1), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["scse", "step_conditioned", "hyper_scse"])
@pytest.mark.parametrize("rule", ["kl", "maxtoken"])
def test_batched_and_unbatched_decoding_halt_alike(name: str, rule: str) -> None:
    T = 6
    model, prompt = _model(name), _prompts(B=4)
    thr = _mixed_threshold(model, prompt, T, rule)
    batched = decode(model, prompt, 16, T, halt=rule, threshold=thr)
    for b in range(prompt.shape[0]):
        one = decode(model, prompt[b : b + 1], 16, T, halt=rule, threshold=thr)
        assert torch.equal(one.loops[0], batched.loops[b])
        assert torch.equal(one.tokens[0], batched.tokens[b])


def test_every_row_halted_still_fills_every_slot() -> None:
    """A threshold so loose that every token stops after one loop: the cache stays aligned
    (every slot has every position) and decoding goes on."""
    model, prompt = _model("sc_cond_subtractive"), _prompts()  # two block calls per loop step
    cache = KVCache()
    next_logits(model, prompt, 4, cache)
    _, d = adaptive_next_logits(model, prompt[:, :1], 4, cache, Halting("kl", 1e9))
    assert torch.all(d == 1)
    assert len(cache.slots) == 8 and cache.length == 8
    assert all(k.shape[2] == 8 and v.shape[2] == 8 for k, v in cache.slots)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_keys_values_of_fully_halted_steps_are_what_later_tokens_need(positions: str) -> None:
    """One prompt: a token that halts early leaves every row halted, so its later slots are
    filled by the keys/values-only path (rotated keys with rope); deeper later tokens read them
    exactly as the uncached reference does."""
    T = 6
    model, prompt = _model("scse", positions=positions), _prompts(B=1, L=5)
    with torch.no_grad():  # sharp attention, so that wrong keys show in the logits
        model.block.attn.qkv.weight.mul_(8.0)
    halting = Halting("kl", _mixed_threshold(model, prompt, T))
    tokens = decode(model, prompt, 10, T, halt="kl", threshold=halting.threshold).tokens
    got, depths = _decode_stepwise(model, prompt, tokens, T, halting)
    depth = torch.stack(depths, dim=1)
    assert bool((depth[:, :-1] < T).any())  # some token halted early with a later one after it
    target = torch.full(tokens.shape, T, dtype=torch.long)
    target[:, prompt.shape[1] :] = depth
    h, _ = per_token_halting(model, tokens, _ForcedDepth(target), T)
    ref = model.readout(h[:, prompt.shape[1] :])
    torch.testing.assert_close(torch.stack(got, dim=1), ref, rtol=1e-4, atol=1e-4)


def test_halting_rejects_bad_settings() -> None:
    model, prompt = _model("scse"), _prompts()
    with pytest.raises(LoopLMError, match="allowed: none, kl, update, gate"):
        decode(model, prompt, 2, halt="entropy", threshold=0.1)
    with pytest.raises(LoopLMError, match="must be >= 0"):
        decode(model, prompt, 2, halt="kl", threshold=-1.0)
    with pytest.raises(LoopLMError, match="KV-cached path"):
        decode(model, prompt, 2, halt="kl", threshold=0.1, use_cache=False)
    unshared = looplm.build_model("tiny", "unshared", n_layers=2).eval()
    with pytest.raises(LoopLMError, match="KV-cached path"):
        decode(unshared, prompt, 2, halt="maxtoken", threshold=0.1)
    assert decode(unshared, prompt, 2).tokens.shape == (3, 9)  # fixed depth still works


def test_cli_generate_with_halting(tmp_path, capsys) -> None:
    from looplm.cli import main
    from looplm.model import model_from_config
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config

    cfg = load_config("tiny_bool", [])
    save_checkpoint(tmp_path / "ck", model_from_config(cfg.model), cfg)
    args = ["generate", str(tmp_path / "ck"), "--prompt", "T&F=", "--max-new", "6"]
    assert main([*args, "--halt", "kl", "--threshold", "0.01"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("T&F=") and "halt=kl" in out and "mean loops/token" in out
    assert main([*args, "--halt", "kl"]) == 2  # a halting rule needs --threshold
    assert main([*args, "--halt", "kl", "--threshold", "0.01", "--prefill-halt"]) == 0
    assert ", prompt " in capsys.readouterr().out  # the prompt's mean loops


STRUCTURES = {
    "rope": {"positions": "rope"},
    "no_positions": {"positions": "none"},
    "prelude_core2": {"prelude_layers": 1, "core_layers": 2},
}


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_adaptive_decoding_on_structural_variants(structure: str) -> None:
    """Rotary keys, no positions, a prelude and a 2-layer core: the cached adaptive pass still
    equals the uncached per-token halting with the same depths, and threshold 0 is fixed depth."""
    T = 5
    model, prompt = _model("scse", **STRUCTURES[structure]), _prompts()
    fixed = generate(model, prompt, 8, loops=T)
    assert torch.equal(decode(model, prompt, 8, T, halt="kl", threshold=0.0).tokens, fixed)
    halting = Halting("kl", _mixed_threshold(model, prompt, T))
    tokens = decode(model, prompt, 10, T, halt="kl", threshold=halting.threshold).tokens
    got, depths = _decode_stepwise(model, prompt, tokens, T, halting)
    target = torch.full(tokens.shape, T, dtype=torch.long)
    target[:, prompt.shape[1] :] = torch.stack(depths, dim=1)
    h, _ = per_token_halting(model, tokens, _ForcedDepth(target), T)
    ref = model.readout(h[:, prompt.shape[1] :])
    torch.testing.assert_close(torch.stack(got, dim=1), ref, rtol=1e-4, atol=1e-4)


def test_coda_models_halt_by_kl_as_the_per_token_evaluation() -> None:
    """A coda model's KL reads go through the coda at every step, attending to the earlier
    positions' step-t coda inputs: the cached decode's depths and tokens are the uncached
    per-token evaluation's; a cache filled without those per-step keys/values is refused."""
    from looplm.model.halting_rules import KLHalt

    model, prompt = _model("scse", coda_layers=1), _prompts()
    fixed = generate(model, prompt, 6, loops=4)
    assert torch.equal(decode(model, prompt, 6, 4, halt="maxtoken", threshold=0.0).tokens, fixed)
    assert torch.equal(decode(model, prompt, 6, 4, halt="kl", threshold=0.0).tokens, fixed)
    g = decode(model, prompt, 6, 4, halt="maxtoken", threshold=0.5)
    assert g.tokens.shape == (3, 13)
    thr = _mixed_threshold(model, prompt, 4, "kl")
    g = decode(model, prompt, 6, 4, halt="kl", threshold=thr, prefill_halt=True)
    h, depth = per_token_halting(model, g.tokens[:, :-1], KLHalt(thr), 4)
    P = prompt.shape[1]
    assert len(depth.unique()) >= 2
    assert torch.equal(g.prompt_loops, depth[:, :P]) and torch.equal(g.loops[:, 1:], depth[:, P:])
    assert torch.equal(model.readout(h[:, P - 1 :]).argmax(-1), g.tokens[:, P:])
    cache = StaticKVCache(model.config.context)
    next_logits(model, prompt, 4, cache)
    with pytest.raises(LoopLMError, match="prefill it through decode"):
        adaptive_next_logits(model, prompt[:, :1], 4, cache, Halting("kl", thr))


def test_preallocated_cache_equals_the_list_cache() -> None:
    model, prompt = _model("sc_cond_subtractive"), _prompts()
    a, b = KVCache(), StaticKVCache(capacity=20)
    torch.testing.assert_close(next_logits(model, prompt, 3, a), next_logits(model, prompt, 3, b))
    for n in range(4):
        tok = prompt[:, n : n + 1]
        torch.testing.assert_close(next_logits(model, tok, 3, a), next_logits(model, tok, 3, b))
    assert [k.shape for k, _ in a.slots] == [k.shape for k, _ in b.slots]
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a.slots, b.slots))
    with pytest.raises(LoopLMError, match="holds 20 positions"):
        next_logits(model, torch.zeros(3, 10, dtype=torch.long), 3, b)


@pytest.mark.parametrize("name", ["scse", "step_conditioned", "hyper_scse"])
@pytest.mark.parametrize("rule", ["kl", "maxtoken"])
def test_prefill_halting_is_the_per_token_evaluation_of_the_prompt(name: str, rule: str) -> None:
    """With prefill halting the prompt's tokens halt as the per-token halting evaluation halts
    them (same rule, same frozen states): the same depths, and the first generated token is read
    from the same last state; threshold 0 is fixed-depth generation exactly."""
    from looplm.model.halting_rules import KLHalt, UpdateHalt

    T = 6
    model, prompt = _model(name), _prompts(B=3, L=12)
    thr = _mixed_threshold(model, prompt, T, rule)
    g = decode(model, prompt, 6, T, halt=rule, threshold=thr, prefill_halt=True)
    decide = KLHalt(thr) if rule == "kl" else UpdateHalt(thr)
    h, depth = per_token_halting(model, prompt, decide, T)
    assert torch.equal(g.prompt_loops, depth)
    assert len(depth.unique()) >= 2  # the rule did act on the prompt
    assert torch.equal(g.loops[:, 0], depth[:, -1])
    first = model.readout(h[:, -1]).argmax(-1)
    assert torch.equal(g.tokens[:, prompt.shape[1]], first)
    # decoding after a halted prefill attends to the prompt's frozen states: equal to feeding
    # the generated tokens through the uncached evaluation with the same depths forced
    target = torch.full(g.tokens.shape, T, dtype=torch.long)
    target[:, : prompt.shape[1]] = depth
    target[:, prompt.shape[1] : -1] = g.loops[:, 1:]  # the token at P + k took g.loops[:, k + 1]
    h_all, ref_depth = per_token_halting(model, g.tokens[:, :-1], _ForcedDepth(target[:, :-1]), T)
    assert torch.equal(ref_depth, target[:, :-1])
    assert torch.equal(
        model.readout(h_all[:, prompt.shape[1] :]).argmax(-1), g.tokens[:, prompt.shape[1] + 1 :]
    )
    zero = decode(model, prompt, 6, T, halt=rule, threshold=0.0, prefill_halt=True)
    assert torch.equal(zero.tokens, generate(model, prompt, 6, loops=T))
    assert torch.all(zero.prompt_loops == T)
