"""Loop-level continuous batching (looplm.decoding.loop_batching): rows at different loop steps share one
application of the core, and every sequence still gets the tokens and loop depths that
looplm.decoding.decoder.decode gives it alone — with mixed depths, joins, leaves, cancels and chunked
prefill; the static (bucketed) step compiles once per bucket."""

from __future__ import annotations

import pytest
import torch
from test_batching import _model, _requests

from looplm.decoding.batching import Request
from looplm.decoding.decoder import Halting, decode
from looplm.decoding.loop_batching import LoopBatcher, buckets, generate_loop_level
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
    "looped_gqa": ("model.recurrence=looped", "model.n_kv_heads=2"),
    "ouro": ("model.recurrence=ouro", "model.final_norm=false"),
}


def _alone(model, r: Request, loops: int, halt: str, thr: float):
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
    )
    return got.tokens[0, len(r.ids) :].tolist(), got.loops[0].tolist()


# (layout, rule, threshold): thresholds at which these random-weight models' tokens halt at mixed
# depths (asserted below)
CASES = [
    ("learned", "none", 0.0),
    ("learned", "maxtoken", 0.5),
    ("learned", "kl", 0.02),
    ("rope_prelude_core2_coda", "maxtoken", 1.0),
    ("looped_gqa", "maxtoken", 1.0),
    ("ouro", "gate", 0.5),
]


@pytest.mark.parametrize("layout,halt,thr", CASES)
def test_each_sequence_equals_generating_it_alone(layout: str, halt: str, thr: float) -> None:
    model = _model(*LAYOUTS[layout])
    requests = _requests()
    T = 4
    alone = [_alone(model, r, T, halt, thr) for r in requests]
    # 6 requests through 3 slots (sequences leave, the queued ones join), prompts of 1-29 tokens
    # prefilled in chunks of 5 beside the decoding rows, windows sliding past the context of 24
    res = generate_loop_level(
        model, requests, slots=3, loops=T, halt=halt, threshold=thr,
        prefill_chunk=5,
    )  # fmt: skip
    for (tokens, loops), c in zip(alone, res.completions):
        assert c.tokens == tokens
        assert c.loops == loops
    if halt != "none":  # the rule acted: tokens left the loop at different steps ...
        depths = [d for _, loops in alone for d in loops]
        assert min(depths) < T and max(depths) == T
        # ... and rows at different loop steps shared applications of the core
        run = LoopBatcher(model, T, Halting(halt, thr), slots=3, prefill_chunk=5)
        run.queue.extend(enumerate(requests))
        while run.busy:
            run.iterate()
        assert run.mixed_steps > 0


def test_arrivals_leaves_and_cancels_change_no_other_sequence() -> None:
    model = _model(context=32)
    T, halt, thr = 4, "maxtoken", 0.5
    reqs = _requests(5, seed=3)
    events: dict[int, list[tuple[int, int]]] = {}
    run = LoopBatcher(
        model,
        T,
        Halting(halt, thr),
        slots=3,
        prefill_chunk=4,
        on_token=lambda k, tok, d, out: events.setdefault(k, []).append((tok, d)),
    )
    arrivals = {0: [0, 1], 5: [2], 9: [3, 4]}  # iteration → requests arriving then
    run.queue.append((99, Request((1, 2), 8)))
    assert run.cancel(99)  # cancelled while queued: never runs
    cancelled = False
    i = 0
    while run.busy or arrivals:
        for k in arrivals.pop(i, []):
            run.queue.append((k, reqs[k]))
        if i == 14:  # request 1 is mid-sequence (a lane, or its slid window's prefill)
            assert run.cancel(1)
            cancelled = True
        run.iterate()
        i += 1
    assert cancelled and 99 not in events and 99 not in run.completions
    for k, r in enumerate(reqs):
        tokens, loops = _alone(model, r, T, halt, thr)
        out = run.completions[k]
        if k == 1:
            assert out.finish == "cancelled" and 0 < len(out.tokens) < len(tokens)
            tokens, loops = tokens[: len(out.tokens)], loops[: len(out.tokens)]
        else:
            assert out.finish == "length"
        assert out.tokens == tokens and out.loops == loops
        assert events[k] == list(zip(tokens, loops))
    assert run.cancel(1) is False  # ended: nothing to cancel
    assert not run.prefills and all(r is None for r in run.lanes)
    assert (run.cache.length == 0).all()  # every cache row was given back


