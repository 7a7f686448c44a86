"""Settings as dataclasses: one way to read, validate and document them.

Every group of settings looplm reads — run configs (:mod:`looplm.settings.config`), a method's own
settings (a recurrence's ``Config``), experiment grids (:mod:`looplm.experiments.grid`) and the sections of
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

UNION_TYPES = (typing.Union, getattr(types, "UnionType", typing.Union))


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
    if origin in UNION_TYPES:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for i, t in enumerate(inner):  # the first type the value fits
            try:
                return coerce(value, t, key)
            except LoopLMError:
                if i == len(inner) - 1:
                    raise
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise LoopLMError(f"{key}={value!r} must be a list")
        if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed-length tuple
            if len(value) != len(args):
                raise LoopLMError(f"{key}={value!r} must have {len(args)} items")
            return tuple(coerce(v, t, key) for v, t in zip(value, args, strict=True))
        items = [coerce(v, args[0], key) for v in value] if args else list(value)
        return tuple(items) if origin is tuple else items
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
    name: Callable[[str], str] | None = None,
    large: bool | None = None,
) -> Any:
    """An instance of the dataclass ``cls`` from the mapping ``values``, validated.

    Keys are named ``<prefix>.<key>`` in errors ("unknown <noun> <prefix>.<key>; allowed: …",
    or ``unknown(key, allowed)``; ``name(key)`` when given, e.g. the option ``--key``); nested
    dataclass fields are built the same way; each value is checked against its field's range,
    cap and choices (:func:`setting`; ``large`` lifts the caps), and the instance's
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
    by_name = {f.name: f for f in fields}
    # a field marked raises_ceiling raises the loop ceiling of the loop depths beside it
    # (``--max-loops``), so it is read first
    over = [f.name for f in fields if (f.metadata or {}).get("raises_ceiling")]
    max_loops = values.get(over[0]) if over else None
    if max_loops is not None:
        key = name(over[0]) if name else f"{prefix}.{over[0]}".lstrip(".")
        max_loops = coerce(max_loops, hints[over[0]], key)
        check_field(by_name[over[0]], max_loops, key)
    for k, v in values.items():
        typ, key = hints[k], name(k) if name else f"{prefix}.{k}".lstrip(".")
        if dataclasses.is_dataclass(typ):
            if not isinstance(v, dict):
                raise LoopLMError(f"{key} must be a mapping")
            kwargs[k] = build_settings(typ, v, key, noun=noun, large=large)
        else:
            kwargs[k] = coerce(v, typ, key)
            check_field(by_name[k], kwargs[k], key, large=large, max_loops=max_loops,
                        offer_flag=bool(over))  # fmt: skip
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
            if comment:  # comment lines right below continue an unclosed "(" (mid-sentence)
                j = node.end_lineno
                while (
                    j < len(lines)
                    and lines[j].strip().startswith("#")
                    and comment.count("(") > comment.count(")")
                ):
                    comment += " " + lines[j].strip().lstrip("#").strip()
                    j += 1
            else:
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


def allowed_text(f: dataclasses.Field) -> str:
    """A field's allowed values in words (``1..4096``, ``>= 0, usual cap 512``, ``a | b``), or ''."""
    meta = f.metadata or {}
    parts = []
    if meta.get("choices") is not None:
        parts.append(" \\| ".join(str(c) for c in meta["choices"]))
    lo, hi, cap = meta.get("lo"), meta.get("hi"), meta.get("cap")
    if lo is not None and hi is not None:
        parts.append(f"{_num(lo)}..{_num(hi)}")
    elif lo is not None:
        parts.append(f">= {lo:g}")
    elif hi is not None:
        parts.append(f"<= {hi:g}")
    if cap is not None:
        parts.append(f"usual cap {cap:g}")
    if meta.get("loops"):
        parts.append("at most the loop ceiling (256, `LOOPLM_MAX_LOOPS`)")
    return ", ".join(parts)


