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
