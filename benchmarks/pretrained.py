"""A random-weight model of Parcae-140M's published shape, loaded natively and run on this CPU.

    python benchmarks/pretrained.py [--tokens 32] [--new 16] [--no-write]

Writes a checkpoint in Parcae's published layout (config.json of parcae-small-140m from the
fixture's ``published/`` folder, ``pytorch_model.bin`` with random weights) into a temporary
folder, then measures in a fresh process:

* load time and peak resident memory of ``looplm.from_pretrained`` (VmHWM above the resident
  set before the load), against the weights' bytes;
* prefill tokens/s (one prompt of ``--tokens`` tokens) and greedy cached decode tokens/s at the
  trained loop count T = 8;
* decode tokens/s with per-token halting forced to a mean of T/2 loops (every token halts after
  step T/2: speed only, the outputs mean nothing with random weights).

Results are appended to benchmarks/RESULTS.md unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PUBLISHED = HERE.parent / "tests/fixtures/pretrained/parcae/published/parcae-small-140m.json"


def write_checkpoint(folder: Path) -> None:
    import torch

    from looplm.model.families import FAMILIES, published_model_config

    cfg = json.loads(PUBLISHED.read_text())
    _, mc = published_model_config(cfg)
    plan = FAMILIES["parcae"].weights(cfg, set(), mc)  # value embeddings by the config's rules
    g = torch.Generator().manual_seed(0)
    state = {}
    for w in plan.weights:
        for name, shape in w.sources.items():
            state[name] = torch.randn(shape, generator=g) * 0.02
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(state, folder / "pytorch_model.bin")


WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(2)
import looplm, looplm.model.families, looplm.model.families.base
from looplm.decoding.decoder import StaticKVCache, next_logits
from looplm.model.halting import TokenHalting
def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key + ':')).split()[1]) * 1024
before = status('VmRSS')
t0 = time.perf_counter()
model = looplm.from_pretrained(sys.argv[1])
load_s = time.perf_counter() - t0
weights = sum(p.numel() * p.element_size() for p in model.parameters())
peak = status('VmHWM') - before
n, new, T = int(sys.argv[2]), int(sys.argv[3]), 8
ids = torch.randint(0, 32768, (1, n), generator=torch.Generator().manual_seed(0))

class Half:  # every token halts after step T/2
    needs_logits = False
    def __call__(self, t, h, cur, prev):
        return torch.full((h.shape[0],), t >= T // 2)

@torch.no_grad()
def decode(halt):
    cache = StaticKVCache(model.config.context)
    t0 = time.perf_counter()
    logits = next_logits(model, ids, T, cache)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    depths = []
    for _ in range(new):
        tok = logits.argmax(-1, keepdim=True)
        ctx = model.prepare(tok, cache=cache, pos_offset=cache.length)
        core = model.core_call(ctx, cache=cache)
        halting = TokenHalting(Half()) if halt else None
        for last in model.unroll(ctx, T, core=core, halting=halting):
            pass
        h = model.finish(last.hidden, ctx, cache=cache, first_slot=core.slot)
        cache.length += 1
        logits = model.readout(h[:, -1])
        depths.append(float(halting.depth.float().mean()) if halt else T)
    return n / prefill, new / (time.perf_counter() - t0), sum(depths) / len(depths)

decode(False)  # warm-up
pre, dec, _ = decode(False)
_, dec_half, mean_loops = decode(True)
print(json.dumps(dict(params=model.num_parameters(), weights_bytes=weights, load_s=load_s,
      peak_bytes=peak, prefill_tok_s=pre, decode_tok_s=dec, decode_half_tok_s=dec_half,
      halting_mean_loops=mean_loops, prompt=n, new=new, loops=T)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder)
        out = subprocess.run(
            [sys.executable, "-c", WORKER, str(folder), str(args.tokens), str(args.new)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    text = (
        f"\n## Parcae-140M shape, random weights, loaded natively ({time.strftime('%Y-%m-%d')})\n\n"
        f"`python benchmarks/pretrained.py` — {r['params']:,} parameters, fp32 "
        f"({r['weights_bytes'] / 1e6:.0f} MB), 2 torch threads on the shared 2-core CPU.\n\n"
        "| load s | peak load memory / weights | prefill tok/s | decode tok/s (T=8) | "
        "decode tok/s (halting, mean loops) |\n|---|---|---|---|---|\n"
        f"| {r['load_s']:.1f} | {r['peak_bytes'] / r['weights_bytes']:.2f} | "
        f"{r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} | "
        f"{r['decode_half_tok_s']:.2f} ({r['halting_mean_loops']:.1f}) |\n\n"
        f"Prompt {r['prompt']} tokens, {r['new']} greedy new tokens with the KV cache; the halting "
        "row stops every token after T/2 = 4 loop steps (speed only).\n"
    )
    print(text)
    if not args.no_write:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
