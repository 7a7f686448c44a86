"""The model's one unroll with its halting objects, and the one scorer of hidden states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.errors import LoopLMError
from looplm.model.block import KVCache
from looplm.model.halting import ExampleHalting, TokenHalting
from looplm.model.halting_rules import KLHalt
from looplm.targets import IGNORE_INDEX

SMALL = dict(d_model=32, n_heads=2, d_ff=64, context=16, dropout=0.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(name: str = "scse", seed: int = 0):
    torch.manual_seed(seed)
    return looplm.build_model("tiny", name, **SMALL).eval()


def _batch(B: int = 3, L: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 257, (B, L), generator=g)
    y = torch.randint(0, 257, (B, L), generator=g)
    y[:, : L // 3] = IGNORE_INDEX  # unscored prefix
    return x, y


# ----------------------------------------------------------------------------- scorer
@pytest.mark.parametrize("name", ["scse", "unshared"])
def test_score_is_cross_entropy_of_the_logits_at_scored_positions(name: str) -> None:
    model = _model(name).double()
    x, y = _batch()
    with torch.no_grad():
        logits = model(x, loops=3)  # (B, L, V)
        (h,) = model.hidden_states(x, 3)
        s = model.score(h, y)
        per = model.score(h, y, per_token=True)
    want = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")  # ignores -100
    valid = y != IGNORE_INDEX
    hits = (logits.argmax(-1) == y) & valid
    assert int(s.n_tokens) == int(valid.sum()) == int(per.n_tokens)
    torch.testing.assert_close(s.nll.double(), want, rtol=1e-6, atol=0)
    assert int(s.correct) == int(hits.sum())
    want_tok = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # 0 where ignored
    torch.testing.assert_close(per.nll, want_tok, rtol=1e-6, atol=1e-9)
    assert torch.equal(per.correct, hits)


def test_training_loss_gradient_is_the_plain_cross_entropy_gradient() -> None:
    model = _model().double()
    x, y = _batch()
    model.loss(x, y, loops=2).backward()
    got = model.tok_emb.weight.grad.clone()
    model.zero_grad()
    logits = model(x, loops=2)
    F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    torch.testing.assert_close(got, model.tok_emb.weight.grad, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- halting
def test_token_halting_that_never_halts_is_the_plain_unroll() -> None:
    model = _model("step_conditioned")
    x, _ = _batch()
    ctx = model.prepare(x)
    plain = [st.hidden for st in model.unroll(ctx, 5)]
    halting = TokenHalting(KLHalt(0.0))
    steps = list(model.unroll(ctx, 5, halting=halting))
    assert [st.t for st in steps] == list(range(6))
    for a, b in zip(plain, steps):
        assert torch.equal(a, b.hidden)
    assert bool((halting.depth == 5).all())


def test_token_halting_ends_the_uncached_unroll_once_every_token_halted() -> None:
    model = _model()
    x, _ = _batch()
    halting = TokenHalting(KLHalt(float("inf")))
    steps = list(model.unroll(model.prepare(x), 6, halting=halting))
    assert [st.t for st in steps] == [0, 1]  # frozen from step 1: nothing left to compute
    assert bool((halting.depth == 1).all())
    assert not halting.running


class StopAt:
    """Per-example decision: example b stops after loop ``at[b]``."""

    def __init__(self, at: list[int]) -> None:
        self.at = torch.tensor(at)
        self.asked: list[int] = []

    def __call__(self, t, h, h_prev, rows):
        self.asked.append(len(rows))
        assert h.shape[0] == h_prev.shape[0] == len(rows)
        return self.at[rows] == t


def test_example_halting_drops_stopped_rows_and_keeps_their_states() -> None:
    model = _model()
    x, _ = _batch(B=4)
    decide = StopAt([1, 3, 6, 3])
    halting = ExampleHalting(decide)
    for _ in model.unroll(model.prepare(x), 6, halting=halting):
        pass
    assert halting.depth.tolist() == [1, 3, 6, 3]
    assert decide.asked == [4, 3, 3, 1, 1]  # rows still running at t = 1 … 5
    for b, T in enumerate([1, 3, 6, 3]):
        (want,) = model.hidden_states(x[b : b + 1], T)
        torch.testing.assert_close(halting.out[b], want[0], rtol=1e-5, atol=1e-6)


def test_example_halting_refuses_a_kv_cache() -> None:
    model = _model()
    x, _ = _batch()
    ctx = model.prepare(x)
    core = model.core_call(ctx, cache=KVCache())
    with pytest.raises(LoopLMError, match="per-example halting drops rows"):
        next(model.unroll(ctx, 3, core=core, halting=ExampleHalting(StopAt([1, 1, 1]))))
