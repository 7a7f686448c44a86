"""HRM-Text checkpoints load natively: parity with the reference implementation, which
``transformers`` ships (``HrmTextForCausalLM``), run live on a tiny random model saved in the
published layout; the decoding invariants; the published size's parameter count.

The reference is perturbed so that a wrong formula cannot pass: z₀ (``z_L_init``) is random
instead of zero, the attention gates are far from σ = ½, the embedding scale is not the default,
and the weights are large enough for every stack to matter."""

from __future__ import annotations

import shutil

import pytest
import torch
from pretrained_common import (
    check_batched_equals_one_by_one,
    check_cached_equals_uncached,
    close,
    fixture,
    logits_at,
    meta_parameter_count,
    published,
)

import looplm
from looplm.decoding.decoder import KVCache, decode, next_logits
from looplm.errors import LoopLMError
from looplm.model.families import published_model_config

transformers = pytest.importorskip("transformers", reason="the reference ships with transformers")
if not hasattr(transformers, "HrmTextForCausalLM"):
    pytest.skip("this transformers has no HrmTextForCausalLM (5.9+)", allow_module_level=True)

V, D, STACK = 97, 32, 2  # vocabulary, width, layers per stack


def reference(h_cycles: int = 2, l_cycles: int = 3, state: dict | None = None):
    """The reference model (eval mode, float32) at these cycle counts, with ``state``'s
    weights when given, else perturbed random ones (module docstring)."""
    cfg = transformers.HrmTextConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_hidden_layers=STACK,  # the per-stack count: the config rewrites it (the trap)
        num_attention_heads=4,
        head_dim=D // 4,
        max_position_embeddings=64,
        H_cycles=h_cycles,
        L_cycles=l_cycles,
        embedding_scale=3.7,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    torch.manual_seed(0)
    model = transformers.HrmTextForCausalLM(cfg).eval()
    with torch.no_grad():
        if state is not None:
            model.load_state_dict(state)
        else:
            model.model.z_L_init.normal_()
            for name, p in model.named_parameters():
                if name.endswith("self_attn.gate_proj.weight"):
                    p.normal_(0.0, 1.0)
    return model


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def folder(ref, tmp_path_factory):
    out = tmp_path_factory.mktemp("hrm_text")
    ref.save_pretrained(out)
    # a published folder ships its tokenizer; the fixtures' 97-character one fits this vocabulary
    shutil.copy(fixture("ouro") / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def model(folder):
    return looplm.from_pretrained(folder)


IDS = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(3))


def test_pretrained_hrm_text_reads_the_published_layout(folder, model):
    cfg = (folder / "config.json").read_text()
    assert '"num_hidden_layers": 16' in cfg  # the inflated count: 2 layers · 2 · (3 + 1)
    c = model.config
    assert (c.core_layers, c.recurrence_args["inner_steps"]) == (2 * STACK, 3)
    assert (c.emb_scale, c.rope_base, c.tie_head, c.final_norm) == (3.7, 500.0, False, False)
    assert model.pretrained["trained_loops"] == 2
    assert not any("norm" in n for n, _ in model.named_parameters())  # gainless norms


@pytest.mark.parametrize("h_cycles", [1, 2, 3])
def test_pretrained_hrm_text_logits_match_the_reference(ref, model, h_cycles):
    """looplm's loop count is the reference's H_cycles (its config changed, same weights)."""
    other = reference(h_cycles, state=ref.state_dict())
    with torch.no_grad():
        want = other(IDS).logits
    close(logits_at(model, IDS, h_cycles), want)


def test_pretrained_hrm_text_inner_steps_follow_l_cycles(ref, tmp_path):
    other = reference(2, 2, state=ref.state_dict())
    other.save_pretrained(tmp_path)
    loaded = looplm.from_pretrained(tmp_path)
    assert loaded.config.recurrence_args["inner_steps"] == 2
    with torch.no_grad():
        want = other(IDS).logits
    close(logits_at(loaded, IDS, 2), want)


def test_pretrained_hrm_text_states_are_the_reference_z_h_and_z_l(ref, model):
    """The per-step state is the pair (z_H, z_L); after T steps it is the reference's."""
    ctx = model.prepare(IDS)
    with torch.no_grad():
        steps = list(model.unroll(ctx, 2))
        hidden = ref.model(IDS).last_hidden_state
    assert steps[0].state.shape == (2, 2, 13, D)
    close(steps[0].state[:, 1], ref.model.z_L_init.expand(2, 13, D))  # z_L,0 = z₀
    close(steps[-1].hidden, hidden)
    with torch.no_grad():  # a step from h_t alone pairs it with z₀, not with z_L,t
        assert not torch.allclose(model.step(steps[1].hidden, ctx, 1), steps[2].hidden)


