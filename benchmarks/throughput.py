"""Training-step throughput on the CPU: SCSE at T = 8 versus an unshared 8-layer Transformer.

Both models have the 22m preset's width (d 384, 6 heads, SwiGLU 1536, context 128, GPT-2 vocabulary,
tied head); the unshared one is ``22m-unshared-8x384`` (Transformer-8), so both run eight block
applications per token and the Eq. 20–21 FLOP proxy is identical. Each step is looplm's own
``train_step`` (forward, backward, clip, AdamW) on random tokens, dropout 0, T fixed at 8.

The two models are measured in one process, alternating which goes first in each round, so that
load changes on a shared machine hit both alike; the machine's load average is recorded before
and after. Each step is timed twice: wall clock and the process's CPU time. On a machine shared with
other work the wall clock mostly measures the neighbours, so the CPU-time ratio (one torch thread
by default, so no time goes to spinning on contended cores) is the primary figure; the wall-clock
ratio is reported beside it. Reported: median step time and tokens/s per model and the
SCSE / unshared ratio of the medians (target: ≤ 1.05).

    python benchmarks/throughput.py [--batch 2] [--rounds 10] [--threads 1] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from _results import machine_line, update_section

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def random_source(vocab_size: int, context: int, seed: int = 0):
    """A DataSource of uniformly random tokens, every position supervised (a pure function of the
    step, like the real sources)."""
    import torch

    from looplm.data.sources import DataSource

    class RandomTokens(DataSource):
        def make_global_batch(self, step: int, n_rows: int):
            g = torch.Generator().manual_seed(seed * 1_000_003 + step)
            chunk = torch.randint(0, vocab_size, (n_rows, context + 1), generator=g)  # (B, L+1)
            return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

        def eval_batches(self, batch_size, max_tokens=None, n_examples=0):
            yield self.make_global_batch(-1, batch_size)

    return RandomTokens()


def bench_config(
    preset: str,
    recurrence: str,
    *,
    batch: int,
    loops: int = 8,
    device: str = "cpu",
    compile: bool = False,
    seq_len: int | None = None,
    extra: list[str] | None = None,
):
    """The RunConfig of :func:`make_state` (no model built)."""
    from looplm.settings.config import load_config

    over = [
        f"model.preset={preset}",
        f"model.recurrence={recurrence}",
        "model.dropout=0.0",
        f"train.depth_min={loops}",
        f"train.depth_max={loops}",
        f"train.batch_size={batch}",
        "train.warmup=0",
        "train.steps=1000000",
        f"train.device={device}",
        f"train.compile={'true' if compile else 'false'}",
        "out_dir=/tmp/looplm-bench",
        *(extra or []),
    ]
    if seq_len:
        over.append(f"model.context={seq_len}")
    return load_config(None, over)


def make_state(preset: str, recurrence: str, **kw):
    """A looplm TrainState for ``preset``/``recurrence`` at fixed depth ``loops`` on random
    tokens (dropout 0); keywords as :func:`bench_config`."""
    from looplm.training.loop import setup

    cfg = bench_config(preset, recurrence, **kw)
    ts = setup(cfg)
    ts.source = random_source(cfg.model.vocab_size, cfg.model.context)
    return ts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2, help="rows of 128 tokens per step")
    ap.add_argument("--rounds", type=int, default=10, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per model")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")

    import torch

    from looplm.training.loop import train_step

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    models = {
        "scse (T=8, shared block)": make_state("22m", "scse", batch=args.batch),
        "unshared Transformer-8": make_state("22m-unshared-8x384", "unshared", batch=args.batch),
    }
    names = list(models)
    params = {n: ts.raw_model.num_parameters() for n, ts in models.items()}
    for ts in models.values():
        for _ in range(args.warmup):
            train_step(ts)
    times: dict[str, list[float]] = {n: [] for n in names}  # wall clock
    cpu: dict[str, list[float]] = {n: [] for n in names}  # process CPU time
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
        for n in order:
            t0, c0 = time.perf_counter(), time.process_time()
            train_step(models[n])
            times[n].append(time.perf_counter() - t0)
            cpu[n].append(time.process_time() - c0)
    load_after = os.getloadavg()
    wall = time.perf_counter() - t_start
    tokens = args.batch * 128
    med = {n: statistics.median(v) for n, v in times.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    ratio = med[names[0]] / med[names[1]]
    ratio_cpu = med_cpu[names[0]] / med_cpu[names[1]]
    lines = [
        "## Training-step throughput, CPU: SCSE (T = 8) vs unshared Transformer-8 (22m width)",
        "",
        f"{machine_line()} · batch {args.batch}×128 tokens, dropout 0, random tokens, "
        f"looplm `train_step` (fwd + bwd + clip + AdamW), {args.rounds} alternating rounds after "
        f"{args.warmup} warm-up steps each, {wall:.0f} s in all.",
        f"Load average (1/5/15 min) before: {load_before[0]:.2f}/{load_before[1]:.2f}/"
        f"{load_before[2]:.2f}, after: {load_after[0]:.2f}/{load_after[1]:.2f}/"
        f"{load_after[2]:.2f} on {os.cpu_count()} CPUs (shared with other work).",
        "",
        "| model | parameters | median step, CPU time (s) | median step, wall (s) | "
        "wall min / max (s) | tokens/s (CPU time) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in names:
        v = times[n]
        lines.append(
            f"| {n} | {params[n] / 1e6:.2f}M | {med_cpu[n]:.3f} | {med[n]:.3f} | "
            f"{min(v):.3f} / {max(v):.3f} | {tokens / med_cpu[n]:.0f} |"
        )
    verdict = "meets" if ratio_cpu <= 1.05 else "misses"
    lines += [
        "",
        f"**SCSE / unshared step-time ratio (medians): {ratio_cpu:.3f} in CPU time** ({verdict} "
        f"the ≤ 1.05 target); {ratio:.3f} in wall-clock time.",
        "Per-round ratios, CPU time: "
        + ", ".join(f"{a / b:.3f}" for a, b in zip(cpu[names[0]], cpu[names[1]]))
        + "; wall: "
        + ", ".join(f"{a / b:.3f}" for a, b in zip(times[names[0]], times[names[1]])),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("throughput", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
