"""`looplm generate CHECKPOINT --prompt TEXT`: continue a prompt with a KV-cached looped model."""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a text prompt (KV cache per loop step; greedy or sampled)",
        description="Generate from a checkpoint with its own tokenizer at a fixed loop depth.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new", type=int, default=32, help="tokens to generate")
    p.add_argument("--loops", type=int, default=8, help="loop depth T")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each token")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from looplm.checkpoint import load_checkpoint
    from looplm.data import get_tokenizer
    from looplm.errors import LoopLMError
    from looplm.generate import generate
    from looplm.model.lm import check_loops

    check_loops(args.loops)
    if args.max_new < 1:
        raise LoopLMError(f"--max-new {args.max_new} must be >= 1")
    model, cfg, _ = load_checkpoint(args.checkpoint)
    tok = get_tokenizer(cfg.model.tokenizer)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise LoopLMError("--prompt is empty")
    t0 = time.perf_counter()
    out = generate(
        model,
        ids,
        args.max_new,
        loops=args.loops,
        temperature=args.temperature,
        top_k=args.top_k,
        use_cache=not args.no_cache,
        generator=torch.Generator().manual_seed(args.seed),
    )
    dt = time.perf_counter() - t0
    print(tok.decode(out[0].tolist()))
    print(
        f"[{args.max_new} tokens at T={args.loops} in {dt:.2f} s, cache={'off' if args.no_cache else 'on'}]"
    )
    return 0