def settings_table(
    cls: type, prefix: str = "", *, key: Callable[[str], str] | None = None
) -> list[str]:
    """Markdown rows ``| key | type | default | meaning |`` for the fields of ``cls`` (nested
    dataclass fields are left out: they get tables of their own; ``key(name)`` names a field,
    e.g. as its option). The meaning ends with the allowed values where the field states them
    (:func:`setting`). A field without a comment is a LoopLMError: every setting is documented."""
    meaning = field_comments(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) or (key and not f.metadata.get("cli", True)):
            continue
        if not meaning.get(f.name):
            raise LoopLMError(f"setting {prefix}{f.name} of {cls.__name__} has no comment")
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        name = key(f.name) if key else f"{prefix}{f.name}"
        text = _cell(meaning[f.name])
        allowed = allowed_text(f)
        if allowed:
            text += f" (allowed: {allowed})"
        rows.append(f"| `{name}` | `{_cell(typ)}` | `{_cell(_default(f))}` | {text} |")
    return rows


# ----------------------------------------------------------------------------- fields and ranges
LARGE_ENV = "LOOPLM_ALLOW_LARGE"  # set to 1 to lift every soft cap (as ``--allow-large`` does)


def setting(
    default: Any = dataclasses.MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    cap: float | None = None,
    choices: tuple[Any, ...] | None = None,
    flags: tuple[str, ...] = (),
    positional: bool = False,
    cli: bool = True,
    what: str = "",
    loops: bool = False,
    raises_ceiling: bool = False,
    parse: Callable[[str, str], Any] | None = None,
    renamed: tuple[str, ...] = (),
    spaced: bool = False,
) -> Any:
    """A settings field with what the command line and the checks need to know about it.

    ``lo``/``hi`` bound the value (a sequence: every item) — out of range is an error naming the
    range; ``cap`` is a soft upper bound for values that cost compute linearly or worse (loop
    depths, steps): above it the settings are refused unless ``--allow-large`` (or
    ``LOOPLM_ALLOW_LARGE=1``) says the large value is meant. ``choices`` lists the allowed
    values; ``flags`` are further option names (today's names where the field's own differs);
    ``positional`` makes it a positional argument; ``cli=False`` keeps it off the command line;
    ``what`` names the quantity in range errors ("the loop depth T"); ``parse(text, option)``
    reads the option's text where the type alone does not say how (loop depths: ``1-48,96``);
    ``loops`` marks a loop depth, checked against the loop ceiling
    (:func:`looplm.settings.limits.check_ceiling`: 256, raised by a field of the same settings marked
    ``raises_ceiling`` — ``--max-loops`` — or ``LOOPLM_MAX_LOOPS``; lifted by ``--allow-large``
    like a cap). ``renamed``: the setting's old names (``max_new``), still accepted for one release
    with a one-line note. ``spaced``: a sequence option that also takes its items as separate
    words (``--split valid test`` as well as ``--split valid,test``), for an option that always
    did. The field's comment is its help, as everywhere else."""
    meta = {"lo": lo, "hi": hi, "cap": cap, "choices": choices, "flags": flags,
            "positional": positional, "cli": cli, "what": what, "loops": loops,
            "raises_ceiling": raises_ceiling, "parse": parse, "renamed": renamed,
            "spaced": spaced}  # fmt: skip
    if isinstance(default, (list, dict, set)):
        value = copy.deepcopy(default)
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def allow_large() -> bool:
    """Whether soft caps are lifted (``LOOPLM_ALLOW_LARGE=1``)."""
    import os

    return os.environ.get(LARGE_ENV) == "1"


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_field(
    f: dataclasses.Field,
    value: Any,
    key: str,
    *,
    large: bool | None = None,
    max_loops: int | None = None,
    offer_flag: bool = False,
) -> None:
    """``value`` against ``f``'s range, cap, choices and (a loop depth) the loop ceiling
    (``max_loops`` raises it; ``offer_flag``: the error may suggest ``--max-loops``); a
    one-line LoopLMError naming ``key``."""
    meta = f.metadata
    if value is None or not meta:
        return
    _check_range(meta, value, key, large)
    if meta.get("loops") and not (allow_large() if large is None else large):
        from looplm.settings.limits import check_ceiling

        depths = [v for v in _items(value) if isinstance(v, int) and not isinstance(v, bool)]
        check_ceiling(key, depths, max_loops, offer_flag and key.startswith("--"))


