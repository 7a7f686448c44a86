"""Text corpora as streams of documents: WikiText, OpenWebText, C4, LAMBADA, local files.

``load_documents(name, split, source)`` yields the documents of one split as strings. ``source``
is a local copy (a file or a folder); without one the corpus is read online through HuggingFace
``datasets`` (an optional extra, imported only then). The token cache (:mod:`looplm.data.cache`)
tokenizes each document separately and puts ``<|endoftext|>`` after every document, the way
GPT-2's training data was built.

What a document is, per source:

- **WikiText** (``wiki.{train,valid,test}.{tokens,raw}``, or ``{train,valid,test}.txt``): one
  article. A new article starts at a title line `` = Title = `` (one ``=`` on each side) that has
  a blank line before and after it; that gives the published 600 / 60 / 60 articles of
  WikiText-2. Lines are kept verbatim, so the articles concatenate back to the file and the
  GPT-2 tokens of all articles equal those of the whole file (plus one ``<|endoftext|>`` each).
- **``.txt`` files** (OpenWebText sample, generic text): blocks separated by blank lines. The
  shared OpenWebText sample has no recoverable document boundaries (its documents contain blank
  lines themselves), so its "documents" are paragraphs: 2,121 blocks in the 4,242-line sample.
- **``.jsonl`` / ``.jsonl.gz`` / ``.json.gz`` / ``.json``**: one JSON object per line, field
  ``text`` (a ``.json`` file may also hold one JSON array of such objects or of strings).
- **a folder**: every supported file under it, in sorted path order.

Splits are ``train``, ``validation`` (aliases ``valid``, ``val``) and ``test``.

- OpenWebText (paper): documents [0, 200,000) train, the next 4,096 validation, the next 4,096
  test, in stream order.
- C4 (paper): the first 100,000 train documents; two disjoint 4,096-document slices of C4's
  validation split (validation = its first 4,096, test = the next 4,096; the paper's held-out C4
  slice is "the first 4,096 validation examples"). A local source whose files are not named by
  split (the shared 1,000-document sample) is one stream: train, validation, test follow each
  other, like OpenWebText.
- The counts are parameters (``counts=SplitCounts(...)``) so a small local sample can be split
  with scaled-down counts.
- LAMBADA: ``test`` only (the OpenAI-preprocessed test set).
- Generic local text (``text:<path>`` or a path with a supported suffix): if a folder holds files
  named by split (``train``, ``valid``/``validation``/``val``, ``test`` as a ``.``/``_``/``-``
  separated part of the file name) each split reads its files; otherwise the document stream
  (all files in name order) is split by :func:`text_split_slices`: the last 5% of documents are
  ``test``, the 5% before them ``validation``, the rest ``train``; ``all`` reads everything.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looplm.data.textfiles import (
    TEXT_SUFFIXES,
    _by_split,
    _chain_files,
    _check_nonempty,
    _counted,
    _file_docs,
    _json_docs,
    _local_files,
    _nonempty,
    _slice,
    _suffix,
    _wikitext_docs,
    wikitext_articles,
)
from looplm.errors import LoopLMError

log = logging.getLogger("looplm.data")

CORPORA = (
    "wikitext-2",
    "wikitext-2-raw",
    "wikitext-103",
    "wikitext-103-raw",
    "openwebtext",
    "c4",
    "lambada",
)
SPLITS = ("train", "validation", "test")
SPLIT_ALIASES = {"valid": "validation", "val": "validation", "dev": "validation"}
_WIKI_SUFFIX = {
    "wikitext-2": "tokens",
    "wikitext-103": "tokens",
    "wikitext-2-raw": "raw",
    "wikitext-103-raw": "raw",
}
_WIKI_FILE_SPLIT = {"train": "train", "validation": "valid", "test": "test"}
# Where the online path reads each corpus: (HF dataset id, config).
HF_DATASETS: dict[str, tuple[str, str | None]] = {
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-v1"),
    "wikitext-2-raw": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-v1"),
    "wikitext-103-raw": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
    "openwebtext": ("Skylion007/openwebtext", None),
    "c4": ("allenai/c4", "en"),
    "lambada": ("EleutherAI/lambada_openai", "en"),
}


@dataclass(frozen=True)
class SplitCounts:
    """Document counts of a contiguous train / validation / test split."""

    train: int
    validation: int
    test: int

    def __post_init__(self) -> None:
        for name in ("train", "validation", "test"):
            if int(getattr(self, name)) < 1:
                raise LoopLMError(f"split count {name}={getattr(self, name)} must be >= 1")

    @classmethod
    def parse(cls, value: SplitCounts | str | Iterable[int] | None) -> SplitCounts | None:
        """``SplitCounts``, ``"TRAIN,VALIDATION,TEST"`` or a 3-sequence of ints (None passes)."""
        if value is None or isinstance(value, SplitCounts):
            return value
        parts = value.split(",") if isinstance(value, str) else list(value)
        try:
            nums = [int(p) for p in parts]
        except (TypeError, ValueError):
            nums = []
        if len(nums) != 3:
            raise LoopLMError(f"split counts {value!r}: expected three integers TRAIN,VALID,TEST")
        return cls(*nums)


PAPER_COUNTS = {
    "openwebtext": SplitCounts(200_000, 4_096, 4_096),
    "c4": SplitCounts(100_000, 4_096, 4_096),
}


@dataclass
class ResolvedSplit:
    """One split of one corpus, resolved to its source; ``documents()`` streams it."""

    name: str  # canonical corpus name, or "text:<absolute path>"
    split: str  # canonical split name
    source: dict[str, Any]  # {"kind": "local", "path": ...} or {"kind": "hf", "dataset": ...}
    files: list[Path]  # local files this split reads (empty for the online path)
    rule: dict[str, Any]  # how documents are delimited and selected (recorded in cache metadata)
    documents: Callable[[], Iterator[str]] = field(repr=False)
    expected_documents: int | None = None


# ----------------------------------------------------------------------------- names and splits


def canonical_split(split: str) -> str:
    """``valid``/``val``/``dev`` -> ``validation``; other names are returned unchanged."""
    return SPLIT_ALIASES.get(split, split)


def _split_error(name: str, split: str, allowed: Iterable[str]) -> LoopLMError:
    return LoopLMError(f"unknown split {split!r} for {name}; allowed: {', '.join(allowed)}")


def is_local_text(name: str) -> bool:
    """True when ``name`` names a local text corpus rather than a known corpus."""
    if name.startswith("text:"):
        return True
    if name in CORPORA:
        return False
    return name.lower().endswith(TEXT_SUFFIXES) or os.path.sep in name or os.path.exists(name)


def check_corpus_name(name: str) -> None:
    """Raise LoopLMError unless ``name`` is a known corpus or a local text path."""
    if name not in CORPORA and not is_local_text(name):
        raise LoopLMError(
            f"unknown corpus {name!r}; allowed: {', '.join(CORPORA)}, text:<path>, "
            f"or a path to a {'/'.join(TEXT_SUFFIXES)} file or a folder of them"
        )


def _existing(path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise LoopLMError(f"{what} {str(p)!r} does not exist")
    return p.resolve()


# ----------------------------------------------------------------------------- resolution


def resolve_split(
    name: str,
    split: str,
    source: str | os.PathLike | None = None,
    *,
    counts: SplitCounts | str | Iterable[int] | None = None,
) -> ResolvedSplit:
    """Resolve corpus ``name``'s ``split`` to its source files (or the online dataset)."""
    check_corpus_name(name)
    counts = SplitCounts.parse(counts)
    if counts is not None and name not in PAPER_COUNTS:
        raise LoopLMError(f"split counts apply only to {', '.join(PAPER_COUNTS)}, not to {name}")
    if is_local_text(name):
        if source is not None:
            raise LoopLMError(f"{name!r} is a path itself; it takes no separate source")
        return _resolve_text(name.removeprefix("text:"), split)
    split = canonical_split(split)
    allowed = ("test",) if name == "lambada" else SPLITS
    if split not in allowed:
        raise _split_error(name, split, allowed)
    if source is None:
        return _resolve_hf(name, split, counts)
    path = _existing(source, f"{name} source")
    if name in _WIKI_SUFFIX:
        return _resolve_wikitext(name, split, path)
    if name == "lambada":
        if path.is_dir() and (path / "lambada_test.jsonl").is_file():
            files = [path / "lambada_test.jsonl"]
        else:
            files = _local_files(path)
        for f in files:
            _check_nonempty(f)
        return ResolvedSplit(
            name,
            split,
            {"kind": "local", "path": str(path)},
            files,
            {"documents": "one example (its full text) per JSON line"},
            lambda: _nonempty(_chain_files(files, _file_docs), str(path)),
        )
    return _resolve_counted(name, split, path, counts or PAPER_COUNTS[name])


