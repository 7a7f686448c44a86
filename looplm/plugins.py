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

    def items(self) -> dict[str, type[T]]:
        """Every registered class by name (plugins loaded)."""
        if not self._plugins_loaded:
            self._plugins_loaded = True
            load_plugins(self.group)
        return self._items


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
    """``looplm.<package>.<leaf>`` for every package of looplm that has a module ``<leaf>``
    (``command``, ``kind``, ``section``): an analysis that lives in one package brings its
    command, its evaluation kind and its report section this way (found, not listed)."""
    import looplm

    root = list(looplm.__path__)
    names = []
    for info in sorted(pkgutil.iter_modules(root), key=lambda m: m.name):
        if not info.ispkg or info.name.startswith("_"):
            continue
        sub = [str(p) + "/" + info.name for p in root]
        if any(m.name == leaf for m in pkgutil.iter_modules(sub)):
            names.append(f"looplm.{info.name}.{leaf}")
    return names


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