def _num(x: float) -> str:
    """An integer as written (every digit: a seed), a float in short form."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _check_range(meta: Any, value: Any, key: str, large: bool | None) -> None:
    lo, hi, cap, choices = meta.get("lo"), meta.get("hi"), meta.get("cap"), meta.get("choices")
    sep = " " if key.startswith("--") else "="  # an option reads as typed: --loops 0
    for v in _items(value):
        if choices is not None and v not in choices:
            allowed = ", ".join(str(c) for c in choices)
            raise LoopLMError(f"{key}={v!r}; allowed: {allowed}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            lo_s = "" if lo is None else _num(lo)
            hi_s = "" if hi is None else _num(hi)
            span = f"{lo_s}..{hi_s}" if lo_s and hi_s else (f">= {lo_s}" if lo_s else f"<= {hi_s}")
            words = f"in {span}" if ".." in span else span
            if isinstance(v, int) and hi is None and lo in (0, 1):  # the usual words for counts
                words = "a positive integer" if lo == 1 else "an integer >= 0"
            what = f" ({meta['what']} must be {span})" if meta.get("what") else ""
            if not what and words == "a positive integer":
                what = " (>= 1)"  # the range, named as every range error names it
            raise LoopLMError(f"{key}{sep}{_num(v)} must be {words}{what}")
        if cap is not None and v > cap and not (allow_large() if large is None else large):
            raise LoopLMError(
                f"{key}{sep}{v:g} is above the usual cap {cap:g} (it costs time in proportion); "
                f"pass --allow-large or set {LARGE_ENV}=1 if it is meant"
            )


def check_fields(obj: Any, prefix: str = "", *, large: bool | None = None) -> None:
    """Every field of the settings instance ``obj`` against its range, cap and choices."""
    fields = dataclasses.fields(obj)
    over = [getattr(obj, f.name) for f in fields if (f.metadata or {}).get("raises_ceiling")]
    max_loops = over[0] if over else None
    for f in fields:
        check_field(f, getattr(obj, f.name), f"{prefix}{f.name}", large=large, max_loops=max_loops)


def defaults(cls: type) -> dict[str, Any]:
    """``{field: default}`` of the settings dataclass ``cls`` (required fields left out)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


MAX_RANGE = 1_000_000  # values one ``a-b`` range may spell out


def parse_ints(text: str, what: str = "--depths") -> list[int]:
    """'4,8,12' → [4, 8, 12]; ranges too: '1-4,8' → [1, 2, 3, 4, 8] (an empty item is an error
    naming ``what``)."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                raise LoopLMError(
                    f"{what} {text!r}: empty item between commas; give integers or ranges "
                    "like 1,2,4 or 1-48"
                )
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else ("", "")
                a, b = int(lo), int(hi)
                if b < a:
                    raise LoopLMError(f"{what} {text!r}: range {part!r} runs backwards")
                if b - a >= MAX_RANGE:  # refused before it is spelled out
                    raise LoopLMError(
                        f"{what} {b}: range {part!r} is out of range; a range spans at most "
                        f"{MAX_RANGE:,} values"
                    )
                out.extend(range(a, b + 1))
            else:
                out.append(int(part))
    except LoopLMError:  # a ValueError too: keep its own message
        raise
    except ValueError:
        raise LoopLMError(
            f"{what} {text!r}: expected comma-separated integers or ranges like 1-48"
        ) from None
    return out


def parse_depths(text: str, what: str = "--depths") -> list[int]:
    """Loop depths from text (:func:`parse_ints`); every depth must be >= 1."""
    depths = parse_ints(text, what)
    if not depths or any(d < 1 for d in depths):
        raise LoopLMError(f"{what} {text!r}: loop depths must be integers >= 1")
    return depths


def depth_list(value: Any, where: str, *, ceiling: bool = True) -> list[int]:
    """Depths from a config value: a list, an integer or a string like ``1-48,96``; each at most
    the loop ceiling (:func:`looplm.settings.limits.check_ceiling`; a grid has no ``--max-loops``, so the
    error names ``LOOPLM_MAX_LOOPS``) unless ``ceiling`` is False (a field that checks it)."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, int):
        value = str(value)
    elif isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise LoopLMError(f"{where}={value!r}: give a list of depths or a string like 1-48")
    depths = parse_depths(value)
    if ceiling:
        from looplm.settings.limits import check_ceiling

        check_ceiling(where, depths, offer_flag=False)
    return depths
