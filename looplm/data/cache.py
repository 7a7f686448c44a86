"""Token caches: tokenize a corpus split once into a memory-mapped file, then reuse it.

``prepare(name, split, tokenizer_name, source, cache_dir)`` writes two files into ``cache_dir``:

- ``<name>.<split>.<tokenizer>.bin``: the token ids, uint16 (uint32 when the vocabulary has more
  than 65,535 entries), every document followed by the tokenizer's end-of-text id;
- ``<name>.<split>.<tokenizer>.json``: metadata (corpus, split, split rule, tokenizer, source
  files with size / mtime / sha256, n_tokens, n_documents, dtype, sha256 and size of the .bin,
  looplm version).

Both are written atomically (temp file, fsync, ``os.replace``; the .bin is streamed to its temp
file). A later ``prepare`` reuses the cache when the metadata matches; it rebuilds, with a one-line
notice, when the source changed (file list, size, or mtime with a different sha256) or the cache
is corrupt (missing or unreadable metadata, wrong .bin size, sha256 mismatch).

Training and evaluation code call ``get_split_tokens(dataset, split, tokenizer, data_dir,
cache_dir)``; batching the tokens into windows lives in :mod:`looplm.data.sources`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from looplm.data.corpora import (
    ResolvedSplit,
    SplitCounts,
    check_corpus_name,
    is_local_text,
    resolve_split,
)
from looplm.data.tokenizers import get_tokenizer
from looplm.errors import LoopLMError
from looplm.io import atomic_open, atomic_write_json

log = logging.getLogger("looplm.data")

CACHE_FORMAT = 1
CACHE_DIR_ENV = "LOOPLM_CACHE_DIR"
DATA_DIR_ENV = "LOOPLM_DATA_DIR"
# Folder of each corpus inside the shared data folder (``data_dir``).
SHARED_FOLDERS = {
    "wikitext-2": "wikitext-2",
    "wikitext-2-raw": "wikitext-2",
    "wikitext-103": "wikitext-103",
    "wikitext-103-raw": "wikitext-103",
    "openwebtext": "owt-sample",
    "c4": "c4-sample",
    "lambada": "lambada",
}
_BATCH_DOCS = 2048
_BATCH_CHARS = 1 << 22  # 4 Mi characters per encode_batch call


def default_data_dir() -> Path | None:
    """The data folder used when none is named: ``$LOOPLM_DATA_DIR``, else ``shared/data`` beside
    a source checkout of looplm (``<repository>/../shared/data``) when it exists, else None.

    The one precedence order for a data folder, everywhere one is looked up: the folder named for
    the run (``--data-dir``, ``data.data_dir`` in a config, an override or the checkpoint's
    config), then ``$LOOPLM_DATA_DIR``, then ``../shared/data`` beside the checkout, then the
    online path (HF ``datasets``).
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    beside = repo.parent / "shared" / "data"
    return beside if (repo / "pyproject.toml").is_file() and beside.is_dir() else None


def absolute_dataset(name: str) -> str:
    """A local text corpus name with its path made absolute (``text:/abs/path``), so a run's
    stored config reads the same file from any working folder (prompt/completion pairs too:
    ``pairs:/abs/path``); other names pass unchanged."""
    if name.startswith("pairs:"):
        return "pairs:" + str(Path(name.removeprefix("pairs:")).expanduser().resolve())
    if not is_local_text(name):
        return name
    raw = name.removeprefix("text:")
    return "text:" + str(Path(raw).expanduser().resolve())