def _resolve_wikitext(name: str, split: str, folder: Path) -> ResolvedSplit:
    if not folder.is_dir():
        raise LoopLMError(
            f"{name} source {str(folder)!r} must be a folder with wiki.*.{_WIKI_SUFFIX[name]} files"
        )
    stem = _WIKI_FILE_SPLIT[split]
    candidates = [folder / f"wiki.{stem}.{_WIKI_SUFFIX[name]}", folder / f"{stem}.txt"]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise LoopLMError(
            f"{name} {split}: no {candidates[0].name} (or {candidates[1].name}) in {str(folder)!r}"
        )
    _check_nonempty(path)
    return ResolvedSplit(
        name,
        split,
        {"kind": "local", "path": str(folder)},
        [path],
        {"documents": "wikitext articles (a new one at each ' = Title = ' line between blanks)"},
        lambda: _nonempty(_wikitext_docs(path), str(path)),
    )


def wikitext_available_splits(name: str, folder: str | os.PathLike) -> list[str]:
    """The splits of a WikiText corpus whose file exists in ``folder``."""
    out = []
    for split, stem in _WIKI_FILE_SPLIT.items():
        folder = Path(folder)
        if (folder / f"wiki.{stem}.{_WIKI_SUFFIX[name]}").is_file() or (
            folder / f"{stem}.txt"
        ).is_file():
            out.append(split)
    return out


