"""Generation as ``looplm generate`` runs it: one prompt continued and streamed to the terminal
(:func:`generate_text`), or a prompt file streamed through batch slots (:func:`generate_file`,
continuous batching, :mod:`looplm.decoding.batching`), with :class:`GenerateSettings`, the one statement of
the command's settings. Light at import (torch loads when a model runs): the command line is made
from the settings at start-up.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.model.halting_rules import RENAMED, RuleNames
from looplm.settings import setting

PROMPT_KEYS = ("prompt", "max_tokens", "temperature", "top_k", "seed")
# per-token halting rules of decoding (:mod:`looplm.model.halting_rules`), and old names
HALTS = RuleNames(extra=("none",), suffix=tuple(RENAMED), decoding=True)
SEED_MAX = 2**63 - 1  # the largest seed a torch generator takes


@dataclass
class GenerateSettings:
    """Decoding: depth, halting, sampling, and (for a prompt file) batching."""

    # loop depth T (default: the depth the checkpoint was trained to, train.depth_max, as serve)
    loops: int | None = setting(None, lo=1, loops=True, what="the loop depth T")
    # the largest loop depth accepted (default: the usual ceiling, 256, or $LOOPLM_MAX_LOOPS)
    max_loops: int | None = setting(None, lo=1, raises_ceiling=True)
    # tokens to generate (printed as they are made; Ctrl-C stops); --max-new: its old name
    max_tokens: int = setting(32, lo=1, renamed=("max_new",))
    temperature: float = setting(0.0, lo=0)  # 0: greedy
    top_k: int | None = setting(None, lo=1)  # sample among the k most likely (default: all)
    seed: int = setting(0, lo=0, hi=SEED_MAX)  # seed of the sampler
    cache: bool = True  # keep a KV cache per loop step (--no-cache: recompute the prefix)
    # per-token halting: kl = KL(p_t||p_t-1) < X, update = relative hidden update < X, gate = a
    # learned exit gate's cumulative exit probability >= X (Ouro); maxtoken: the old name of update
    halt: str = setting("none", choices=HALTS)
    threshold: float | None = setting(None, lo=0)  # halting threshold X (0: never)
    # with --halt: the prompt's tokens halt by the same rule (instead of all running T)
    prefill_halt: bool = False
    slide: int = setting(1, lo=1)  # tokens the window advances when the context is full
    slots: int = setting(8, lo=1, hi=65_536)  # --prompts: sequences decoded together (batch size)
    # --prompts: refill a slot as soon as its sequence ends (continuous), run fixed groups of
    # --slots prompts to the end of their longest (static), or keep every sequence at its own
    # loop step (loop: a halted token's next one starts in the next core application)
    schedule: str = setting("continuous", choices=("continuous", "static", "loop"))
    prefill_chunk: int = setting(32, lo=1)  # --schedule loop: prompt tokens per prefill chunk
    stop_at_eot: bool = False  # end a sequence at the end-of-text token
    out: str | None = None  # --prompts: write the JSON lines here instead of stdout

    def validate(self) -> None:
        if self.halt != "none" and self.threshold is None:
            raise LoopLMError(f"--halt {self.halt} needs --threshold")


def generate_text(model: Any, tok: Any, prompt: str, s: GenerateSettings) -> str:
    """Continue ``prompt``, printing each token as it is made; returns the summary line."""
    import torch

    from looplm.decoding.decoder import decode

    _check_prompt(prompt)
    ids = torch.tensor([tok.encode(prompt)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise LoopLMError("--prompt is empty")
    stream = _Stream(tok)
    print(prompt, end="", flush=True)
    t0 = time.perf_counter()
    out = decode(
        model,
        ids,
        s.max_tokens,
        loops=s.loops,
        halt=s.halt,
        threshold=s.threshold or 0.0,
        temperature=s.temperature,
        top_k=s.top_k,
        use_cache=s.cache,
        slide=s.slide,
        generator=torch.Generator().manual_seed(s.seed),
        prefill_halt=s.prefill_halt,
        on_token=stream,
    )
    dt = time.perf_counter() - t0
    stream.flush()
    print()
    depth = f"T={s.loops}"
    if s.halt != "none":
        depth = (
            f"halt={s.halt} threshold={s.threshold:g} ceiling T={s.loops}, "
            f"mean loops/token {out.mean_loops:.2f}"
        )
        if out.prompt_loops is not None:
            depth += f", prompt {out.prompt_loops.double().mean():.2f}"
    return f"[{s.max_tokens} tokens at {depth} in {dt:.2f} s, cache={'on' if s.cache else 'off'}]"


def read_prompts(path: str, defaults: dict, tok) -> tuple[list[str], list]:
    """(prompt texts, :class:`~looplm.decoding.batching.Request` list) from a prompt file: one prompt per
    non-empty line, or for a ``.jsonl`` file one object per line (keys ``PROMPT_KEYS``)."""
    from looplm.decoding.batching import Request

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
            if "max_new" in item and "max_tokens" not in item:  # the old name, for one release
                print(f"note: {path}:{n}: 'max_new' is now 'max_tokens'", file=sys.stderr)
                item["max_tokens"] = item.pop("max_new")
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
            max_new = settings.pop("max_tokens")
            requests.append(Request(tuple(ids), max_new=max_new, **settings))
        except TypeError as exc:
            raise LoopLMError(f"{path}:{n}: {exc}") from None
        except LoopLMError as exc:
            raise LoopLMError(f"{path}:{n}: {exc}") from None
        texts.append(text)
    if not requests:
        raise LoopLMError(f"--prompts {path}: no prompts in the file")
    return texts, requests


def generate_file(model: Any, tok: Any, path: str, s: GenerateSettings) -> str:
    """``--prompts FILE``: continuous (or static) batching over the file's prompts; the JSON
    lines go to ``s.out`` or stdout, the summary line is returned."""
    from looplm.decoding.batching import generate_many
    from looplm.decoding.loop_batching import generate_loop_level
    from looplm.io import atomic_write_text
    from looplm.progress import progress_enabled

    defaults = {
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "seed": s.seed,
    }
    texts, requests = read_prompts(path, defaults, tok)
    cpu0 = time.process_time()
    kw = dict(
        slots=s.slots,
        loops=s.loops,
        halt=s.halt,
        threshold=s.threshold or 0.0,
        slide=s.slide,
        eot_id=tok.eot_id if s.stop_at_eot else None,
        progress=progress_enabled(),
    )
    if s.schedule == "loop":
        if s.prefill_halt:
            raise LoopLMError("--prefill-halt runs on --schedule continuous or static")
        res = generate_loop_level(model, requests, prefill_chunk=s.prefill_chunk, **kw)
    else:
        res = generate_many(model, requests, schedule=s.schedule, prefill_halt=s.prefill_halt, **kw)
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
    if s.out:
        atomic_write_text(s.out, body)
    else:
        sys.stdout.write(body)
    depth = f"T={s.loops}"
    if s.halt != "none":
        depth = f"halt={s.halt} threshold={s.threshold:g} ceiling T={s.loops}"
    return (
        f"[{len(requests)} prompts, {res.tokens} tokens in {res.seconds:.2f} s "
        f"(CPU {cpu:.2f} s): {res.tokens_per_second:.1f} tokens/s; {s.schedule} batching, "
        f"{s.slots} slots, {depth}, mean loops/token {res.mean_loops:.2f}]"
    )


def _check_prompt(prompt: str) -> None:
    """A prompt that is not UTF-8 text (a terminal's stray byte) is a one-line error."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = prompt[exc.start].encode("utf-8", "surrogateescape")
        raise LoopLMError(
            f"--prompt is not valid UTF-8 text (byte {bad.hex()} at character {exc.start}); "
            "pass UTF-8 text"
        ) from None


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
