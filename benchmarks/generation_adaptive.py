"""Adaptive per-token depth in batched generation: tokens/s at fixed T against adaptive depth,
with and without prefill halting, and continuous against static batching.

Model: a trained checkpoint (``--checkpoint``; a random-weight model's halting says nothing about
quality), e.g. the tiny byte-level SCSE model trained on WikiText-2 with
``looplm train tiny_wt2 data.data_dir=<shared data> out_dir=<dir>``; or ``--stand-in 22m``: a
random-weight model of that preset (GPT-2 vocabulary) for the *speed* of a wider model at a given
mean depth (``--stand-in-threshold`` for maxtoken; its quality columns are left empty). Text: the
WikiText-2 test split in the model's tokenizer, B windows at evenly spaced offsets.

1. **Threshold sweep (quality).** For each halting threshold, the held-out NLL of the text read
   through the cached decoding path: the first ``--prompt`` tokens of a window are prefilled at
   full T, then every next true token is fed as one decoding step with per-token halting
   (``looplm.decoding.decoder.adaptive_next_logits``) and the NLL of the token after it is scored; mean
   NLL per scored token and mean loops per decoded token. The gap is relative to threshold 0,
   which is fixed-depth decoding exactly. The chosen threshold is also read with the prefill
   halted by the same rule (prefill halting).
2. **Chosen threshold** per rule: the largest one whose held-out NLL gap is within ``--max-gap``
   (0.5%).
3. **Speed.** Generation of ``--new`` tokens for B prompts (``looplm.decoding.decoder.decode``), sampled
   at ``--temperature`` 1 with a fixed seed (greedy decoding of a small byte-level model falls into
   repeating one word, which says little about either speed or quality): fixed T against adaptive
   at the chosen threshold, with the prefill at full T and halted, run in alternating order over
   ``--rounds`` rounds; the **median** wall clock and process CPU time over rounds, tokens/s =
   B·new / time. The machine's load average is recorded before and after.
4. **Continuation quality.** The mean NLL of each run's generated continuation under the fixed-T
   model (one uncached forward over prompt + continuation), beside the fixed-T continuation's own,
   with the standard error of the difference (the two continuations are different samples).
5. **Batching.** ``--mixed`` prompts of mixed lengths (prompt 8–64 tokens, 8–``--new`` new
   tokens, seeded) through ``--slots`` slots (``looplm.decoding.batching.generate_many``): static batches
   (each runs to its longest sequence) against continuous batching, at fixed T and adaptive;
   median tokens/s over alternating rounds.

    python benchmarks/generation_adaptive.py --checkpoint runs/tiny_wt2/ckpt [--batch 1 8 32]
        [--rules kl maxtoken] [--threads 1] [--device cpu] [--no-write]
    python benchmarks/generation_adaptive.py --stand-in 22m --rules maxtoken \
        --stand-in-threshold 0.5
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


def heldout_corpus(cfg) -> tuple[str, str]:
    """(corpus, its name in prose) of the held-out text: the test split of the model's own text
    corpus when it was trained on one (``text:FILE``), else WikiText-2's test split."""
    from looplm.data.corpora import is_local_text

    dataset = cfg.data.dataset
    if is_local_text(dataset):
        return dataset, f"`{Path(dataset.removeprefix('text:')).name}` test-split"
    return "wikitext-2", "WikiText-2 test"


def text_windows(cfg, data_dir: str, n: int, length: int, device: str):
    """(n, length) token windows of the held-out test split (:func:`heldout_corpus`) at evenly
    spaced offsets."""
    import numpy as np
    import torch

    from looplm.data.cache import get_split_tokens

    tokens = get_split_tokens(heldout_corpus(cfg)[0], "test", cfg.model.tokenizer, data_dir)
    starts = np.linspace(0, len(tokens) - length - 1, n).astype(np.int64)
    rows = [np.asarray(tokens[s : s + length], dtype=np.int64) for s in starts]
    return torch.tensor(np.stack(rows), device=device)