def _resolve_counted(name: str, split: str, path: Path, counts: SplitCounts) -> ResolvedSplit:
    files = _local_files(path)
    for f in files:
        _check_nonempty(f)
    by_split = _by_split(files) if name == "c4" else {}
    rule: dict[str, Any] = {
        "documents": "one per JSON line (field text); .txt: blocks between blank lines",
        "counts": [counts.train, counts.validation, counts.test],
    }
    if "train" in by_split and "validation" in by_split:
        # C4 layout: c4-train.*.json.gz and c4-validation.*.json.gz
        if split == "train":
            use, start, stop = by_split["train"], 0, counts.train
        elif split == "validation":
            use, start, stop = by_split["validation"], 0, counts.validation
        else:
            use, start = by_split["validation"], counts.validation
            stop = start + counts.test
        rule["stream"] = "train files" if split == "train" else "validation files"
    else:
        use = files
        start = {"train": 0, "validation": counts.train, "test": counts.train + counts.validation}[
            split
        ]
        stop = start + getattr(counts, split)
        rule["stream"] = "all files, in order"
    rule["slice"] = [start, stop]
    want = stop - start
    return ResolvedSplit(
        name,
        split,
        {"kind": "local", "path": str(path)},
        use,
        rule,
        lambda: _counted(_slice(_chain_files(use, _file_docs), start, stop), want, name, split),
        expected_documents=want,
    )


