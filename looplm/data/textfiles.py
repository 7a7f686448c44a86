"""Reading local text files as streams of documents (the file formats of
:mod:`looplm.data.corpora`): WikiText articles, blank-line blocks of ``.txt`` files, the ``text``
field of JSON lines, gzip-compressed or not, one file or a folder of them."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError

log = logging.getLogger("looplm.data")

TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz")
_TITLE = re.compile(r"^ = [^=].* = $")
_SPLIT_WORDS = {
    "train": "train",
    "valid": "validation",
    "validation": "validation",
    "val": "validation",
    "test": "test",
}


def _suffix(path: Path) -> str | None:
    low = path.name.lower()
    for suf in sorted(TEXT_SUFFIXES, key=len, reverse=True):
        if low.endswith(suf):
            return suf
    return None


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _guard(path: Path, lines: Iterator[str]) -> Iterator[str]:
    """Re-raise read/decode errors of ``path`` as one-line LoopLMErrors."""
    try:
        yield from lines
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise LoopLMError(f"could not read {str(path)!r}: {msg}") from None


def _check_nonempty(path: Path) -> None:
    if path.stat().st_size == 0:
        raise LoopLMError(f"empty file {str(path)!r}: it holds no documents")


def _blank_line_blocks(path: Path) -> Iterator[str]:
    """Blocks of non-blank lines (joined by newlines) separated by blank lines."""
    with _open_text(path) as fh:
        block: list[str] = []
        for line in _guard(path, fh):
            if line.strip():
                block.append(line.rstrip("\r\n"))
            elif block:
                yield "\n".join(block)
                block = []
        if block:
            yield "\n".join(block)


def _json_docs(path: Path, field_name: str = "text") -> Iterator[str]:
    """``text`` fields of a JSON-lines file (or of a JSON array in a ``.json`` file)."""
    with _open_text(path) as fh:
        lines = _guard(path, fh)
        first = next(lines, "")
        if path.name.lower().endswith(".json") and first.lstrip().startswith("["):
            try:
                items = json.loads(first + "".join(lines))
            except json.JSONDecodeError as exc:
                raise LoopLMError(f"{str(path)!r} is not valid JSON: {exc}") from None
            for i, item in enumerate(items):
                yield _json_text(item, path, i + 1, field_name)
            return
        for i, line in enumerate(itertools.chain([first], lines), start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LoopLMError(f"{str(path)!r} line {i} is not valid JSON: {exc}") from None
            yield _json_text(item, path, i, field_name)


def _json_text(item: Any, path: Path, where: int, field_name: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get(field_name), str):
        return item[field_name]
    raise LoopLMError(f"{str(path)!r} record {where} has no string field {field_name!r}")


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Split WikiText lines (each ending in a newline) into articles, keeping every character."""
    window: list[str] = []  # the last three lines seen
    article: list[str] = []
    for line in lines:
        window.append(line)
        if len(window) == 4:
            window.pop(0)
        # a title is confirmed once the line after it is seen: blank, title, blank
        if (
            len(window) == 3
            and window[0].strip() == ""
            and window[2].strip() == ""
            and _TITLE.match(window[1].rstrip("\r\n"))
            and len(article) > 2
        ):
            # article holds ... blank, title: the new article starts at the title line
            done = article[:-1]
            if any(x.strip() for x in done):
                yield "".join(done)
                article = article[-1:]
        article.append(line)
    if article:
        yield "".join(article)


def _wikitext_docs(path: Path) -> Iterator[str]:
    with _open_text(path) as fh:
        yield from wikitext_articles(_guard(path, fh))


def _file_docs(path: Path) -> Iterator[str]:
    suf = _suffix(path)
    if suf is None:
        raise LoopLMError(
            f"unknown format of {str(path)!r}; allowed suffixes: {', '.join(TEXT_SUFFIXES)}"
        )
    _check_nonempty(path)
    if suf in (".txt", ".txt.gz"):
        return _blank_line_blocks(path)
    return _json_docs(path)


def _nonempty(docs: Iterator[str], where: str) -> Iterator[str]:
    n = 0
    for d in docs:
        n += 1
        yield d
    if n == 0:
        raise LoopLMError(f"no documents in {where}")


def _files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and _suffix(p) is not None)


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        if _suffix(path) is None:
            raise LoopLMError(
                f"unknown format of {str(path)!r}; allowed suffixes: {', '.join(TEXT_SUFFIXES)}"
            )
        return [path]
    files = _files_in(path)
    if not files:
        raise LoopLMError(f"no {'/'.join(TEXT_SUFFIXES)} files in folder {str(path)!r}")
    return files


def _chain_files(files: list[Path], reader: Callable[[Path], Iterator[str]]) -> Iterator[str]:
    for f in files:
        yield from reader(f)


def _split_of_file(path: Path) -> str | None:
    words = re.split(r"[._\-]", path.name.lower())
    found = {_SPLIT_WORDS[w] for w in words if w in _SPLIT_WORDS}
    return found.pop() if len(found) == 1 else None


def _by_split(files: list[Path]) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for f in files:
        s = _split_of_file(f)
        if s is not None:
            out.setdefault(s, []).append(f)
    return out


def _slice(docs: Iterator[str], start: int, stop: int) -> Iterator[str]:
    return itertools.islice(docs, start, stop)


def _counted(docs: Iterator[str], want: int, name: str, split: str) -> Iterator[str]:
    """Pass documents through; error if there are none, a notice if fewer than wanted."""
    n = 0
    for d in docs:
        n += 1
        yield d
    if n == 0:
        raise LoopLMError(
            f"{name} {split}: the source has no documents left for this split (wanted {want:,}); "
            "it is smaller than the split counts: pass smaller counts (e.g. --counts 800,100,100)"
        )
    if n < want:
        log.warning(
            "%s %s: the source has only %s of the %s documents wanted; using them all",
            name,
            split,
            f"{n:,}",
            f"{want:,}",
        )
