"""looplm: looped (depth-recurrent, weight-shared) Transformer LMs built around SCSE."""

from looplm.errors import LoopLMError
from looplm.model import LoopedLM, UnsharedLM, build_model, model_from_config, recurrence_names

__version__ = "0.1.0"

__all__ = [
    "LoopLMError",
    "LoopedLM",
    "UnsharedLM",
    "__version__",
    "build_model",
    "model_from_config",
    "recurrence_names",
]
