"""Token caches on real WikiText-2: counts, reuse, staleness, corruption, batching, CLI."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import data_dir, require_data

from looplm import cli
from looplm.data.cache import (
    get_split_tokens,
    list_caches,
    prepare,
    shared_source,
)
from looplm.data.sources import eval_windows, sample_windows
from looplm.errors import LoopLMError

EOT = 50256
# GPT-2 token counts of the WikiText-2 (v1, "wiki.*.tokens") caches: the whole-file counts of
# the data folder's SOURCE.md (258,659 / 295,877 / 2,448,382) plus one <|endoftext|> per article.
WT2_COUNTS = {"train": 2_448_982, "validation": 258_719, "test": 295_937}
WT2_ARTICLES = {"train": 600, "validation": 60, "test": 60}
SOURCE_MD_COUNTS = {"train": 2_448_382, "validation": 258_659, "test": 295_877}


@pytest.fixture(scope="session")
def wt2_cache(tmp_path_factory):
    """WikiText-2 tokenized once per session (all three splits) into a temporary cache."""
    src = require_data("wikitext-2")
    out = tmp_path_factory.mktemp("wt2-cache")
    caches = {s: prepare("wikitext-2", s, "gpt2", src, out) for s in WT2_COUNTS}
    return out, caches


@pytest.fixture()
def small_wiki(tmp_path):
    """A small WikiText-style folder (first 300 lines of the validation file) for rebuild tests."""
    src = require_data("wikitext-2", "wiki.valid.tokens")
    folder = tmp_path / "wt"
    folder.mkdir()
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)[:300]
    (folder / "wiki.valid.tokens").write_text("".join(lines), encoding="utf-8")
    return folder


def test_wikitext2_gpt2_token_counts(wt2_cache):
    _, caches = wt2_cache
    for split, cache in caches.items():
        toks = np.asarray(cache.tokens)
        assert isinstance(cache.tokens, np.memmap) and cache.tokens.dtype == np.uint16
        assert cache.n_tokens == len(toks) == WT2_COUNTS[split]
        assert cache.meta["n_documents"] == WT2_ARTICLES[split]
        assert int((toks == EOT).sum()) == WT2_ARTICLES[split]
        assert len(toks) - WT2_ARTICLES[split] == SOURCE_MD_COUNTS[split]
        assert toks[-1] == EOT and toks.max() < 50257


def test_metadata_and_checksum(wt2_cache):
    out, caches = wt2_cache
    cache = caches["validation"]
    meta = json.loads(cache.meta_path.read_text())
    assert cache.bin_path.name == "wikitext-2.validation.gpt2.bin"
    assert (
        meta["tokenizer"] == "gpt2" and meta["dtype"] == "uint16" and meta["split"] == "validation"
    )
    assert meta["bin_sha256"] == hashlib.sha256(cache.bin_path.read_bytes()).hexdigest()
    assert meta["bin_bytes"] == cache.bin_path.stat().st_size == 2 * meta["n_tokens"]
    assert meta["source"] == {"kind": "local", "path": str(require_data("wikitext-2").resolve())}
    [src] = meta["source_files"]
    assert src["path"].endswith("wiki.valid.tokens") and src["sha256"] == (
        "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"
    )
    assert meta["looplm_version"] and meta["vocab_size"] == 50257 and meta["eot_id"] == EOT
    assert not list(out.glob("*.tmp"))


def test_cache_is_reused_and_round_trips(wt2_cache):
    out, caches = wt2_cache
    before = caches["validation"]
    mtime = before.bin_path.stat().st_mtime_ns
    again = prepare("wikitext-2", "valid", "gpt2", require_data("wikitext-2"), out)
    assert again.reused and again.bin_path == before.bin_path
    assert before.bin_path.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(again.tokens, before.tokens)
    from looplm.data.tokenizers import get_tokenizer

    text = (require_data("wikitext-2") / "wiki.valid.tokens").read_text(encoding="utf-8")
    decoded = get_tokenizer("gpt2").decode(np.asarray(again.tokens))
    assert decoded.replace("<|endoftext|>", "") == text


def test_bytes_tokenizer_cache(tmp_path):
    src = require_data("wikitext-2")
    cache = prepare("wikitext-2-raw", "validation", "bytes", src, tmp_path)
    raw = (src / "wiki.valid.raw").read_bytes()
    assert cache.n_tokens == len(raw) + 60 and cache.tokens.dtype == np.uint16
    toks = np.asarray(cache.tokens)
    assert bytes(toks[toks != 256].astype(np.uint8)) == raw


def test_c4_sample_caches_add_up_to_the_published_token_count(tmp_path):
    src = require_data("c4-sample")
    caches = [
        prepare("c4", s, "gpt2", src, tmp_path, counts=(800, 100, 100))
        for s in ("train", "validation", "test")
    ]
    assert [c.meta["n_documents"] for c in caches] == [800, 100, 100]
    assert [c.meta["rule"]["slice"] for c in caches] == [[0, 800], [800, 900], [900, 1000]]
    # SOURCE.md: 478,224 GPT-2 tokens over the 1,000 texts, each encoded separately
    assert sum(c.n_tokens for c in caches) - 1000 == 478_224


def test_stale_source_is_detected(small_wiki, tmp_path, caplog):
    out = tmp_path / "cache"
    first = prepare("wikitext-2", "validation", "gpt2", small_wiki, out)
    assert not first.reused
    f = small_wiki / "wiki.valid.tokens"
    # touched only (same bytes): reused, and the new mtime is recorded
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert prepare("wikitext-2", "validation", "gpt2", small_wiki, out).reused
    rec = json.loads(first.meta_path.read_text())["source_files"][0]
    assert rec["mtime_ns"] == f.stat().st_mtime_ns
    # content changed: rebuilt, with a notice
    with open(f, "a", encoding="utf-8") as fh:
        fh.write(" one more line \n")
    with caplog.at_level(logging.WARNING, logger="looplm.data"):
        rebuilt = prepare("wikitext-2", "validation", "gpt2", small_wiki, out)
    assert not rebuilt.reused and rebuilt.n_tokens > first.n_tokens
    assert "source changed" in caplog.text and "rebuilding" in caplog.text
    # a different split rule / tokenizer never reuses another's cache
    other = prepare("wikitext-2", "validation", "bytes", small_wiki, out)
    assert not other.reused and other.bin_path != rebuilt.bin_path


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-meta", "bad-meta", "no-bin"])
def test_corrupt_cache_is_detected_and_rebuilt(small_wiki, tmp_path, caplog, damage):
    out = tmp_path / "cache"
    good = prepare("wikitext-2", "validation", "gpt2", small_wiki, out)
    ref = np.array(good.tokens)
    data = bytearray(good.bin_path.read_bytes())
    if damage == "flip":
        data[10] ^= 0xFF
        good.bin_path.write_bytes(bytes(data))
    elif damage == "truncate":
        good.bin_path.write_bytes(bytes(data[:-6]))
    elif damage == "no-meta":
        good.meta_path.unlink()
    elif damage == "bad-meta":
        good.meta_path.write_text("{not json")
    else:
        good.bin_path.unlink()
    with caplog.at_level(logging.WARNING, logger="looplm.data"):
        fixed = prepare("wikitext-2", "validation", "gpt2", small_wiki, out)
    assert not fixed.reused and "rebuilding" in caplog.text
    np.testing.assert_array_equal(fixed.tokens, ref)
    assert prepare("wikitext-2", "validation", "gpt2", small_wiki, out).reused


def test_sample_windows_deterministic_per_seed(wt2_cache):
    toks = wt2_cache[1]["validation"].tokens
    a = sample_windows(toks, 8, 16, torch.Generator().manual_seed(3))
    b = sample_windows(toks, 8, 16, torch.Generator().manual_seed(3))
    c = sample_windows(toks, 8, 16, torch.Generator().manual_seed(4))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], c[0])
    x, y = a
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    full = np.asarray(toks, dtype=np.int64)
    for row_x, row_y in zip(x.numpy(), y.numpy()):  # each row is a real window of the split
        starts = np.flatnonzero(full[: len(full) - 16] == row_x[0])
        assert any(
            (full[s : s + 16] == row_x).all() and (full[s + 1 : s + 17] == row_y).all()
            for s in starts
        )
    tiny = np.arange(10, dtype=np.uint16)  # every start in [0, 10 - 4) is reachable
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_windows(tiny, 1, 4, g)[0][0, 0]) for _ in range(200)}
    assert seen == set(range(6))
    with pytest.raises(LoopLMError, match="too few"):
        sample_windows(tiny, 1, 10, g)


@pytest.mark.parametrize(
    "n,batch,seq,max_tokens",
    [(1000, 4, 32, None), (129, 3, 128, None), (50, 2, 7, 20), (2, 5, 8, None)],
)
def test_eval_windows_see_every_token_once(n, batch, seq, max_tokens):
    toks = np.arange(n, dtype=np.uint16) * 7 % 50257
    xs, ys = [], []
    for x, y in eval_windows(toks, batch, seq, max_tokens=max_tokens):
        assert x.shape == y.shape and x.shape[0] <= batch
        # context-wide, except a batch of partial windows only: as wide as its longest row
        assert x.shape[1] == int((y != -100).sum(1).max()) <= seq
        assert x.dtype == y.dtype == torch.int64
        xs.append(x.flatten())
        ys.append(y.flatten())
    x, y = torch.cat(xs), torch.cat(ys)
    mask = y != -100
    want = min(n - 1, max_tokens or n)
    assert int(mask.sum()) == want
    np.testing.assert_array_equal(y[mask].numpy(), toks[1 : want + 1])  # each once, in order
    np.testing.assert_array_equal(x[mask].numpy(), toks[:want])  # inputs line up with targets
    assert (x[~mask] == 0).all()


def test_eval_windows_on_real_split_and_errors(wt2_cache):
    toks = wt2_cache[1]["test"].tokens
    n_pred = sum(int((y != -100).sum()) for _, y in eval_windows(toks, 32, 128))
    assert n_pred == WT2_COUNTS["test"] - 1
    with pytest.raises(LoopLMError, match="too few"):
        next(eval_windows(np.zeros(1, np.uint16), 1, 4))
    with pytest.raises(LoopLMError, match="max_tokens"):
        next(eval_windows(toks, 1, 4, max_tokens=0))


def test_get_split_tokens_uses_the_shared_layout(wt2_cache, monkeypatch):
    out, caches = wt2_cache
    toks = get_split_tokens("wikitext-2", "valid", "gpt2", str(data_dir()), str(out))
    assert isinstance(toks, np.memmap)
    np.testing.assert_array_equal(toks, caches["validation"].tokens)
    monkeypatch.setenv("LOOPLM_DATA_DIR", str(data_dir()))
    monkeypatch.setenv("LOOPLM_CACHE_DIR", str(out))
    assert len(get_split_tokens("wikitext-2", "test", "gpt2")) == WT2_COUNTS["test"]
    # WikiText-103-raw validation/test come from WikiText-2's raw files (same articles)
    assert shared_source(data_dir(), "wikitext-103-raw", "test") == data_dir() / "wikitext-2"
    with pytest.raises(LoopLMError, match="unknown corpus"):
        get_split_tokens("bool_logic", "train", "gpt2", str(data_dir()), str(out))
    with pytest.raises(LoopLMError, match="no local copy of c4"):
        shared_source(out, "c4", "train")


# ----------------------------------------------------------------------------- CLI


@pytest.fixture()
def data_cli(monkeypatch):
    """``cli.main`` with only the data command registered (other commands may be in progress)."""
    assert "looplm.commands.data" in cli.COMMAND_MODULES
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["looplm.commands.data"])
    return cli.main


def test_cli_prepare_all_splits_and_info(wt2_cache, data_cli, capsys):
    out, _ = wt2_cache
    src = str(require_data("wikitext-2"))
    # the acceptance command (all splits by default); reuses the session's caches
    assert data_cli(["data", "prepare", "wikitext-2", "--source", src, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for split, n in WT2_COUNTS.items():
        assert f"wikitext-2 {split}: {n:,} tokens" in printed
    assert printed.count("(reused)") == 3
    assert data_cli(["data", "info", str(out), "--verify"]) == 0
    info = capsys.readouterr().out
    assert "wikitext-2.train.gpt2.bin  [ok]" in info and f"tokens {WT2_COUNTS['test']:,}" in info
    assert len(list_caches(out)) >= 3


def test_cli_prepare_split_with_data_dir(tmp_path, data_cli, capsys):
    require_data("lambada")  # skip with a reason on a clone without the shared data folder
    require_data("wikitext-2")
    out = tmp_path / "c"
    args = [
        "data",
        "prepare",
        "lambada",
        "--data-dir",
        str(data_dir()),
        "--out",
        str(out),
        "--tokenizer",
        "bytes",
    ]
    assert data_cli(args) == 0
    assert "lambada test:" in capsys.readouterr().out
    owt = [
        "data",
        "prepare",
        "openwebtext",
        "--source",
        str(require_data("owt-sample")),
        "--split",
        "valid",
        "test",
        "--counts",
        "1500,300,300",
        "--out",
        str(out),
    ]
    assert data_cli(owt) == 0
    printed = capsys.readouterr().out
    assert "openwebtext validation:" in printed and "300 documents" in printed
    # WikiText-103-raw from the shared folder: no train file; validation/test are WikiText-2's
    # raw files (same articles), found through the shared layout
    wt103 = [
        "data",
        "prepare",
        "wikitext-103-raw",
        "--data-dir",
        str(data_dir()),
        "--out",
        str(out),
        "--tokenizer",
        "bytes",
    ]
    assert data_cli(wt103) == 0
    printed = capsys.readouterr().out
    assert "wikitext-103-raw validation: 1,146,906 tokens" in printed  # bytes + 60 EOT
    assert "wikitext-103-raw test:" in printed and " train:" not in printed


def test_cli_errors_exit_2(tmp_path, data_cli, capsys):
    bad = [
        ["data", "prepare", "wikitext-3", "--out", str(tmp_path)],
        ["data", "prepare", "wikitext-2", "--source", str(tmp_path / "x"), "--out", str(tmp_path)],
        ["data", "prepare", "wikitext-2", "--source", str(tmp_path), "--split", "dev2"],
        ["data", "prepare", "wikitext-2", "--source", str(tmp_path)],  # no wiki.* files
        ["data", "info", str(tmp_path)],
        ["data", "info", str(tmp_path / "missing")],
    ]
    for argv in bad:
        assert data_cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err


def test_info_reports_a_damaged_cache(small_wiki, tmp_path, data_cli, capsys):
    out = tmp_path / "cache"
    cache = prepare("wikitext-2", "validation", "bytes", small_wiki, out)
    with open(cache.bin_path, "ab") as f:
        f.write(b"\0\0")
    assert data_cli(["data", "info", str(out)]) == 1  # a damaged cache is a failure: scripts see it
    assert "[corrupt (token file has" in capsys.readouterr().out


def test_the_suite_never_writes_the_users_cache() -> None:
    """conftest points LOOPLM_CACHE_DIR at a folder of this session: a test that imports a
    checkpoint or tokenizes a corpus leaves ~/.cache/looplm alone."""
    from looplm.data.cache import default_cache_dir

    home = Path("~/.cache/looplm").expanduser().resolve()
    assert default_cache_dir().resolve() != home
