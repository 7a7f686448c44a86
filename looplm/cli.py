"""`looplm <command>`: the command-line entry point.

Each command lives in ``looplm/commands/<name>.py`` (or an analysis package's ``command.py``) and
exposes ``register(subparsers)``; they are found by scanning (:func:`command_modules`), in the
order of their names.
Bad input (:class:`looplm.errors.LoopLMError`) becomes one line on stderr and exit status 2,
never a traceback; a storage fault (``OSError``: full disk, read-only folder, no permission)
becomes one line naming the path and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from looplm.errors import LoopLMError, describe_os_error
from looplm.settings.plugins import command_modules
from looplm.signals import Interrupted

COMMAND_MODULES = command_modules()


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every registered command."""
    parser = argparse.ArgumentParser(
        prog="looplm", description="Looped (depth-recurrent) Transformer LMs with SCSE."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for name in _plugin_commands():
        importlib.import_module(name).register(sub)
    return parser


def _plugin_commands() -> list[str]:
    """Plugin modules (``$LOOPLM_PLUGINS``) that bring a command: those that define a function
    ``register(subparsers)`` of their own.
    A plugin analysis is then one module: its settings, kind, report section and command."""
    from looplm.settings.plugins import plugin_modules

    out = []
    for name in plugin_modules():
        try:
            module = importlib.import_module(name)
        except Exception:  # the registries name a broken plugin in one line when it is used
            continue
        register = getattr(module, "register", None)
        # its own register(subparsers), not a registry's decorator it imported
        if callable(register) and getattr(register, "__module__", None) == name:
            out.append(name)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``key=value`` settings may also follow an option.

    ``looplm train CFG out_dir=X --resume train.steps=20``: argparse stops filling a positional
    list at the first option, so the settings after it come back unparsed; they join the
    command's ``key=value`` list (``overrides`` or ``settings``). Anything else is an error.
    """
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        dest = next((d for d in _KEY_VALUE_LISTS if isinstance(getattr(args, d, None), list)), None)
        if dest is None or any(a.startswith("-") or "=" not in a for a in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        setattr(args, dest, [*getattr(args, dest), *rest])
    return args


_KEY_VALUE_LISTS = ("overrides", "settings")


STDOUT = "standard output"


class _NamedStdout:
    """``sys.stdout`` whose write faults (``> /dev/full``, a full disk) name it, so the error
    line says where the results were being written."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def _named(self, exc: OSError) -> OSError:
        if isinstance(exc, BrokenPipeError) or exc.filename is not None:
            return exc
        return OSError(exc.errno, exc.strerror, STDOUT)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._named(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._named(exc) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _silence_stdout() -> None:
    """Keep Python's exit-time flush of a failed stdout from printing a second error."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.__stdout__.fileno())
    except (OSError, AttributeError, ValueError):  # no real file descriptor (captured output)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    args = parse_args(argv)
    real = sys.stdout
    sys.stdout = _NamedStdout(real)
    try:
        return _run(args)
    finally:
        sys.stdout = real


def _run(args: argparse.Namespace) -> int:
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe (``| head``) surfaces here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away: stop quietly, as ``cat`` does, and keep Python's exit-time flush
        # of the same buffer from printing a second traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except LoopLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # storage faults (full disk, read-only folder, no permission): one line naming the path;
        # whatever was finished before the fault (checkpoints, store rows, printed results) stays
        if exc.filename == STDOUT:
            print(
                f"error: {describe_os_error(exc)}: the printed results are incomplete (where the "
                "command has --out FILE, it writes them to a file)",
                file=sys.stderr,
            )
            _silence_stdout()
            return 1
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Interrupted as exc:  # SIGTERM / Ctrl-C stopped a command that trains several models
        print(exc.describe(), file=sys.stderr)
        return exc.exit_status


if __name__ == "__main__":
    sys.exit(main())
