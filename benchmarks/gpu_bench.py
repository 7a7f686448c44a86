"""The GPU suite's measurements, in one process, within a wall-time budget.

Sections (in this order; each is skipped, and said so, if the budget is already spent):

1. ``tests``: ``pytest tests/test_gpu.py`` in a subprocess (bf16 + compile vs fp32 eager, chunked
   loss, flat evaluation memory, a compiled training run); their measured errors are reported.
2. ``matmul``: the measured dense bf16 matrix rate (8192³ products), the MFU denominator.
3. ``throughput``: training tokens/s of looplm's ``train_step`` (compiled blocks + bf16 autocast
   + fused AdamW) for SCSE at 22m and 95.6m, T = 8, dropout 0, context 128, batch 32, random
   tokens, against a straightforward Listing-1 SCSE written here around a plain pre-norm block
   (same compile/autocast/optimizer settings, plain full-logits cross-entropy); MFU of each
   against the measured matrix rate, with FLOPs = 3 × Eq. 21 per token. Peak memory of
   training at T = 8 and of evaluation at T = 8, 48, 96 (above the resident weights).
4. ``ratio``: step time of SCSE (T = 8) over the unshared Transformer-8, 22m width, alternating.
5. ``depth``: SCSE 22m step time at T ∈ {1, 2, 4, 8, 16}.
6. ``wt2``: the WikiText-2 diagnostic table: 22M, 1,200 steps, context 128, batch 32, lr 3e-4,
   500 warmup, depth 1–8, dropout 0.1, bf16, for scse, looped, tuned_adapter and norm_reset × 3
   seeds, test PPL at T = 8, 24, 48. Runs go seed-major (every method's seed 0 first) in
   parallel worker processes sharing the GPU; a run is started only if the time measured so far
   says it can finish inside the budget, so a short budget cuts whole seeds, never steps, and the
   table says which runs were cut.

The summary table is printed last and written into ``benchmarks/RESULTS.md`` (section
``gpu_bench``; ``--results`` names another file). ``--smoke`` runs every section at toy size on
the CPU (no compile, tiny models, a few steps) to check the code paths.

    PYTHONPATH=. python benchmarks/gpu_bench.py --data-dir .data [--budget-s 290]
    PYTHONPATH=. python benchmarks/gpu_bench.py --smoke --data-dir ../shared/data --results /tmp/r.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from _results import RESULTS, machine_line, update_section  # noqa: E402

WT2_METHODS = ["scse", "looped", "tuned_adapter", "norm_reset"]
WT2_DEPTHS = [8, 24, 48]
# Paper Table 19 (WikiText-2, 22M, 1,200 steps, 3 seeds), where the text quotes the value.
PAPER_T8 = {"scse": "355.2 ± 2.4", "norm_reset": "387.8 ± 0.9"}
# Toy model used by --smoke in place of the 22m / 95.6m shapes (the WikiText-2 runs keep GPT-2's
# vocabulary; the random-token benchmarks also shrink it).
SMOKE_DIMS = {
    "22m": ["model.d_model=32", "model.n_heads=2", "model.d_ff=64"],
    "95.6m": ["model.d_model=48", "model.n_heads=2", "model.d_ff=96"],
}
SMOKE_VOCAB = ["model.vocab_size=512"]


class Budget:
    """Wall-clock budget measured from ``t0`` (the suite's start when given)."""

    def __init__(self, seconds: float, t0: float | None = None) -> None:
        self.t0 = t0 if t0 is not None else time.time()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


# ----------------------------------------------------------------------------- helpers
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gb(nbytes: float) -> float:
    return nbytes / 2**30


def _mem_reset() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    _sync()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _mem_now() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    _sync()
    return torch.cuda.memory_allocated()


def _mem_peak(base: int = 0) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    _sync()
    return _gb(torch.cuda.max_memory_allocated() - base)


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _fmt(v: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{unit}"


# ----------------------------------------------------------------------------- 1. tests
def run_tests(smoke: bool, report: Path) -> dict[str, Any]:
    env = {**os.environ, "LOOPLM_GPU_REPORT": str(report)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if report.exists():
        report.unlink()
    t0 = time.time()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_gpu.py",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(tail[-25:]))
    details = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    return {
        "rc": proc.returncode,
        "summary": tail[-1] if tail else "",
        "seconds": time.time() - t0,
        "details": details,
    }


# ----------------------------------------------------------------------------- 2. matmul
def matmul_rate(smoke: bool) -> float:
    """Measured TFLOP/s of a dense product (bf16 8192³ on GPU; fp32 512³ on CPU for --smoke)."""
    import torch

    if torch.cuda.is_available() and not smoke:
        n, dtype, dev, reps = 8192, torch.bfloat16, "cuda", 10
    else:
        n, dtype, dev, reps = 512, torch.float32, "cpu", 3
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


# ----------------------------------------------------------------------------- Listing-1 reference
def build_reference(d: int, n_heads: int, d_ff: int, vocab: int, context: int, device):
    """A straightforward SCSE (paper Listing 1) around a plain pre-norm block; forward = loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class PreNormBlock(nn.Module):
        """x ↦ G(x): causal attention and SwiGLU, each after RMSNorm; bias-free."""

        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.w12 = nn.Linear(d, 2 * d_ff, bias=False)
            self.w3 = nn.Linear(d_ff, d, bias=False)

        def forward(self, x):
            Bx, Lx, _ = x.shape
            q, k, v = (
                self.qkv(self.n1(x)).view(Bx, Lx, 3, n_heads, d // n_heads).permute(2, 0, 3, 1, 4)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = self.proj(a.transpose(1, 2).reshape(Bx, Lx, d))
            g, u = self.w12(self.n2(x + a)).chunk(2, dim=-1)
            return a + self.w3(F.silu(g) * u)

    def scse_step(h, anchor, core, step_scale=0.5, eps=1e-8):  # Listing 1 (leak 0, no cond)
        delta = h - anchor
        q = step_scale * core(delta)
        active = (delta.pow(2).sum(dim=(1, 2), keepdim=True) > eps).to(q.dtype)
        return anchor + delta + q * active

    class ListingSCSE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(context, d)
            self.anchor_proj = nn.Linear(d, d, bias=False)
            self.init_delta_proj = nn.Linear(d, d, bias=False)
            self.core = PreNormBlock()
            self.norm_f = nn.RMSNorm(d, eps=1e-6)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)

        def forward(self, ids, targets, loops: int):
            e = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            anchor = e + 0.1 * self.anchor_proj(e)
            h = e + 0.1 * self.init_delta_proj(e)
            for _ in range(loops):
                h = scse_step(h, anchor, self.core)
            logits = F.linear(self.norm_f(h), self.tok.weight)  # (B, L, V)
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return ListingSCSE().to(device)


class RefTrainer:
    """The reference's training step: autocast forward, backward, clip, fused AdamW."""

    def __init__(self, model, device, *, compile_mode: str, lr: float = 3e-4) -> None:
        import torch

        self.model, self.device = model, device
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        extra = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
            lr=lr,
            betas=(0.9, 0.95),
            **extra,
        )
        self.fn = model
        if compile_mode == "block":
            model.core.compile()
        elif compile_mode == "full":
            self.fn = torch.compile(model)

    def step(self, x, y, loops: int) -> float:
        import torch

        self.opt.zero_grad(set_to_none=True)
        ac = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None
        if ac is not None:
            with ac:
                loss = self.fn(x, y, loops)
        else:
            loss = self.fn(x, y, loops)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())  # logged every step, as looplm's step does


# ----------------------------------------------------------------------------- 3–5. throughput
def _preset_dims(preset: str) -> tuple[int, int, int]:
    from looplm.config import PRESETS

    p = PRESETS[preset]
    return p["d_model"], p["n_heads"], p["d_ff"]


def _time_steps(step_fn, n: int) -> float:
    """Seconds per call of ``step_fn`` over ``n`` calls (synchronised)."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step_fn()
    _sync()
    return (time.perf_counter() - t0) / n


def throughput_section(args, rate_tflops: float, out: dict[str, Any], budget: Budget) -> None:
    import torch
    from throughput import make_state

    from looplm import flops
    from looplm.train import train_step

    smoke = args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    batch = 2 if smoke else args.batch
    warm, n = (1, 2) if smoke else (args.warmup, args.steps)
    seq = 32 if smoke else 128
    compile_ = not smoke
    rows = []
    for preset in ("22m", "95.6m"):
        if budget.left() < args.reserve_s:
            out.setdefault("cut", []).append(f"throughput {preset}: budget spent")
            continue
        extra = [*SMOKE_DIMS[preset], *SMOKE_VOCAB] if smoke else []
        m0 = _mem_now()  # peaks below are above this: the model's whole training footprint
        ts = make_state(
            preset,
            "scse",
            batch=batch,
            device=dev.type,
            compile=compile_,
            seq_len=seq if smoke else None,
            extra=extra,
        )
        cfg = ts.cfg.model
        t0 = time.time()
        for _ in range(warm):
            train_step(ts)
        compile_s = time.time() - t0
        _mem_reset()
        sec = _time_steps(lambda ts=ts: train_step(ts), n)
        train_peak = _mem_peak(m0)
        # evaluation memory above the resident weights + optimizer state, T = 8, 48, 96
        x, y = ts.source.train_batch(0, 0, batch)
        x, y = x.to(dev), y.to(dev)
        model = ts.raw_model
        model.eval()
        eval_peak = {}
        stance = getattr(torch.compiler, "set_stance", None)
        for T in (1, 8, 48, 96):  # T = 1 first: one-time allocations land there, not counted
            base = _mem_reset()
            with (
                torch.no_grad(),
                (
                    torch.autocast("cuda", dtype=torch.bfloat16)
                    if dev.type == "cuda"
                    else torch.autocast("cpu", enabled=False)
                ),
                stance("force_eager") if stance and compile_ else contextlib.nullcontext(),
            ):
                model.nll_sum(x, y, T)
            if T > 1:
                eval_peak[T] = _mem_peak(base)
        model.train()
        if preset == "22m":
            out["_state_22m"] = ts  # reused by the ratio and depth sections
        else:
            del ts, model
            _free()
        # the Listing-1 reference with the same shapes and settings
        d, h, ff = (cfg.d_model, cfg.n_heads, cfg.d_ff)
        torch.manual_seed(0)
        m0 = _mem_now()
        ref = build_reference(d, h, ff, cfg.vocab_size, cfg.context, dev)
        trainer = RefTrainer(ref, dev, compile_mode="none" if smoke else args.ref_compile)
        t0 = time.time()
        for _ in range(warm):
            trainer.step(x, y, 8)
        ref_compile_s = time.time() - t0
        _mem_reset()
        ref_sec = _time_steps(lambda tr=trainer, x=x, y=y: tr.step(x, y, 8), n)
        ref_peak = _mem_peak(m0)
        del ref, trainer
        _free()
        tokens = batch * cfg.context
        f_tok = 3 * (
            flops(preset, "scse", 8, cfg.context)["body_head"]
            if not smoke
            else _smoke_flops(cfg, 8)
        )
        rows.append(
            {
                "preset": preset,
                "looplm_tok_s": tokens / sec,
                "ref_tok_s": tokens / ref_sec,
                "looplm_ms": 1e3 * sec,
                "ref_ms": 1e3 * ref_sec,
                "looplm_mfu": tokens / sec * f_tok / (rate_tflops * 1e12),
                "ref_mfu": tokens / ref_sec * f_tok / (rate_tflops * 1e12),
                "train_peak_gb": train_peak,
                "ref_train_peak_gb": ref_peak,
                "eval_peak_gb": eval_peak,
                "warmup_s": compile_s,
                "ref_warmup_s": ref_compile_s,
            }
        )
        print(f"[throughput] {rows[-1]}", flush=True)
    out["throughput"] = rows


def _smoke_flops(cfg, loops: int) -> float:
    from looplm.train import train_flops

    return train_flops(cfg, loops, cfg.context, 1, 1) / 3


def ratio_and_depth_section(args, out: dict[str, Any], budget: Budget) -> None:
    from throughput import make_state

    from looplm.train import train_step

    smoke = args.smoke
    ts = out.pop("_state_22m", None)
    if ts is None or budget.left() < args.reserve_s:
        out.setdefault("cut", []).append("ratio/depth: budget spent or no 22m state")
        return
    dev = ts.device
    batch = ts.cfg.train.batch_size
    warm, n = (1, 2) if smoke else (args.warmup, args.steps)
    extra = [*SMOKE_DIMS["22m"], *SMOKE_VOCAB, "model.n_layers=8"] if smoke else []
    un = make_state(
        "22m-unshared-8x384",
        "unshared",
        batch=batch,
        device=dev.type,
        compile=not smoke,
        seq_len=32 if smoke else None,
        extra=extra,
    )
    for _ in range(warm):
        train_step(un)
    t_s, t_u = [], []
    for r in range(4 if not smoke else 2):  # alternate who goes first
        pair = [(ts, t_s), (un, t_u)]
        for state, acc in pair if r % 2 == 0 else pair[::-1]:
            acc.append(_time_steps(lambda state=state: train_step(state), max(1, n // 2)))
    out["ratio"] = {
        "scse_ms": 1e3 * statistics.median(t_s),
        "unshared_ms": 1e3 * statistics.median(t_u),
        "ratio": statistics.median(t_s) / statistics.median(t_u),
    }
    print(f"[ratio] {out['ratio']}", flush=True)
    del un
    _free()
    depth = {}
    for T in (1, 2, 4, 8, 16):
        if budget.left() < args.reserve_s:
            out.setdefault("cut", []).append(f"depth T={T}: budget spent")
            break
        ts.cfg.train.depth_min = ts.cfg.train.depth_max = T
        train_step(ts)
        sec = _time_steps(lambda ts=ts: train_step(ts), max(1, n // 2))
        depth[T] = {"ms": 1e3 * sec, "tok_s": batch * ts.cfg.model.context / sec}
    out["depth"] = depth
    print(f"[depth] {depth}", flush=True)
    del ts
    _free()


# ----------------------------------------------------------------------------- 6. WikiText-2
def wt2_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one (method, seed) on WikiText-2 and evaluate test PPL at T = 8, 24, 48."""
    os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")
    for k, v in spec.get("env", {}).items():
        os.environ[k] = v
    import shutil

    import torch

    from looplm.checkpoint import load_checkpoint
    from looplm.config import load_config
    from looplm.data.sources import make_source
    from looplm.evaluate.sweep import depth_sweep
    from looplm.train import fit

    t0 = time.time()
    out_dir = Path(spec["tmp"]) / f"wt2-{spec['method']}-s{spec['seed']}"
    cfg = load_config(
        "wt2_22m",
        [
            f"model.recurrence={spec['method']}",
            f"train.seed={spec['seed']}",
            f"train.steps={spec['steps']}",
            f"data.data_dir={spec['data_dir']}",
            f"data.cache_dir={spec['cache_dir']}",
            f"train.device={spec['device']}",
            f"train.compile={'true' if spec.get('compile') else 'false'}",
            f"out_dir={out_dir}",
            *spec.get("extra", []),
        ],
    )
    # Past the job's deadline, stop training the way SIGTERM does (checkpoint, then exit): the
    # signal is raised from inside fit's loop, where fit's handler is installed.
    import signal

    import looplm.train as train_mod

    real_step = train_mod.train_step
    deadline = spec.get("deadline")

    def step_with_deadline(ts):
        m = real_step(ts)
        if deadline is not None and time.time() > deadline:
            os.kill(os.getpid(), signal.SIGTERM)
        return m

    train_mod.train_step = step_with_deadline
    truncated = None
    try:
        last = fit(cfg, progress=False, quiet=True)
    except SystemExit:
        last = {}
        truncated = "deadline"
    finally:
        train_mod.train_step = real_step
    train_s = time.time() - t0
    model, _, meta = load_checkpoint(out_dir / "ckpt", map_location=spec["device"])
    steps_done = int(meta["state"]["step"])
    cfg.data.eval_split = "test"
    source = make_source(cfg.data, cfg.model, cfg.train.seed)
    t1 = time.time()
    ac = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if spec["device"] == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    with ac:
        rows = depth_sweep(
            model,
            source,
            spec["depths"],
            batch_size=spec.get("eval_batch", 32),
            max_tokens=spec.get("max_tokens"),
            device=spec["device"],
        )
    eval_s = time.time() - t1
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "method": spec["method"],
        "seed": spec["seed"],
        "steps": steps_done,
        "truncated": truncated,
        "final_train_loss": last.get("loss"),
        "ppl": {r["depth"]: r["ppl"] for r in rows},
        "test_tokens": rows[0]["n_tokens"],
        "train_s": train_s,
        "eval_s": eval_s,
    }


