"""LAMBADA: target spans (byte-level and GPT-2), left truncation, and the three metrics on a tiny
hand-made set, checked against an oracle model with known answers and against per-passage
unbatched forward passes of a real model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from looplm.data.corpora import LambadaExample, lambada_examples
from looplm.data.tokenizers import get_tokenizer
from looplm.errors import LoopLMError
from looplm.lambada.completion import lambada_batches, lambada_items, lambada_sweep
from looplm.model import build_model
from looplm.settings.config import load_config

TEXTS = [
    "The cat sat on the mat",
    "She opened the door and saw her brother",
    "Rain fell all night over the quiet little harbour town",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_set(path, texts=TEXTS):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_byte_spans_and_left_truncation(tmp_path):
    ex = lambada_examples(write_set(tmp_path / "l.jsonl"))
    assert [e.target for e in ex] == ["mat", "brother", "town"]
    tok = get_tokenizer("bytes")
    items = lambada_items(ex, tok, context=64)
    for it, e in zip(items, ex):
        assert tok.decode(it.ids[it.start : it.end]) == " " + e.target
        assert tok.decode(it.ids) == e.context + " " + e.target
        assert it.end == len(it.ids) and not it.truncated
    short = lambada_items(ex, tok, context=12)
    for it, e in zip(short, ex):
        assert len(it.ids) <= 13  # 12 inputs + the last target token
        assert tok.decode(it.ids[it.start : it.end]) == " " + e.target
        assert tok.decode(it.ids).endswith(" " + e.target)
    assert [it.truncated for it in short] == [True, True, True]
    with pytest.raises(LoopLMError, match="longer than the context"):
        lambada_items(ex, tok, context=5)


def test_gpt2_spans():
    try:
        tok = get_tokenizer("gpt2")
    except LoopLMError as exc:
        pytest.skip(f"GPT-2 tokenizer files unavailable: {exc}")
    ex = [LambadaExample(t, *t.rsplit(" ", 1)) for t in TEXTS]
    items = lambada_items(ex, tok, context=128)
    for it, e in zip(items, ex):
        assert tok.decode(it.ids[it.start : it.end]) == " " + e.target
        assert it.ids[it.start : it.end] == tuple(tok.encode(" " + e.target))


def test_batches_put_targets_at_their_predicting_positions(tmp_path):
    tok = get_tokenizer("bytes")
    items = lambada_items(lambada_examples(write_set(tmp_path / "l.jsonl")), tok, 64)
    x, y = next(lambada_batches(items, 8))
    for i, it in enumerate(items):
        pos = (y[i] != -100).nonzero()[:, 0].tolist()
        assert pos == list(range(it.start - 1, it.end - 1))
        assert y[i, pos].tolist() == list(it.ids[it.start : it.end])
        # each target position's input is the token just before the target token
        assert x[i, pos].tolist() == list(it.ids[it.start - 1 : it.end - 1])


class Oracle(torch.nn.Module):
    """Predicts the true next byte with logit 10 (others 0), except where told to be wrong."""

    def __init__(self, items, wrong: dict[int, tuple[int, set[int]]]) -> None:
        super().__init__()
        self.items, self.wrong = items, wrong  # passage -> (target offset, depths wrong at)

    def iter_depths(self, x, depths):
        for T in sorted(depths):
            h = torch.zeros(*x.shape, 257)
            for b in range(x.shape[0]):
                i = next(
                    k
                    for k, it in enumerate(self.items)
                    if list(it.ids[:-1]) == x[b, : len(it.ids) - 1].tolist()
                )
                it = self.items[i]
                nxt = torch.tensor(it.ids[1:])
                h[b, torch.arange(len(nxt)), nxt] = 10.0
                if i in self.wrong and T in self.wrong[i][1]:
                    p = it.start - 1 + self.wrong[i][0]
                    h[b, p] = 0.0
                    h[b, p, (it.ids[p + 1] + 1) % 256] = 10.0
            yield T, h

    def readout(self, h):
        return h


def test_metrics_on_hand_made_set_with_oracle(tmp_path):
    tok = get_tokenizer("bytes")
    items = lambada_items(lambada_examples(write_set(tmp_path / "l.jsonl")), tok, 64)
    # passage 1 misses its 2nd target byte at T=1 only; passage 2 misses its 1st at T = 1 and 2
    model = Oracle(items, {1: (1, {1}), 2: (0, {1, 2})})
    rows = {r["depth"]: r for r in lambada_sweep(model, items, [1, 2, 4], batch_size=2)}
    n = sum(it.end - it.start for it in items)  # 4 + 8 + 5 target bytes
    assert n == 17
    good = -math.log(math.exp(10) / (math.exp(10) + 256))
    bad = math.log(math.exp(10) + 256)
    for T, n_wrong in ((1, 2), (2, 1), (4, 0)):
        r = rows[T]
        assert r["n_tokens"] == r["n_examples"] == n
        assert r["n_correct"] == n - n_wrong
        assert r["exact_word_correct"] == 3 - n_wrong
        assert r["exact_word_accuracy"] == pytest.approx((3 - n_wrong) / 3)
        assert r["sum_nll"] == pytest.approx((n - n_wrong) * good + n_wrong * bad, abs=2e-5)
        assert r["ppl"] == pytest.approx(math.exp(r["sum_nll"] / n), rel=1e-9)


def test_batched_metrics_equal_unbatched_forward_and_greedy_decode(tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny", "scse", d_model=32, n_heads=2, d_ff=64, context=32, dropout=0.0)
    model.eval()
    tok = get_tokenizer("bytes")
    items = lambada_items(lambada_examples(write_set(tmp_path / "l.jsonl")), tok, 32)
    T = 3
    (row,) = lambada_sweep(model, items, [T], batch_size=2)
    nll = correct = exact = 0
    with torch.no_grad():
        for it in items:
            ids = torch.tensor(it.ids)
            logits = model(ids[None, :-1], loops=T)[0].float()  # (L, V)
            tgt = ids[it.start : it.end]
            lp = torch.log_softmax(logits[it.start - 1 : it.end - 1], -1)
            nll += -lp.gather(1, tgt[:, None]).sum().item()
            correct += int((lp.argmax(-1) == tgt).sum())
            # literal greedy decoding of len(target) tokens from the context
            seq = ids[: it.start].tolist()
            for _ in range(len(tgt)):
                nxt = model(torch.tensor([seq[-32:]]), loops=T)[0, -1].argmax().item()
                seq.append(nxt)
            exact += int(tok.decode(seq[it.start :]) == tok.decode(tgt.tolist()))
    assert row["sum_nll"] == pytest.approx(nll, rel=1e-5)
    assert row["n_correct"] == correct
    assert row["exact_word_correct"] == exact


def test_cli_lambada_writes_store_rows(tmp_path, capsys):
    from looplm.cli import main
    from looplm.model.checkpoint import save_checkpoint
    from looplm.results.store import ResultsStore

    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            "model.d_model=32",
            "model.n_heads=2",
            "model.d_ff=64",
            "model.context=32",
            "model.dropout=0.0",
        ],
    )
    torch.manual_seed(0)
    from looplm.model import model_from_config

    save_checkpoint(tmp_path / "ck", model_from_config(cfg.model), cfg, state={"step": 0})
    data = write_set(tmp_path / "l.jsonl")
    store = tmp_path / "r.sqlite"
    args = [
        "eval",
        str(tmp_path / "ck"),
        "--lambada",
        str(data),
        "--depths",
        "1-3",
        "--store",
        str(store),
        "--max-examples",
        "2",
    ]
    assert main(args) == 0
    assert main(args) == 0  # re-run: rows replaced, not duplicated
    recs = ResultsStore(store).query()
    assert [r.depth for r in recs] == [1, 2, 3]
    assert {(r.dataset, r.split, r.eval_tag) for r in recs} == {("lambada", "test", "cap=2ex")}
    assert all(r.n_tokens == 4 + 8 and r.extra["n_passages"] == 2 for r in recs)