def heldout(
    model, windows, prompt: int, loops: int, rule: str, thr: float, prefill_halt: bool = False
) -> tuple[float, float]:
    """(mean NLL per scored token, mean loops per decoded token) of ``windows`` read through the
    cached decoding path with halting ``rule`` at ``thr`` (see the module docstring);
    ``prefill_halt``: the prompt's tokens halt by the same rule."""
    import torch
    import torch.nn.functional as F

    from looplm.decoding.decoder import Halting, StaticKVCache, adaptive_next_logits, next_logits

    halting = Halting(rule, thr)
    cache = StaticKVCache(model.config.context)
    with torch.no_grad():
        if prefill_halt and halting.enabled:
            logits, _ = adaptive_next_logits(model, windows[:, :prompt], loops, cache, halting)
        else:
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


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def alternate(configs: list, run, rounds: int, device) -> dict:
    """Run every config ``rounds`` times in alternating order: name → (median wall, median CPU,
    per-round walls, per-round CPU times, the last result)."""
    times = {c[0]: ([], [], None) for c in configs}
    for k in range(rounds):
        for cfg in configs if k % 2 == 0 else configs[::-1]:
            w, c, out = timed(lambda cfg=cfg: run(cfg), device)
            walls, cpus, _ = times[cfg[0]]
            walls.append(w)
            cpus.append(c)
            times[cfg[0]] = (walls, cpus, out)
    return {n: (median(w), median(c), w, c, out) for n, (w, c, out) in times.items()}


def load_model(args, device):
    """(model, cfg, state) of ``--checkpoint``, or a random-weight ``--stand-in`` preset."""
    import torch

    if args.checkpoint:
        from looplm.model.checkpoint import load_checkpoint

        model, cfg, meta = load_checkpoint(args.checkpoint, map_location=device)
        return model, cfg, meta.get("state", {})
    from looplm.model import model_from_config
    from looplm.settings.config import load_config

    cfg = load_config("wt2_22m", [f"model.preset={args.stand_in}", "model.dropout=0.0"])
    torch.manual_seed(args.seed)
    return model_from_config(cfg.model).to(device).eval(), cfg, {}


def sweep_thresholds(args, model, cfg, T: int):
    """Held-out NLL per threshold; the chosen threshold per rule; its prefill-halting reading."""
    win = text_windows(cfg, args.data_dir, args.sweep_windows, args.sweep_len, args.device)
    base_nll, _ = heldout(model, win, args.prompt, T, "none", 0.0)
    sweep, chosen, prefill = [], {}, {}
    for rule in args.rules:
        for thr in SWEEPS[rule]:
            nll, loops = heldout(model, win, args.prompt, T, rule, thr)
            gap = nll / base_nll - 1
            sweep.append((rule, thr, nll, gap, loops))
            print(f"  {rule} {thr:g}: NLL {nll:.4f} ({gap:+.2%}), loops {loops:.2f}", flush=True)
            if gap <= args.max_gap:
                chosen[rule] = thr  # thresholds ascend: the last one within the gap wins
        if rule in chosen:
            nll, loops = heldout(model, win, args.prompt, T, rule, chosen[rule], True)
            prefill[rule] = (nll, nll / base_nll - 1, loops)
            print(f"  {rule} {chosen[rule]:g} + prefill halting: NLL {nll:.4f}", flush=True)
    return base_nll, sweep, chosen, prefill


def speed_runs(args, model, cfg, T: int, chosen: dict, device, quality: bool) -> list[dict]:
    """Fixed vs adaptive (prefill at T and halted) per batch size: medians over rounds."""
    import torch

    from looplm.decoding.decoder import decode

    configs = [("fixed", "none", 0.0, False)]
    for r in args.rules:
        if r in chosen:
            configs += [(r, r, chosen[r], False), (f"{r} + prefill halting", r, chosen[r], True)]
    speed = []
    for B in args.batch:
        prompts = text_windows(cfg, args.data_dir, B, args.prompt, args.device)

        def run(c, p=prompts):
            gen = torch.Generator(device=device).manual_seed(args.seed)
            kw = dict(halt=c[1], threshold=c[2], prefill_halt=c[3])
            return decode(model, p, args.new, T, temperature=args.temperature, generator=gen, **kw)

        res = alternate(configs, run, args.rounds, device)
        ref = continuation_nll(model, res["fixed"][4].tokens, args.prompt, T) if quality else None
        for name, _rule, thr, _pf in configs:
            w, c, walls, cpus, g = res[name]
            row = dict(batch=B, config=name, thr=thr, wall=w, cpu=c, tps=B * args.new / w)
            row.update(tps_cpu=B * args.new / c, loops=g.mean_loops)
            row.update(speedup=res["fixed"][0] / w, speedup_cpu=res["fixed"][1] / c)
            row["prompt_loops"] = (
                float(g.prompt_loops.double().mean()) if g.prompt_loops is not None else T
            )
            row["spread"] = (min(walls), max(walls))
            if quality:
                nll = continuation_nll(model, g.tokens, args.prompt, T)
                se = (nll.var() / nll.numel() + ref.var() / ref.numel()).sqrt() / ref.mean()
                row.update(cont=float(nll.mean()), cont_gap=float(nll.mean() / ref.mean() - 1))
                row["cont_se"] = float(se)
            speed.append(row)
            print(f"  B={B} {name}: {row}", flush=True)
    return speed


