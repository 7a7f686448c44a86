"""Continuous batching (looplm.decoding.batching): every sequence gets the tokens and loop depths it gets
when generated alone (looplm.decoding.decoder.decode), whatever shares its batch; slots are refilled."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.decoding.batching import Request, generate_many
from looplm.decoding.decoder import decode
from looplm.errors import LoopLMError
from looplm.model import model_from_config
from looplm.settings.config import load_config

LAYOUTS = {
    "learned": (),
    "rope_prelude_core2_coda": (
        "model.positions=rope",
        "model.prelude_layers=1",
        "model.core_layers=2",
        "model.coda_layers=1",
    ),
}


def _model(*overrides: str, context: int = 24):
    cfg = load_config("tiny_wt2", ["model.dropout=0.0", f"model.context={context}", *overrides])
    torch.manual_seed(0)
    model = model_from_config(cfg.model).eval()
    with torch.no_grad():  # away from the init so that tokens halt at different depths
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _requests(n: int = 6, seed: int = 0) -> list[Request]:
    """Mixed prompt lengths (some past the context) and lengths; greedy and sampled."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(1, 30, (1,), generator=g))
        new = int(torch.randint(1, 24, (1,), generator=g))
        ids = tuple(torch.randint(0, 256, (L,), generator=g).tolist())
        out.append(Request(ids, new, temperature=0.0 if i % 2 else 1.0, top_k=50, seed=i))
    return out


def _alone(model, r: Request, loops: int, halt: str, thr: float, prefill_halt: bool = False):
    got = decode(
        model,
        torch.tensor([r.ids]),
        r.max_new,
        loops,
        halt=halt,
        threshold=thr,
        temperature=r.temperature,
        top_k=r.top_k,
        generator=torch.Generator().manual_seed(r.seed),
        prefill_halt=prefill_halt,
    )
    return got.tokens[0, len(r.ids) :].tolist(), got.loops[0].tolist()


# (layout, rule, threshold): thresholds at which this random-weight model's tokens halt at mixed
# depths (asserted below); halt=kl does not serve a model with coda layers.
CASES = [
    ("learned", "none", 0.0),
    ("learned", "maxtoken", 0.5),
    ("learned", "kl", 0.02),
    ("rope_prelude_core2_coda", "none", 0.0),
    ("rope_prelude_core2_coda", "maxtoken", 1.0),
]


# … each with the prompt at full depth, and those with a rule also with prefill halting
RUNS = [(*c, False) for c in CASES] + [(*c, True) for c in CASES if c[1] != "none"]


@pytest.mark.parametrize("layout,halt,thr,prefill_halt", RUNS)
def test_each_sequence_equals_generating_it_alone(
    layout: str, halt: str, thr: float, prefill_halt: bool
) -> None:
    model = _model(*LAYOUTS[layout])
    requests = _requests()
    T = 3
    alone = [_alone(model, r, T, halt, thr, prefill_halt) for r in requests]
    for schedule in ("continuous", "static"):
        res = generate_many(
            model,
            requests,
            slots=3,
            loops=T,
            halt=halt,
            threshold=thr,
            schedule=schedule,
            prefill_halt=prefill_halt,
        )
        assert len(res.completions) == len(requests)
        for (tokens, loops), c in zip(alone, res.completions):
            assert c.tokens == tokens, schedule
            assert c.loops == loops, schedule
    if halt != "none":  # the halting rule did act, so the depths above mean something
        depths = [d for _, loops in alone for d in loops]
        assert min(depths) < T and max(depths) == T


def test_continuous_batching_refills_slots_and_computes_fewer_rows() -> None:
    model = _model(context=64)
    lengths = [1, 20, 2, 20, 1, 3]
    requests = [Request((5 + i, 7), n) for i, n in enumerate(lengths)]
    cont = generate_many(model, requests, slots=2, loops=2, schedule="continuous")
    static = generate_many(model, requests, slots=2, loops=2, schedule="static")
    assert [len(c.tokens) for c in cont.completions] == lengths
    assert [c.tokens for c in cont.completions] == [c.tokens for c in static.completions]
    # static: groups (1, 20), (2, 20), (1, 3) each run to their longest: 19 + 19 + 2 passes of
    # 2 rows; continuous keeps both slots busy until the queue is empty
    assert static.steps == 19 + 19 + 2 and static.row_steps == 2 * static.steps
    # each sequence's first token comes from its prefill, every later one from one decoding pass
    assert cont.row_steps == sum(n - 1 for n in lengths)
    assert cont.steps < static.steps


def test_a_sequence_ends_at_the_end_of_text_token() -> None:
    model = _model(context=64)
    r = Request((1, 2, 3), 12)
    tokens, _ = _alone(model, r, 2, "none", 0.0)
    eot = tokens[4]
    cut = tokens[: tokens.index(eot) + 1]
    res = generate_many(model, [r, Request((9,), 12)], slots=2, loops=2, eot_id=eot)
    assert res.completions[0].tokens == cut


def test_bad_settings_are_one_line_errors() -> None:
    model = _model()
    with pytest.raises(LoopLMError, match="slots=0"):
        generate_many(model, [Request((1,), 2)], slots=0)
    with pytest.raises(LoopLMError, match="schedule='batch'"):
        generate_many(model, [Request((1,), 2)], schedule="batch")
    with pytest.raises(LoopLMError, match="max_new=0"):
        Request((1,), 0)
    with pytest.raises(LoopLMError, match="at least one token"):
        Request((), 3)
    with pytest.raises(LoopLMError, match="outside the vocabulary"):
        generate_many(model, [Request((999,), 2)])


def test_cli_generate_prompts(tmp_path, capsys) -> None:
    from looplm.cli import main
    from looplm.data import get_tokenizer
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config

    cfg = load_config("tiny_wt2", ["model.dropout=0.0"])
    torch.manual_seed(0)
    model = model_from_config(cfg.model).eval()
    ck = save_checkpoint(tmp_path / "ck", model, cfg)
    tok = get_tokenizer("bytes")
    lines = tmp_path / "p.txt"
    lines.write_text("The cat\n\nA much longer prompt about looped models\nx\n")
    assert (
        main(["generate", str(ck), "--prompts", str(lines), "--max-new", "5", "--loops", "2"]) == 0
    )
    cap = capsys.readouterr()
    rows = [json.loads(line) for line in cap.out.splitlines()]
    assert [r["prompt"] for r in rows] == [
        "The cat",
        "A much longer prompt about looped models",
        "x",
    ]
    for r in rows:
        want = decode(model, torch.tensor([tok.encode(r["prompt"])]), 5, 2).tokens[0]
        assert r["completion"] == tok.decode(want[len(tok.encode(r["prompt"])) :].tolist())
        assert r["new_tokens"] == 5
    assert "3 prompts, 15 tokens" in cap.err and "tokens/s" in cap.err
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "ab", "max_new": 3}\n{"prompt": "cd", "temperature": 1.0}\n')
    out = tmp_path / "out.jsonl"
    argv = ["generate", str(ck), "--prompts", str(jsonl), "--max-new", "4", "--out", str(out)]
    assert main([*argv, "--slots", "1", "--schedule", "static"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["new_tokens"] for r in rows] == [3, 4]
    jsonl.write_text('{"prompt": "ab", "loops": 3}\n')
    assert main(argv) == 2
    assert "unknown key 'loops'" in capsys.readouterr().err
