"""Section ``throughput``: training tokens/s of looplm's ``train_step`` (compiled blocks + bf16
autocast + fused AdamW) for SCSE at 22m and 95.6m, T = 8, dropout 0, context 128, batch 32,
random tokens, against the straightforward Listing-1 SCSE of :mod:`gpubench.reference` (same
compile/autocast/optimizer settings, plain full-logits cross-entropy); MFU of each against the
measured matrix rate, with FLOPs = 3 × Eq. 21 per token. Peak memory of training at T = 8 and of
evaluation at T = 8, 48, 96 (above the resident weights)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from gpubench import matmul
from gpubench.common import (
    SMOKE_DIMS,
    SMOKE_VOCAB,
    Budget,
    fmt,
    free,
    mem_now,
    mem_peak,
    mem_reset,
    time_steps,
)
from gpubench.reference import RefTrainer, build_reference


def _eval_peaks(ts, x, y, compiled: bool) -> dict[int, float | None]:
    """Evaluation memory above the resident weights + optimizer state at T = 8, 48, 96."""
    import torch

    model, dev = ts.raw_model, x.device
    model.eval()
    peaks = {}
    stance = getattr(torch.compiler, "set_stance", None)
    for T in (1, 8, 48, 96):  # T = 1 first: one-time allocations land there, not counted
        base = mem_reset()
        with (
            torch.no_grad(),
            (
                torch.autocast("cuda", dtype=torch.bfloat16)
                if dev.type == "cuda"
                else torch.autocast("cpu", enabled=False)
            ),
            stance("force_eager") if stance and compiled else contextlib.nullcontext(),
        ):
            model.nll_sum(x, y, T)
        if T > 1:
            peaks[T] = mem_peak(base)
    model.train()
    return peaks


def _measure_looplm(args, preset: str, dev, warm: int, n: int) -> dict[str, Any]:
    from throughput import make_state

    from looplm.training.loop import train_step

    smoke = args.smoke
    batch = 2 if smoke else args.batch
    m0 = mem_now()  # peaks below are above this: the model's whole training footprint
    ts = make_state(
        preset,
        "scse",
        batch=batch,
        device=dev.type,
        compile=not smoke,
        seq_len=32 if smoke else None,
        extra=[*SMOKE_DIMS[preset], *SMOKE_VOCAB] if smoke else [],
    )
    t0 = time.time()
    for _ in range(warm):
        train_step(ts)
    compile_s = time.time() - t0
    mem_reset()
    sec = time_steps(lambda: train_step(ts), n)
    train_peak = mem_peak(m0)
    x, y = ts.source.train_batch(0, 0, batch)
    x, y = x.to(dev), y.to(dev)
    eval_peak = _eval_peaks(ts, x, y, compiled=not smoke)
    return {
        "ts": ts,
        "x": x,
        "y": y,
        "sec": sec,
        "train_peak": train_peak,
        "eval_peak": eval_peak,
        "warmup_s": compile_s,
    }


def _measure_reference(args, cfg, x, y, dev, warm: int, n: int) -> dict[str, Any]:
    """The Listing-1 reference with the same shapes and settings."""
    import torch

    torch.manual_seed(0)
    m0 = mem_now()
    ref = build_reference(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size, cfg.context, dev)
    trainer = RefTrainer(ref, dev, compile_mode="none" if args.smoke else args.ref_compile)
    t0 = time.time()
    for _ in range(warm):
        trainer.step(x, y, 8)
    warmup_s = time.time() - t0
    mem_reset()
    sec = time_steps(lambda tr=trainer: tr.step(x, y, 8), n)
    peak = mem_peak(m0)
    del ref, trainer
    free()
    return {"sec": sec, "peak": peak, "warmup_s": warmup_s}


def run(args, out: dict[str, Any], budget: Budget) -> None:
    import torch

    from looplm.model.accounting import model_flops

    rate_tflops = matmul.rate(args, out)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    warm, n = (1, 2) if args.smoke else (args.warmup, args.steps)
    rows = []
    for preset in ("22m", "95.6m"):
        if budget.left() < args.reserve_s:
            out.setdefault("cut", []).append(f"throughput {preset}: budget spent")
            continue
        mine = _measure_looplm(args, preset, dev, warm, n)
        ts, x, y = mine.pop("ts"), mine.pop("x"), mine.pop("y")
        cfg = ts.cfg.model
        if preset == "22m":
            out["_state_22m"] = ts  # reused by the ratio and depth sections
        else:
            del ts
            free()
        ref = _measure_reference(args, cfg, x, y, dev, warm, n)
        tokens = x.shape[0] * cfg.context
        f_tok = 3 * model_flops(cfg, 8, cfg.context)["body_head"]  # Eq. 21 at the run's shape
        rows.append(
            {
                "preset": preset,
                "looplm_tok_s": tokens / mine["sec"],
                "ref_tok_s": tokens / ref["sec"],
                "looplm_ms": 1e3 * mine["sec"],
                "ref_ms": 1e3 * ref["sec"],
                "looplm_mfu": tokens / mine["sec"] * f_tok / (rate_tflops * 1e12),
                "ref_mfu": tokens / ref["sec"] * f_tok / (rate_tflops * 1e12),
                "train_peak_gb": mine["train_peak"],
                "ref_train_peak_gb": ref["peak"],
                "eval_peak_gb": mine["eval_peak"],
                "warmup_s": mine["warmup_s"],
                "ref_warmup_s": ref["warmup_s"],
            }
        )
        print(f"[throughput] {rows[-1]}", flush=True)
    out["throughput"] = rows


def summarize(out: dict[str, Any], args) -> list[str]:
    rows = out.get("throughput") or []
    if not rows:
        return []
    L = [
        "| preset | looplm tok/s | Listing-1 tok/s | looplm / ref | looplm MFU | ref MFU | "
        "train peak looplm / ref (GiB: weights + grads + AdamW + activations) | eval peak T=8 / 48 / 96 (GiB above weights) | warm-up looplm / ref (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ep = r["eval_peak_gb"]
        L.append(
            f"| {r['preset']} | {r['looplm_tok_s']:,.0f} | {r['ref_tok_s']:,.0f} | "
            f"{r['looplm_tok_s'] / r['ref_tok_s']:.2f} | {100 * r['looplm_mfu']:.1f}% | "
            f"{100 * r['ref_mfu']:.1f}% | {fmt(r['train_peak_gb'], '.2f')} / "
            f"{fmt(r['ref_train_peak_gb'], '.2f')} | {fmt(ep[8], '.3f')} / {fmt(ep[48], '.3f')} / "
            f"{fmt(ep[96], '.3f')} | {r['warmup_s']:.0f} / {r['ref_warmup_s']:.0f} |"
        )
    L.append("")
    L.append(
        f"Training: T = 8, batch {2 if args.smoke else args.batch} × context, dropout 0, "
        f"random tokens, {'eager' if args.smoke else 'compiled blocks'} + "
        f"{'fp32' if args.smoke else 'bf16 autocast + fused AdamW'}; the reference compiles "
        f"{'nothing' if args.smoke else args.ref_compile} and uses full-logits cross-entropy."
    )
    return L + [""]
