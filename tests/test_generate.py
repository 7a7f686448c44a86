"""Cached generation equals uncached generation for looped models."""

from __future__ import annotations

import pytest
import torch

import looplm
from looplm.decoding.decoder import KVCache, generate, next_logits

METHODS = [
    "scse",
    "looped",
    "tuned_adapter",
    "step_conditioned",
    "sc_cond_subtractive",
    "hyper_scse",
]


@pytest.mark.parametrize("name", METHODS)
def test_cached_logits_and_tokens_match_uncached(name: str) -> None:
    torch.manual_seed(0)
    model = looplm.build_model("tiny", name, dropout=0.0).eval()
    prompt = torch.randint(0, 257, (2, 7), generator=torch.Generator().manual_seed(1))
    cache = KVCache()
    ids = prompt
    step_in = prompt
    for _ in range(5):  # logits at every decoding step agree
        cached = next_logits(model, step_in, 6, cache)
        full = model(ids, loops=6)[:, -1]
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
        step_in = full.argmax(-1, keepdim=True)
        ids = torch.cat([ids, step_in], dim=1)
    a = generate(model, prompt, 12, loops=6, use_cache=True)
    b = generate(model, prompt, 12, loops=6, use_cache=False)
    assert torch.equal(a, b)
    assert a.shape == (2, 19) and torch.equal(a[:, :7], prompt)


@pytest.mark.parametrize("slide", [1, 5])
def test_generation_slides_the_window_past_the_context(slide: int) -> None:
    torch.manual_seed(0)
    model = looplm.build_model("tiny", "scse", context=16, dropout=0.0).eval()
    prompt = torch.randint(0, 257, (2, 5), generator=torch.Generator().manual_seed(2))
    out = generate(model, prompt, 40, loops=3, slide=slide)
    assert out.shape == (2, 45) and torch.equal(out[:, :5], prompt)
    # Reference: each token from the uncached model over the window the rule says it sees.
    # slide=1: always the last `context` tokens; slide=k: the window restarts (k − 1 tokens
    # short of full) whenever it is full.
    start = 0
    for n in range(5, 45):
        if n - start > 16:
            start = n - (16 - slide + 1)
        expected = model(out[:, start:n], loops=3)[:, -1].argmax(-1)
        assert torch.equal(out[:, n], expected), n
    if slide == 1:
        assert torch.equal(out, generate(model, prompt, 40, loops=3, use_cache=False))


def test_prompt_longer_than_the_context_is_cut_from_the_left() -> None:
    model = looplm.build_model("tiny", "looped", context=16, dropout=0.0).eval()
    prompt = torch.randint(0, 257, (1, 30), generator=torch.Generator().manual_seed(4))
    out = generate(model, prompt, 3, loops=2)
    assert torch.equal(out[:, :30], prompt)
    assert torch.equal(out[:, 30], model(prompt[:, -16:], loops=2)[:, -1].argmax(-1))


def test_sampling_is_reproducible_with_a_generator() -> None:
    model = looplm.build_model("tiny", "looped").eval()
    p = torch.zeros(1, 3, dtype=torch.long)
    a = generate(model, p, 8, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    b = generate(model, p, 8, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_cli_generate(tmp_path, capsys) -> None:
    from looplm.cli import main
    from looplm.model import model_from_config
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config

    cfg = load_config("tiny_bool", [])
    save_checkpoint(tmp_path / "ck", model_from_config(cfg.model), cfg)
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "T&F=", "--max-new", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("T&F=") and "4 tokens at T=8" in out
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "T", "--loops", "0"]) == 2