def mixed_requests(args, cfg):
    """``--mixed`` requests: prompts of 8–64 WikiText-2 test tokens, 8–``--new`` new tokens."""
    import torch

    from looplm.decoding.batching import Request

    g = torch.Generator().manual_seed(args.seed)
    text = text_windows(cfg, args.data_dir, args.mixed, 64, "cpu")
    out = []
    for i in range(args.mixed):
        L = int(torch.randint(8, 65, (1,), generator=g))
        new = int(torch.randint(8, args.new + 1, (1,), generator=g))
        ids = tuple(text[i, :L].tolist())
        out.append(Request(ids, new, temperature=args.temperature, seed=args.seed + i))
    return out


def batching_runs(args, model, cfg, T: int, chosen: dict, device) -> list[dict]:
    """Static vs continuous batching of the mixed set, fixed T and each chosen rule."""
    from looplm.decoding.batching import generate_many

    requests = mixed_requests(args, cfg)
    configs = []
    for rule in ["none", *(r for r in args.rules if r in chosen)]:
        for schedule in ("static", "continuous"):
            configs.append((f"{rule}/{schedule}", rule, chosen.get(rule, 0.0), schedule))

    def run(c):
        kw = dict(slots=args.slots, loops=T, halt=c[1], threshold=c[2], schedule=c[3])
        return generate_many(model, requests, **kw)

    res = alternate(configs, run, args.rounds, device)
    rows = []
    for name, rule, thr, schedule in configs:
        w, c, walls, _, out = res[name]
        base_w, base_c = res[f"{rule}/static"][:2]
        rows.append(
            dict(
                rule=rule if rule != "none" else "fixed",
                thr=thr,
                schedule=schedule,
                tokens=out.tokens,
                tps=out.tokens / w,
                tps_cpu=out.tokens / c,
                vs_static=base_w / w,
                vs_static_cpu=base_c / c,
                vs_fixed_static=res["none/static"][0] / w,
                loops=out.mean_loops,
                row_steps=out.row_steps,
            )
        )
        print(f"  batching {name}: {rows[-1]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--stand-in", default=None, help="a preset with random weights (speed only)")
    ap.add_argument("--stand-in-threshold", type=float, default=0.5, help="maxtoken threshold")
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
    ap.add_argument("--mixed", type=int, default=64, help="prompts of the batching set (0: skip)")
    ap.add_argument("--slots", type=int, default=8, help="batch slots for the batching set")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if (args.checkpoint is None) == (args.stand_in is None):
        ap.error("give one of --checkpoint and --stand-in")

    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, cfg, state = load_model(args, device)
    T = args.loops or int(cfg.train.depth_max)
    load0 = os.getloadavg()
    print(f"{cfg.method_label} {cfg.model.preset}, step {state.get('step')}, T={T}; load {load0}")
    t0 = time.perf_counter()
    if args.checkpoint:
        base_nll, sweep, chosen, prefill = sweep_thresholds(args, model, cfg, T)
    else:
        base_nll, sweep, prefill = None, [], {}
        chosen = {r: args.stand_in_threshold for r in args.rules}
    speed = speed_runs(args, model, cfg, T, chosen, device, quality=bool(args.checkpoint))
    batching = batching_runs(args, model, cfg, T, chosen, device) if args.mixed else []
    load1 = os.getloadavg()
    body = render(args, cfg, state, T, (load0, load1), time.perf_counter() - t0)
    body += "\n" + render_tables(args, T, base_nll, sweep, chosen, prefill, speed, batching)
    print(body)
    if not args.no_write:
        name = "generation_adaptive" + ("" if args.checkpoint else f"_{args.stand_in}")
        update_section(name, body)
    return 0


def render(args, cfg, state, T: int, loads, seconds: float) -> str:
    (a0, a1) = loads
    m = cfg.model
    what = (
        f"Checkpoint: {cfg.method_label}, preset {m.preset} (d {m.d_model}, context {m.context}, "
        f"{m.tokenizer} tokens), trained {state.get('step')} steps on {cfg.data.dataset} (depths "
        f"{cfg.train.depth_min}–{cfg.train.depth_max}); T = {T} (the ceiling for adaptive depth)."
        if args.checkpoint
        else f"Stand-in: {cfg.method_label} preset {m.preset} (d {m.d_model}, vocabulary "
        f"{m.vocab_size}, context {m.context}) with **random weights**, maxtoken halting at "
        f"{args.stand_in_threshold:g}: the speed of this width at the mean depth shown, not a "
        f"quality claim (a random model's halting says nothing about NLL). T = {T}."
    )
    title = "## Adaptive depth and batching in generation (`benchmarks/generation_adaptive.py`)"
    if not args.checkpoint:
        title += f", {args.stand_in} width"
    return "\n".join(
        [
            title,
            "",
            f"{machine_line()} · load average (1/5/15 min) before {a0[0]:.2f}/{a0[1]:.2f}/"
            f"{a0[2]:.2f}, after {a1[0]:.2f}/{a1[1]:.2f}/{a1[2]:.2f} on {os.cpu_count()} CPUs "
            f"shared with other work · {seconds / 60:.1f} min in all",
            "",
            what,
            "",
        ]
    )


