"""Models: the shared block, the looped LM and its recurrences, the unshared control, halting,
checkpoints and the foreign checkpoint families. The package's face is light (attributes load on
first use), so the command line can list halting rules and methods without loading torch."""

from looplm.settings.plugins import lazy_attributes

__getattr__ = lazy_attributes(
    __name__,
    {
        "Block": "looplm.model.block",
        "LanguageModelBase": "looplm.model.lm",
        "LoopOutput": "looplm.model.lm",
        "LoopStep": "looplm.model.lm",
        "LoopedLM": "looplm.model.lm",
        "UnsharedLM": "looplm.model.unshared",
        "build_model": "looplm.model.build",
        "model_from_config": "looplm.model.build",
        "recurrence_names": "looplm.model.recurrences",
    },
)

__all__ = [
    "Block",
    "LoopOutput",
    "LoopStep",
    "LoopedLM",
    "UnsharedLM",
    "build_model",
    "model_from_config",
    "recurrence_names",
]
