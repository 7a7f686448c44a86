"""Real-data layer: tokenizers, corpora, token caches and batching (re-exported, loaded lazily)."""

from looplm.settings.plugins import lazy_attributes

# Loaded on first use, so that ``looplm --help`` (which names the corpora) does not load torch.
__getattr__ = lazy_attributes(
    __name__,
    {
        "TokenCache": "looplm.data.cache",
        "default_cache_dir": "looplm.data.cache",
        "get_split_tokens": "looplm.data.cache",
        "list_caches": "looplm.data.cache",
        "prepare": "looplm.data.cache",
        "shared_source": "looplm.data.cache",
        "CORPORA": "looplm.data.corpora",
        "SPLITS": "looplm.data.corpora",
        "LambadaExample": "looplm.data.corpora",
        "SplitCounts": "looplm.data.corpora",
        "TargetSpan": "looplm.data.corpora",
        "available_splits": "looplm.data.corpora",
        "canonical_split": "looplm.data.corpora",
        "lambada_examples": "looplm.data.corpora",
        "load_documents": "looplm.data.corpora",
        "locate_target": "looplm.data.corpora",
        "locate_targets": "looplm.data.corpora",
        "eval_windows": "looplm.data.sources",
        "sample_windows": "looplm.data.sources",
        "TOKENIZER_NAMES": "looplm.data.tokenizers",
        "Tokenizer": "looplm.data.tokenizers",
        "get_tokenizer": "looplm.data.tokenizers",
    },
)

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