TEXT_HOLDOUT = 0.05  # share of a single-stream text corpus held out for validation, and for test


def text_split_slices(n_docs: int) -> dict[str, tuple[int, int]]:
    """Document slices of a text corpus without files named by split: the last 5% of documents
    (at least one) are ``test``, the 5% before them ``validation``, the rest ``train``; ``all``
    is everything. In document order, so held-out text follows the training text."""
    k = max(1, round(TEXT_HOLDOUT * n_docs))
    if n_docs - 2 * k < 1:
        raise LoopLMError(
            f"this text corpus has {n_docs} document(s); holding out validation and test needs at "
            "least 3 (documents are blocks between blank lines, or JSON lines), or name files "
            "by split (train/valid/test); use split 'all' to read everything"
        )
    return {
        "train": (0, n_docs - 2 * k),
        "validation": (n_docs - 2 * k, n_docs - k),
        "test": (n_docs - k, n_docs),
        "all": (0, n_docs),
    }


def _resolve_text(raw_path: str, split: str) -> ResolvedSplit:
    path = _existing(raw_path, "text corpus path")
    files = _local_files(path)
    for f in files:
        _check_nonempty(f)
    canon = canonical_split(split)
    by_split = _by_split(files) if path.is_dir() else {}
    name = f"text:{path}"
    source = {"kind": "local", "path": str(path)}
    if by_split:
        if canon not in by_split:
            raise _split_error(name, split, sorted(by_split))
        use = by_split[canon]
        rule = {"documents": "per file format", "split": "files named by split"}
        return ResolvedSplit(
            name, canon, source, use, rule,
            lambda: _nonempty(_chain_files(use, _file_docs), str(path)),
        )  # fmt: skip
    if canon not in SPLITS + ("all",):
        raise _split_error(name, split, list(SPLITS) + ["all"])
    if canon == "all":
        rule = {"documents": "per file format", "split": "everything"}
        return ResolvedSplit(
            name, canon, source, files, rule,
            lambda: _nonempty(_chain_files(files, _file_docs), str(path)),
        )  # fmt: skip
    n_docs = sum(1 for _ in _chain_files(files, _file_docs))
    if n_docs == 0:
        raise LoopLMError(f"no documents in {path}")
    start, stop = text_split_slices(n_docs)[canon]
    rule = {
        "documents": "per file format",
        "split": f"last documents held out ({TEXT_HOLDOUT:g} validation, {TEXT_HOLDOUT:g} test)",
        "slice": [start, stop],
    }
    return ResolvedSplit(
        name, canon, source, files, rule,
        lambda: _nonempty(_slice(_chain_files(files, _file_docs), start, stop), str(path)),
        expected_documents=stop - start,
    )  # fmt: skip


HUB_HOST = "huggingface.co"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# What a data folder holds for each corpus (the layout ``data.data_dir`` / $LOOPLM_DATA_DIR name).
DATA_LAYOUT = {
    "wikitext-2": "wikitext-2/wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens",
    "wikitext-2-raw": "wikitext-2/wiki.train.raw, wiki.valid.raw, wiki.test.raw",
    "wikitext-103": "wikitext-103/wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens",
    "wikitext-103-raw": "wikitext-103/wiki.train.raw, wiki.valid.raw, wiki.test.raw",
    "openwebtext": "owt-sample/*.txt or *.jsonl (documents: blank-line blocks or JSON lines)",
    "c4": "c4-sample/*.json.gz (C4's JSON lines)",
    "lambada": "lambada/lambada_test.jsonl",
}
_reachable: dict[str, str | None] = {}


def hub_offline_reason(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be used now (an offline variable is set, or one TCP
    connection to it fails within ``timeout`` seconds), or None; checked once per process, so an
    offline machine fails at once instead of after the datasets library's retries."""
    for var in _OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} is set"
    if HUB_HOST not in _reachable:
        import socket

        try:
            socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
            _reachable[HUB_HOST] = None
        except OSError as exc:
            _reachable[HUB_HOST] = f"{HUB_HOST} is unreachable ({exc.strerror or exc})"
    return _reachable[HUB_HOST]


