"""looplm: looped (depth-recurrent, weight-shared) Transformer LMs built around SCSE.

Attributes and subpackages (``looplm.data``, ``looplm.results``, …) are resolved lazily, so light
modules (the results store, reports) import without loading torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from looplm.errors import LoopLMError

__version__ = "0.1.0"

_LAZY = {
    "LoopedLM": "looplm.model",
    "UnsharedLM": "looplm.model",
    "build_model": "looplm.model",
    "model_from_config": "looplm.model",
    "recurrence_names": "looplm.model",
    "flops": "looplm.model.accounting",
    "from_pretrained": "looplm.model.families",
    "import_pretrained": "looplm.model.families",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    # Subpackages and modules load on first use too: ``import looplm; looplm.data.CORPORA``.
    if not name.startswith("_") and importlib.util.find_spec(f"looplm.{name}") is not None:
        return importlib.import_module(f"looplm.{name}")
    raise AttributeError(f"module 'looplm' has no attribute {name!r}")


__all__ = ["LoopLMError", "__version__", *_LAZY]
