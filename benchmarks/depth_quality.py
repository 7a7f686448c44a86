"""Does depth matter for this checkpoint, and what does adaptive depth cost in held-out NLL?

For a trained checkpoint: the held-out NLL of test windows (WikiText-2's, or the test split of the
model's own text corpus) read through the cached
decoding path (``generation_adaptive.heldout``: a prompt prefilled, then every next true token
decoded) at the trained depth T and at T/4 (fixed depth: the gap says whether depth matters), then
for every halting rule the model has (kl, update, gate where the model has an exit gate)
a threshold sweep: NLL cost against fixed T and mean loops per token. The chosen threshold of a
rule is the one with the fewest loops at a cost ≤ ``--budget`` percent (the serving benchmark's
adaptive rows then use it).

    python benchmarks/depth_quality.py --checkpoint runs/tiny_wt2/ckpt

A random-weight model is refused: its NLL gap says nothing about depth.
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

SWEEP = {
    "kl": [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05],
    "update": [0.02, 0.05, 0.1, 0.2, 0.3, 0.5],
    "gate": [0.5, 0.7, 0.9, 0.95, 0.99],
}


# long: the measurement plan top to bottom (depth gap, one sweep per rule, the results section)
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--loops", type=int, default=0, help="T (default: the trained depth)")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--budget", type=float, default=0.5, help="NLL cost allowed, percent")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=os.environ.get("LOOPLM_DATA_DIR", "../shared/data"))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    import torch
    from generation_adaptive import heldout, heldout_corpus, text_windows

    from looplm.model.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    model, cfg, meta = load_checkpoint(args.checkpoint)
    steps = (meta.get("state") or {}).get("step", cfg.train.steps)
    model.eval()
    T = args.loops or cfg.train.depth_max
    win = text_windows(cfg, args.data_dir, args.windows, args.length, "cpu")
    t0 = time.time()
    base, _ = heldout(model, win, args.prompt, T, "none", 0.0)
    quarter, _ = heldout(model, win, args.prompt, max(1, T // 4), "none", 0.0)
    rules = ["kl", "update"]
    if getattr(model.recurrence, "exit_probability", None) is not None:
        rules.append("gate")
    rows, chosen = [], {}
    for rule in rules:
        for thr in SWEEP[rule]:
            nll, depth = heldout(model, win, args.prompt, T, rule, thr)
            cost = 100 * (nll / base - 1)
            rows.append((rule, thr, nll, cost, depth))
            ok = cost <= args.budget
            if ok and (rule not in chosen or depth < chosen[rule][2]):
                chosen[rule] = (thr, cost, depth)
            print(rule, thr, f"{nll:.4f} {cost:+.2f}% {depth:.2f} loops", file=sys.stderr)
    lines = [
        f"## Depth and adaptive-depth quality (`benchmarks/depth_quality.py`): `{args.checkpoint}`",
        "",
        machine_line(),
        "",
        f"Model d {cfg.model.d_model}, {cfg.model.recurrence}, {cfg.model.tokenizer} tokenizer, "
        f"trained at T ~ U{{{cfg.train.depth_min}..{cfg.train.depth_max}}} for {steps} steps, read at T = {T}. Held-out: {args.windows} "
        f"{heldout_corpus(cfg)[1]} windows of {args.length} tokens, {args.prompt}-token prompt prefilled at full "
        f"depth, every later true token decoded through the cache ({time.time() - t0:.0f} s).",
        "",
        f"**Depth response:** NLL {base:.4f} at T = {T} against {quarter:.4f} at T/4 = "
        f"{max(1, T // 4)} ({100 * (quarter / base - 1):+.2f}%: "
        + ("depth helps this model)." if quarter > base else "depth does not help this model)."),
        "",
        "| rule | threshold | NLL | cost vs fixed T | loops/token | chosen (≤ "
        f"{args.budget:g}%, fewest loops) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for rule, thr, nll, cost, depth in rows:
        mark = "yes" if chosen.get(rule, (None,))[0] == thr else ""
        lines.append(f"| {rule} | {thr:g} | {nll:.4f} | {cost:+.2f}% | {depth:.2f} | {mark} |")
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        update_section("depth_quality", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
