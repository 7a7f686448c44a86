"""The results store: identities, upserts, filters, export, locking and concurrent writers."""

from __future__ import annotations

import json
import multiprocessing as mp
import sqlite3
import threading
import time

import pytest

from looplm.errors import LoopLMError
from looplm.results.export import load_records
from looplm.results.store import IDENTITY_FIELDS, EvalRecord, ResultsStore


def make(method="scse", depth=8, seed=0, n=1000, nll=4600.0, **kw) -> EvalRecord:
    return EvalRecord(method=method, depth=depth, seed=seed, n_tokens=n, sum_nll=nll, **kw)


def test_roundtrip_and_identity(tmp_path):
    r = make(
        model_hash="abc",
        protocol="wt2-1200",
        dataset="wikitext2",
        split="test",
        extra={"n_correct": 3, "n_examples": 10, "flops_per_token": 7.79e7},
    )
    assert r.identity() == ("abc", "scse", "wt2-1200", "wikitext2", "test", 8, 0, "", "", "")
    assert tuple(r.identity_dict()) == IDENTITY_FIELDS
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.put(r)
        (got,) = store.query()
    assert got.identity() == r.identity()
    assert (got.n_tokens, got.sum_nll, got.extra) == (r.n_tokens, r.sum_nll, r.extra)
    assert got.created_at and got.updated_at == got.created_at


def test_rerun_updates_instead_of_duplicating(tmp_path):
    store = ResultsStore(tmp_path / "r.sqlite")
    store.put(make(nll=4600.0, extra={"wall_clock_s": 1.0}))
    (first,) = store.query()
    time.sleep(0.01)
    store.put(make(nll=4500.0, extra={"wall_clock_s": 2.0}))
    (second,) = store.query()
    assert len(store) == 1
    assert second.sum_nll == 4500.0 and second.extra == {"wall_clock_s": 2.0}
    assert second.created_at == first.created_at and second.updated_at > first.updated_at
    # any identity field that differs makes a new evaluation
    for change in (
        {"eval_tag": "ctx1024"},
        {"adaptive_mode": "kl:thr=1e-3"},
        {"calibration": "val"},
        {"seed": 1},
        {"depth": 16},
        {"model_hash": "x"},
    ):
        store.put(make(**change))
    assert len(store) == 7
    store.close()


