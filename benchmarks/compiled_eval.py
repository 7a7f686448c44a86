"""Compiled fixed-depth sweep (``looplm eval --compile``) against the eager sweep, alternating in
one process.

A small random model (width 128, 2 heads, context 128, the GPT-2 vocabulary: the 22m preset is too
slow for a CPU run) and random tokens cut into full (batch × context) windows, so every batch runs
the compiled graph. Warm-up: one eager sweep and the compiled sweep's first batch (its compile
time, reported). Then ``--rounds`` rounds, each one eager and one compiled sweep over the same
batches, the order alternating, so load changes on a shared machine hit both alike. Reported: the
median time per batch of each (process CPU time at one thread, wall clock otherwise), the speed-up,
the compile time, and the largest relative difference of a depth's Σ NLL (compiled vs eager).

Inductor bakes the thread count into its CPU kernels, so each thread count is its own process:

    python benchmarks/compiled_eval.py --threads 1 [--depths 1,2,4,8] [--batch 4] [--batches 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# Compile times are reported cold: inductor's on-disk caches would hide them after the first run.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _results import machine_line  # noqa: E402

MODEL = [
    "model.d_model=128",
    "model.n_heads=2",
    "model.d_ff=512",
    "model.context=128",
    "model.vocab_size=50257",
    "model.tokenizer=gpt2",
]


class Windows:
    """An LM source of ``n`` full (batch × context) windows of random tokens."""

    is_task = False

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def eval_batches(self, batch_size, max_tokens=None, n_examples=0):
        yield from self.batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--depths", default="1,2,4,8")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batches", type=int, default=4, help="full batches per sweep")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    args = ap.parse_args()

    import torch

    from looplm.evaluate.sweep import CompiledSweep, depth_sweep
    from looplm.model import model_from_config
    from looplm.settings.config import load_config

    torch.set_num_threads(args.threads)
    depths = sorted({int(d) for d in args.depths.split(",")})
    torch.manual_seed(0)
    cfg = load_config(None, [*MODEL, "model.dropout=0.0"])
    model = model_from_config(cfg.model).to(args.device).eval()
    L, V = cfg.model.context, cfg.model.vocab_size
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, V, (args.batch, L), generator=g), torch.randint(0, V, (args.batch, L)))
        for _ in range(args.batches)
    ]
    source = Windows(data)
    by_cpu = args.device == "cpu" and args.threads == 1
    clock = time.process_time if by_cpu else time.perf_counter

    def sweep(compiled):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        rows = depth_sweep(
            model, source, depths, batch_size=args.batch, device=args.device, compile=compiled
        )
        return rows, (clock() - t0) / args.batches

    eager_rows, _ = sweep(False)  # warm-up
    compiled = CompiledSweep(model, depths, (args.batch, L))
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(data[0][0].to(args.device), data[0][1].to(args.device))  # compiles
    compile_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    comp_rows = eager_rows
    for i in range(args.rounds):
        for name in ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager"):
            rows, dt = sweep(compiled if name == "compiled" else False)
            times[name].append(dt)
            comp_rows = rows if name == "compiled" else comp_rows
    diff = max(
        abs(c["sum_nll"] - e["sum_nll"]) / abs(e["sum_nll"]) for c, e in zip(comp_rows, eager_rows)
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    what = "CPU time" if by_cpu else "wall"
    print(f"{machine_line()} · {args.device}")
    print()
    print(
        f"d_model 128, 2 heads, context {L}, vocabulary {V}; depths {depths} (one unroll to "
        f"T = {depths[-1]}); batch {args.batch} × {L}, {args.batches} full batches per sweep, "
        f"{args.rounds} alternating rounds"
    )
    print()
    print(f"| sweep | median per batch, {what} (s) | tokens/s | compile (s, wall) |")
    print("| --- | ---: | ---: | ---: |")
    tokens = args.batch * L
    for name in ("eager", "compiled"):
        comp = f"{compile_s:.1f}" if name == "compiled" else "–"
        print(f"| {name} | {med[name]:.3f} | {tokens / med[name]:.0f} | {comp} |")
    print()
    print(
        f"compiled vs eager: **{med['eager'] / med['compiled']:.2f}×**; largest relative "
        f"difference of a depth's Σ NLL: {diff:.1e}; compile time earned back after "
        f"{compile_s / max(med['eager'] - med['compiled'], 1e-9):.0f} batches"
        if med["eager"] > med["compiled"]
        else f"compiled vs eager: **{med['eager'] / med['compiled']:.2f}×** (no gain); largest "
        f"relative difference of a depth's Σ NLL: {diff:.1e}"
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
