"""Atomic file writes: a temp file in the same folder, fsync, then ``os.replace``.

A reader never sees a half-written checkpoint, results store export or report: it sees either the
old file or the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO


def _umask() -> int:
    """The process's file-mode creation mask (read without changing it where Linux allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: the classic read-by-setting, restored at once
    os.umask(mask)
    return mask


def _final_mode(path: Path) -> int:
    """The mode a plain ``open(path, "w")`` would leave: the existing file's, or 0666 & ~umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temp file beside it, synced and renamed into
    place when the block ends normally, removed when it raises (creating parent folders). The
    file gets the mode an ordinary write would give it (0644 under umask 022; an existing file
    keeps its own), not the temp file's private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # a read-only or full folder: name the file that was to be written
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    try:
        os.fchmod(fd, _final_mode(path))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            # name the file being written (a failed write() on a descriptor names no path)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (creating parent folders)."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def finite_json(obj: Any, where: str = "") -> tuple[Any, list[str]]:
    """``obj`` with every NaN / infinite float replaced by ``None`` (JSON has no NaN: Python's
    ``json`` would write an invalid ``NaN``), and the paths (``results.0.nll``) it replaced."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return None, [where]
    if isinstance(obj, dict):
        out, bad = {}, []
        for k, v in obj.items():
            out[k], b = finite_json(v, f"{where}.{k}".lstrip("."))
            bad += b
        return out, bad
    if isinstance(obj, (list, tuple)):
        items = [finite_json(v, f"{where}.{i}".lstrip(".")) for i, v in enumerate(obj)]
        return [v for v, _ in items], [p for _, b in items for p in b]
    return obj, []


@contextlib.contextmanager
def file_lock(path: str | os.PathLike, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive advisory lock on ``path`` (created if missing) for the block: yields True
    when held; with ``wait=False`` yields False at once when another process holds it. The
    operating system releases it when the holder exits, however it exits (kill -9 included)."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
