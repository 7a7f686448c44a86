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


def matmul_tflops(device: str, cpu_time: bool = False, bf16: bool = False) -> float:
    """Measured dense matrix rate: bf16 8192³ on a GPU, fp32 (``bf16``: bf16) 1024³ on the CPU
    (this thread count); ``cpu_time``: per second of the process's CPU time, as the steps are
    then timed."""
    import torch

    n, dtype, reps = (8192, torch.bfloat16, 10) if device == "cuda" else (1024, torch.float32, 5)
    dtype = torch.bfloat16 if bf16 else dtype
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

    def __init__(
        self,
        name: str,
        preset: str,
        batch: int,
        device: str,
        depths: tuple[int, int],
        autocast: str = "auto",
        allocator: str = "system",
    ):
        import torch
        from gpubench.reference import RefTrainer, build_reference
        from throughput import make_state

        self.name = self.base = name
        self.allocator = allocator
        self.looplm = name.startswith("looplm")
        extra = [
            f"train.depth_min={depths[0]}",
            f"train.depth_max={depths[1]}",
            f"train.autocast={autocast}",
            f"train.cpu_allocator={allocator}",
        ]
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
                autocast=autocast == "bf16" or (autocast == "auto" and device == "cuda"),
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

    def timed_step(self, step: int, loops: int) -> tuple[float, float]:
        """(wall, process CPU time) of one step, in seconds."""
        t0, c0 = time.perf_counter(), time.process_time()
        self.step(step, loops)
        return time.perf_counter() - t0, time.process_time() - c0


class Remote:
    """A model in its own process (``--worker``), so that it runs with its own allocator setting:
    looplm's as ``looplm train`` sets it (``train.cpu_allocator``), the reference's as a plain
    script gets it. Steps are timed in the worker (its own CPU time and wall clock)."""

    def __init__(self, name: str, allocator: str, args, depths: tuple[int, int]) -> None:
        import subprocess

        self.name = f"{name} [{allocator} allocator]"
        self.base, self.allocator, self.peak_mb = name, allocator, 0.0
        cmd = [sys.executable, __file__, "--worker", name, "--allocator", allocator]
        cmd += ["--preset", args.preset, "--batch", str(args.batch), "--threads", str(args.threads)]
        cmd += ["--device", args.device, "--autocast", args.autocast]
        cmd += ["--depths", f"{depths[0]},{depths[1]}"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> list[float]:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"{self.name}: worker exited ({self.proc.wait()})")
        return [float(x) for x in reply.split()]

    def step(self, step: int, loops: int) -> None:
        self.timed_step(step, loops)

    def timed_step(self, step: int, loops: int) -> tuple[float, float]:
        wall, cpu, rss = self.ask(f"{step} {loops}")
        self.peak_mb = max(self.peak_mb, rss)
        return wall, cpu

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def worker(args) -> int:
    """``--worker NAME``: one model; reads "step T" lines, answers "wall cpu peak_rss_MiB"."""
    import resource

    import torch

    from looplm.device import reuse_freed_host_memory

    if args.allocator == "reuse":
        reuse_freed_host_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.depths.split(","))
    r = Runner(args.worker, args.preset, args.batch, args.device, (lo, hi), args.autocast)
    for line in sys.stdin:
        step, loops = (int(x) for x in line.split())
        wall, cpu = r.timed_step(step, loops)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        print(f"{wall} {cpu} {rss}", flush=True)
    return 0