def offline_data_message(name: str, reason: str) -> str:
    """The one-line error for corpus ``name`` with no local copy and no network: what to place
    where, and the settings that name the folder."""
    return (
        f"no local copy of {name} and no network ({reason}): place it in a data folder as "
        f"DIR/{DATA_LAYOUT[name]} and name DIR with LOOPLM_DATA_DIR=DIR or data.data_dir=DIR "
        f"(or --data-dir DIR), or run `looplm data prepare {name}` where the network is "
        "reachable (README, 'Real data')"
    )


def _import_datasets():
    try:
        import datasets  # optional extra, imported lazily
    except ImportError:
        return None
    return datasets


# long: the online path's checks and their messages, one after the other
def _resolve_hf(name: str, split: str, counts: SplitCounts | None) -> ResolvedSplit:
    datasets = _import_datasets()
    dataset_id, config = HF_DATASETS[name]
    if datasets is None:
        raise LoopLMError(
            f"no local source for {name!r} and the optional package 'datasets' is not installed: "
            f"pass a local copy (--source PATH, or --data-dir / data.data_dir / $LOOPLM_DATA_DIR "
            f"naming a folder DIR with DIR/{DATA_LAYOUT[name]}), or run `pip install 'looplm[data]'` "
            f"on a machine with network access (it reads {dataset_id}{'/' + config if config else ''})"
        )
    offline = hub_offline_reason()
    if offline is not None:
        raise LoopLMError(offline_data_message(name, offline))
    source = {"kind": "hf", "dataset": dataset_id, "config": config}

    def load(hf_split: str, streaming: bool):
        try:
            return datasets.load_dataset(dataset_id, config, split=hf_split, streaming=streaming)
        except Exception as exc:  # network, missing dataset, ...
            msg = " ".join(str(exc).split())[:300]
            raise LoopLMError(
                f"could not load {dataset_id} ({hf_split}) via datasets: {msg}"
            ) from None

    def texts(rows: Iterable[dict]) -> Iterator[str]:
        for row in rows:
            yield row["text"]

    if name in _WIKI_SUFFIX:
        # HF rows are the file's lines; blank lines (" \n" in the files) come as "".
        def docs() -> Iterator[str]:
            lines = (t if t else " \n" for t in texts(load(split, False)))
            return _nonempty(wikitext_articles(lines), f"{dataset_id} {split}")

        rule = {"documents": "wikitext articles (rows rejoined into lines)"}
        return ResolvedSplit(name, split, source, [], rule, docs)
    if name == "lambada":
        rule = {"documents": "one example per row"}
        return ResolvedSplit(name, split, source, [], rule, lambda: texts(load("test", False)))
    counts = counts or PAPER_COUNTS[name]
    if name == "c4" and split != "train":
        hf_split = "validation"
        start = 0 if split == "validation" else counts.validation
    else:
        hf_split = "train"
        start = {"train": 0, "validation": counts.train, "test": counts.train + counts.validation}[
            split
        ]
    stop = start + getattr(counts, split)
    rule = {
        "documents": "one per row",
        "counts": [counts.train, counts.validation, counts.test],
        "stream": f"{hf_split} split",
        "slice": [start, stop],
    }
    return ResolvedSplit(
        name,
        split,
        source,
        [],
        rule,
        lambda: _counted(
            _slice(texts(load(hf_split, True)), start, stop), stop - start, name, split
        ),
        expected_documents=stop - start,
    )


