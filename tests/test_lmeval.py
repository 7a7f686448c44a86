"""The lm-eval adapter's scoring functions, checked against direct computations."""

from __future__ import annotations

import math

import torch

import looplm
from looplm.data import get_tokenizer
from looplm.decoding.lmeval import generate_until, loglikelihood, loglikelihood_rolling


def _model():
    torch.manual_seed(0)
    return looplm.build_model("tiny", "scse", dropout=0.0).eval()


def test_loglikelihood_matches_direct_sum() -> None:
    model, tok = _model(), get_tokenizer("bytes")
    ((lp, greedy),) = loglikelihood(model, tok, [("T&F", "=F")], loops=3)
    ids = list(b"T&F=F")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]]), loops=3)[0].float(), -1)
    expected = float(logp[2, ids[3]] + logp[3, ids[4]])
    assert math.isclose(lp, expected, rel_tol=1e-5)
    assert greedy == bool(logp[2].argmax() == ids[3] and logp[3].argmax() == ids[4])


def test_rolling_scores_every_token_once_across_windows() -> None:
    model, tok = _model(), get_tokenizer("bytes")
    text = "abc" * 100  # 300 bytes: three windows of the 128-token context
    (total,) = loglikelihood_rolling(model, tok, [text], loops=2)
    ids = [tok.eot_id] + list(text.encode())
    expected = 0.0
    for s in range(0, len(ids) - 1, 128):
        w = ids[s : s + 129]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([w[:-1]]), loops=2)[0].float(), -1)
        expected += float(logp.gather(1, torch.tensor(w[1:])[:, None]).sum())
    assert math.isclose(total, expected, rel_tol=1e-5)


def test_generate_until_stops_at_stop_string() -> None:
    model, tok = _model(), get_tokenizer("bytes")
    (full,) = generate_until(model, tok, [("T&F=", {"max_gen_toks": 12})], loops=2)
    assert len(full.encode("utf-8", "surrogateescape")) <= 12 * 4
    if full:
        stop = full[len(full) // 2]
        (cut,) = generate_until(model, tok, [("T&F=", {"max_gen_toks": 12, "until": [stop]})], 2)
        assert cut == full[: full.index(stop)]
