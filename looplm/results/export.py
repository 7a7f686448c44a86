"""A results store as data in the repository: one JSON line per evaluation row.

The findings pages are generated from stores; a store is a binary SQLite file that lives in a run
folder and is lost with it. :func:`export_store` writes the rows those pages read as a compact,
diff-friendly text file that can be committed (``docs/data/<grid>.jsonl``), and
:func:`import_export` puts them back into a store. Format, one line per row::

    {"adaptive_mode":"","calibration":"","dataset":"wikitext-2","depth":8,"eval_tag":"cap=8192tok",
     "extra":{...},"method":"scse","model_hash":"3c6825406c1c","n_tokens":8192,
     "protocol":"paper-wt2-bytes-d128-600","seed":0,"split":"test","sum_nll":21456.01...}

* lines sorted by evaluation identity (:data:`~looplm.results.store.IDENTITY_FIELDS`), keys
  sorted, no spaces: a re-run that changes one row changes one line;
* numbers exactly as stored (Python's shortest round-trip repr): nothing is rounded, so a page
  regenerated from the export is the page regenerated from the store, and every verdict too;
* dropped: the write times (``created_at`` / ``updated_at``, which change on every re-run and
  that no page reads; an import stamps its own) and the ``extra`` fields of :data:`DROPPED`
  (a machine-specific checkpoint path and per-step arrays no report, figure or verdict reads).

A name ending in ``.gz`` is written gzip-compressed (byte-reproducible: no time stamp or name in
the header), for a grid whose export passes :data:`COMPRESS_ABOVE` bytes.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.io import atomic_write_bytes
from looplm.results.store import (
    _SQLITE_MAGIC,
    IDENTITY_FIELDS,
    METRIC_FIELDS,
    EvalRecord,
    ResultsStore,
    _json_default,
)

#: ``extra`` fields left out of an export (dotted paths into nested objects): nothing that
#: ``looplm paper report``, its figures or the verdicts read.
DROPPED = (
    "checkpoint",
    "anchor_energy_per_step",  # a copy of per_step.anchor_energy
    "per_step.bias_energy",
    "per_step.raw_bias_energy",
    "per_step.gain_std",
    "per_step.update_energy",
    "steering.anchor_distance_per_step",
    "steering.ray_cosine_per_step_mean",
)
#: Exports above this many bytes are committed compressed (``.jsonl.gz``).
COMPRESS_ABOVE = 2_000_000
SUFFIXES = (".jsonl", ".jsonl.gz")


def _drop(extra: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(extra, default=_json_default))  # a deep copy
    for path in DROPPED:
        *parents, leaf = path.split(".")
        node: Any = out
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def export_line(rec: EvalRecord) -> str:
    """One row as its export line (identity, ``n_tokens``, ``sum_nll``, trimmed ``extra``)."""
    row = {f: getattr(rec, f) for f in IDENTITY_FIELDS + METRIC_FIELDS}
    row["extra"] = _drop(rec.extra)
    return json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def export_text(records: list[EvalRecord]) -> str:
    """Every row's line, sorted by evaluation identity (a trailing newline; empty: ``""``)."""
    lines = [export_line(r) for r in sorted(records, key=lambda r: r.identity())]
    return "".join(line + "\n" for line in lines)


def _check_suffix(path: Path) -> None:
    if not path.name.endswith(SUFFIXES):
        raise LoopLMError(
            f"results export {str(path)!r}: the name must end in {' or '.join(SUFFIXES)}"
        )


def write_export(records: list[EvalRecord], out: str | os.PathLike) -> int:
    """Write ``records`` to ``out`` (``.jsonl``, or ``.jsonl.gz`` compressed) atomically;
    returns the bytes written."""
    path = Path(out)
    _check_suffix(path)
    data = export_text(records).encode("utf-8")
    if path.name.endswith(".gz"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
            gz.write(data)
        data = buf.getvalue()
    atomic_write_bytes(path, data)
    return len(data)


def export_store(store: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Export every row of the SQLite ``store`` to ``out``; returns ``{"rows", "bytes", "out"}``."""
    if not Path(store).is_file():
        raise LoopLMError(f"results store {str(store)!r} does not exist")
    with ResultsStore(store, read_only=True) as st:
        records = st.query()
    return {"rows": len(records), "bytes": write_export(records, out), "out": str(out)}


def read_export(path: str | os.PathLike) -> list[EvalRecord]:
    """The rows of an export file (``.jsonl`` or ``.jsonl.gz``), in file order."""
    p = Path(path)
    _check_suffix(p)
    if not p.is_file():
        raise LoopLMError(f"results export {str(p)!r} does not exist")
    try:
        raw = gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise LoopLMError(f"results export {str(p)!r} is unreadable: {exc}") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise LoopLMError(f"{p}:{i}: not a JSON line ({exc.msg})") from None
        if not isinstance(row, dict):
            raise LoopLMError(f"{p}:{i}: expected a JSON object (one evaluation row)")
        try:
            out.append(EvalRecord.from_dict(row))
        except (LoopLMError, TypeError) as exc:
            raise LoopLMError(f"{p}:{i}: {exc}") from None
    return out


def import_export(path: str | os.PathLike, store: str | os.PathLike) -> int:
    """Put every row of the export ``path`` into ``store`` (created when missing; a row whose
    identity is already there is replaced); returns the number of rows."""
    records = read_export(path)
    with ResultsStore(store) as st:
        return st.put_many(records)


def data_file(folder: str | os.PathLike, store: str | os.PathLike) -> Path:
    """The export of ``store`` in the data folder: ``<folder>/<grid>.jsonl`` (or ``.jsonl.gz``
    where only that exists), ``<grid>`` being the name of the store's run folder
    (``runs/paper/wt2_bytes/results.sqlite`` → ``wt2_bytes``)."""
    grid = Path(store).parent.name or Path(store).stem
    plain = Path(folder) / f"{grid}.jsonl"
    packed = Path(folder) / f"{grid}.jsonl.gz"
    return packed if packed.is_file() and not plain.is_file() else plain


def load_records(path: str | os.PathLike) -> list[EvalRecord]:
    """All records of a results file: a SQLite store, a JSON file from ``export_json``, or a
    line-per-row export (``.jsonl`` / ``.jsonl.gz``, :mod:`looplm.results.export`).

    Raises LoopLMError when the file is missing or is none of these.
    """
    path = Path(path)
    if not path.is_file():
        raise LoopLMError(f"results file {str(path)!r} does not exist")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return read_export(path)
    with open(path, "rb") as f:
        head = f.read(16)
    if head == _SQLITE_MAGIC:
        with ResultsStore(path, read_only=True) as store:
            return store.query()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoopLMError(
            f"{str(path)!r} is neither a SQLite results store nor a JSON export ({exc})"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise LoopLMError(f"{str(path)!r} is JSON but has no 'records' list (not a looplm export)")
    return [EvalRecord.from_dict(r) for r in data["records"]]