def wt2_section(args, out: dict[str, Any], budget: Budget) -> None:
    import torch

    from looplm.data.cache import get_split_tokens

    smoke = args.smoke
    data_dir = str(Path(args.data_dir).resolve())
    cache_dir = args.cache_dir or str(Path(tempfile.gettempdir()) / "looplm-cache")
    t0 = time.time()
    for split in ("train", "validation", "test"):
        get_split_tokens("wikitext-2", split, "gpt2", data_dir, cache_dir)
    prep_s = time.time() - t0
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    steps = 3 if smoke else args.wt2_steps
    extra = []
    if smoke:
        extra = [
            *SMOKE_DIMS["22m"],
            "model.context=32",
            "train.batch_size=2",
            "train.warmup=1",
            "train.eval_batches=1",
            "eval.batch_size=4",
        ]
    tmp = tempfile.mkdtemp(prefix="looplm-wt2-")
    specs = [
        {
            "method": m,
            "seed": s,
            "steps": steps,
            "data_dir": data_dir,
            "cache_dir": cache_dir,
            "device": device,
            "tmp": tmp,
            "depths": WT2_DEPTHS,
            "extra": extra,
            "compile": args.wt2_compile and not smoke,
            "max_tokens": 256 if smoke else None,
            "eval_batch": 4 if smoke else 32,
            # CPU threads per worker process (set before it imports torch)
            "env": {"LOOPLM_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1" if smoke else "4"},
        }
        for s in range(args.wt2_seeds)
        for m in WT2_METHODS
    ]
    results, cut, failed = [], [], []
    workers = max(1, min(args.wt2_workers, len(specs)))
    deadline = budget.t0 + budget.seconds - args.reserve_s
    print(
        f"[wt2] {len(specs)} runs × {steps} steps on {device}, {workers} worker(s), "
        f"{max(0.0, deadline - time.time()):.0f} s left (token caches ready in {prep_s:.1f} s)",
        flush=True,
    )
    durations: list[float] = []
    eval_reserve = 5.0 if smoke else 25.0  # a cut-off run still needs its test evaluation

    def job(spec):
        return {**spec, "deadline": deadline - eval_reserve}

    def fits() -> bool:  # runs are alike: the median finished run predicts the next one
        return not durations or time.time() + statistics.median(durations) <= deadline

    pending = list(specs)
    if workers == 1:
        while pending:
            if not fits():
                cut.extend(pending)
                break
            spec = pending.pop(0)
            t = time.time()
            try:
                results.append(wt2_job(job(spec)))
            except Exception:  # report, keep going
                failed.append((spec, traceback.format_exc(limit=3)))
            durations.append(time.time() - t)
    else:
        import multiprocessing as mp

        running: dict[Any, tuple[dict[str, Any], float]] = {}
        submitted = 0
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            while pending or running:
                while pending and len(running) < workers:
                    if not durations and submitted >= workers:
                        break  # the first wave runs blind; later runs wait for a measurement
                    if not fits():
                        cut.extend(pending)
                        pending.clear()
                        break
                    spec = pending.pop(0)
                    running[pool.submit(wt2_job, job(spec))] = (spec, time.time())
                    submitted += 1
                if not running:
                    break
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    spec, started = running.pop(fut)
                    try:
                        results.append(fut.result())
                    except Exception:
                        failed.append((spec, traceback.format_exc(limit=3)))
                    durations.append(time.time() - started)
    out["wt2"] = {
        "results": results,
        "cut": [f"{s['method']}/seed{s['seed']}" for s in cut],
        "failed": [f"{s['method']}/seed{s['seed']}: {tb.splitlines()[-1]}" for s, tb in failed],
        "steps": steps,
        "workers": workers,
        "prep_s": prep_s,
        "run_s": durations,
    }
    for s, tb in failed:
        print(f"[wt2] FAILED {s['method']}/seed{s['seed']}:\n{tb}", flush=True)
    print(f"[wt2] done: {len(results)} runs, cut {len(cut)}, failed {len(failed)}", flush=True)


