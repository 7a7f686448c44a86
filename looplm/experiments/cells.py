"""The cells of an experiment grid shared by several ``looplm sweep`` processes: each cell's run
folder holds a lock, and a cell another process holds is passed over and came back to."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOCK_NAME = ".sweep.lock"  # per run folder: one sweep process trains a cell at a time
LOCK_FILES = {LOCK_NAME, ".train.lock"}  # what a cell's folder holds before anything is written


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _no_lock_only_folder(run_dir: Path) -> Iterator[None]:
    """A cell refused before it wrote anything (missing data, a bad setting) leaves no run folder
    holding only lock files, nor the empty folders made for it."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        yield
    except BaseException:
        if made and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= LOCK_FILES:
            shutil.rmtree(run_dir, ignore_errors=True)
            for folder in made[1:]:  # the parents made for it, while empty
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


def each_cell_locked(
    what: str,
    cells: list[tuple[int, Any]],
    n: int,
    fn: Callable[[int, Any], bool],
    wait: bool = True,
) -> bool:
    """``fn(i, plan)`` for every cell (a run plan: ``run_dir``, ``label``) under its run folder's
    lock, so several ``looplm sweep`` processes on one grid share the cells: a cell another
    process holds is passed over, and waited for at the end (then what it finished is skipped),
    or left to that process when not ``wait``. False as soon as ``fn`` is."""
    from looplm.io import file_lock

    busy: list[tuple[int, Any]] = []
    for i, plan in cells:
        with (
            _no_lock_only_folder(plan.run_dir),
            file_lock(plan.run_dir / LOCK_NAME, wait=False) as held,
        ):
            if not held:
                _log(f"[{what} {i}/{n}] {plan.label}: another process holds it; later")
                busy.append((i, plan))
            elif not fn(i, plan):
                return False
    for i, plan in busy if wait else []:
        _log(f"[{what} {i}/{n}] {plan.label}: waiting for the other process …")
        with file_lock(plan.run_dir / LOCK_NAME):
            if not fn(i, plan):
                return False
    return True
