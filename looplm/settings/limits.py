"""Allowed ranges checked before any work, and output paths checked before any computation.

A loop depth T costs T applications of the shared block per token, so ``--loops 100000`` or
``--depths 1-2000`` would run for hours without a word. Depths above :data:`MAX_LOOPS` are refused
with a one-line error unless the caller raises the ceiling on purpose: ``--max-loops N`` where a
command offers it, or ``LOOPLM_MAX_LOOPS=N`` in the environment for every command and sweep.

Output paths (``--out FILE``, a run or cache folder) are checked the same way, before anything is
computed, so an hour of evaluation is never lost to a path that could not have been written.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError

#: The largest loop depth T accepted without an explicit override (the paper's sweeps reach 96).
MAX_LOOPS = 256
#: Environment variable that raises (or lowers) :data:`MAX_LOOPS` for every command.
MAX_LOOPS_ENV = "LOOPLM_MAX_LOOPS"


def loop_limit(override: int | None = None) -> int:
    """The loop-depth ceiling: ``override`` when given, else ``$LOOPLM_MAX_LOOPS``, else
    :data:`MAX_LOOPS`."""
    if override is not None:
        check_int_range("--max-loops", override, 1)
        return int(override)
    env = os.environ.get(MAX_LOOPS_ENV)
    if env is None or env.strip() == "":
        return MAX_LOOPS
    try:
        value = int(env)
    except ValueError:
        raise LoopLMError(f"{MAX_LOOPS_ENV}={env!r} must be a positive integer") from None
    check_int_range(MAX_LOOPS_ENV, value, 1)
    return value


# named apart from looplm.model.lm.check_loops (the >= 1 check): the standalone export copies
# both into one file
def check_ceiling(
    flag: str, depths: int | Iterable[int], override: int | None = None, offer_flag: bool = True
) -> None:
    """Raise LoopLMError naming the deepest of ``depths`` when it exceeds the ceiling
    (:func:`loop_limit`); depths below 1 are the caller's to refuse. ``offer_flag``: the command
    has a ``--max-loops`` option to suggest (else only the environment variable is)."""
    values = [depths] if isinstance(depths, int) else list(depths)
    limit = loop_limit(override)
    deepest = max(values, default=0)
    if deepest > limit:
        raise LoopLMError(
            f"{flag} {deepest} is out of range: loop depths run 1 … {limit} (each loop is one "
            f"more pass of the shared block per token); to run it deliberately "
            + (f"pass --max-loops {deepest} or " if offer_flag else "")
            + f"set {MAX_LOOPS_ENV}={deepest}"
        )


def check_int_range(flag: str, value: object, lo: int, hi: int | None = None) -> None:
    """Raise LoopLMError unless ``value`` is an integer in ``lo … hi`` (``hi`` None: no upper
    bound), naming the value and the range."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and value >= lo and (hi is None or value <= hi):
        return
    allowed = f"{lo} … {hi}" if hi is not None else f"an integer >= {lo}"
    raise LoopLMError(f"{flag} {value!r} is out of range; allowed: {allowed}")


def check_output_file(flag: str, path: str | os.PathLike | None) -> None:
    """Refuse, before any work, an output file path that cannot be written: an existing
    folder, or a path under something that is a file."""
    if not path:
        if path is not None:
            raise LoopLMError(f"{_named(flag, '')} is empty; give a file path")
        return
    p = Path(path)
    if p.is_dir():
        raise LoopLMError(
            f"{_named(flag, p)} is a folder; give a file path (e.g. {p / 'out.json'})"
        )
    _check_parents(flag, p)


def check_output_folder(flag: str, path: str | os.PathLike | None) -> None:
    """Refuse, before any work, an output folder that is empty, is a file or lies under one."""
    if path is None:
        return
    if str(path).strip() == "":
        raise LoopLMError(f"{_named(flag, '')} is empty; give a folder path")
    p = Path(path)
    if p.is_symlink() and not p.exists():
        raise LoopLMError(
            f"{_named(flag, p)} is a symbolic link that leads nowhere (a loop, or its target "
            f"{os.readlink(p)!r} is missing); remove it or choose another path"
        )
    if p.exists() and not p.is_dir():
        raise LoopLMError(
            f"{_named(flag, p)} is a file; it must be a folder (remove it or choose another path)"
        )
    _check_parents(flag, p)


def _check_parents(flag: str, p: Path) -> None:
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise LoopLMError(f"{_named(flag, p)}: {parent} is a file; it must be a folder")
            return


def _named(flag: str, value: object) -> str:
    """``--out X`` or ``out_dir=X``: how the user wrote the setting."""
    return f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}".rstrip()


MAX_STEPS_ENV = "LOOPLM_MAX_STEPS"


def max_steps_cap() -> int | None:
    """The step cap ``LOOPLM_MAX_STEPS=N`` sets, or None when unset: each :func:`fit` call then
    runs at most N optimizer steps (``train.steps`` becomes ``min(train.steps, start + N)``, and
    ``config.yaml`` records the capped value). It exists so the documentation's commands run as
    written in seconds (the docs test sets it); the one place looplm reads it."""
    raw = os.environ.get(MAX_STEPS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise LoopLMError(f"{MAX_STEPS_ENV}={raw!r} must be a positive whole number of steps")
    return int(raw)


def cap_steps(ts: Any, cfg: Any, quiet: bool = False) -> None:
    """Apply :func:`max_steps_cap` to a set-up training ``ts`` (its ``step`` and ``cfg``) and
    the run config ``cfg``: at most N more optimizer steps, said on stderr unless ``quiet``."""
    cap = max_steps_cap()
    if cap is None or cfg.train.steps <= ts.step + cap:
        return
    if not quiet:
        print(
            f"{MAX_STEPS_ENV}={cap}: training stops at step {ts.step + cap} "
            f"(train.steps={cfg.train.steps})",
            file=sys.stderr,
        )
    cfg.train.steps = ts.cfg.train.steps = ts.step + cap


def available_memory(device: Any) -> int | None:
    """Bytes free for a training step on ``device`` (a GPU's free memory; on the CPU the
    kernel's MemAvailable), or None where it cannot be told."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def step_memory_floor(cfg: Any, row_len: int, device: Any) -> int:
    """A lower bound on one micro-batch's training memory in bytes: every unrolled layer keeps at
    least its input, its attention output and its MLP hidden layer per token for the backward
    pass ((2·d + d_ff) values), and the readout its logits (V values); 2 bytes a value on a GPU
    (bf16 autocast), 4 on the CPU. Real steps need more, so a refusal is never wrong."""
    m, t = cfg.model, cfg.train
    looped = m.recurrence != "unshared"
    layers = (
        m.prelude_layers + m.coda_layers + m.core_layers * t.depth_max if looped else m.n_layers
    )
    per_token = layers * (2 * m.d_model + m.d_ff) + m.vocab_size
    width = 2 if getattr(device, "type", "cpu") == "cuda" else 4
    return t.batch_size * row_len * per_token * width


def check_step_memory(cfg: Any, row_len: int, device: Any) -> None:
    """One line, before the first step, when ``train.batch_size`` cannot fit in memory."""
    need = step_memory_floor(cfg, row_len, device)
    free = available_memory(device)
    if free is not None and need > free:
        gib = 1 << 30
        raise LoopLMError(
            f"train.batch_size={cfg.train.batch_size} needs at least {need / gib:.1f} GiB for one "
            f"step ({row_len} tokens a row, depth {cfg.train.depth_max}) but {free / gib:.1f} GiB "
            "are free; lower train.batch_size (train.grad_accum=N keeps the optimizer's batch)"
        )