# ----------------------------------------------------------------------------- summary
def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.1f}"
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"


def summary(out: dict[str, Any], args, wall: float) -> str:
    L = []
    mode = (
        " — SMOKE run (toy sizes on the CPU; the numbers are not benchmarks)" if args.smoke else ""
    )
    L.append(f"## GPU suite{mode}")
    L.append("")
    L.append(f"{machine_line()} · total wall {wall:.0f} s (budget {args.budget_s:.0f} s)")
    L.append("")
    t = out.get("tests")
    if t:
        L.append(
            f"**GPU tests** (`tests/test_gpu.py`, {t['seconds']:.0f} s): `{t['summary']}` (rc {t['rc']})"
        )
        for d in t["details"]:
            name = d.pop("test")
            L.append(
                f"- {name}: "
                + ", ".join(
                    f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items()
                )
            )
        L.append("")
    if "matmul_tflops" in out:
        L.append(
            f"**Measured dense matrix rate**: {out['matmul_tflops']:.3g} TFLOP/s "
            f"({'fp32 512³, CPU' if args.smoke else 'bf16 8192³'}); MFU below is against it, "
            "FLOPs = 3 × Eq. 21 (body + head) per token at T = 8."
        )
        L.append("")
    rows = out.get("throughput") or []
    if rows:
        L.append(
            "| preset | looplm tok/s | Listing-1 tok/s | looplm / ref | looplm MFU | ref MFU | "
            "train peak looplm / ref (GiB: weights + grads + AdamW + activations) | eval peak T=8 / 48 / 96 (GiB above weights) | warm-up looplm / ref (s) |"
        )
        L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            ep = r["eval_peak_gb"]
            L.append(
                f"| {r['preset']} | {r['looplm_tok_s']:,.0f} | {r['ref_tok_s']:,.0f} | "
                f"{r['looplm_tok_s'] / r['ref_tok_s']:.2f} | {100 * r['looplm_mfu']:.1f}% | "
                f"{100 * r['ref_mfu']:.1f}% | {_fmt(r['train_peak_gb'], '.2f')} / "
                f"{_fmt(r['ref_train_peak_gb'], '.2f')} | {_fmt(ep[8], '.3f')} / {_fmt(ep[48], '.3f')} / "
                f"{_fmt(ep[96], '.3f')} | {r['warmup_s']:.0f} / {r['ref_warmup_s']:.0f} |"
            )
        L.append("")
        L.append(
            f"Training: T = 8, batch {2 if args.smoke else args.batch} × context, dropout 0, "
            f"random tokens, {'eager' if args.smoke else 'compiled blocks'} + "
            f"{'fp32' if args.smoke else 'bf16 autocast + fused AdamW'}; the reference compiles "
            f"{'nothing' if args.smoke else args.ref_compile} and uses full-logits cross-entropy."
        )
        L.append("")
    r = out.get("ratio")
    if r:
        L.append(
            f"**SCSE / unshared Transformer-8 step time** (22m width, T = 8): "
            f"{r['scse_ms']:.2f} ms / {r['unshared_ms']:.2f} ms = **{r['ratio']:.3f}**"
        )
        L.append("")
    dep = out.get("depth")
    if dep:
        L.append("| T | " + " | ".join(str(k) for k in dep) + " |")
        L.append("| --- |" + " ---: |" * len(dep))
        L.append(
            "| SCSE 22m step (ms) | " + " | ".join(f"{v['ms']:.2f}" for v in dep.values()) + " |"
        )
        L.append("| tokens/s | " + " | ".join(f"{v['tok_s']:,.0f}" for v in dep.values()) + " |")
        L.append("")
    w = out.get("wt2")
    if w:
        res = w["results"]
        L.append(
            f"**WikiText-2 diagnostic** (22M, {w['steps']} steps, batch 32, context 128, lr 3e-4, "
            f"500 warmup, depth 1–8, dropout 0.1; test PPL; mean ± sd over seeds; "
            f"{w['workers']} worker process(es) sharing the device)"
        )
        L.append("")
        L.append("| method | seeds | T = 8 | T = 24 | T = 48 | paper T = 8 |")
        L.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for m in WT2_METHODS:
            mine = [x for x in res if x["method"] == m and not x.get("truncated")]
            cells = [_mean_std([x["ppl"][T] for x in mine]) for T in WT2_DEPTHS]
            L.append(f"| {m} | {len(mine)} | " + " | ".join(cells) + f" | {PAPER_T8.get(m, '–')} |")
        L.append("")
        if w["run_s"]:
            L.append(
                f"Run wall time (train + test eval): median {statistics.median(w['run_s']):.0f} s; "
                f"token caches {w['prep_s']:.0f} s."
            )
        short = [
            f"{x['method']}/seed{x['seed']} (stopped at step {x['steps']})"
            for x in res
            if x.get("truncated")
        ]
        if short:
            L.append("Stopped early by the budget (not in the means): " + ", ".join(short) + ".")
        L.append(
            f"Not started (time budget): {', '.join(w['cut']) or 'nothing'}. "
            f"Failed: {', '.join(w['failed']) or 'nothing'}."
        )
        L.append("")
    if out.get("cut"):
        L.append("Sections cut: " + "; ".join(out["cut"]))
    if out.get("errors"):
        L.append("Errors: " + "; ".join(out["errors"]))
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("LOOPLM_DATA_DIR", str(REPO.parent / "shared" / "data")),
        help="folder with wikitext-2/ and gpt2-tokenizer/ (laid out like ../shared/data)",
    )
    ap.add_argument(
        "--cache-dir", default=None, help="token cache folder (default: $TMP/looplm-cache)"
    )
    ap.add_argument("--smoke", action="store_true", help="everything at toy size on the CPU")
    ap.add_argument("--budget-s", type=float, default=290.0, help="wall-time budget of the suite")
    ap.add_argument("--reserve-s", type=float, default=10.0, help="kept back for the summary")
    ap.add_argument(
        "--results",
        default=None,
        help="results file (default benchmarks/RESULTS.md; --smoke writes nothing unless given)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of sections to skip: tests,matmul,throughput,ratio,wt2",
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per throughput measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed (compile) steps")
    ap.add_argument("--ref-compile", choices=["block", "full", "none"], default="block")
    ap.add_argument("--wt2-steps", type=int, default=1200)
    ap.add_argument("--wt2-seeds", type=int, default=3)
    ap.add_argument(
        "--wt2-workers",
        type=int,
        default=None,
        help="parallel WikiText-2 worker processes (default 4 on GPU, 1 with --smoke)",
    )
    ap.add_argument("--wt2-compile", action="store_true", help="compile blocks in WikiText-2 runs")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)
    if args.wt2_workers is None:
        args.wt2_workers = 1 if args.smoke else 4
    os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")
    tok_dir = Path(args.data_dir) / "gpt2-tokenizer"
    if tok_dir.is_dir():
        os.environ.setdefault("LOOPLM_GPT2_DIR", str(tok_dir.resolve()))
    t0 = float(os.environ.get("LOOPLM_SUITE_T0", time.time()))
    budget = Budget(args.budget_s, t0)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    import torch

    if args.smoke:
        torch.set_num_threads(1)  # toy sizes: threads only add contention on a shared machine
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA GPU; use --smoke for the CPU check", file=sys.stderr)
        return 2
    if not args.smoke:
        import torch._dynamo

        torch._dynamo.config.automatic_dynamic_shapes = (
            False  # static shapes, no surprise recompiles
        )
        torch._dynamo.config.cache_size_limit = 64
    out: dict[str, Any] = {}

    def section(name: str, fn) -> None:
        if name in skip:
            out.setdefault("cut", []).append(f"{name}: skipped (--skip)")
            return
        if budget.left() < args.reserve_s:
            out.setdefault("cut", []).append(f"{name}: budget spent")
            return
        t = time.time()
        try:
            fn()
        except Exception as exc:
            traceback.print_exc()
            out.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"[{name}] {time.time() - t:.1f} s (elapsed {budget.elapsed():.0f} s)", flush=True)

    report = Path(tempfile.gettempdir()) / "looplm-gpu-report.jsonl"
    section("tests", lambda: out.__setitem__("tests", run_tests(args.smoke, report)))
    rate = [0.0]

    def _matmul():
        rate[0] = matmul_rate(args.smoke)
        out["matmul_tflops"] = rate[0]

    section("matmul", _matmul)
    if rate[0] <= 0:
        rate[0] = matmul_rate(args.smoke)
    section("throughput", lambda: throughput_section(args, rate[0], out, budget))
    section("ratio", lambda: ratio_and_depth_section(args, out, budget))
    out.pop("_state_22m", None)
    _free()
    section("wt2", lambda: wt2_section(args, out, budget))
    text = summary(out, args, budget.elapsed())
    results = Path(args.results) if args.results else (None if args.smoke else RESULTS)
    if results is not None:
        update_section("gpu_bench_smoke" if args.smoke else "gpu_bench", text, path=results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print("\n" + "=" * 100 + "\n" + text, flush=True)
    bad = bool(out.get("errors")) or (out.get("tests", {}).get("rc", 0) not in (0, 5))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
