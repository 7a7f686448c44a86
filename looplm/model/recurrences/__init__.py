"""Registered recurrences: every module in this folder registers its methods when imported.

The folder is scanned (no import list to edit): adding a method is adding one file here, or one
module outside looplm named by an entry point (group ``looplm.recurrences``) or by
``$LOOPLM_PLUGINS`` (see :mod:`looplm.settings.plugins`).
"""

from looplm.model.recurrences.base import (
    LoopContext,
    Recurrence,
    build_recurrence,
    get_recurrence_class,
    recurrence_names,
    register,
)
from looplm.settings.plugins import import_submodules

import_submodules(__name__, __path__)

__all__ = [
    "LoopContext",
    "Recurrence",
    "build_recurrence",
    "get_recurrence_class",
    "recurrence_names",
    "register",
]
