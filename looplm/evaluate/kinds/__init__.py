"""Evaluation kinds: every module in this folder registers its kind when imported.

The folder is scanned (no import list to edit); see :mod:`looplm.evaluate.kinds.base` for the
contract and :mod:`looplm.plugins` for kinds that live outside looplm.
"""

from looplm.evaluate.kinds.base import (
    EvalJob,
    EvaluationKind,
    check_keys,
    configure_kinds,
    evaluate_keys,
    evaluation_kinds,
    get_kind,
    kind_names,
    register_kind,
)
from looplm.plugins import import_submodules

import_submodules(__name__, __path__)

__all__ = [
    "EvalJob",
    "EvaluationKind",
    "check_keys",
    "configure_kinds",
    "evaluate_keys",
    "evaluation_kinds",
    "get_kind",
    "kind_names",
    "register_kind",
]
