"""`looplm generate CHECKPOINT --prompt TEXT`: continue a prompt with a KV-cached looped model,
at a fixed loop depth or with per-token adaptive depth (``--halt kl|maxtoken --threshold X``)."""

from __future__ import annotations

import argparse
import math
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a text prompt (KV cache per loop step; greedy or sampled)",
        description="Generate from a checkpoint with its own tokenizer. --loops is the depth T "
        "(the ceiling with --halt); the prompt always runs T loops, each new token stops early when "
        "the halting rule says so. Past the model's context the window slides (the last "
        "context - slide + 1 tokens are re-read).",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument(
        "--max-new",
        type=int,
        default=32,
        help="tokens to generate (printed as they are made; Ctrl-C stops)",
    )
    p.add_argument("--loops", type=int, default=8, help="loop depth T")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each token")
    p.add_argument(
        "--halt",
        choices=["none", "kl", "maxtoken"],
        default="none",
        help="per-token halting: kl = KL(p_t||p_t-1) < X, maxtoken = relative hidden update < X",
    )
    p.add_argument("--threshold", type=float, default=None, help="halting threshold X (0: never)")
    p.add_argument(
        "--slide", type=int, default=1, help="tokens the window advances when the context is full"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from looplm.checkpoint import load_checkpoint
    from looplm.data import get_tokenizer
    from looplm.errors import LoopLMError
    from looplm.generate import decode
    from looplm.model.lm import check_loops

    check_loops(args.loops)
    if args.max_new < 1:
        raise LoopLMError(f"--max-new {args.max_new} must be >= 1")
    _check_sampling(args)
    model, cfg, _ = load_checkpoint(args.checkpoint)
    tok = get_tokenizer(cfg.model.tokenizer)
    ids = torch.tensor([tok.encode(args.prompt)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise LoopLMError("--prompt is empty")
    stream = _Stream(tok)
    print(args.prompt, end="", flush=True)
    t0 = time.perf_counter()
    out = decode(
        model,
        ids,
        args.max_new,
        loops=args.loops,
        halt=args.halt,
        threshold=args.threshold or 0.0,
        temperature=args.temperature,
        top_k=args.top_k,
        use_cache=not args.no_cache,
        slide=args.slide,
        generator=torch.Generator().manual_seed(args.seed),
        on_token=stream,
    )
    dt = time.perf_counter() - t0
    stream.flush()
    print()
    depth = f"T={args.loops}"
    if args.halt != "none":
        depth = (
            f"halt={args.halt} threshold={args.threshold:g} ceiling T={args.loops}, "
            f"mean loops/token {out.mean_loops:.2f}"
        )
    print(
        f"[{args.max_new} tokens at {depth} in {dt:.2f} s, cache={'off' if args.no_cache else 'on'}]"
    )
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """One-line errors for sampling settings and a prompt that is not UTF-8 text."""
    from looplm.errors import LoopLMError

    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise LoopLMError(f"--temperature {args.temperature} must be >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise LoopLMError(f"--top-k {args.top_k} must be >= 1 (or left out: the whole vocabulary)")
    if args.threshold is not None and not args.threshold >= 0:
        raise LoopLMError(f"--threshold {args.threshold} must be >= 0")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = args.prompt[exc.start].encode("utf-8", "surrogateescape")
        raise LoopLMError(
            f"--prompt is not valid UTF-8 text (byte {bad.hex()} at character {exc.start}); "
            "pass UTF-8 text"
        ) from None
    if args.halt != "none" and args.threshold is None:
        raise LoopLMError(f"--halt {args.halt} needs --threshold")


class _Stream:
    """Prints each new token of the first row as it is made. Text is decoded from the tokens
    not yet printed, held back while it ends in an incomplete UTF-8 character."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.pending: list[int] = []

    def __call__(self, token) -> None:
        self.pending.append(int(token[0, 0]))
        text = self.tok.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 4:
            return  # wait for the rest of a multi-byte character
        sys.stdout.write(text)
        sys.stdout.flush()
        self.pending.clear()

    def flush(self) -> None:
        if self.pending:
            sys.stdout.write(self.tok.decode(self.pending))
            self.pending.clear()
        sys.stdout.flush()