def available_splits(name: str, source: str | os.PathLike | None = None) -> list[str]:
    """The splits ``prepare`` builds by default for ``name`` read from ``source`` (maybe none)."""
    check_corpus_name(name)
    if is_local_text(name):
        path = _existing(name.removeprefix("text:"), "text corpus path")
        by_split = _by_split(_local_files(path)) if path.is_dir() else {}
        return [s for s in SPLITS if s in by_split] if by_split else list(SPLITS)
    if name == "lambada":
        return ["test"]
    if name in _WIKI_SUFFIX and source is not None:
        folder = _existing(source, f"{name} source")
        return wikitext_available_splits(name, folder) if folder.is_dir() else []
    return list(SPLITS)


def load_documents(
    name: str,
    split: str,
    source: str | os.PathLike | None = None,
    *,
    counts: SplitCounts | str | Iterable[int] | None = None,
) -> Iterator[str]:
    """Stream the documents of corpus ``name``'s ``split`` (see the module docstring)."""
    return resolve_split(name, split, source, counts=counts).documents()


# ----------------------------------------------------------------------------- LAMBADA


@dataclass(frozen=True)
class LambadaExample:
    """One LAMBADA passage: ``text`` = ``context`` + whitespace + ``target`` (the last word)."""

    text: str
    context: str
    target: str


@dataclass(frozen=True)
class TargetSpan:
    """Token ids of ``context + " " + target`` and the target's token span ``ids[start:end]``.

    ``in_text`` is True when the span was found at the end of the tokenization of the whole
    passage (its last separator written as one space, which it is in all but 7 of the 5,153
    examples of ``lambada_test.jsonl``); False when the ids had to be built as ``encode(context) + encode(" " + target)``
    (BPE merged the target with what precedes it, or the separator was not one space).
    """

    ids: list[int]
    start: int
    end: int
    in_text: bool


def split_last_word(text: str) -> tuple[str, str]:
    """(context, last whitespace-separated word) of ``text``; context excludes the separator."""
    m = re.search(r"(\s+)(\S+)\s*$", text)
    if m is None:
        raise LoopLMError(f"LAMBADA text has no context before its last word: {text[:60]!r}")
    return text[: m.start(1)], m.group(2)


def lambada_examples(path: str | os.PathLike) -> list[LambadaExample]:
    """The examples of a LAMBADA JSON-lines file (field ``text``), or of a folder holding one."""
    p = _existing(path, "LAMBADA file")
    if p.is_dir():
        p = p / "lambada_test.jsonl" if (p / "lambada_test.jsonl").is_file() else _local_files(p)[0]
    if _suffix(p) not in (".jsonl", ".jsonl.gz", ".json", ".json.gz"):
        raise LoopLMError(f"unknown LAMBADA format {str(p)!r}; expected JSON lines with 'text'")
    _check_nonempty(p)
    out = []
    for text in _json_docs(p):
        context, target = split_last_word(text)
        out.append(LambadaExample(text=text, context=context, target=target))
    if not out:
        raise LoopLMError(f"no LAMBADA examples in {str(p)!r}")
    return out


def locate_target(example: LambadaExample, tokenizer) -> TargetSpan:
    """Token ids of the passage and the span of its target word (tokens of ``" " + target``)."""
    return locate_targets([example], tokenizer)[0]


def locate_targets(examples: list[LambadaExample], tokenizer) -> list[TargetSpan]:
    """``locate_target`` for many examples, tokenized in batches (parallel for GPT-2)."""
    passages = tokenizer.encode_batch([e.context + " " + e.target for e in examples])
    targets = tokenizer.encode_batch([" " + e.target for e in examples])
    out: list[TargetSpan] = []
    misses = [i for i, (ids, t) in enumerate(zip(passages, targets)) if ids[-len(t) :] != t]
    contexts = dict(zip(misses, tokenizer.encode_batch([examples[i].context for i in misses])))
    for i, (ids, t) in enumerate(zip(passages, targets)):
        if i in contexts:
            ids = contexts[i] + t
        out.append(TargetSpan(ids, len(ids) - len(t), len(ids), i not in contexts))
    return out