def test_static_step_compiles_once_per_bucket_and_never_again() -> None:
    """A long run with sequences joining and leaving at mixed depths: the compiled step is traced
    once per bucketed lane count it meets (backend ``eager``: tracing only, cheap) and the
    answers stay those of decoding each sequence alone."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model()
    reqs = _requests(10, seed=1)
    T, halt, thr = 3, "maxtoken", 0.5
    run = LoopBatcher(model, T, Halting(halt, thr), slots=4, prefill_chunk=5, compile="eager")
    run.queue.extend(enumerate(reqs))
    before = counters["stats"]["unique_graphs"]
    while run.busy:
        run.iterate()
    assert run.steps > 80 and run.mixed_steps > 0
    assert run.lane_counts <= set(buckets(4)) and len(run.lane_counts) >= 2
    assert counters["stats"]["unique_graphs"] - before == len(run.lane_counts)
    for k, r in enumerate(reqs):
        assert (run.completions[k].tokens, run.completions[k].loops) == _alone(
            model, r, T, halt, thr
        )


def test_buckets() -> None:
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(8) == [1, 2, 4, 8]


def test_what_the_loop_schedule_does_not_serve_is_a_one_line_error() -> None:
    model = _model()
    with pytest.raises(LoopLMError, match="prefill halting"):
        LoopBatcher(model, 3, Halting("kl", 0.1), prefill_halt=True)
    coda = _model(*LAYOUTS["rope_prelude_core2_coda"])
    with pytest.raises(LoopLMError, match="halt=kl on a model with coda"):
        LoopBatcher(coda, 3, Halting("kl", 0.1))
    stepped = _model("model.recurrence=step_conditioned")
    with pytest.raises(LoopLMError, match="depend on the loop index"):
        LoopBatcher(stepped, 3, Halting())
    with pytest.raises(LoopLMError, match="prefill_chunk=0"):
        LoopBatcher(model, 3, Halting(), prefill_chunk=0)


def test_cli_generate_prompts_schedule_loop(tmp_path, capsys) -> None:
    """`looplm generate --prompts --schedule loop` writes what the token-level schedule writes."""
    import json

    from looplm.cli import main
    from looplm.model.checkpoint import save_checkpoint

    cfg = load_config("tiny_wt2", ["model.dropout=0.0"])
    torch.manual_seed(0)
    ck = save_checkpoint(tmp_path / "ck", model_from_config(cfg.model).eval(), cfg)
    lines = tmp_path / "p.txt"
    lines.write_text("The cat\nA much longer prompt about looped models\nx\n")
    argv = ["generate", str(ck), "--prompts", str(lines), "--max-new", "6", "--loops", "3"]
    argv += ["--halt", "maxtoken", "--threshold", "0.05", "--slots", "2"]
    out = {}
    for schedule in ("continuous", "loop"):
        assert main([*argv, "--schedule", schedule, "--prefill-chunk", "4"]) == 0
        cap = capsys.readouterr()
        out[schedule] = [json.loads(line) for line in cap.out.splitlines()]
        assert f"{schedule} batching" in cap.err
    assert out["loop"] == out["continuous"]
    assert main([*argv, "--schedule", "loop", "--prefill-halt"]) == 2
    assert "--prefill-halt runs on --schedule continuous" in capsys.readouterr().err


def test_a_lone_sequence_takes_whole_token_passes_with_the_same_answer() -> None:
    """Once a sequence runs alone, each token is one cached pass (halted tokens' later step
    slots copied from the frozen state's keys/values); the answers stay those of decoding alone,
    and equal those of the step-by-step path."""
    model = _model()
    reqs = [Request((1, 2, 3), 20), Request((4, 5), 3, temperature=1.0, seed=4)]
    out = {}
    for alone_pass in (True, False):
        run = LoopBatcher(model, 4, Halting("kl", 0.02), slots=2)
        run.alone_pass = alone_pass
        run.queue.extend(enumerate(reqs))
        while run.busy:
            run.iterate()
        assert (run.alone_tokens > 10) is alone_pass
        out[alone_pass] = [(run.completions[k].tokens, run.completions[k].loops) for k in (0, 1)]
    want = [_alone(model, r, 4, "kl", 0.02) for r in reqs]
    assert out[True] == want == out[False]
    assert min(want[0][1]) < 4  # tokens halted early, so later slots were filled by the rule
