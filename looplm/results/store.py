"""The results store: one row per **evaluation identity**, in a SQLite file.

An evaluation identity is what makes two measurements "the same evaluation" (paper, Reproducibility
Details: model configuration, training protocol, dataset and split, loop depth, seed, evaluation
tag, adaptive-runtime or calibration setting). Re-running an evaluation **replaces** its row; it
never adds a second one, so repeated benchmark runs cannot inflate the seed count.

Schema (table ``evaluations``; one row = one :class:`EvalRecord`)
-----------------------------------------------------------------

Identity columns (``UNIQUE`` together; empty values are stored as ``''``, never ``NULL``, because
SQLite treats NULLs as distinct in a UNIQUE constraint and duplicates would slip in):

=============== ======= ===================================================================
column          type    meaning / who fills it
=============== ======= ===================================================================
model_hash      TEXT    hash of the *model/training configuration*, **excluding the seed**
                        (all seeds of one configuration share it), e.g. ``'3f2a9c01'``
method          TEXT    recurrence / method name, e.g. ``'scse'``, ``'tuned_adapter'``
protocol        TEXT    training protocol, e.g. ``'wt2-1200'``, ``'wt103-5k'``
dataset         TEXT    evaluation corpus, e.g. ``'wikitext103'``, ``'lambada'``
split           TEXT    ``'validation'`` / ``'test'`` / ...
depth           INTEGER loop depth T (>= 1); for adaptive rows the depth *ceiling* (e.g. 48)
seed            INTEGER training seed of the evaluated model
eval_tag        TEXT    free tag separating evaluation variants (e.g. ``'ctx1024'``), or ``''``
adaptive_mode   TEXT    ``''`` for fixed depth; else the rule, e.g. ``'maxtoken:budget=8'``,
                        ``'kl:thr=1e-3'``, ``'router'``
calibration     TEXT    calibration setting that changes the metric (e.g. ``'val:target=8'``)
=============== ======= ===================================================================

Metric columns:

=============== ======= ===================================================================
n_tokens        INTEGER number of scored tokens (summed over all batches)
sum_nll         REAL    sum of per-token negative log-likelihoods in nats (over all batches);
                        PPL = exp(sum_nll / n_tokens), token-weighted (see ``stats``)
extra           TEXT    JSON object with metric-specific fields (below)
created_at      TEXT    ISO-8601 UTC time of the first write of this identity
updated_at      TEXT    ISO-8601 UTC time of the latest write
=============== ======= ===================================================================

Keys of ``extra`` that the statistics and report layers read (all optional; others are kept as is):

* ``n_correct``, ``n_examples`` (int) — task accuracy counts (LAMBADA target-token accuracy,
  synthetic tasks); accuracy = n_correct / n_examples.
* ``kind`` (str) — the evaluation kind that wrote the record (:mod:`looplm.evaluate.kinds`);
  the report puts the record in that kind's section.
* ``mean_depth`` (float) — achieved mean active loop depth of an adaptive evaluation.
* ``n_once``, ``n_rec``, ``train_tokens`` (numbers) and optional ``r`` (recurrence count; defaults
  to ``depth``) — a point of the recurrence scaling-law sweep (see :mod:`looplm.scaling.fit`).
* free diagnostics, e.g. ``flops_per_token``, ``wall_clock_s``, ``tokens_per_s``,
  ``peak_mem_bytes``, ``exact_word_correct``.

Concurrency: the file is in WAL mode with a busy timeout; every write is one ``BEGIN IMMEDIATE``
transaction with an ``INSERT ... ON CONFLICT DO UPDATE`` upsert, and "database is locked/busy"
errors are retried with jittered back-off until ``retry_deadline`` seconds have passed. Several
evaluation processes can therefore write into one store at the same time. (WAL needs a local
filesystem; on network filesystems SQLite falls back to its rollback journal.)

Typical use by evaluation code::

    from looplm.results.store import EvalRecord, ResultsStore

    with ResultsStore("runs/results.sqlite") as store:
        store.put(EvalRecord(model_hash=cfg_hash, method="scse", protocol="wt2-1200",
                             dataset="wikitext2", split="test", depth=8, seed=0,
                             n_tokens=acc.n_tokens, sum_nll=acc.sum_nll,
                             extra={"flops_per_token": 7.79e7}))
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from looplm.errors import LoopLMError
from looplm.io import atomic_write_json

SCHEMA_VERSION = 1

#: Identity fields, in the order of :meth:`EvalRecord.identity`.
IDENTITY_FIELDS: tuple[str, ...] = (
    "model_hash",
    "method",
    "protocol",
    "dataset",
    "split",
    "depth",
    "seed",
    "eval_tag",
    "adaptive_mode",
    "calibration",
)
_INT_IDENTITY = ("depth", "seed")
_STR_IDENTITY = tuple(f for f in IDENTITY_FIELDS if f not in _INT_IDENTITY)
METRIC_FIELDS: tuple[str, ...] = ("n_tokens", "sum_nll", "extra")
_ALL_COLUMNS = IDENTITY_FIELDS + METRIC_FIELDS + ("created_at", "updated_at")

_SQLITE_MAGIC = b"SQLite format 3\x00"

_T = TypeVar("_T")


def _json_default(obj: Any) -> Any:
    """JSON fallback for numpy / torch scalars (anything with ``.item()``) and paths."""
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(kw_only=True)
class EvalRecord:
    """One evaluation: its identity, token-level NLL totals and metric-specific ``extra`` fields.

    All fields are keyword-only. ``method``, ``depth`` and ``seed`` are required; the other
    identity strings default to ``''`` (``None`` is turned into ``''``). ``n_tokens`` and
    ``sum_nll`` are totals over *all* batches of the evaluation (not per-batch means), so that
    PPL is token-weighted. ``created_at``/``updated_at`` are filled by the store.
    """

    model_hash: str = ""
    method: str
    protocol: str = ""
    dataset: str = ""
    split: str = ""
    depth: int
    seed: int
    eval_tag: str = ""
    adaptive_mode: str = ""
    calibration: str = ""
    n_tokens: int = 0
    sum_nll: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    created_at: str | None = None
    updated_at: str | None = None

    def __post_init__(self) -> None:
        for name in _STR_IDENTITY:
            value = getattr(self, name)
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise LoopLMError(f"EvalRecord.{name} must be a string, got {value!r}")
            setattr(self, name, value)
        if not self.method:
            raise LoopLMError("EvalRecord.method must be a non-empty method name, got ''")
        for name in _INT_IDENTITY + ("n_tokens",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                if hasattr(value, "item") and float(value.item()).is_integer():
                    value = int(value.item())  # numpy / torch integer scalars
                else:
                    raise LoopLMError(f"EvalRecord.{name} must be an integer, got {value!r}")
            setattr(self, name, int(value))
        if self.depth < 1:
            raise LoopLMError(f"EvalRecord.depth must be >= 1 (loop depth T), got {self.depth}")
        if self.n_tokens < 0:
            raise LoopLMError(f"EvalRecord.n_tokens must be >= 0, got {self.n_tokens}")
        try:
            self.sum_nll = float(self.sum_nll)
        except (TypeError, ValueError):
            raise LoopLMError(
                f"EvalRecord.sum_nll must be a number, got {self.sum_nll!r}"
            ) from None
        if not math.isfinite(self.sum_nll) or self.sum_nll < 0:
            raise LoopLMError(
                f"EvalRecord.sum_nll must be a finite sum of NLLs >= 0, got {self.sum_nll!r}"
            )
        if self.n_tokens == 0 and self.sum_nll != 0:
            raise LoopLMError(f"EvalRecord has sum_nll={self.sum_nll} but n_tokens=0")
        if self.extra is None:
            self.extra = {}
        if not isinstance(self.extra, dict):
            raise LoopLMError(f"EvalRecord.extra must be a dict, got {type(self.extra).__name__}")
        try:  # normalise (numpy scalars -> Python) and fail now, not inside the store
            self.extra = json.loads(json.dumps(self.extra, default=_json_default))
        except (TypeError, ValueError) as exc:
            raise LoopLMError(f"EvalRecord.extra is not JSON-serializable: {exc}") from None

    def identity(self) -> tuple:
        """The evaluation identity: values of :data:`IDENTITY_FIELDS`, in that order."""
        return tuple(getattr(self, f) for f in IDENTITY_FIELDS)

    def identity_dict(self) -> dict[str, Any]:
        """The evaluation identity as ``{field: value}``."""
        return {f: getattr(self, f) for f in IDENTITY_FIELDS}

    @property
    def kind(self) -> str:
        """The evaluation kind that wrote this record (``extra['kind']``; ``''`` for records
        written before kinds were recorded)."""
        return str(self.extra.get("kind", ""))

    @property
    def mean_nll(self) -> float:
        """Token-weighted mean NLL (nats/token); NaN when no tokens were scored."""
        return self.sum_nll / self.n_tokens if self.n_tokens else math.nan

    @property
    def ppl(self) -> float:
        """Token-weighted perplexity ``exp(sum_nll / n_tokens)``; NaN when no tokens were scored."""
        return math.exp(self.mean_nll) if self.n_tokens else math.nan

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (JSON-ready)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalRecord:
        """Inverse of :meth:`to_dict`; unknown keys raise LoopLMError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise LoopLMError(f"unknown EvalRecord field(s) {unknown}; allowed: {sorted(names)}")
        return cls(**data)


