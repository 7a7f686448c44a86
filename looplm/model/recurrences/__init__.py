"""Registered recurrences. Importing a module registers its methods."""

from looplm.model.recurrences import adapters, controls, gated, hyper, looped, scse  # noqa: F401
from looplm.model.recurrences.base import (
    LoopContext,
    Recurrence,
    build_recurrence,
    get_recurrence_class,
    recurrence_names,
    register,
)

__all__ = [
    "LoopContext",
    "Recurrence",
    "build_recurrence",
    "get_recurrence_class",
    "recurrence_names",
    "register",
]
