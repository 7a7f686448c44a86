"""Adaptive per-token depth in batched generation: tokens/s at fixed T against adaptive depth.

Model: a trained checkpoint (``--checkpoint``; a random-weight model's halting says nothing), e.g.
the tiny byte-level SCSE model trained on WikiText-2 with
``looplm train tiny_wt2 data.data_dir=<shared data> out_dir=<dir>``. Text: the WikiText-2 test split
in the checkpoint's tokenizer, B windows at evenly spaced offsets.

1. **Threshold sweep (quality).** For each halting threshold, the held-out NLL of the text read
   through the cached decoding path: the first ``--prompt`` tokens of a window are prefilled at
   full T, then every next true token is fed as one decoding step with per-token halting
   (``looplm.generate.adaptive_next_logits``) and the NLL of the token after it is scored; mean
   NLL per scored token and mean loops per decoded token. The gap is relative to threshold 0,
   which is fixed-depth decoding exactly.
2. **Chosen threshold** per rule: the largest one whose held-out NLL gap is within ``--max-gap``
   (0.5%).
3. **Speed.** Generation of ``--new`` tokens for B prompts (``looplm.generate.decode``), sampled
   at ``--temperature`` 1 with a fixed seed (greedy decoding of a small byte-level model falls into
   repeating one word, which says little about either speed or quality): fixed T against adaptive
   at the chosen threshold, measured in alternating order over ``--rounds`` rounds; wall clock and
   the process's CPU time, minimum over rounds (the usual noise-robust estimate on a shared
   machine), tokens/s = B·new / time. The machine's load average is recorded before and after.
4. **Continuation quality.** The mean NLL of each run's generated continuation under the fixed-T
   model (one uncached forward over prompt + continuation), beside the fixed-T continuation's own,
   with the standard error of the difference (the two continuations are different samples).

    python benchmarks/generation_adaptive.py --checkpoint runs/tiny_wt2/ckpt [--batch 1 8 32]
        [--rules kl maxtoken] [--threads 1] [--device cpu] [--no-write]
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

SWEEPS = {
    "kl": [1e-4, 3e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2, 3e-2, 1e-1],
    "maxtoken": [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3],
}


def text_windows(cfg, data_dir: str, n: int, length: int, device: str):
    """(n, length) token windows of the WikiText-2 test split at evenly spaced offsets."""
    import numpy as np
    import torch

    from looplm.data.cache import get_split_tokens

    tokens = get_split_tokens("wikitext-2", "test", cfg.model.tokenizer, data_dir)
    starts = np.linspace(0, len(tokens) - length - 1, n).astype(np.int64)
    rows = [np.asarray(tokens[s : s + length], dtype=np.int64) for s in starts]
    return torch.tensor(np.stack(rows), device=device)


def heldout(model, windows, prompt: int, loops: int, rule: str, thr: float) -> tuple[float, float]:
    """(mean NLL per scored token, mean loops per decoded token) of ``windows`` read through the
    cached decoding path with halting ``rule`` at ``thr`` (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from looplm.generate import Halting, KVCache, adaptive_next_logits, next_logits

    halting = Halting(rule, thr)
    cache = KVCache()
    with torch.no_grad():
        logits = next_logits(model, windows[:, :prompt], loops, cache)
        nll, n, depth, steps = 0.0, 0, 0, 0
        for j in range(prompt, windows.shape[1]):
            nll += float(F.cross_entropy(logits.float(), windows[:, j], reduction="sum"))
            n += windows.shape[0]
            if j == windows.shape[1] - 1:
                break
            logits, d = adaptive_next_logits(model, windows[:, j : j + 1], loops, cache, halting)
            depth += int(d.sum())
            steps += d.numel()
    return nll / n, depth / max(steps, 1)


def continuation_nll(model, tokens, prompt: int, loops: int):
    """Per-token NLL (B·new,) of ``tokens[:, prompt:]`` under the fixed-depth model (one uncached
    forward)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(tokens[:, :-1], loops=loops)[:, prompt - 1 :].float()  # (B, new, V)
        target = tokens[:, prompt:].flatten()
        return F.cross_entropy(logits.flatten(0, 1), target, reduction="none").double()


def timed(fn, device) -> tuple[float, float, object]:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - w0, time.process_time() - c0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data-dir", default=os.environ.get("LOOPLM_DATA_DIR", "../shared/data"))
    ap.add_argument("--loops", type=int, default=None, help="T (default: train.depth_max)")
    ap.add_argument("--rules", nargs="+", default=["kl", "maxtoken"], choices=list(SWEEPS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=96, help="generated tokens per prompt")
    ap.add_argument("--sweep-windows", type=int, default=32, help="held-out windows")
    ap.add_argument("--sweep-len", type=int, default=128, help="tokens per held-out window")
    ap.add_argument("--max-gap", type=float, default=0.005, help="held-out NLL gap allowed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from looplm.checkpoint import load_checkpoint
    from looplm.generate import decode

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, cfg, meta = load_checkpoint(args.checkpoint, map_location=device)
    T = args.loops or int(cfg.train.depth_max)
    load0 = os.getloadavg()
    state = meta.get("state", {})
    print(
        f"checkpoint {args.checkpoint}: {cfg.method_label} {cfg.model.preset}, step "
        f"{state.get('step')}, T={T}; load {load0}",
        flush=True,
    )

    # 1-2. threshold sweep on held-out text, chosen threshold per rule
    win = text_windows(cfg, args.data_dir, args.sweep_windows, args.sweep_len, args.device)
    base_nll, _ = heldout(model, win, args.prompt, T, "none", 0.0)
    sweep, chosen = [], {}
    for rule in args.rules:
        for thr in SWEEPS[rule]:
            nll, loops = heldout(model, win, args.prompt, T, rule, thr)
            gap = nll / base_nll - 1
            sweep.append((rule, thr, nll, gap, loops))
            print(f"  {rule} {thr:g}: NLL {nll:.4f} ({gap:+.2%}), loops {loops:.2f}", flush=True)
            if gap <= args.max_gap:
                chosen[rule] = thr  # thresholds ascend: the last one within the gap wins

    # 3-4. speed and continuation quality per batch size
    speed = []
    for B in args.batch:
        prompts = text_windows(cfg, args.data_dir, B, args.prompt, args.device)
        configs = [("fixed", "none", 0.0)] + [(r, r, chosen[r]) for r in args.rules if r in chosen]
        best = {name: [float("inf"), float("inf"), None] for name, _, _ in configs}
        for k in range(args.rounds):
            order = configs if k % 2 == 0 else configs[::-1]
            for name, rule, thr in order:

                def run(p=prompts, r=rule, t=thr):
                    gen = torch.Generator(device=device).manual_seed(args.seed)
                    return decode(
                        model,
                        p,
                        args.new,
                        T,
                        halt=r,
                        threshold=t,
                        temperature=args.temperature,
                        generator=gen,
                    )

                w, c, g = timed(run, device)
                b = best[name]
                b[0], b[1], b[2] = min(b[0], w), min(b[1], c), g
        ref = continuation_nll(model, best["fixed"][2].tokens, args.prompt, T)
        for name, _rule, thr in configs:
            w, c, g = best[name]
            nll = continuation_nll(model, g.tokens, args.prompt, T)
            cont = float(nll.mean())
            se = float((nll.var() / nll.numel() + ref.var() / ref.numel()).sqrt()) / float(
                ref.mean()
            )
            speed.append(
                dict(
                    batch=B,
                    config=name,
                    thr=thr,
                    wall=w,
                    cpu=c,
                    tps=B * args.new / w,
                    tps_cpu=B * args.new / c,
                    loops=g.mean_loops,
                    cont=cont,
                    cont_gap=cont / float(ref.mean()) - 1,
                    cont_se=se,
                    speedup=best["fixed"][0] / w,
                    speedup_cpu=best["fixed"][1] / c,
                )
            )
            print(f"  B={B} {name}: {speed[-1]}", flush=True)
    load1 = os.getloadavg()

    sampling = (
        "greedy"
        if args.temperature <= 0
        else f"sampled at temperature {args.temperature:g} (seed {args.seed})"
    )
    lines = [
        "## Adaptive depth in batched generation (`benchmarks/generation_adaptive.py`)",
        "",
        f"{machine_line()} · load average before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
        f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}",
        "",
        f"Checkpoint: {cfg.method_label}, preset {cfg.model.preset} (d {cfg.model.d_model}, "
        f"context {cfg.model.context}, {cfg.model.tokenizer} tokens), trained "
        f"{state.get('step')} steps on {cfg.data.dataset} (depths {cfg.train.depth_min}–"
        f"{cfg.train.depth_max}); T = {T} (the ceiling for adaptive depth). Prefill always runs T.",
        "",
        f"**Threshold sweep**: held-out NLL of WikiText-2 test text read through the cached "
        f"decoding path ({args.sweep_windows} windows × {args.sweep_len} tokens, {args.prompt}-token "
        f"prefill); fixed T: NLL {base_nll:.4f}. Mean loops per decoded token.",
        "",
        "| rule | threshold | held-out NLL | gap vs fixed T | mean loops |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for rule, thr, nll, gap, loops in sweep:
        mark = " ←" if chosen.get(rule) == thr else ""
        lines.append(f"| {rule} | {thr:g}{mark} | {nll:.4f} | {gap:+.2%} | {loops:.2f} |")
    lines += [
        "",
        f"← the largest threshold within {args.max_gap:.1%} of fixed T (chosen for the speed runs).",
        "",
        f"**Speed**: generation of {args.new} tokens from {args.prompt}-token prompts (WikiText-2 "
        f"test), {sampling}, {args.threads} torch thread(s), device {args.device}; minimum over "
        f"{args.rounds} alternating rounds. Continuation NLL: the generated {args.new} tokens "
        "scored by the fixed-T model (mean per token), gap relative to the fixed-T continuation ± "
        "its standard error (different samples). Mean loops per generated token counts the first "
        "token (from the prefill) at T.",
        "",
        "| batch | config | threshold | tokens/s (wall) | speed-up (wall) | tokens/s (CPU) | "
        "speed-up (CPU) | mean loops/token | continuation NLL | gap |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in speed:
        lines.append(
            f"| {r['batch']} | {r['config']} | {r['thr']:g} | {r['tps']:.1f} | "
            f"{r['speedup']:.2f}× | {r['tps_cpu']:.1f} | {r['speedup_cpu']:.2f}× | "
            f"{r['loops']:.2f} | {r['cont']:.4f} | "
            + ("—" if r["config"] == "fixed" else f"{r['cont_gap']:+.2%} ± {r['cont_se']:.2%}")
            + " |"
        )
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        update_section("generation_adaptive", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
