"""Shared checks of the pretrained-family tests (``pytest -k pretrained``).

The fixtures under ``tests/fixtures/pretrained/<family>/`` are tiny random-weight checkpoints in
each family's published layout with the reference implementation's outputs (each folder's
README and ``make_fixture.py`` say how they were made)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

import looplm
from looplm.decoding.batching import Request, generate_many
from looplm.decoding.decoder import decode
from looplm.model.families import build_meta, published_model_config

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pretrained"


def fixture(family: str) -> Path:
    return FIXTURES / family


def reference(family: str) -> dict[str, torch.Tensor]:
    return load_file(str(fixture(family) / "reference.safetensors"))


def load(family: str) -> torch.nn.Module:
    return looplm.from_pretrained(fixture(family))


@torch.no_grad()
def logits_at(model, ids: torch.Tensor, loops: int, state: torch.Tensor | None = None):
    """Logits (B, L, V) at depth ``loops`` from the initial state ``state`` (default: the
    recurrence's own)."""
    ctx = model.prepare(ids)
    for last in model.unroll(ctx, loops, state=state):  # noqa: B007
        pass
    return model.readout(model.finish(last.hidden, ctx))


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def check_cached_equals_uncached(model, prompt: torch.Tensor, loops: int, n: int = 6) -> None:
    a = decode(model, prompt, n, loops=loops, use_cache=True).tokens
    b = decode(model, prompt, n, loops=loops, use_cache=False).tokens
    assert torch.equal(a, b)


def check_batched_equals_one_by_one(model, prompts: list[list[int]], loops: int) -> None:
    """Prompts of different lengths in one batch (a ragged cache: each row its own length)
    get exactly the tokens each gets alone."""
    requests = [Request(tuple(p), max_new=4) for p in prompts]
    batched = generate_many(model, requests, slots=len(prompts), loops=loops)
    for p, got in zip(prompts, batched.completions):
        alone = decode(model, torch.tensor([p]), 4, loops=loops).tokens[0, len(p) :]
        assert got.tokens == alone.tolist()


def published(family: str, name: str) -> dict:
    """A published config.json of a real size (the fixture helper's notes keys removed)."""
    cfg = json.loads((fixture(family) / "published" / name).read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_") or k == "_class_name"}


def meta_parameter_count(cfg: dict) -> int:
    _, mc = published_model_config(cfg)
    return build_meta(mc).num_parameters()
