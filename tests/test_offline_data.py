"""Real data on a machine without it: a corpus with no local copy and no network fails at once
with one line saying what to place where and which setting names the folder, not after the
datasets library's retries with a hub error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from looplm.cli import main
from looplm.data import corpora


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LOOPLM_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOOPLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    # a checkout with ../shared/data beside it would find the data: pretend there is none
    monkeypatch.setattr("looplm.data.cache.default_data_dir", lambda: None)


@pytest.mark.parametrize("name", ["wikitext-2", "lambada", "c4"])
def test_offline_resolution_names_the_data_folder(offline: None, name: str) -> None:
    split = "test" if name == "lambada" else "train"
    with pytest.raises(corpora.LoopLMError) as err:
        corpora.resolve_split(name, split)
    msg = str(err.value)
    assert "\n" not in msg
    for part in ("HF_HUB_OFFLINE=1", "LOOPLM_DATA_DIR", "data.data_dir", corpora.DATA_LAYOUT[name]):
        assert part in msg, (part, msg)
    assert f"looplm data prepare {name}" in msg


def test_unreachable_hub_is_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    calls = []

    def refuse(addr, timeout=None):
        calls.append(addr)
        raise OSError(101, "Network is unreachable")

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(corpora, "_reachable", {})
    monkeypatch.setattr(socket, "create_connection", refuse)
    first = corpora.hub_offline_reason()
    assert first == "huggingface.co is unreachable (Network is unreachable)"
    assert corpora.hub_offline_reason() == first and len(calls) == 1


def test_train_tiny_wt2_without_data_ends_in_the_one_line_error(
    offline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.perf_counter()
    assert main(["train", "tiny_wt2", "out_dir=run"]) == 2
    assert time.perf_counter() - t0 < 20  # no hub retries
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LOOPLM_DATA_DIR=DIR or data.data_dir=DIR" in err[0], err
