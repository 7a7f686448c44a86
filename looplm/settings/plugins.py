"""Finding registered components without hand-kept import lists.

Recurrences (``looplm/model/recurrences/``) and evaluation kinds (``looplm/evaluate/kinds/``)
register themselves when their module is imported. A package's own modules are found by a
package scan (:func:`import_submodules`); modules outside looplm come in two ways
(:func:`load_plugins`):

* an entry point of an installed distribution, in the group ``looplm.recurrences`` or
  ``looplm.evaluations`` (its value names the module, e.g.
  ``mymethod = "my_pkg.mymethod"`` under ``[project.entry-points."looplm.recurrences"]``);
* ``LOOPLM_PLUGINS``: comma-separated module names to import, e.g.
  ``LOOPLM_PLUGINS=my_pkg.mymethod looplm methods``.

A plugin that does not import is a one-line :class:`LoopLMError` naming it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Iterable
from pathlib import Path
from typing import Generic, TypeVar

from looplm.errors import LoopLMError

ENV_VAR = "LOOPLM_PLUGINS"
_loaded: set[str] = set()
T = TypeVar("T")


class Registry(Generic[T]):
    """Classes of one kind by name (``cls.name``), added by the :meth:`register` decorator.

    The plugins of entry-point ``group`` (and ``$LOOPLM_PLUGINS``) are imported on the first
    lookup, not when the registry is created: a plugin module may itself import the package
    that holds the registry.
    """

    def __init__(self, what: str, group: str) -> None:
        self.what, self.group = what, group
        self._items: dict[str, type[T]] = {}
        self._plugins_loaded = False

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: add ``cls`` under ``cls.name`` (a second class of that name fails)."""
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{cls.__name__} has no name")
        if name in self._items and self._items[name] is not cls:
            raise ValueError(f"{self.what} {name!r} registered twice")
        self._items[name] = cls
        return cls

    def items(self, *, plugins: bool = True) -> dict[str, type[T]]:
        """Every registered class by name (plugins loaded; ``plugins=False``: only those
        registered so far, without importing any plugin — for lists made at import time)."""
        if plugins and not self._plugins_loaded:
            self._plugins_loaded = True
            load_plugins(self.group)
        return self._items


def lazy_attributes(module: str, table: dict[str, str]):
    """A package's ``__getattr__`` (PEP 562) that imports ``table[name]`` (a module name) on the
    first use of ``name``: a light package face, so that ``looplm --help`` does not load torch."""

    def __getattr__(name: str):
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    __getattr__.table = table  # type: ignore[attr-defined]  # where each name lives
    return __getattr__


def import_submodules(package: str, path: Iterable[str], skip: Iterable[str] = ()) -> list[str]:
    """Import every module of ``package`` (found on its ``__path__``) not named in ``skip`` or
    starting with ``_``; returns their names."""
    names = []
    for info in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in set(skip):
            continue
        importlib.import_module(f"{package}.{info.name}")
        names.append(info.name)
    return names


def analysis_modules(leaf: str) -> list[str]:
    """``looplm.<package>.<leaf>`` for every package of looplm (at any depth, e.g.
    ``looplm.lens`` or ``looplm.experiments.findings``) that has a module ``<leaf>`` (``command``,
    ``kind``, ``section``): an analysis that lives in one package brings its command, its
    evaluation kind and its report section this way (found, not listed). Read from the files, so
    nothing is imported to find them."""
    import looplm

    names = []
    for root in looplm.__path__:
        for init in sorted(Path(root).rglob("__init__.py")):
            folder = init.parent
            rel = folder.relative_to(root).parts
            if not rel or any(p.startswith(("_", ".")) for p in rel):
                continue
            if (folder / f"{leaf}.py").is_file():
                names.append(".".join(("looplm", *rel, leaf)))
    return sorted(set(names))


def command_modules() -> list[str]:
    """Every command's module, found by scanning (no list to edit): the modules of
    ``looplm/commands/`` and each analysis package's ``command`` module (``looplm/lens/
    command.py``), in one alphabetical list (an analysis package's command sorts by the package's
    name). A command module defines ``register(subparsers)``."""
    import looplm

    here = [
        f"looplm.commands.{m.name}"
        for m in pkgutil.iter_modules([str(Path(p) / "commands") for p in looplm.__path__])
        if not m.name.startswith("_")
    ]
    return sorted(
        here + analysis_modules("command"),
        key=lambda m: m.split(".")[-2 if m.endswith(".command") else -1],
    )


def command_settings() -> list[tuple[str, list[type]]]:
    """(title, settings classes) of every command whose options are made from settings.

    A module with one command names its classes in ``SETTINGS = (XSettings, …)``; a module with
    several commands or subcommands maps each command's words to its classes
    (``SETTINGS = {"data prepare": (PrepareSettings,), …}``)."""
    import importlib

    from looplm.settings.plugins import command_modules

    out = []
    for name in command_modules():
        module = importlib.import_module(name)
        settings = getattr(module, "SETTINGS", ())
        if isinstance(settings, dict):
            out += [(f"looplm {words}", list(classes)) for words, classes in settings.items()]
            continue
        classes = list(settings)
        if classes:
            command = (module.__doc__ or "").split("`")[1].split()[:2]
            out.append((" ".join(command) if command and command[0] == "looplm" else name, classes))
    return out


def plugin_modules() -> list[str]:
    """Module names listed in ``$LOOPLM_PLUGINS`` (commas or whitespace between them)."""
    raw = os.environ.get(ENV_VAR, "")
    return [m for m in raw.replace(",", " ").split() if m]


def _import(module: str, where: str) -> None:
    if module in _loaded:
        return
    _loaded.add(module)  # before importing: a plugin may query the registry while it loads
    try:
        importlib.import_module(module)
    except Exception as exc:
        raise LoopLMError(
            f"plugin module {module!r} ({where}) does not import: {type(exc).__name__}: {exc}"
        ) from None


def load_plugins(group: str) -> None:
    """Import the modules named in ``$LOOPLM_PLUGINS`` and the entry points of ``group``
    (each at most once per process)."""
    for module in plugin_modules():
        _import(module, f"from ${ENV_VAR}")
    import importlib.metadata  # here, not at import: the command line starts without it

    for ep in importlib.metadata.entry_points(group=group):
        _import(ep.module, f"entry point {ep.name!r} of group {group!r}")
