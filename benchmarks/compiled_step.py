"""Compiled training step: looplm eager and compiled against the Listing-1 reference, eager and
compiled whole, alternating in one process.

The reference is :func:`gpubench.reference.build_reference` (a straightforward SCSE, paper
Listing 1, around a plain pre-norm block at the preset's width) trained by
:class:`gpubench.reference.RefTrainer`: its whole forward and loss compiled by ``torch.compile`` at
a fixed T (one graph per T, ``dynamic=False``), bf16 autocast and fused AdamW on a GPU, AdamW
(foreach) on a CPU — the best the reference itself allows. looplm runs its own ``train_step``
(forward, backward, clip, AdamW) with ``train.compile`` off and on (:class:`looplm.training.loop.
CompiledLoss`: the whole loss, one graph per T). Random tokens, dropout 0, every position
supervised.

Two depth schedules: T = 8 on every step, and T ~ U{1..8} drawn per step by looplm's
``sample_depth`` (the same draws for all four). Warm-up runs every T of the schedule once per
model, untimed; its duration is reported as the compile/warm-up time. Then ``--rounds`` rounds,
each one step of every model in an order that alternates, so load changes on a shared machine hit
all alike. Reported per model: median step time, tokens/s (of the medians), MFU (Eq. 20–21 proxy
×3, against the measured dense matrix rate of this device and thread count) and peak memory (GPU:
peak allocated per model; CPU: the process's peak resident set, shared by all four).

Inductor bakes the thread count into its CPU kernels, so each thread count is its own process:

    python benchmarks/compiled_step.py --threads 1 [--preset 22m] [--rounds 8] [--batch 2]
    python benchmarks/compiled_step.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Compile times are reported cold: inductor's on-disk caches would hide them after the first run.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

from _results import machine_line, update_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

NAMES = ("looplm eager", "looplm compiled", "reference eager", "reference compiled whole")
#: On a CPU also the reference with the fused AdamW looplm uses there (not part of the reference
#: as specified, which fuses AdamW on a GPU only): how much of the gap is the optimizer.
FUSED_REF = "reference compiled whole + fused AdamW"


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(device: str, cpu_time: bool = False) -> float:
    """Measured dense matrix rate: bf16 8192³ on a GPU, fp32 1024³ on the CPU (this thread count);
    ``cpu_time``: per second of the process's CPU time, as the steps are then timed."""
    import torch

    n, dtype, reps = (8192, torch.bfloat16, 10) if device == "cuda" else (1024, torch.float32, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    sync()
    clock = time.process_time if cpu_time else time.perf_counter
    t0 = clock()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (clock() - t0) / 1e12


class Runner:
    """One of the four: ``step(T)`` runs a training step at depth T and returns the loss."""

    def __init__(self, name: str, preset: str, batch: int, device: str, depths: tuple[int, int]):
        import torch
        from gpubench.reference import RefTrainer, build_reference
        from throughput import make_state

        self.name = name
        self.looplm = name.startswith("looplm")
        extra = [f"train.depth_min={depths[0]}", f"train.depth_max={depths[1]}"]
        if self.looplm:
            self.ts = make_state(
                preset, "scse", batch=batch, device=device, compile="compiled" in name, extra=extra
            )
            mc = self.ts.cfg.model
        else:
            self.ts = make_state(preset, "scse", batch=batch, device=device, extra=extra)
            mc = self.ts.cfg.model
            model = build_reference(
                mc.d_model, mc.n_heads, mc.d_ff, mc.vocab_size, mc.context, device
            )
            self.ref = RefTrainer(
                model,
                torch.device(device),
                compile_mode="full" if "compiled" in name else "none",
                fused=True if name == FUSED_REF else None,
            )
        self.model_cfg = mc
        self.batch = batch
        self.device = device
        self.peak_mb = 0.0

    def step(self, step: int, loops: int) -> float:
        import torch

        from looplm.training.loop import train_step

        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        if self.looplm:
            self.ts.step = step  # the schedule's step: train_step draws the same T
            loss = train_step(self.ts)["loss"]
        else:
            x, y = self.ts.source.global_batch(step, self.batch)
            x, y = x.to(self.device), y.to(self.device)
            loss = self.ref.step(x, y, loops)
        sync()
        if self.device == "cuda":
            self.peak_mb = max(self.peak_mb, torch.cuda.max_memory_allocated() / 2**20)
        return loss


# long: one benchmark table: warm-up, alternating rounds, then the rows and the verdict
def run_schedule(args, label: str, depths: tuple[int, int], rate: float) -> list[str]:
    from looplm.training.loop import sample_depth, train_flops

    names = NAMES + ((FUSED_REF,) if args.device == "cpu" else ())
    runners = [Runner(n, args.preset, args.batch, args.device, depths) for n in names]
    cfg = runners[0].ts.cfg
    # a step of every T the schedule can draw (so no timed round compiles)
    first = {}
    for s in range(10_000):
        first.setdefault(sample_depth(s, cfg), s)
    warm_steps = sorted(first.items())
    warm: dict[str, float] = {}
    for r in runners:  # every T once, untimed: compilation happens here
        t0 = time.perf_counter()
        for loops, s in warm_steps:
            r.step(s, loops)
        warm[r.name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {r.name: [] for r in runners}  # wall clock
    cpu: dict[str, list[float]] = {r.name: [] for r in runners}  # the process's CPU time
    flops: list[float] = []
    tokens = args.batch * cfg.model.context
    for i in range(args.rounds):
        s = 100 + i
        loops = sample_depth(s, cfg)
        flops.append(train_flops(cfg.model, loops, cfg.model.context, tokens, tokens))
        order = runners if i % 2 == 0 else runners[::-1]
        order = order[i % len(order) :] + order[: i % len(order)]
        for r in order:
            t0, c0 = time.perf_counter(), time.process_time()
            r.step(s, loops)
            times[r.name].append(time.perf_counter() - t0)
            cpu[r.name].append(time.process_time() - c0)
    # One thread on a shared CPU: the process's CPU time leaves out the time spent waiting for a
    # core, so it is the figure compared; wall clock otherwise (GPU, or several threads).
    by_cpu = args.device == "cpu" and args.threads == 1
    chosen = cpu if by_cpu else times
    med = {n: statistics.median(v) for n, v in chosen.items()}
    other = times if by_cpu else cpu  # the other clock, for the second column
    med_other = {n: statistics.median(v) for n, v in other.items()}
    mean_flops = statistics.mean(flops)
    lines = [
        f"**{label}** ({args.rounds} alternating rounds; warm-up = every T of the schedule once)",
        "",
        f"| model | median step, {'CPU time' if by_cpu else 'wall'} (s) | median step, "
        f"{'wall' if by_cpu else 'process CPU time'} (s) "
        "| tokens/s | MFU | compile / warm-up, wall (s) | peak memory |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runners:
        mfu = mean_flops / med[r.name] / (rate * 1e12)
        mem = f"{r.peak_mb:.0f} MiB" if args.device == "cuda" else "process-wide (below)"
        lines.append(
            f"| {r.name} | {med[r.name]:.3f} | {med_other[r.name]:.3f} | "
            f"{tokens / med[r.name]:.0f} | {mfu:.1%} | "
            f"{warm[r.name]:.1f} | {mem} |"
        )
    fast = med["reference compiled whole"] / med["looplm compiled"]
    lines += [
        "",
        f"looplm compiled vs reference compiled whole: **{fast:.3f}×** the reference's speed "
        f"(target ≥ 1.15: {'met' if fast >= 1.15 else 'missed'}); looplm compiled vs looplm eager "
        f"{med['looplm eager'] / med['looplm compiled']:.3f}×; reference compiled vs eager "
        f"{med['reference eager'] / med['reference compiled whole']:.3f}×."
        + (
            f" Against the reference with fused AdamW too: "
            f"{med[FUSED_REF] / med['looplm compiled']:.3f}×."
            if FUSED_REF in med
            else ""
        ),
        "Per-round ratio (reference compiled / looplm compiled step time): "
        + ", ".join(
            f"{a / b:.2f}"
            for a, b in zip(chosen["reference compiled whole"], chosen["looplm compiled"])
        ),
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="22m")
    ap.add_argument("--batch", type=int, default=2, help="rows of `context` tokens per step")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per model and schedule")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--schedules", default="fixed,sampled", help="fixed (T = 8), sampled (U{1..8})")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")
    import resource

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(0)
    # every compiled model keeps one graph per T of each schedule in the compiler's cache
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    rate = matmul_tflops(args.device, cpu_time=args.device == "cpu" and args.threads == 1)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    body = []
    for sched in args.schedules.split(","):
        depths, label = ((8, 8), "T = 8") if sched == "fixed" else ((1, 8), "T ~ U{1..8}")
        lines = run_schedule(args, label, depths, rate)
        print("\n".join(lines), flush=True)  # each table as soon as it is measured
        body += lines
    load1 = os.getloadavg()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    dev = "GPU" if args.device == "cuda" else "CPU"
    lines = [
        f"## Compiled training step, {dev}, {args.preset}, {args.threads or 'default'} thread(s): "
        "looplm vs the Listing-1 reference compiled whole (`benchmarks/compiled_step.py`)",
        "",
        f"{machine_line()} · batch {args.batch}×context tokens, dropout 0, random tokens; "
        f"measured dense matrix rate {rate:.3g} TFLOP/s (the MFU denominator); "
        f"{time.perf_counter() - t0:.0f} s in all. Load average (1 min) before {load0[0]:.2f}, "
        f"after {load1[0]:.2f} on {os.cpu_count()} CPUs"
        + (" (a busy shared machine: compare ratios, not absolute times)." if dev == "CPU" else ".")
        + (
            f" Peak resident set of the process (all four models): {rss:.0f} MiB."
            if dev == "CPU"
            else ""
        ),
        "",
        *body,
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        key = args.schedules.replace(",", "-")
        update_section(f"compiled_step_{args.device}_{args.preset}_t{args.threads}_{key}", text)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
