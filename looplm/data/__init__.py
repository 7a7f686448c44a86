"""Real-data layer: tokenizers, corpora, token caches and batching (plain re-exports)."""

from looplm.data.cache import (
    TokenCache,
    default_cache_dir,
    get_split_tokens,
    list_caches,
    prepare,
    shared_source,
)
from looplm.data.corpora import (
    CORPORA,
    SPLITS,
    LambadaExample,
    SplitCounts,
    TargetSpan,
    available_splits,
    canonical_split,
    lambada_examples,
    load_documents,
    locate_target,
    locate_targets,
)
from looplm.data.sources import eval_windows, sample_windows
from looplm.data.tokenizers import TOKENIZER_NAMES, Tokenizer, get_tokenizer

__all__ = [
    "CORPORA",
    "SPLITS",
    "TOKENIZER_NAMES",
    "LambadaExample",
    "SplitCounts",
    "TargetSpan",
    "TokenCache",
    "Tokenizer",
    "available_splits",
    "canonical_split",
    "default_cache_dir",
    "eval_windows",
    "get_split_tokens",
    "get_tokenizer",
    "lambada_examples",
    "list_caches",
    "load_documents",
    "locate_target",
    "locate_targets",
    "prepare",
    "sample_windows",
    "shared_source",
]