# long: one benchmark table: warm-up, alternating rounds, then the rows and the verdict
def run_schedule(args, label: str, depths: tuple[int, int], rate: float) -> list[str]:
    from throughput import bench_config

    from looplm.training.loop import sample_depth, train_flops

    names = NAMES + ((FUSED_REF,) if args.device == "cpu" else ())
    if args.processes:
        # each in its own process, with the allocator it gets by default; and the fused reference
        # once more with looplm's allocator setting (like for like)
        plan = [(n, "reuse" if n.startswith("looplm") else "system") for n in names]
        plan.append((FUSED_REF, "reuse"))
        runners = [Remote(n, a, args, depths) for n, a in plan]
    else:
        runners = [
            Runner(n, args.preset, args.batch, args.device, depths, args.autocast, args.allocator)
            for n in names
        ]
    extra = [f"train.depth_min={depths[0]}", f"train.depth_max={depths[1]}"]
    cfg = bench_config(args.preset, "scse", batch=args.batch, extra=extra)  # the depth schedule
    # a step of every T the schedule can draw (so no timed round compiles)
    first = {}
    for s in range(10_000):
        first.setdefault(sample_depth(s, cfg), s)
    warm_steps = sorted(first.items())
    warm: dict[str, float] = {}
    for r in runners:  # every T once, untimed: compilation happens here
        warm[r.name] = sum(r.timed_step(s, loops)[0] for loops, s in warm_steps)
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
            wall, used = r.timed_step(s, loops)
            times[r.name].append(wall)
            cpu[r.name].append(used)
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
        mem = (
            f"{r.peak_mb:.0f} MiB"
            if args.device == "cuda" or args.processes
            else "process-wide (below)"
        )
        lines.append(
            f"| {r.name} | {med[r.name]:.3f} | {med_other[r.name]:.3f} | "
            f"{tokens / med[r.name]:.0f} | {mfu:.1%} | "
            f"{warm[r.name]:.1f} | {mem} |"
        )

    def find(base: str, allocator: str | None = None) -> str | None:
        """The row of model ``base`` (with ``allocator``, when given)."""
        hits = [r.name for r in runners if r.base == base and allocator in (None, r.allocator)]
        return hits[0] if hits else None

    ours, ref = find("looplm compiled"), find("reference compiled whole")
    # the yardstick: the reference compiled whole with fused AdamW (the reference) where
    # measured (CPU), else the reference compiled whole (on a GPU it fuses AdamW itself)
    yard = find(FUSED_REF, "system" if args.processes else None) or ref
    fast = med[yard] / med[ours]
    lines += [
        "",
        f"looplm compiled vs {yard}: **{fast:.3f}×** the reference's speed "
        f"(target ≥ 1.15: {'met' if fast >= 1.15 else 'missed'}); vs {ref}: "
        f"{med[ref] / med[ours]:.3f}×; looplm compiled vs looplm eager "
        f"{med[find('looplm eager')] / med[ours]:.3f}×; reference compiled vs eager "
        f"{med[find('reference eager')] / med[ref]:.3f}×.",
    ]
    same = find(FUSED_REF, "reuse") if args.processes else None
    if same:
        lines[-1] += (
            f" Like for like (the fused reference with looplm's allocator setting too): "
            f"{med[same] / med[ours]:.3f}×."
        )
    lines += [
        f"Per-round ratio ({yard} / looplm compiled step time): "
        + ", ".join(f"{a / b:.2f}" for a, b in zip(chosen[yard], chosen[ours])),
        "",
    ]
    for r in runners:
        if isinstance(r, Remote):
            r.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="22m")
    ap.add_argument("--batch", type=int, default=2, help="rows of `context` tokens per step")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per model and schedule")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--schedules", default="fixed,sampled", help="fixed (T = 8), sampled (U{1..8})")
    ap.add_argument(
        "--autocast",
        default="auto",
        choices=("auto", "bf16", "off"),
        help="bf16 autocast for all four (auto: on a GPU only; bf16: on the CPU too)",
    )
    ap.add_argument(
        "--allocator",
        default="system",
        choices=("system", "reuse"),
        help="one process: the host allocator of all four (train.cpu_allocator)",
    )
    ap.add_argument(
        "--processes",
        action="store_true",
        help="each model in its own process: looplm with the allocator `looplm train` sets, the "
        "reference with the system's (and once more with looplm's, like for like)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--depths", default="8,8", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")
    if args.worker:
        return worker(args)
    import resource

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(0)
    # every compiled model keeps one graph per T of each schedule in the compiler's cache
    import torch._dynamo

    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    rate = matmul_tflops(
        args.device,
        cpu_time=args.device == "cpu" and args.threads == 1,
        bf16=args.autocast == "bf16",
    )
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
        f"## Compiled training step, {dev}, {args.preset}, {args.threads or 'default'} thread(s)"
        + (", bf16 autocast" if args.autocast == "bf16" else "")
        + (
            ", each model in its own process"
            if args.processes
            else (", reuse allocator" if args.allocator == "reuse" else "")
        )
        + ": looplm vs the Listing-1 reference compiled whole (`benchmarks/compiled_step.py`)",
        "",
        f"{machine_line()} · batch {args.batch}×context tokens, dropout 0, random tokens; "
        f"measured dense matrix rate {rate:.3g} TFLOP/s (the MFU denominator); "
        f"{time.perf_counter() - t0:.0f} s in all. Load average (1 min) before {load0[0]:.2f}, "
        f"after {load1[0]:.2f} on {os.cpu_count()} CPUs"
        + (" (a busy shared machine: compare ratios, not absolute times)." if dev == "CPU" else ".")
        + (
            f" Peak resident set of the process (all four models): {rss:.0f} MiB."
            if dev == "CPU" and not args.processes
            else " Peak memory: each process's peak resident set."
            if args.processes
            else ""
        ),
        "",
        *body,
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        key = args.schedules.replace(",", "-")
        key += "_bf16" if args.autocast == "bf16" else ""
        key += "_processes" if args.processes else ("_reuse" if args.allocator == "reuse" else "")
        update_section(f"compiled_step_{args.device}_{args.preset}_t{args.threads}_{key}", text)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