def default_cache_dir() -> Path:
    """``$LOOPLM_CACHE_DIR`` or ``~/.cache/looplm``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path("~/.cache/looplm").expanduser()


def _looplm_version() -> str:
    try:
        from looplm import __version__

        return str(__version__)
    except Exception:
        try:
            from importlib.metadata import version

            return version("looplm")
        except Exception:
            return "unknown"


def _progress_disabled() -> bool:
    from looplm.progress import progress_enabled

    return not progress_enabled()


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint32 if vocab_size > 65535 else np.uint16)


def cache_stem(name: str, split: str, tokenizer_name: str) -> str:
    """File stem of a cache: ``<corpus>.<split>.<tokenizer>`` (local paths get a short hash)."""
    if is_local_text(name):
        raw = str(Path(name.removeprefix("text:")).expanduser().resolve())
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", Path(raw).name)[:40] or "text"
        name = f"text-{base}-{hashlib.sha1(raw.encode()).hexdigest()[:8]}"
    if "/" in tokenizer_name or "\\" in tokenizer_name:  # a tokenizer.json path: a short hash
        raw = str(Path(tokenizer_name).expanduser().resolve())
        tokenizer_name = f"tok-{hashlib.sha1(raw.encode()).hexdigest()[:10]}"
    return f"{name}.{split}.{tokenizer_name}"


@dataclass
class TokenCache:
    """A prepared token cache: ``tokens`` is a read-only ``np.memmap`` of the .bin file."""

    bin_path: Path
    meta_path: Path
    meta: dict[str, Any]
    reused: bool = False

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    @property
    def tokens(self) -> np.ndarray:
        """The token ids (uint16/uint32 memmap; an empty array for an empty cache)."""
        if not hasattr(self, "_tokens"):
            dtype = np.dtype(self.meta["dtype"])
            if self.n_tokens == 0:
                self._tokens = np.zeros(0, dtype=dtype)
            else:
                self._tokens = np.memmap(
                    self.bin_path, dtype=dtype, mode="r", shape=(self.n_tokens,)
                )
        return self._tokens

    def __len__(self) -> int:
        return self.n_tokens


def _source_record(resolved: ResolvedSplit) -> list[dict[str, Any]]:
    out = []
    for f in resolved.files:
        st = f.stat()
        out.append({"path": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": None})
    return out


def _expected_meta(
    resolved: ResolvedSplit, tok, tokenizer_name: str, dtype: np.dtype
) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "corpus": resolved.name,
        "split": resolved.split,
        "rule": resolved.rule,
        "tokenizer": tokenizer_name,
        "vocab_size": int(tok.vocab_size),
        "eot_id": int(tok.eot_id),
        "dtype": dtype.name,
        "source": resolved.source,
    }


def check_cache(
    bin_path: Path,
    meta_path: Path,
    expected: dict[str, Any] | None,
    files: list[Path] | None,
    verify: bool = True,
) -> tuple[dict[str, Any] | None, str | None]:
    """(metadata, None) when the cache is usable, else (None or metadata, why it is not).

    ``expected``: the fields that must match (None skips that check); ``files``: the current
    source files (None skips the staleness check); ``verify``: also check the .bin's sha256.
    """
    if not meta_path.exists():
        return None, "missing" if not bin_path.exists() else "metadata missing"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        n_tokens = int(meta["n_tokens"])
        itemsize = np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"metadata unreadable ({type(exc).__name__})"
    if expected is not None:
        for key, want in expected.items():
            if meta.get(key) != want:
                return meta, f"{key} changed ({meta.get(key)!r} -> {want!r})"
    if files is not None:
        try:
            why = _source_changed(meta, files)
        except (KeyError, TypeError, AttributeError):
            return meta, "metadata unreadable (source record)"
        if why is not None:
            return meta, why
    if not bin_path.exists():
        return meta, "token file missing"
    size = bin_path.stat().st_size
    if size != n_tokens * itemsize or size != meta.get("bin_bytes", size):
        return meta, f"corrupt (token file has {size} bytes, expected {n_tokens * itemsize})"
    if verify and _sha256_file(bin_path) != meta.get("bin_sha256"):
        return meta, "corrupt (token file checksum mismatch)"
    return meta, None


def _source_changed(meta: dict[str, Any], files: list[Path]) -> str | None:
    """Why the recorded source files differ from ``files`` (None when they are the same)."""
    old = {r["path"]: r for r in meta["source_files"]}
    if sorted(old) != sorted(str(f) for f in files):
        return "source changed (different files)"
    for f in files:
        rec, st = old[str(f)], f.stat()
        if rec["size"] != st.st_size:
            return f"source changed ({f.name}: size {rec['size']} -> {st.st_size})"
        if rec["mtime_ns"] != st.st_mtime_ns:
            if rec.get("sha256") is None or rec["sha256"] != _sha256_file(f):
                return f"source changed ({f.name}: modified)"
            rec["mtime_ns"] = st.st_mtime_ns  # same content, only touched: refresh the record
            meta["_touched"] = True
    return None


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_LINE_EVERY_S = 10.0  # a progress line this often where no bar is drawn (a log file, a pipe)


class _ProgressLines:
    """Tokenizing progress as a line every :data:`_LINE_EVERY_S` seconds on stderr where no bar
    is drawn (output to a log file or a pipe), unless ``LOOPLM_NO_PROGRESS=1``."""

    def __init__(self, label: str, expected: int | None, no_bar: bool) -> None:
        self.label, self.expected = label, expected
        self.on = no_bar and os.environ.get("LOOPLM_NO_PROGRESS") != "1"
        self.t0 = self.last = time.perf_counter()

    def tick(self, n_docs: int, n_tokens: int) -> None:
        now = time.perf_counter()
        if not self.on or now - self.last < _LINE_EVERY_S:
            return
        self.last = now
        of = f"/{self.expected:,}" if self.expected else ""
        print(
            f"tokenizing {self.label}: {n_docs:,}{of} documents, {n_tokens:,} tokens, "
            f"{now - self.t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def _write_tokens(
    resolved: ResolvedSplit, tok, dtype: np.dtype, bin_path: Path, label: str
) -> tuple[int, int, str]:
    """Tokenize the split into ``bin_path`` atomically; returns (n_tokens, n_documents, sha256).

    Batches are encoded in a small thread pool (two in flight: the Rust tokenizer releases the
    GIL), so reading the next documents and writing the previous ids overlap with encoding, and
    one batch's tail keeps the cores busy while the next one starts.
    """
    from tqdm.auto import tqdm

    eot = int(tok.eot_id)
    hasher = hashlib.sha256()
    n_tokens = n_docs = 0

    def write(encoded: list[list[int]]) -> None:
        nonlocal n_tokens, n_docs
        lengths = np.fromiter((len(e) + 1 for e in encoded), np.int64, len(encoded))
        ends = np.cumsum(lengths)
        flat = np.empty(int(ends[-1]), dtype=dtype)
        pos = 0
        for ids, end in zip(encoded, ends):
            flat[pos : end - 1] = ids
            pos = end
        flat[ends - 1] = eot  # each document is followed by <|endoftext|>
        data = flat.tobytes()
        f.write(data)
        hasher.update(data)
        n_tokens += len(flat)
        n_docs += len(encoded)
        bar.update(len(encoded))
        bar.set_postfix(tokens=f"{n_tokens:,}", refresh=False)
        lines.tick(n_docs, n_tokens)

    lines = _ProgressLines(label, resolved.expected_documents, _progress_disabled())
    with (
        atomic_open(bin_path) as f,
        tqdm(
            total=resolved.expected_documents,
            unit="doc",
            desc=label,
            disable=_progress_disabled(),
            dynamic_ncols=True,
        ) as bar,
        ThreadPoolExecutor(max_workers=2, thread_name_prefix="looplm-tok") as pool,
    ):
        in_flight: deque = deque()
        for batch in _batches(resolved.documents()):
            in_flight.append(pool.submit(tok.encode_batch, batch))
            if len(in_flight) == 2:
                write(in_flight.popleft().result())
        while in_flight:
            write(in_flight.popleft().result())
    return n_tokens, n_docs, hasher.hexdigest()


def prepare(
    name: str,
    split: str,
    tokenizer_name: str = "gpt2",
    source: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    counts: SplitCounts | str | Iterable[int] | None = None,
    tokenizer_path: str | os.PathLike | None = None,
    force: bool = False,
    verify: bool = True,
) -> TokenCache:
    """Tokenize corpus ``name``'s ``split`` into ``cache_dir`` once; reuse the cache after that.

    ``source``: a local copy (file or folder) or None for the online path (HF ``datasets``).
    ``counts``: document counts for OpenWebText / C4 splits (default: the paper's).
    ``force``: rebuild even when a valid cache exists. ``verify``: check the .bin's sha256 when
    reusing (cheap next to tokenizing: about 1 GB/s).
    """
    resolved = resolve_split(name, split, source, counts=counts)
    tok = get_tokenizer(tokenizer_name, tokenizer_path)
    dtype = _dtype_for(tok.vocab_size)
    cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    stem = cache_stem(resolved.name, resolved.split, tokenizer_name)
    bin_path, meta_path = cache_dir / f"{stem}.bin", cache_dir / f"{stem}.json"
    expected = _expected_meta(resolved, tok, tokenizer_name, dtype)
    files = resolved.files if resolved.source["kind"] == "local" else None

    remove_stale_temporaries(cache_dir)
    with _writer_lock(cache_dir, stem):  # one writer per cache; a second one waits, then reuses
        return _prepare_locked(
            resolved, tok, dtype, bin_path, meta_path, expected, files, force, verify
        )


def _prepare_locked(
    resolved: ResolvedSplit,
    tok,
    dtype: np.dtype,
    bin_path: Path,
    meta_path: Path,
    expected: dict[str, Any],
    files: list[Path] | None,
    force: bool,
    verify: bool,
) -> TokenCache:
    """:func:`prepare`'s reuse-or-build, with the cache's writer lock held."""
    if not force:
        meta, why = check_cache(bin_path, meta_path, expected, files, verify=verify)
        if why is None:
            if meta.pop("_touched", False):
                atomic_write_json(meta_path, meta)
            return TokenCache(bin_path, meta_path, meta, reused=True)
        if why != "missing":
            log.warning("token cache %s: %s; rebuilding", bin_path, why)

    t0 = time.perf_counter()
    source_files = _source_record(resolved)
    for rec in source_files:
        rec["sha256"] = _sha256_file(Path(rec["path"]))
    if meta_path.exists():
        meta_path.unlink()  # a crash from here on leaves a .bin without metadata: rebuilt
    label = f"{resolved.name} {resolved.split}"
    n_tokens, n_docs, digest = _write_tokens(resolved, tok, dtype, bin_path, label)
    meta = {
        **expected,
        "source_files": source_files,
        "tokenizer_source": getattr(tok, "source", None),
        "n_tokens": n_tokens,
        "n_documents": n_docs,
        "bin_bytes": n_tokens * dtype.itemsize,
        "bin_sha256": digest,
        "looplm_version": _looplm_version(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    atomic_write_json(meta_path, meta)
    return TokenCache(bin_path, meta_path, meta, reused=False)


def _lock_path(cache_dir: Path, stem: str) -> Path:
    return cache_dir / f".{stem}.lock"


@contextlib.contextmanager
def _writer_lock(cache_dir: Path, stem: str) -> Iterator[None]:
    """Hold the cache's writer lock (the sweep cells' :func:`looplm.io.file_lock`, released by
    the operating system however the holder exits): a second process preparing the same cache
    waits for the first and then reuses what it wrote, and a temporary file whose cache lock is
    free belongs to a writer that is gone."""
    from looplm.io import file_lock

    path = _lock_path(cache_dir, stem)
    with contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(file_lock(path, wait=False))
        except OSError:  # a read-only cache folder: reading needs no lock, writing fails anyway
            held = True
        if held:
            yield
            return
    log.warning("token cache %s: another process is preparing it; waiting", cache_dir / stem)
    with file_lock(path):
        yield


def _temp_owner(name: str) -> str | None:
    """The cache stem a temporary file of :func:`looplm.io.atomic_open` was writing
    (``.<stem>.bin.<random>.tmp`` → ``<stem>``), or None for another file."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    target = name[1:-4].rsplit(".", 1)[0]  # drop the random part
    for suffix in (".bin", ".json"):
        if target.endswith(suffix):
            return target[: -len(suffix)]
    return None