def _is_locked(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in msg or "busy" in msg)


def _is_disk_full(exc: sqlite3.Error, path: Path) -> bool:
    """SQLite's SQLITE_FULL, or an I/O error on a file system with (almost) no space left: a
    full disk during a WAL or journal write is reported as a bare "disk I/O error"."""
    from looplm.errors import disk_nearly_full

    name = getattr(exc, "sqlite_errorname", "") or ""
    if name == "SQLITE_FULL" or "disk is full" in str(exc):
        return True
    io = name.startswith("SQLITE_IOERR") or "disk I/O error" in str(exc)
    return io and disk_nearly_full(str(path))


def _fault_cause(exc: sqlite3.Error, path: Path) -> str:
    """What SQLite's terse "unable to open database file" / "attempt to write a readonly
    database" / "disk I/O error" means here: the folder and the cause, where they can be told."""
    from looplm.errors import disk_nearly_full

    text = str(exc)
    folder = path.resolve().parent
    if not folder.is_dir():
        return f"its folder {folder} does not exist (SQLite: {text})"
    if disk_nearly_full(str(folder)):
        return f"the disk holding {folder} is full (SQLite: {text}); free some space or write the store elsewhere"
    readonly = "readonly" in text or "read-only" in text
    if (
        readonly
        or not os.access(folder, os.W_OK)
        or (path.exists() and not os.access(path, os.W_OK))
    ):
        return (
            f"the store or its folder {folder} is read-only (no write permission or a read-only "
            f"file system; SQLite writes a journal beside the store) (SQLite: {text}); write the "
            "store in a writable folder"
        )
    if "unable to open" in text:
        return f"SQLite cannot open or create it in {folder} ({text})"
    return f"an I/O error in {folder}: a failing or full device ({text})" if "I/O" in text else text


