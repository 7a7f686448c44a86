"""``looplm data``'s options as settings dataclasses (``data prepare``, ``data info``):
:mod:`looplm.settings.options` makes each subcommand's command line from its dataclass. Light on
purpose: the command line imports it at start-up (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.data.tokenizers import TOKENIZER_NAMES
from looplm.errors import LoopLMError
from looplm.settings import setting


@dataclass
class PrepareSettings:
    """``looplm data prepare NAME``: where the corpus is read from and the cache written."""

    source: str | None = None  # local copy of the corpus (file or folder)
    # a folder laid out like the shared data (data_dir/wikitext-2, ...) instead of --source
    data_dir: str | None = None
    # splits to prepare (default: every split the source has)
    split: tuple[str, ...] | None = setting(None, spaced=True)
    tokenizer: str = setting("gpt2", choices=TOKENIZER_NAMES)  # tokenizer the tokens are made by
    tokenizer_path: str | None = None  # folder with GPT-2 tokenizer files
    out: str | None = None  # cache folder (default $LOOPLM_CACHE_DIR or ~/.cache/looplm)
    # document counts TRAIN,VALID,TEST of the openwebtext / c4 splits (default: the paper's)
    counts: str | None = None
    force: bool = False  # rebuild even if a valid cache exists

    def validate(self) -> None:
        """One source at most."""
        if self.source and self.data_dir:
            raise LoopLMError("give either --source or --data-dir, not both")


@dataclass
class InfoSettings:
    """``looplm data info DIR``: how closely the caches are checked."""

    verify: bool = False  # also check each token file's sha256