def test_pretrained_hrm_text_greedy_tokens_match_the_reference(ref, model):
    prompt = IDS[:, :6]
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(decode(model, prompt, 6, loops=2).tokens, want)


def test_pretrained_hrm_text_cached_equals_uncached(model):
    check_cached_equals_uncached(model, IDS[:, :5], loops=2)
    check_cached_equals_uncached(model, IDS[:1, :4], loops=3)


def test_pretrained_hrm_text_cache_slots_are_the_reference_attention_invocations(ref, model):
    """One KV slot per (cycle, stack, layer) invocation: the reference's inflated
    ``num_hidden_layers``; token-by-token cached logits equal the reference's cached ones."""
    cache = KVCache()  # the list cache: every append must be one invocation's own
    ids = IDS[:1, :9]
    with torch.no_grad():
        next_logits(model, ids[:, :7], 2, cache)
        out = ref(ids[:, :7], use_cache=True)
        for n in (7, 8):
            got = next_logits(model, ids[:, n : n + 1], 2, cache)
            out = ref(ids[:, n : n + 1], cache=out.cache, use_cache=True)
    assert len(cache.slots) == ref.config.num_hidden_layers == 16
    assert all(k.shape[2] == 9 for k, _ in cache.slots)
    close(got, out.logits[:, -1])


def test_pretrained_hrm_text_batched_equals_one_by_one(model):
    ids = IDS.tolist()
    check_batched_equals_one_by_one(model, [ids[0][:9], ids[1][:4], ids[0][3:6]], loops=2)


def test_pretrained_hrm_text_halted_tokens_write_keys_values_only(model):
    """Every token, the prompt's too, halts after its first step (an unreachable threshold):
    the later steps only write keys and values (each stack part its own slots), and the tokens
    are those of depth 1."""
    prompt = IDS[:, :5]
    halted = decode(model, prompt, 5, loops=3, halt="maxtoken", threshold=1e9, prefill_halt=True)
    assert (halted.loops == 1).all()
    assert torch.equal(halted.tokens, decode(model, prompt, 5, loops=1).tokens)


def test_pretrained_hrm_text_imports_as_a_looplm_checkpoint(ref, folder, tmp_path):
    """``import_pretrained`` writes a checkpoint every command reads: rebuilt from its own config
    (block options, recurrence settings, frozen z₀), it gives the reference's logits."""
    from looplm.model.checkpoint import load_checkpoint
    from looplm.model.families import import_pretrained

    loaded, cfg, _ = load_checkpoint(import_pretrained(folder, tmp_path / "ck"))
    assert cfg.model.attn_gate and not cfg.model.norm_weight
    assert not loaded.recurrence.z_L_init.requires_grad
    with torch.no_grad():
        want = ref(IDS).logits
    close(logits_at(loaded, IDS, 2), want)


def test_pretrained_hrm_text_refuses_what_it_cannot_compute(folder):
    from looplm.model.families import read_config

    cfg = read_config(folder)
    for key, value in (("attention_bias", True), ("hidden_act", "gelu"), ("head_dim", 16)):
        with pytest.raises(LoopLMError, match=key):
            published_model_config({**cfg, key: value})
    with pytest.raises(LoopLMError, match="rope_type"):
        published_model_config({**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1}})


def test_pretrained_hrm_text_published_size_has_the_reference_parameter_count():
    """HRM-Text-1B's published config: no exact count is published (the card says 1B), so the
    reference model built from the same config on the meta device is the count to meet."""
    cfg = published("hrm_text", "HRM-Text-1B.json")
    keys = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    with torch.device("meta"):
        want = transformers.HrmTextForCausalLM(transformers.HrmTextConfig(**keys)).num_parameters()
    assert meta_parameter_count(cfg) == want == 1_182_795_264


def test_hrm_text_recurrence_needs_a_core_that_splits_into_two_stacks():
    """A looplm-native hrm_text model: an odd k-layer core has no two equal stacks (one line);
    a one-layer core serves as both (each step applies it inner_steps + 1 times)."""
    ids = torch.randint(0, 257, (1, 6))
    odd = looplm.build_model("tiny", "hrm_text", core_layers=3).eval()
    with pytest.raises(LoopLMError, match="2 equal stacks"):
        odd(ids, loops=1)
    one = looplm.build_model("tiny", "hrm_text", inner_steps=2).eval()
    calls = []
    one.block.attn.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        one(ids, loops=2)
    assert len(calls) == 2 * (2 + 1)