def render_tables(args, T, base_nll, sweep, chosen, prefill, speed, batching) -> str:
    sampling = (
        "greedy"
        if args.temperature <= 0
        else f"sampled at temperature {args.temperature:g} (seed {args.seed})"
    )
    lines = []
    if sweep:
        lines += [
            f"**Threshold sweep**: held-out NLL of WikiText-2 test text read through the cached "
            f"decoding path ({args.sweep_windows} windows × {args.sweep_len} tokens, "
            f"{args.prompt}-token prefill at T); fixed T: NLL {base_nll:.4f}. Mean loops per "
            "decoded token.",
            "",
            "| rule | threshold | held-out NLL | gap vs fixed T | mean loops |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for rule, thr, nll, gap, loops in sweep:
            mark = " ←" if chosen.get(rule) == thr else ""
            lines.append(f"| {rule} | {thr:g}{mark} | {nll:.4f} | {gap:+.2%} | {loops:.2f} |")
        for rule, (nll, gap, loops) in prefill.items():
            lines.append(
                f"| {rule} + prefill halting | {chosen[rule]:g} | {nll:.4f} | {gap:+.2%} | "
                f"{loops:.2f} |"
            )
        lines += [
            "",
            f"← the largest threshold within {args.max_gap:.1%} of fixed T (chosen for the speed "
            "runs); the prefill-halting rows read the same text with the prompt halted too.",
            "",
        ]
    lines += [
        f"**Speed**: generation of {args.new} tokens from {args.prompt}-token prompts (WikiText-2 "
        f"test), {sampling}, {args.threads} torch thread(s), device {args.device}; **median** over "
        f"{args.rounds} alternating rounds (wall min–max in the last column). Mean loops per "
        "generated token counts a token chosen from the prefill at the prefill's last-token depth; "
        "prompt loops: mean depth of the prompt tokens."
        + (
            " Continuation NLL: the generated tokens scored by the fixed-T model, gap relative to "
            "the fixed-T continuation ± its standard error (different samples)."
            if sweep
            else ""
        ),
        "",
        "| batch | config | threshold | tokens/s (wall) | speed-up (wall) | tokens/s (CPU) | "
        "speed-up (CPU) | loops/token | prompt loops | continuation NLL (gap) | wall min–max s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in speed:
        quality = "—"
        if "cont" in r:
            quality = f"{r['cont']:.4f}" + (
                "" if r["config"] == "fixed" else f" ({r['cont_gap']:+.2%} ± {r['cont_se']:.2%})"
            )
        lines.append(
            f"| {r['batch']} | {r['config']} | {r['thr']:g} | {r['tps']:.1f} | "
            f"{r['speedup']:.2f}× | {r['tps_cpu']:.1f} | {r['speedup_cpu']:.2f}× | "
            f"{r['loops']:.2f} | {r['prompt_loops']:.2f} | {quality} | "
            f"{r['spread'][0]:.2f}–{r['spread'][1]:.2f} |"
        )
    if batching:
        lines += [
            "",
            f"**Batching**: {args.mixed} WikiText-2 test prompts of 8–64 tokens, each with 8–"
            f"{args.new} new tokens (seeded), {sampling}, through {args.slots} slots "
            "(`looplm.decoding.batching.generate_many`); static: groups of slots run to their longest "
            "sequence; continuous: a slot takes the next prompt when its sequence ends. Median "
            f"over {args.rounds} alternating rounds. Rows computed: sequence-steps of the "
            "decoding passes.",
            "",
            "| rule | threshold | schedule | tokens | tokens/s (wall) | tokens/s (CPU) | "
            "vs static (wall) | vs static (CPU) | vs fixed static (wall) | loops/token | "
            "rows computed |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in batching:
            lines.append(
                f"| {r['rule']} | {r['thr']:g} | {r['schedule']} | {r['tokens']} | "
                f"{r['tps']:.1f} | {r['tps_cpu']:.1f} | {r['vs_static']:.2f}× | "
                f"{r['vs_static_cpu']:.2f}× | {r['vs_fixed_static']:.2f}× | {r['loops']:.2f} | "
                f"{r['row_steps']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
