"""The command line of a settings dataclass: options generated from its fields.

:func:`add_options` gives every field of a settings dataclass (:mod:`looplm.settings`) an option
``--field-name`` (plus the names in its ``setting(flags=...)``, today's names where they differ):
its type from the annotation, its choices and default from the field, its help from the field's
comment. A boolean gets ``--x`` / ``--no-x``; a sequence is written comma-separated (``24,48``,
loop depths also as ranges ``1-48``; ``''`` for none). :func:`from_args` reads the parsed values
back into an instance through :func:`looplm.settings.build_settings`, so a command, a sweep kind
and a library call check the same ranges and give the same one-line errors (naming the option).

No option is written twice: a command is ``add_options(p, XSettings)`` plus its positional
inputs, and ``from_args(XSettings, args)`` is the object the library function takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from argparse import SUPPRESS
from typing import Any

from looplm.errors import LoopLMError
from looplm.settings import UNION_TYPES, build_settings, field_comments, parse_ints

ALLOW_LARGE = "allow_large"


def flag(name: str) -> str:
    """The option of the field ``name``: ``tuned_steps`` → ``--tuned-steps``."""
    return "--" + name.replace("_", "-")


def _base(typ: Any) -> tuple[Any, bool]:
    """(the annotation without ``| None``, whether None is allowed)."""
    if typing.get_origin(typ) in UNION_TYPES:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return typ, False


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "''"
    return (
        "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def _sequence_of(typ: Any) -> Any | None:
    """The item type of a sequence annotation (``tuple[int, ...]`` → int), else None."""
    if typing.get_origin(typ) in (tuple, list):
        args = [a for a in typing.get_args(typ) if a is not Ellipsis]
        return args[0] if args else str
    return None


def parse_sequence(text: str, item: Any, option: str) -> list[Any]:
    """``"24,48"`` → ``[24, 48]`` (integers also as ranges ``1-48``; ``''`` → ``[]``)."""
    if not text.strip():
        return []
    if item is int:
        return parse_ints(text, option)
    if item is float:
        try:
            return [float(x) for x in text.split(",")]
        except ValueError:
            raise LoopLMError(f"{option} {text!r}: expected comma-separated numbers") from None
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_text(text: str, typ: Any, option: str) -> Any:
    """An option's text as the field's type ``typ`` (one-line LoopLMError when it is not)."""
    item = _sequence_of(typ)
    if item is not None:
        return parse_sequence(text, item, option)
    if typ is int:
        try:
            return int(text)
        except ValueError:
            raise LoopLMError(f"{option} {text!r}: expected an integer") from None
    if typ is float:
        try:
            value = float(text)
        except ValueError:
            raise LoopLMError(f"{option} {text!r}: expected a number") from None
        if not math.isfinite(value):
            raise LoopLMError(f"{option} {text} is not a finite number")
        return value
    return text


def add_options(p: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One option (or positional argument) per field of ``cls`` (see the module docstring)."""
    hints = typing.get_type_hints(cls)
    helps = field_comments(cls)
    capped = False
    for f in dataclasses.fields(cls):
        meta = f.metadata or {}
        if f.name in skip or not meta.get("cli", True) or dataclasses.is_dataclass(hints[f.name]):
            continue
        capped = capped or meta.get("cap") is not None
        typ, _optional = _base(hints[f.name])
        default = _default(f)
        text = helps.get(f.name, "")
        if meta.get("positional"):
            seq = _sequence_of(typ) is not None
            p.add_argument(f.name, nargs="+" if seq else None, help=text,
                           metavar=f.name.upper().rstrip("S"))  # fmt: skip
            continue
        names = [flag(f.name), *meta.get("flags", ())]
        required = default is dataclasses.MISSING
        if not required and default is not None and "(default" not in text:
            text = f"{text} (default: {_shown(default)})"
        kw: dict[str, Any] = {"dest": f.name, "help": text.replace("%", "%%")}
        if typ is bool:
            p.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, **kw)
            continue
        # values stay text here and are read by from_args: a bad one is a one-line error naming
        # the option and what is allowed, as in a YAML file (argparse would print its usage)
        kw["default"] = None if required else default
        if _sequence_of(typ) is not None:
            kw["metavar"] = "A,B,..."
            if meta.get("spaced"):  # the items as separate words too: --split valid test
                kw.update(nargs="+", action="extend", metavar=f.name.upper())
        elif meta.get("choices") is not None:
            kw["metavar"] = "{" + ",".join(str(c) for c in meta["choices"]) + "}"
        else:
            kw["metavar"] = {int: "N", float: "X"}.get(typ, "TEXT")
        p.add_argument(*names, required=required, **kw)
        for old in meta.get("renamed", ()):  # an old name: accepted for one release, with a note
            p.add_argument(flag(old), dest=f.name, action=_Renamed, new=names[0], help=SUPPRESS)
    if capped and "--allow-large" not in p._option_string_actions:  # once per command
        p.add_argument(
            "--allow-large",
            dest=ALLOW_LARGE,
            action="store_true",
            help="accept values above a setting's usual cap (loop depths, steps, samples)",
        )


class _Renamed(argparse.Action):
    """An option's old name: stores the value under the new one and says so on stderr."""

    def __init__(self, *args: Any, new: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import sys

        print(f"note: {option_string} is now {self.new} (the old name goes in a later release)",
              file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def from_args(cls: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The instance of ``cls`` the parsed options ``args`` describe (``fixed`` values override
    them: what a command works out itself, e.g. a depth read from the checkpoint), checked
    like any other settings with errors that name the option."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        read = (f.metadata or {}).get("parse")
        if (f.metadata or {}).get("spaced") and isinstance(value, list):
            value = ",".join(value)  # words and comma-separated items read alike
        if isinstance(value, str):
            value = (
                read(value, flag(f.name))
                if read
                else parse_text(value, _base(hints[f.name])[0], flag(f.name))
            )
        values[f.name] = value
    values.update(fixed)
    return build_settings(
        cls,
        values,
        "",
        name=lambda k: flag(k) if k not in fixed else k,
        large=bool(getattr(args, ALLOW_LARGE, False)) or None,
    )
