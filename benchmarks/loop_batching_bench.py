"""Loop-level against token-level continuous batching in one process: closed-loop clients
without HTTP (each sends its next request the moment its last one ends), tokens/s, p50 / p99
request latency and mean loops per token at fixed depth and with one halting rule (``--rule``: kl,
update or gate, at ``--threshold``), alternating.

    python benchmarks/loop_batching_bench.py --clients 1 8 32 64 --requests 64
    python benchmarks/loop_batching_bench.py --checkpoint CKPT --rule update --threshold 0.1

The tiny stand-in (random weights: speed only, random lowercase prompts) unless ``--checkpoint``
is given; a checkpoint's prompts are 8–64 tokens of its held-out text (WikiText-2's test split, or
its own text corpus's: ``generation_adaptive.heldout_corpus``). The serving
benchmark (``serve_bench.py --modes loop-level continuous``) measures the same through
`looplm serve`; this one leaves out the server's threads and the clients' round trips.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _results import machine_line, update_section

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run(model, reqs, kind: str, clients: int, loops: int, halt: str, thr: float) -> dict:
    """One closed-loop measurement: tokens/s, latencies, mean loops per token."""
    import torch

    from looplm.decoding.batching import Batcher
    from looplm.decoding.decoder import Halting
    from looplm.decoding.loop_batching import LoopBatcher

    todo, lat, start, depths = list(enumerate(reqs)), [], {}, []

    def submit() -> None:
        k, r = todo.pop(0)
        start[k] = time.perf_counter()
        b.queue.append((k, r))

    def on_token(k, tok, d, out) -> None:
        depths.append(d)
        if out.finish:
            lat.append(time.perf_counter() - start[k])
            if todo:
                submit()

    h = Halting(halt, thr)
    if kind == "loop-level":
        b = LoopBatcher(model, loops, h, slots=max(64, clients), on_token=on_token)
    else:
        b = Batcher(model, loops, h, on_token=on_token)
    t0 = time.perf_counter()
    for _ in range(min(clients, len(todo))):
        submit()
    with torch.no_grad():
        if kind == "loop-level":
            while b.busy:
                b.iterate()
        else:  # the server's token boundary (looplm.decoding.serve.scheduler)
            while b.queue or b.rows:
                b.sample()
                b.refill_or_drop()
                b.join_queued()
                b.slide_full_windows()
                b.decode()
    wall = time.perf_counter() - t0
    lat.sort()
    return dict(
        tps=len(depths) / wall,
        p50=lat[len(lat) // 2],
        p99=lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        loops=sum(depths) / len(depths),
    )


# long: the measurement plan top to bottom (model, alternating rounds, table, results file)
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--requests", type=int, default=64, help="requests per measurement")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--loops", type=int, default=8)
    p.add_argument("--rule", default="kl", choices=("kl", "update", "gate"), help="halting rule")
    p.add_argument("--threshold", type=float, default=0.0012, help="the rule's threshold")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    import torch

    from looplm.decoding.batching import Request
    from looplm.model import model_from_config
    from looplm.model.checkpoint import load_checkpoint
    from looplm.settings.config import load_config

    torch.set_num_threads(1)
    if args.checkpoint:
        model, cfg, _ = load_checkpoint(args.checkpoint)
    else:
        cfg = load_config("tiny_wt2", ["model.preset=tiny", "model.dropout=0.0"])
        torch.manual_seed(0)
        model = model_from_config(cfg.model)
    model.eval()
    g = torch.Generator().manual_seed(0)
    reqs = []
    if args.checkpoint:  # held-out text of the model's corpus
        from serve_bench import prompts

        texts = prompts(cfg, os.environ.get("LOOPLM_DATA_DIR"), args.requests)
    for i in range(args.requests):
        L = int(torch.randint(8, 65, (1,), generator=g))
        ids = tuple(torch.randint(97, 123, (L,), generator=g).tolist())
        ids = tuple(texts[i]) if args.checkpoint else ids
        reqs.append(Request(ids, args.new, temperature=1.0, seed=i))
    kinds = ("loop-level", "token-level")
    depths = (("fixed", "none"), (args.rule, args.rule))
    configs = [(c, k, d) for c in args.clients for d in depths for k in kinds]
    results: dict = {x: [] for x in configs}
    load0, t_start = os.getloadavg(), time.time()
    for r in range(args.rounds):
        for c, k, (name, rule) in configs if r % 2 == 0 else configs[::-1]:
            res = run(model, reqs, k, c, args.loops, rule, args.threshold)
            results[(c, k, (name, rule))].append(res)
            print(c, k, name, round(res["tps"], 1), file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731 — the upper median (of 2: the larger)
    by = {}
    for x, rs in results.items():
        by[x] = {key: med([q[key] for q in rs]) for key in ("tps", "p50", "p99", "loops")}
    what = (
        f"`{args.checkpoint}`" if args.checkpoint else "tiny stand-in (random weights, speed only)"
    )
    lines = [
        f"## Loop-level against token-level batching in one process (`benchmarks/loop_batching_bench.py`): {what}",
        "",
        machine_line(),
        "",
        f"Model d {cfg.model.d_model}, context {cfg.model.context}; T = {args.loops}; "
        f"{args.requests} requests of {args.new} sampled tokens from 8–64-token prompts per "
        f"measurement; C closed-loop clients (no HTTP); adaptive: {args.rule} {args.threshold:g}; upper "
        f"medians (of 2: the better) of {args.rounds} alternating rounds, each column on its "
        f"own; 1 torch thread. Load average {load0[0]:.1f} "
        f"before, {load1[0]:.1f} after ({time.time() - t_start:.0f} s): the machine was shared, "
        "so compare ratios.",
        "",
        "| clients | batching | depth | loops/token | tokens/s | p50 s | p99 s | adaptive ÷ fixed "
        "| loop ÷ token |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c, k, d in configs:
        row = by[(c, k, d)]
        ada = f"{row['tps'] / by[(c, k, depths[0])]['tps']:.2f}×" if d != depths[0] else ""
        lt = f"{row['tps'] / by[(c, kinds[1], d)]['tps']:.2f}×" if k == kinds[0] else ""
        lines.append(
            f"| {c} | {k} | {d[0]} | {row['loops']:.2f} | {row['tps']:.1f} | {row['p50']:.2f} "
            f"| {row['p99']:.2f} | {ada} | {lt} |"
        )
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        key = "loop_batching_bench" + ("" if args.checkpoint else "_tiny")
        update_section(key + ("" if args.rule == "kl" else f"_{args.rule}"), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
