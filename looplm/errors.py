"""The one exception type for bad user input.

Every error a user can cause (unknown method, bad config key, missing data, corrupt checkpoint,
T < 1, sequence longer than the context) is raised as :class:`LoopLMError` with a message that names
the bad value and what is allowed. The CLI prints it as one line and exits with status 2.
"""

from __future__ import annotations


class LoopLMError(ValueError):
    """Bad input from the user; the message says what was wrong and what is allowed."""


def check_choice(kind: str, value: object, allowed: list[str] | tuple[str, ...]) -> None:
    """Raise LoopLMError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise LoopLMError(f"unknown {kind} {value!r}; allowed: {', '.join(map(str, allowed))}")


def check_positive_int(name: str, value: object) -> None:
    """Raise LoopLMError unless ``value`` is an int ≥ 1 (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoopLMError(f"{name}={value!r} must be a positive integer")