def test_empty_identity_fields_are_empty_strings_not_null(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.put(make(eval_tag=None, calibration=None))
        store.put(make(eval_tag=None, calibration=None, nll=1.0))  # same identity
        assert len(store) == 1
    conn = sqlite3.connect(path)
    nulls = conn.execute(
        "SELECT COUNT(*) FROM evaluations WHERE "
        + " OR ".join(f"{f} IS NULL" for f in IDENTITY_FIELDS)
    ).fetchone()[0]
    empty = conn.execute("SELECT COUNT(*) FROM evaluations WHERE eval_tag = ''").fetchone()[0]
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    conn.close()
    assert nulls == 0 and empty == 1 and mode == "wal"


def test_query_filters_and_get(tmp_path):
    with ResultsStore(tmp_path / "r.sqlite") as store:
        store.put_many(
            make(method=m, depth=d, seed=s)
            for m in ("scse", "looped")
            for d in (4, 8)
            for s in (0, 1, 2)
        )
        assert len(store.query(method="scse")) == 6
        assert len(store.query(method="scse", depth=[4, 8], seed=(0, 2))) == 4
        assert store.query(method=[]) == []
        assert store.get(method="looped", depth=4, seed=2).depth == 4
        assert store.get(method="looped", depth=4, seed=2, eval_tag="nope") is None
        with pytest.raises(LoopLMError, match="unknown results filter 'ppl'"):
            store.query(ppl=3)
        assert store.delete(method="looped", depth=4) == 3
        assert len(store) == 9


def test_record_validation():
    with pytest.raises(LoopLMError, match="depth"):
        make(depth=0)
    with pytest.raises(LoopLMError, match="depth"):
        make(depth=True)
    with pytest.raises(LoopLMError, match="n_tokens"):
        make(n=-1)
    with pytest.raises(LoopLMError, match="sum_nll"):
        make(nll=float("nan"))
    with pytest.raises(LoopLMError, match="method"):
        make(method="")
    with pytest.raises(LoopLMError, match="JSON"):
        make(extra={"x": object()})
    np = pytest.importorskip("numpy")
    r = make(depth=np.int64(8), seed=np.int32(1), extra={"v": np.float32(0.5), "i": np.int64(2)})
    assert (r.depth, r.seed, r.extra) == (8, 1, {"v": 0.5, "i": 2})


def test_export_json_and_load_records(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.put_many([make(seed=s, extra={"mean_depth": 8.5}) for s in range(3)])
        assert store.export_json(tmp_path / "out" / "export.json") == 3
    data = json.loads((tmp_path / "out" / "export.json").read_text())
    assert data["schema_version"] == 1 and len(data["records"]) == 3
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["export.json"]  # no temp files
    from_json = load_records(tmp_path / "out" / "export.json")
    from_db = load_records(path)
    assert [r.to_dict() for r in from_json] == [r.to_dict() for r in from_db]


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(LoopLMError, match="does not exist"):
        ResultsStore(tmp_path / "missing.sqlite", create=False)
    with pytest.raises(LoopLMError, match="does not exist"):
        load_records(tmp_path / "missing.sqlite")
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database at all, just text")
    with pytest.raises(LoopLMError, match="not a SQLite"):
        ResultsStore(bad)
    with pytest.raises(LoopLMError, match="neither"):
        load_records(bad)


def test_locked_store_is_retried(tmp_path):
    path = tmp_path / "r.sqlite"
    store = ResultsStore(path, timeout=0.02, retry_deadline=10.0)
    quick = ResultsStore(path, timeout=0.02, retry_deadline=0.2)
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")  # hold the write lock
    threading.Timer(0.4, lambda: blocker.execute("COMMIT")).start()
    t0 = time.monotonic()
    store.put(make())
    assert time.monotonic() - t0 >= 0.3 and store.retries > 0
    assert len(store) == 1
    # a lock held past the deadline is a clear error, not a hang
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(LoopLMError, match="locked"):
            quick.put(make(seed=5))
    finally:
        blocker.execute("COMMIT")
        blocker.close()


# ----------------------------------------------------------------------------- concurrency
N_WRITERS, N_EACH, OFFSET, N_IDS = 4, 200, 100, 500


def _identity_for(k: int) -> dict:
    return {
        "method": f"m{k % 3}",
        "depth": 1 + k % 4,
        "seed": k,
        "eval_tag": "" if k % 2 else "tag",
    }


def _writer(path: str, p: int, barrier, results) -> None:
    store = ResultsStore(path)
    barrier.wait()  # all writers start together
    t0 = time.perf_counter()
    for j in range(N_EACH):  # one transaction per put, as evaluation code does
        k = (p * OFFSET + j) % N_IDS
        store.put(
            EvalRecord(
                **_identity_for(k),
                n_tokens=1000 + j,
                sum_nll=float(p * 1000 + j),
                extra={"writer": p, "j": j, "k": k},
            )
        )
    results.put((p, time.perf_counter() - t0, store.retries))
    store.close()


def test_concurrent_writers_lose_nothing_and_duplicate_nothing(tmp_path):
    path = str(tmp_path / "concurrent.sqlite")
    ResultsStore(path).close()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N_WRITERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(path, p, barrier, results)) for p in range(N_WRITERS)
    ]
    t0 = time.perf_counter()
    for pr in procs:
        pr.start()
    timings = sorted(results.get(timeout=120) for _ in procs)
    for pr in procs:
        pr.join(timeout=120)
    elapsed = time.perf_counter() - t0
    assert all(pr.exitcode == 0 for pr in procs), [pr.exitcode for pr in procs]

    writers_of: dict[int, dict[int, int]] = {}  # k -> {writer: j}
    for p in range(N_WRITERS):
        for j in range(N_EACH):
            writers_of.setdefault((p * OFFSET + j) % N_IDS, {})[p] = j
    assert len(writers_of) == N_IDS  # the identities overlap: 800 writes, 500 identities

    conn = sqlite3.connect(path)
    dup_groups = conn.execute(
        f"SELECT COUNT(*) FROM (SELECT 1 FROM evaluations GROUP BY {', '.join(IDENTITY_FIELDS)} "
        "HAVING COUNT(*) > 1)"
    ).fetchone()[0]
    conn.close()
    records = ResultsStore(path).query()
    assert dup_groups == 0
    assert len(records) == N_IDS  # none lost, none duplicated
    for r in records:
        k = r.extra["k"]
        assert r.identity() == EvalRecord(**_identity_for(k), n_tokens=1).identity()
        p, j = r.extra["writer"], r.extra["j"]
        assert writers_of[k].get(p) == j  # the row is one complete write of that identity
        assert r.sum_nll == p * 1000 + j and r.n_tokens == 1000 + j
    write_s = max(t for _, t, _ in timings)
    retries = sum(r for _, _, r in timings)
    print(
        f"\n{N_WRITERS} writers x {N_EACH} puts ({N_IDS} identities): write phase "
        f"{write_s:.2f} s, {retries} lock retries, {elapsed:.2f} s incl. process start"
    )


def test_foreign_and_newer_databases_are_refused(tmp_path):
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(LoopLMError, match="not a looplm results store"):
        ResultsStore(other)
    newer = tmp_path / "newer.sqlite"
    ResultsStore(newer).close()
    conn = sqlite3.connect(newer)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(LoopLMError, match="schema version 99"):
        ResultsStore(newer)


def test_existing_store_opens_and_reads_while_a_writer_holds_the_lock(tmp_path):
    """Opening an existing store takes no write lock, so reports can read during a sweep."""
    path = tmp_path / "r.sqlite"
    with ResultsStore(path) as store:
        store.put(make())
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    blocker.execute("UPDATE evaluations SET n_tokens = 1")  # uncommitted
    try:
        reader = ResultsStore(path, create=False, timeout=0.02, retry_deadline=0.1)
        (got,) = reader.query()
        assert got.n_tokens == 1000 and reader.retries == 0  # the committed snapshot
        reader.close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
