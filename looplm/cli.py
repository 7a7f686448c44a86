"""`looplm <command>`: the command-line entry point.

Each command lives in ``looplm/commands/<name>.py`` and exposes ``register(subparsers)``.
Bad input (:class:`looplm.errors.LoopLMError`) becomes one line on stderr and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from looplm.errors import LoopLMError

COMMAND_MODULES = [
    "looplm.commands.train",
    "looplm.commands.evaluate",
    "looplm.commands.demo",
    "looplm.commands.data",
    "looplm.commands.methods",
    "looplm.commands.report",
    "looplm.commands.adaptive",
    "looplm.commands.sweep",
    "looplm.commands.diagnose",
    "looplm.commands.generate",
    "looplm.commands.export",
]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every registered command."""
    parser = argparse.ArgumentParser(
        prog="looplm", description="Looped (depth-recurrent) Transformer LMs with SCSE."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LoopLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
