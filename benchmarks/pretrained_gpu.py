"""Published looped-model shapes with random weights on one GPU: prefill and decode speed.

    python benchmarks/pretrained_gpu.py [--models parcae-140m,ouro-1.4b,huginn-0125]
                                        [--prompt 512] [--new 64] [--dtype bfloat16] [--json F]

Each model is built from its published ``config.json`` (the fixtures' ``published/`` folders) on
the meta device, materialised on the device in ``--dtype`` with random weights (speed only: the
outputs mean nothing) and measured at its trained loop count T:

* prefill tokens/s (one prompt of ``--prompt`` tokens into a static KV cache);
* greedy cached decode tokens/s at batch 1 and ms/token;
* decode with per-token halting forced to a mean of T/2 loops (every token halts after step T/2);
* peak device memory (``torch.cuda.max_memory_allocated``) against the weights' bytes.

Every figure is the median of ``--repeats`` alternating runs after one warm-up. On a machine
without CUDA it runs on the CPU (``--smoke``: tiny prompt, few tokens) so the script is checked
before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
FIX = HERE.parent / "tests/fixtures/pretrained"
MODELS = {  # name: (published config, trained loop count)
    "parcae-140m": (FIX / "parcae/published/parcae-small-140m.json", 8),
    "parcae-1.3b": (FIX / "parcae/published/parcae-xlarge-1_3b.json", 8),
    "ouro-1.4b": (FIX / "ouro/published/1.4B.json", 4),
    "ouro-2.6b": (FIX / "ouro/published/2.6B.json", 4),
    "huginn-0125": (FIX / "huginn/published/huginn-0125.json", 32),
}


def build(name: str, device, dtype):
    import torch

    from looplm.model.families import build_meta, published_model_config

    cfg = json.loads(MODELS[name][0].read_text())
    cfg = cfg.get("config", cfg)  # Huginn's file: {config, parameter_count}
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") or k == "_class_name"}
    _, mc = published_model_config(cfg)
    model = build_meta(mc).to_empty(device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for b in model.buffers():  # rotary tables etc. are rebuilt by the model on first use
            if b.is_floating_point():
                b.zero_()
    return model.to(dtype).eval()


def run(model, T: int, prompt: int, new: int, halt: bool, device) -> tuple[float, float, float]:
    import torch

    from looplm.decoding.decoder import StaticKVCache, next_logits
    from looplm.model.halting import TokenHalting

    class Half:  # every token halts after step T/2
        needs_logits = False

        def __call__(self, t, h, cur, prev):
            return torch.full((h.shape[0],), t >= T // 2, device=h.device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():
        cache = StaticKVCache(prompt + new + 1)
        sync()
        t0 = time.perf_counter()
        logits = next_logits(model, ids, T, cache)
        sync()
        prefill = time.perf_counter() - t0
        depths = []
        t0 = time.perf_counter()
        for _ in range(new):
            tok = logits.argmax(-1, keepdim=True)
            ctx = model.prepare(tok, cache=cache, pos_offset=cache.length)
            core = model.core_call(ctx, cache=cache)
            halting = TokenHalting(Half()) if halt else None
            for last in model.unroll(ctx, T, core=core, halting=halting):  # noqa: B007
                pass
            h = model.finish(last.hidden, ctx, cache=cache, first_slot=core.slot)
            cache.length += 1
            logits = model.readout(h[:, -1])
            depths.append(float(halting.depth.float().mean()) if halt else T)
        sync()
        decode = time.perf_counter() - t0
    return prompt / prefill, new / decode, sum(depths) / len(depths)


def measure(name: str, args, device, dtype) -> dict:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build(name, device, dtype)
    build_s = time.perf_counter() - t0
    T = MODELS[name][1]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    run(model, T, min(args.prompt, 16), 2, False, device)  # warm-up
    rows = {"fixed": [], "half": []}
    for _ in range(args.repeats):
        for key in rows:
            rows[key].append(run(model, T, args.prompt, args.new, key == "half", device))
    med = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in rows.items()}
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    out = dict(model=name, params=model.num_parameters(), dtype=str(dtype).replace("torch.", ""),
               weights_gb=weights / 1e9, peak_gb=None if peak is None else peak / 1e9,
               build_s=build_s, loops=T, prompt=args.prompt, new=args.new,
               prefill_tok_s=med["fixed"][0], decode_tok_s=med["fixed"][1],
               decode_ms_per_tok=1000 / med["fixed"][1], decode_half_tok_s=med["half"][1],
               half_mean_loops=med["half"][2], repeats=args.repeats)  # fmt: skip
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="parcae-140m,ouro-1.4b,huginn-0125")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny prompt, parcae-140m only")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.models, args.prompt, args.new, args.repeats = "parcae-140m", 8, 2, 1
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"pretrained shapes on {name}, torch {torch.__version__}, {args.dtype}", flush=True)
    results = []
    for m in args.models.split(","):
        try:
            r = measure(m, args, device, dtype)
        except Exception as exc:  # one model that does not fit must not lose the others
            r = {"model": m, "error": f"{type(exc).__name__}: {exc}"[:300]}
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
