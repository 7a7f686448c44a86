"""Stopping a command that trains several models: SIGTERM and Ctrl-C stop the whole command.

A training (:func:`looplm.training.loop.fit`) catches SIGTERM/SIGINT itself, writes a checkpoint and
returns ``stopped="signal"``; a command that trains one model after another (``looplm demo``) must
then stop too instead of going on with the next model. :func:`stop_on_signals` makes the signals
raise :class:`Interrupted` outside a training, :func:`raise_if_stopped` turns a training that a
signal ended into the same exception, and the CLI exits with the shell's status for the signal
(130 for Ctrl-C, 143 for SIGTERM), keeping whatever was finished.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class Interrupted(Exception):
    """A signal stopped the command; ``signum`` is its number, the message says what was kept."""

    def __init__(self, signum: int, kept: str = "") -> None:
        self.signum = int(signum)
        self.kept = kept
        super().__init__(self.describe())

    def describe(self) -> str:
        name = signal.Signals(self.signum).name
        return f"interrupted by {name}" + (f"; {self.kept}" if self.kept else "")

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """For the block, SIGTERM and SIGINT raise :class:`Interrupted` (a training inside installs
    its own handlers for its length and hands the signal back through :func:`raise_if_stopped`)."""

    def stop(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def raise_if_stopped(last: dict[str, Any]) -> None:
    """Raise :class:`Interrupted` when ``fit``'s last metrics say a signal ended the training."""
    if last.get("stopped") == "signal":
        raise Interrupted(int(last.get("signal") or signal.SIGTERM))


class StopFlag:
    """SIGTERM / SIGINT during a training (installed as their handler): the first one asks the
    loop to stop after the step (checkpoint written); a second one — or any while ``now`` is set
    (the final validation, run after the checkpoint is written) — stops at once by raising
    :class:`Interrupted`."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.now = False

    def __call__(self, signum: int, frame: Any) -> None:
        first = self.signal is None
        self.signal = signum
        if self.now or not first:
            raise Interrupted(signum)

    def stopped(self) -> bool:
        return self.signal is not None

    def at_once(self) -> None:
        """From now on a signal stops at once (raises); one already received does so now."""
        self.now = True
        if self.signal is not None:
            raise Interrupted(self.signal)