def remove_stale_temporaries(cache_dir: str | os.PathLike) -> list[Path]:
    """Remove the temporary files that writers killed mid-write (kill -9, power loss) left in
    ``cache_dir``: those whose cache's writer lock is free (a live writer holds it). Returns the
    files removed (each named in a one-line notice)."""
    from looplm.io import file_lock

    folder = Path(cache_dir).expanduser()
    if not folder.is_dir():
        return []
    removed = []
    for tmp in sorted(folder.glob(".*.tmp")):
        stem = _temp_owner(tmp.name)
        if stem is None:
            continue
        try:
            with file_lock(_lock_path(folder, stem), wait=False) as free:
                if free and tmp.exists():
                    size = tmp.stat().st_size
                    tmp.unlink()
                    removed.append(tmp)
                    log.warning(
                        "token cache: removed %s (%d bytes) left by a killed writer", tmp, size
                    )
        except OSError:  # a read-only cache folder: leave it as it is
            continue
    return removed


def list_caches(cache_dir: str | os.PathLike, verify: bool = False) -> list[dict[str, Any]]:
    """Metadata of every cache in ``cache_dir``, each with ``status`` ("ok" or the problem)."""
    folder = Path(cache_dir).expanduser()
    if not folder.is_dir():
        raise LoopLMError(f"cache folder {str(folder)!r} does not exist")
    out = []
    for meta_path in sorted(folder.glob("*.json")):
        bin_path = meta_path.with_suffix(".bin")
        meta, why = check_cache(bin_path, meta_path, None, None, verify=verify)
        if meta is None:
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # not a cache metadata file
        if not isinstance(meta, dict) or "n_tokens" not in meta:
            continue
        meta = {**meta, "bin_path": str(bin_path), "status": why or "ok"}
        out.append(meta)
    return out