class ResultsStore:
    """SQLite results store keyed by evaluation identity (see the module docstring for the schema).

    Args:
        path: the ``.sqlite`` file.
        create: create the file when missing (else a missing file is a LoopLMError).
        timeout: SQLite busy timeout in seconds for one attempt.
        retry_deadline: keep retrying a locked write for this many seconds in total.
        synchronous: SQLite ``synchronous`` level: ``"FULL"`` (default: every commit is on disk
            before ``put`` returns) or ``"NORMAL"`` (faster; in WAL mode a power loss may drop
            the latest commits but never corrupts the file).
        read_only: open an existing store for reading only (what reports do): it is never
            created or changed, and it reads on read-only media and without write permission.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        create: bool = True,
        timeout: float = 10.0,
        retry_deadline: float = 120.0,
        synchronous: str = "FULL",
        read_only: bool = False,
    ) -> None:
        self.path = Path(path)
        self.read_only = bool(read_only)
        create = create and not self.read_only
        if synchronous not in ("NORMAL", "FULL"):
            raise LoopLMError(f"unknown synchronous mode {synchronous!r}; allowed: NORMAL, FULL")
        self.synchronous = synchronous
        self.timeout = float(timeout)
        self.retry_deadline = float(retry_deadline)
        #: number of times an operation was retried because the database was locked
        self.retries = 0
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        if not self.path.exists():
            if not create:
                raise LoopLMError(f"results store {str(self.path)!r} does not exist")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif self.path.is_dir():
            raise LoopLMError(f"results store {str(self.path)!r} is a folder, expected a file")
        elif self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                if f.read(16) != _SQLITE_MAGIC:
                    raise LoopLMError(f"{str(self.path)!r} is not a SQLite results store")
        self._retry(self._init_schema)

    # -- connection handling ----------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        # A connection must not cross a fork: reopen in a child process.
        if self._conn is None or self._pid != os.getpid():
            if self.read_only:
                conn = self._read_only_connection()
            else:
                conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
                conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            conn.execute(f"PRAGMA busy_timeout = {int(self.timeout * 1000)}")
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _read_only_connection(self) -> sqlite3.Connection:
        """``mode=ro``; where even that cannot open the file (a WAL store on read-only media,
        whose shared-memory file cannot be created) ``immutable=1``, which reads the file as it
        is on disk."""
        uri = self.path.resolve().as_uri()
        try:
            conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=self.timeout)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            return sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=self.timeout)

    def _retry(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        deadline = time.monotonic() + self.retry_deadline
        delay = 0.01
        while True:
            try:
                conn = self._connection()
            except sqlite3.Error as exc:
                raise LoopLMError(
                    f"results store {str(self.path)!r}: cannot open it: {_fault_cause(exc, self.path)}"
                ) from exc
            try:
                return fn(conn)
            except sqlite3.OperationalError as exc:
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                if _is_disk_full(exc, self.path):
                    raise LoopLMError(
                        f"results store {str(self.path)!r}: disk full (no space left on the "
                        f"device; SQLite: {exc}): nothing of this write was stored; free some "
                        "space or write the store elsewhere"
                    ) from exc
                if not _is_locked(exc):
                    raise LoopLMError(
                        f"results store {str(self.path)!r}: {_fault_cause(exc, self.path)}"
                    ) from exc
                if time.monotonic() > deadline:
                    raise LoopLMError(
                        f"results store {str(self.path)!r} stayed locked for more than "
                        f"{self.retry_deadline:g} s ({exc}); is another process holding it?"
                    ) from exc
                self.retries += 1
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.5)
            except sqlite3.DatabaseError as exc:
                if conn.in_transaction:
                    try:
                        conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise LoopLMError(f"results store {str(self.path)!r} is unreadable: {exc}") from exc

    def _check_version(self, version: str) -> None:
        if int(version) > SCHEMA_VERSION:
            raise LoopLMError(
                f"results store {str(self.path)!r} has schema version {version}; this looplm "
                f"reads versions <= {SCHEMA_VERSION} (upgrade looplm)"
            )

    def _init_schema(self, conn: sqlite3.Connection) -> None:
        tables = {
            row[0]
            for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name IN "
                "('meta', 'evaluations')"
            )
        }
        if tables == {"meta", "evaluations"}:  # existing store: read only (works on RO media)
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is not None:
                self._check_version(row[0])
                return
        if self.read_only:
            raise LoopLMError(f"{str(self.path)!r} is not a looplm results store (no evaluations)")
        if (
            "evaluations" not in tables
            and conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]
        ):
            raise LoopLMError(
                f"{str(self.path)!r} is a SQLite database but not a looplm results store"
            )
        conn.execute("PRAGMA journal_mode=WAL")  # persistent: set once, at creation
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        ident_cols = ",\n".join(
            f"  {f} INTEGER NOT NULL" if f in _INT_IDENTITY else f"  {f} TEXT NOT NULL DEFAULT ''"
            for f in IDENTITY_FIELDS
        )
        conn.execute(
            "CREATE TABLE IF NOT EXISTS evaluations (\n  id INTEGER PRIMARY KEY,\n"
            f"{ident_cols},\n"
            "  n_tokens INTEGER NOT NULL,\n  sum_nll REAL NOT NULL,\n"
            "  extra TEXT NOT NULL DEFAULT '{}',\n"
            "  created_at TEXT NOT NULL,\n  updated_at TEXT NOT NULL,\n"
            f"  UNIQUE ({', '.join(IDENTITY_FIELDS)})\n)"
        )
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
        if row is not None:
            self._check_version(row[0])

    def close(self) -> None:
        """Close the connection (the store can be used again; it reopens lazily)."""
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def __enter__(self) -> ResultsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------------
    def put(self, record: EvalRecord) -> None:
        """Insert ``record``, or replace the metrics of the row with the same identity.

        ``created_at`` of an existing row is kept; ``updated_at`` is set to now.
        """
        self.put_many([record])

    def put_many(self, records: Iterable[EvalRecord]) -> int:
        """Upsert several records in one transaction (all or nothing); returns how many."""
        records = list(records)
        for rec in records:
            if not isinstance(rec, EvalRecord):
                raise LoopLMError(f"ResultsStore.put expects EvalRecord, got {type(rec).__name__}")
        if not records:
            return 0
        cols = ", ".join(_ALL_COLUMNS)
        marks = ", ".join("?" for _ in _ALL_COLUMNS)
        updates = ", ".join(f"{c}=excluded.{c}" for c in METRIC_FIELDS + ("updated_at",))
        sql = (
            f"INSERT INTO evaluations ({cols}) VALUES ({marks}) "
            f"ON CONFLICT ({', '.join(IDENTITY_FIELDS)}) DO UPDATE SET {updates}"
        )

        def write(conn: sqlite3.Connection) -> int:
            now = _now_iso()
            rows = [
                rec.identity()
                + (rec.n_tokens, rec.sum_nll, json.dumps(rec.extra, sort_keys=True), now, now)
                for rec in records
            ]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql, rows)
            conn.execute("COMMIT")
            return len(rows)

        return self._retry(write)

    def delete(self, **filters: Any) -> int:
        """Delete the rows matching ``filters`` (same syntax as :meth:`query`); returns how many.

        At least one filter is required (use a new file to start afresh).
        """
        if not filters:
            raise LoopLMError("ResultsStore.delete needs at least one filter, e.g. method='scse'")
        where, params = self._where(filters)

        def run(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            n = conn.execute(f"DELETE FROM evaluations{where}", params).rowcount
            conn.execute("COMMIT")
            return n

        return self._retry(run)

    # -- reading ----------------------------------------------------------------------------
    @staticmethod
    def _where(filters: dict[str, Any]) -> tuple[str, list[Any]]:
        clauses, params = [], []
        for key, value in filters.items():
            if key not in IDENTITY_FIELDS:
                raise LoopLMError(
                    f"unknown results filter {key!r}; allowed: {', '.join(IDENTITY_FIELDS)}"
                )
            if isinstance(value, (list, tuple, set, frozenset)):
                values = ["" if v is None else v for v in value]
                if not values:
                    clauses.append("0")
                    continue
                clauses.append(f"{key} IN ({', '.join('?' for _ in values)})")
                params.extend(values)
            else:
                clauses.append(f"{key} = ?")
                params.append("" if value is None else value)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params

    def query(self, **filters: Any) -> list[EvalRecord]:
        """Records whose identity fields match ``filters``, ordered by identity.

        Each filter is ``field=value`` or ``field=[v1, v2, ...]`` (any of); fields are the
        identity fields. Example: ``store.query(method=["scse", "looped"], split="test")``.
        """
        where, params = self._where(filters)
        sql = f"SELECT {', '.join(_ALL_COLUMNS)} FROM evaluations{where} ORDER BY " + ", ".join(
            IDENTITY_FIELDS
        )
        rows = self._retry(lambda conn: conn.execute(sql, params).fetchall())
        out = []
        for row in rows:
            data = dict(zip(_ALL_COLUMNS, row))
            data["extra"] = json.loads(data["extra"])
            out.append(EvalRecord(**data))
        return out

    def get(self, *, method: str, depth: int, seed: int, **identity: Any) -> EvalRecord | None:
        """The record with exactly this identity (missing string fields mean ``''``), or None.

        Useful for sweeps that skip evaluations already in the store.
        """
        unknown = sorted(set(identity) - set(_STR_IDENTITY))
        if unknown:
            raise LoopLMError(f"unknown identity field(s) {unknown}; allowed: {IDENTITY_FIELDS}")
        full = {f: identity.get(f, "") for f in _STR_IDENTITY}
        full.update(method=method, depth=depth, seed=seed)
        found = self.query(**full)
        return found[0] if found else None

    def __len__(self) -> int:
        return self._retry(
            lambda conn: conn.execute("SELECT COUNT(*) FROM evaluations").fetchone()
        )[0]

    def export_json(self, path: str | os.PathLike) -> int:
        """Write every record to a JSON file atomically; returns the number of records.

        Format: ``{"schema_version": 1, "identity_fields": [...], "records": [EvalRecord dicts]}``
        (readable back with :func:`load_records`).
        """
        records = self.query()
        atomic_write_json(
            path,
            {
                "schema_version": SCHEMA_VERSION,
                "identity_fields": list(IDENTITY_FIELDS),
                "records": [r.to_dict() for r in records],
            },
        )
        return len(records)


def group_by(records: Sequence[EvalRecord], fields: Sequence[str]) -> dict[tuple, list[EvalRecord]]:
    """Group records by the values of ``fields`` (any EvalRecord attributes), keeping order."""
    groups: dict[tuple, list[EvalRecord]] = {}
    for rec in records:
        groups.setdefault(tuple(getattr(rec, f) for f in fields), []).append(rec)
    return groups
