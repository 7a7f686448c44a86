"""`looplm generate CHECKPOINT --prompt TEXT`: continue a prompt with a KV-cached looped model,
at a fixed loop depth or with per-token adaptive depth (``--halt kl|maxtoken --threshold X``).

`looplm generate CHECKPOINT --prompts FILE`: many prompts (one per line, or JSONL with per-prompt
settings) streamed through ``--slots`` batch slots (continuous batching, :mod:`looplm.batching`);
one JSON line per prompt, in input order, on stdout or in ``--out``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PROMPT_KEYS = ("prompt", "max_new", "temperature", "top_k", "seed")


# long: the argument list of one-prompt and many-prompt generation, one add_argument per option
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a text prompt (KV cache per loop step; greedy or sampled)",
        description="Generate from a checkpoint with its own tokenizer. --loops is the depth T "
        "(the ceiling with --halt); the prompt runs T loops (or, with --prefill-halt, halts token "
        "by token too), each new token stops early when the halting rule says so. Past the model's context the window slides (the last "
        "context - slide + 1 tokens are re-read). --prompts FILE streams many prompts through "
        "--slots batch slots (continuous batching: a slot takes the next prompt when its sequence "
        "ends; each sequence gets the tokens it would get alone) and prints one JSON line per "
        "prompt plus a tokens/s summary.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="text to continue")
    which.add_argument(
        "--prompts",
        metavar="FILE",
        help="many prompts: one per line, or a .jsonl file of objects with prompt and optionally "
        "max_new, temperature, top_k, seed (defaults: the options below)",
    )
    p.add_argument(
        "--slots", type=int, default=8, help="--prompts: sequences decoded together (batch size)"
    )
    p.add_argument(
        "--schedule",
        choices=["continuous", "static"],
        default="continuous",
        help="--prompts: refill a slot as soon as its sequence ends (continuous) or run fixed "
        "groups of --slots prompts to the end of their longest (static)",
    )
    p.add_argument(
        "--stop-at-eot", action="store_true", help="end a sequence at the end-of-text token"
    )
    p.add_argument("--out", help="--prompts: write the JSON lines here instead of stdout")
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
        "--prefill-halt",
        action="store_true",
        help="with --halt: the prompt's tokens halt by the same rule (instead of all running T)",
    )
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
    if args.prompts is not None:
        return run_many(args, model, tok)
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
        prefill_halt=args.prefill_halt,
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
        if out.prompt_loops is not None:
            depth += f", prompt {out.prompt_loops.double().mean():.2f}"
    print(
        f"[{args.max_new} tokens at {depth} in {dt:.2f} s, cache={'off' if args.no_cache else 'on'}]"
    )
    return 0


def read_prompts(path: str, defaults: dict, tok) -> tuple[list[str], list]:
    """(prompt texts, :class:`~looplm.batching.Request` list) from a prompt file: one prompt per
    non-empty line, or for a ``.jsonl`` file one object per line (keys ``PROMPT_KEYS``)."""
    from looplm.batching import Request
    from looplm.errors import LoopLMError

    file = Path(path)
    if not file.is_file():
        raise LoopLMError(f"--prompts {path}: no such file")
    texts, requests = [], []
    jsonl = file.suffix == ".jsonl"
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        settings = dict(defaults)
        if jsonl:
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LoopLMError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or "prompt" not in item:
                raise LoopLMError(f"{path}:{n}: expected an object with a 'prompt'")
            unknown = sorted(set(item) - set(PROMPT_KEYS))
            if unknown:
                raise LoopLMError(
                    f"{path}:{n}: unknown key {unknown[0]!r}; allowed: {', '.join(PROMPT_KEYS)}"
                )
            text = str(item.pop("prompt"))
            settings.update(item)
        else:
            text = line
        ids = tok.encode(text)
        if not ids:
            raise LoopLMError(f"{path}:{n}: the prompt is empty")
        try:
            requests.append(Request(tuple(ids), **settings))
        except TypeError as exc:
            raise LoopLMError(f"{path}:{n}: {exc}") from None
        except LoopLMError as exc:
            raise LoopLMError(f"{path}:{n}: {exc}") from None
        texts.append(text)
    if not requests:
        raise LoopLMError(f"--prompts {path}: no prompts in the file")
    return texts, requests


def run_many(args: argparse.Namespace, model, tok) -> int:
    """``--prompts FILE``: continuous (or static) batching over the file's prompts."""
    import sys

    from looplm.batching import generate_many
    from looplm.io import atomic_write_text
    from looplm.progress import progress_enabled

    defaults = {
        "max_new": args.max_new,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "seed": args.seed,
    }
    texts, requests = read_prompts(args.prompts, defaults, tok)
    cpu0 = time.process_time()
    res = generate_many(
        model,
        requests,
        slots=args.slots,
        loops=args.loops,
        halt=args.halt,
        threshold=args.threshold or 0.0,
        slide=args.slide,
        eot_id=tok.eot_id if args.stop_at_eot else None,
        schedule=args.schedule,
        progress=progress_enabled(),
        prefill_halt=args.prefill_halt,
    )
    cpu = time.process_time() - cpu0
    lines = []
    for i, (text, c) in enumerate(zip(texts, res.completions)):
        item = {
            "index": i,
            "prompt": text,
            "completion": tok.decode(c.tokens),
            "new_tokens": len(c.tokens),
            "mean_loops": round(sum(c.loops) / len(c.loops), 3),
        }
        lines.append(json.dumps(item, ensure_ascii=False))
    body = "\n".join(lines) + "\n"
    if args.out:
        atomic_write_text(args.out, body)
    else:
        sys.stdout.write(body)
    depth = f"T={args.loops}"
    if args.halt != "none":
        depth = f"halt={args.halt} threshold={args.threshold:g} ceiling T={args.loops}"
    print(
        f"[{len(requests)} prompts, {res.tokens} tokens in {res.seconds:.2f} s "
        f"(CPU {cpu:.2f} s): {res.tokens_per_second:.1f} tokens/s; {args.schedule} batching, "
        f"{args.slots} slots, {depth}, mean loops/token {res.mean_loops:.2f}]",
        file=sys.stderr,
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
        if args.prompt is not None:
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
