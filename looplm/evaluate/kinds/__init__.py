"""Evaluation kinds: every module in this folder registers its kind when imported.

The folder is scanned, and so is every analysis package's ``kind`` module (``looplm/lens/kind.py``;
no import list to edit); see :mod:`looplm.evaluate.kinds.base` for the
contract and :mod:`looplm.settings.plugins` for kinds that live outside looplm.
"""

import importlib

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
from looplm.settings.plugins import analysis_modules, import_submodules

import_submodules(__name__, __path__)
for _module in analysis_modules("kind"):  # an analysis package's own kind (looplm/lens/kind.py)
    importlib.import_module(_module)

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
