"""Settings as dataclasses: one way to read, validate and document them.

Every group of settings looplm reads — run configs (:mod:`looplm.config`), a method's own
settings (a recurrence's ``Config``), experiment grids (:mod:`looplm.grid`) and the sections of
the evaluation kinds under ``evaluate:`` — is a dataclass. :func:`build_settings` turns a mapping
into one: an unknown key, a value of the wrong type or a missing required key is a one-line
:class:`LoopLMError` naming the key, the value and what is allowed, and the dataclass's own
``validate()`` then checks ranges and choices. :func:`parse_key_values` reads ``key=value``
overrides, :func:`merge` lays one mapping over another.

A field's meaning is the comment on its line (or the comment lines right above it), so the
reference :func:`settings_table` writes — ``docs/configuration.md``, ``looplm settings`` — comes
from the same source as the code that reads the settings.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

import yaml

from looplm.errors import LoopLMError, yaml_problem

_UNION_TYPES = (typing.Union, getattr(types, "UnionType", typing.Union))


class _Loader(yaml.SafeLoader):
    """YAML with only true/false as booleans: YAML 1.1 also reads on/off/yes/no as booleans,
    which turned ``train.autocast=off`` into the string 'False'."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with only true/false read as booleans (``off``, ``no`` stay strings)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def coerce(value: Any, typ: Any, key: str) -> Any:
    """``value`` as the annotated type ``typ`` (a LoopLMError naming ``key`` when it is not)."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if typ is Any:
        return value
    if origin in _UNION_TYPES:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for i, t in enumerate(inner):  # the first type the value fits
            try:
                return coerce(value, t, key)
            except LoopLMError:
                if i == len(inner) - 1:
                    raise
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise LoopLMError(f"{key}={value!r} must be a list")
        return [coerce(v, args[0], key) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise LoopLMError(f"{key}={value!r} must be a mapping")
        return dict(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise LoopLMError(f"{key}={value!r} must be true or false")
    if typ is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise LoopLMError(f"{key}={value!r} must be an integer")
        return int(value)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise LoopLMError(f"{key}={value!r} must be a number")
        if not math.isfinite(value):
            raise LoopLMError(f"{key}={value!r} must be a finite number")
        return float(value)
    if typ is str:
        return value if isinstance(value, str) else str(value)
    return value


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def build_settings(
    cls: type,
    values: Any,
    prefix: str,
    *,
    noun: str = "key",
    unknown: Callable[[str, str], str] | None = None,
) -> Any:
    """An instance of the dataclass ``cls`` from the mapping ``values``, validated.

    Keys are named ``<prefix>.<key>`` in errors ("unknown <noun> <prefix>.<key>; allowed: …",
    or ``unknown(key, allowed)``); nested dataclass fields are built the same way; the instance's
    ``validate()`` runs last when the class has one."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise LoopLMError(f"{prefix or 'settings'} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = sorted(f.name for f in fields)
    bad = sorted(set(values) - set(names))
    if bad:
        allowed = ", ".join(names) or "none"
        path = f"{prefix}.{bad[0]}".lstrip(".")
        raise LoopLMError(
            unknown(bad[0], allowed) if unknown else f"unknown {noun} {path}; allowed: {allowed}"
        )
    missing = [f.name for f in fields if _required(f) and f.name not in values]
    if missing:
        raise LoopLMError(f"{prefix or 'settings'} needs {missing[0]}")
    kwargs = {}
    for k, v in values.items():
        typ, key = hints[k], f"{prefix}.{k}".lstrip(".")
        if dataclasses.is_dataclass(typ):
            if not isinstance(v, dict):
                raise LoopLMError(f"{key} must be a mapping")
            kwargs[k] = build_settings(typ, v, key, noun=noun)
        else:
            kwargs[k] = coerce(v, typ, key)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check()
    return obj


def parse_key_values(
    items: list[str], *, what: str = "override", example: str = "train.steps=100"
) -> dict[str, Any]:
    """``["train.steps=10", "model.recurrence_args.s=0.3"]`` → a nested mapping (dotted keys
    nest; values are read as YAML, so ``true``, ``3e-4`` and ``[1, 2]`` keep their types)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise LoopLMError(f"{what} {item!r} must look like key=value (e.g. {example})")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise LoopLMError(
                f"{what} {item!r}: cannot parse value ({yaml_problem(exc)})"
            ) from None
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``upd`` laid over it (mappings merge key by key, anything else is
    replaced)."""
    out = copy.deepcopy(base)
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# ----------------------------------------------------------------------------- reference
def field_comments(cls: type) -> dict[str, str]:
    """Each field's meaning: the comment on its line, else the comment lines right above it
    (inherited fields: the nearest class in the MRO that comments them)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = src.splitlines()
        body = ast.parse(src).body[0]
        for node in getattr(body, "body", []):
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            last = lines[node.end_lineno - 1]
            comment = last.split("  # ", 1)[1].strip() if "  # " in last else ""
            if not comment:
                above, i = [], node.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#").strip())
                    i -= 1
                comment = " ".join(above)
            if comment or node.target.id not in out:
                out[node.target.id] = comment
    return out


def _default(f: dataclasses.Field) -> str:
    if _required(f):
        return "required"
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table(cls: type, prefix: str = "") -> list[str]:
    """Markdown rows ``| key | type | default | meaning |`` for the fields of ``cls`` (nested
    dataclass fields are left out: they get tables of their own). A field without a comment is
    a LoopLMError: every setting is documented."""
    meaning = field_comments(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        if not meaning.get(f.name):
            raise LoopLMError(f"setting {prefix}{f.name} of {cls.__name__} has no comment")
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(
            f"| `{prefix}{f.name}` | `{_cell(typ)}` | `{_cell(_default(f))}` | "
            f"{_cell(meaning[f.name])} |"
        )
    return rows
