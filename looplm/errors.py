"""The one exception type for bad user input.

Every error a user can cause (unknown method, bad config key, missing data, corrupt checkpoint,
T < 1, sequence longer than the context) is raised as :class:`LoopLMError` with a message that names
the bad value and what is allowed. The CLI prints it as one line and exits with status 2.
"""

from __future__ import annotations

import errno
import os
import re


class LoopLMError(ValueError):
    """Bad input from the user; the message says what was wrong and what is allowed."""


def check_choice(kind: str, value: object, allowed: list[str] | tuple[str, ...]) -> None:
    """Raise LoopLMError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise LoopLMError(f"unknown {kind} {value!r}; allowed: {', '.join(map(str, allowed))}")


def yaml_problem(exc: Exception) -> str:
    """A YAML parse error as one line: where (line, column) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def check_positive_int(name: str, value: object) -> None:
    """Raise LoopLMError unless ``value`` is an int ≥ 1 (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoopLMError(f"{name}={value!r} must be a positive integer")


_FAULTS = {
    errno.ENOSPC: "no space left on the device: free some space or write elsewhere",
    errno.EDQUOT: "disk quota exceeded: free some space or write elsewhere",
    errno.EROFS: "read-only file system: choose a writable folder",
    errno.EACCES: "permission denied: choose a folder you can write to",
    errno.EPERM: "operation not permitted: choose a folder you can write to",
}


def describe_os_error(exc: OSError) -> str:
    """One line for a storage fault (full disk, read-only media, no permission, …): the path
    involved and what the fault means, without a traceback."""
    where = exc.filename if exc.filename is not None else None
    if where is not None and exc.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = _file_in_the_way(str(where))
        if blocker is not None:  # not a bare "File exists" / "Not a directory"
            return f"{blocker} is a file; it must be a folder (remove it or choose another path)"
    if exc.errno == errno.EIO and where and disk_nearly_full(str(where)):  # how some writers say it
        return f"{where}: disk full ({_FAULTS[errno.ENOSPC]})"
    what = _FAULTS.get(exc.errno or -1) or (exc.strerror or str(exc) or type(exc).__name__)
    msg = " ".join(str(what).split())
    return f"{where}: {msg}" if where else msg


def _file_in_the_way(path: str) -> str | None:
    """The deepest existing part of ``path`` when it is a file where a folder was needed."""
    p = os.path.abspath(path)
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent
    return p if os.path.exists(p) and not os.path.isdir(p) else None


def disk_nearly_full(path: str, below: int = 1 << 20) -> bool:
    """Whether the file system holding ``path`` has less than ``below`` bytes free."""
    import shutil

    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free < below
    except OSError:
        return False


_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


def os_error_in(exc: BaseException, path: str | os.PathLike) -> OSError | None:
    """An ``OSError`` naming ``path`` for a storage fault that a library reports as its own
    exception type (safetensors' Rust writer says ``… No space left on device (os error 28)``),
    so the CLI prints it as one line; None when ``exc`` carries no operating-system error."""
    found = _OS_ERROR_IN_TEXT.search(str(exc))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))
