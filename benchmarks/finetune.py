"""Fine-tuning throughput and peak memory on Parcae-140M's published shape (random weights), this
CPU: full fine-tuning against LoRA (rank 16 on the looped core).

    python benchmarks/finetune.py [--steps 4] [--seq 128] [--batch 4] [--no-write]
    python benchmarks/finetune.py --config tests/fixtures/pretrained/ouro/published/1.4B.json \
        --loops 4 --backprop 0 --seq 1024 --batch 4 --steps 6       # on a GPU: Ouro-1.4B

Another published config (``--config``) gets its own section (GPU: peak allocated memory).

Builds the model of ``parcae-small-140m``'s published config.json with random weights, saves it
as a looplm checkpoint with a character tokenizer, writes a small text, then runs
``looplm train finetune init=… train.steps=N`` once per mode, each in a fresh process (so the
peak resident set is that mode's): loop depth T = 8 with gradients through the last 4 (the
Parcae recipe's mean depth and backprop depth, fixed so every step does the same work), AdamW.
Reported: the median tokens/s of the steps after the first (metrics.jsonl, ``log_every=1``) and
the process's peak resident set. Random weights: speed and memory only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PUBLISHED = HERE.parent / "tests/fixtures/pretrained/parcae/published/parcae-small-140m.json"


def write_init(root: Path, published: Path) -> Path:
    """A random-weight looplm checkpoint of a published config with a character tokenizer, and a
    text."""
    import random

    from tokenizers import Tokenizer, decoders, models

    from looplm.model import model_from_config
    from looplm.model.checkpoint import save_checkpoint
    from looplm.model.families import published_model_config, run_config

    _, mc = published_model_config(_published(published))
    vocab = {"<|endoftext|>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "<unk>": 96}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    init = root / "init"
    save_checkpoint(init, model_from_config(mc), run_config(mc, 8), state={"step": 0})
    tok.save(str(init / "tokenizer.json"))  # beside the weights: the run reads it from there
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while loops read text".split()
    docs = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(60)]
    (root / "text.txt").write_text("\n\n".join(docs))
    return init


def run_mode(root: Path, init: Path, lora: int, args) -> dict:
    out = root / f"run_lora{lora}"
    cmd = [sys.executable, "-m", "looplm", "train", "finetune", f"init={init}",
           f"data.dataset=text:{root / 'text.txt'}", f"out_dir={out}",
           f"train.steps={args.steps}", f"train.batch_size={args.batch}",
           f"train.seq_len={args.seq}", "train.recipe=looplm", f"train.depth_min={args.loops}",
           f"train.depth_max={args.loops}", f"train.truncate_k={args.backprop}",
           "train.log_every=1", "train.warmup=0", "train.eval_batches=1",
           f"eval.depths=[{args.loops}]", f"lora.rank={lora}", "--no-progress"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "tok_per_s" in x]
    rates = [x["tok_per_s"] for x in steps[1:]] or [steps[0]["tok_per_s"]]
    return {
        "lora": lora,
        "tok_s": statistics.median(rates),
        "rates": rates,
        "peak_mb": max(x.get("peak_rss_mb", x.get("peak_mem_mb", 0.0)) for x in steps),
        "wall": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--config", type=Path, default=PUBLISHED, help="a published config.json")
    ap.add_argument("--loops", type=int, default=8, help="loop depth T of every step")
    ap.add_argument("--backprop", type=int, default=4, help="steps with gradients (0: all)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    import torch
    from _results import machine_line, update_section

    from looplm.model.families import published_model_config
    from looplm.training.finetune import finetune_memory

    _, mc = published_model_config(_published(args.config))
    mem = finetune_memory(mc, rank=16)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init = write_init(root, args.config)
        rows = [run_mode(root, init, lora, args) for lora in (0, 16)]
    load_after = os.getloadavg()
    for r in rows:
        print(json.dumps(r))
    gpu = torch.cuda.is_available()
    default = args.config.resolve() == PUBLISHED.resolve()
    name = "Parcae-140M" if default else args.config.stem
    grad = f"the last {args.backprop}" if args.backprop else "all of them"
    memory = "peak allocated GPU memory" if gpu else "the process's peak resident set"
    flags = (
        ""
        if default
        else f" --config {args.config} --loops {args.loops} --backprop {args.backprop}"
    )
    body = [
        f"## Fine-tuning, {'GPU' if gpu else 'CPU'}: {name} shape (random weights), full vs LoRA "
        "(`benchmarks/finetune.py`)",
        "",
        f"`python benchmarks/finetune.py --steps {args.steps} --seq {args.seq} --batch "
        f"{args.batch}{flags}` · {machine_line()} (the benchmark process; each mode runs in its own "
        f"process with torch's default threads) · load average before {load[0]:.1f}, after "
        f"{load_after[0]:.1f} on a shared machine",
        "",
        f"`looplm train finetune init=…` on {mc.d_model}-wide {name} "
        f"({mem['params'] / 1e6:.1f}M parameters), {args.batch} × {args.seq} tokens per step, "
        f"T = {args.loops} with gradients through {grad}, AdamW; tokens/s is the median of steps "
        f"2…{args.steps} (metrics.jsonl), peak memory {memory}.",
        "",
        "| mode | trainable parameters | tokens/s | peak memory (MB) | tokens/s of each step |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        name = "full" if not r["lora"] else f"LoRA r={r['lora']} (core)"
        trainable = mem["params"] if not r["lora"] else mem["lora_params"]
        rates = ", ".join(f"{x:.0f}" for x in r["rates"])
        body.append(
            f"| {name} | {trainable / 1e6:.2f}M | {r['tok_s']:.0f} | {r['peak_mb']:,.0f} | {rates} |"
        )
    print("\n".join(body))
    if not args.no_write:
        section = (
            "finetune" if default and not gpu else f"finetune_{name}_{'gpu' if gpu else 'cpu'}"
        )
        update_section(section, "\n".join(body))


def _published(path: Path) -> dict:
    """A published config (a fixture's ``{config, …}`` entry or the config itself)."""
    raw = json.loads(Path(path).read_text())
    raw = raw.get("config", raw)
    return {k: v for k, v in raw.items() if not k.startswith("_") or k == "_class_name"}


if __name__ == "__main__":
    main()