# ----------------------------------------------------------------------------- entry point


def shared_source(data_dir: str | os.PathLike, dataset: str, split: str) -> Path:
    """The local copy of ``dataset`` inside a data folder laid out like the shared one.

    Looks for ``data_dir/<folder>`` (the shared names: wikitext-2, wikitext-103, owt-sample,
    c4-sample, lambada) or ``data_dir/<dataset>``. WikiText-103-raw validation/test fall back to
    ``wikitext-2``'s raw files when ``wikitext-103`` has none: the two corpora share their
    validation and test articles.
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise LoopLMError(f"data folder {str(root)!r} does not exist")
    names = [SHARED_FOLDERS.get(dataset, dataset), dataset]
    folder = next((root / n for n in names if (root / n).exists()), None)
    if folder is None:
        raise LoopLMError(
            f"no local copy of {dataset} in {str(root)!r} (looked for "
            f"{' or '.join(dict.fromkeys(names))})"
        )
    if dataset == "wikitext-103-raw" and split in ("validation", "valid", "val", "test"):
        stem = "valid" if split != "test" else "test"
        alt = root / "wikitext-2"
        if not (folder / f"wiki.{stem}.raw").exists() and (alt / f"wiki.{stem}.raw").exists():
            log.info("wikitext-103-raw %s: using %s (same articles)", split, alt)
            return alt
    return folder


def get_split_tokens(
    dataset: str,
    split: str,
    tokenizer: str = "gpt2",
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    *,
    counts: SplitCounts | str | Iterable[int] | None = None,
) -> np.ndarray:
    """Token ids of one split as a memmap, prepared on first use and reused afterwards.

    ``data_dir`` (default :func:`default_data_dir`: ``$LOOPLM_DATA_DIR``, then ``../shared/data``
    beside the checkout) is a folder laid out like the shared data (``data_dir/wikitext-2`` ...);
    without one the corpus is read online (HF ``datasets``).
    Local text corpora (``text:<path>``) ignore ``data_dir``. ``cache_dir`` defaults to
    ``$LOOPLM_CACHE_DIR`` or ``~/.cache/looplm``.
    """
    check_corpus_name(dataset)
    source = None
    if not is_local_text(dataset):
        data_dir = data_dir or default_data_dir()
        if data_dir:
            source = shared_source(data_dir, dataset, split)
    return prepare(dataset, split, tokenizer, source, cache_dir, counts=counts).tokens


def predicted_bytes(tokens: np.ndarray, tokenizer_name: str, max_tokens: int | None = None) -> int:
    """UTF-8 bytes of text that the evaluation windows' targets stand for (tokens 1..n of the
    split, capped at ``max_tokens``; end-of-text counts 0), the denominator of a loss per byte,
    which compares models with different tokenizers."""
    from looplm.data.tokenizers import token_byte_lengths

    n_pred = len(tokens) - 1
    if max_tokens is not None:
        n_pred = min(n_pred, max_tokens)
    lengths = np.asarray(token_byte_lengths(get_tokenizer(tokenizer_name)), dtype=np.int64)
    targets = np.asarray(tokens[1 : n_pred + 1], dtype=np.int64)  # a memmap or a tensor
    return int(lengths[targets].sum())
