"""Files looplm writes are shareable: atomically written files get the mode an ordinary write
would give them (0644 under umask 022), not the private 0600 of the temp file behind them."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from looplm.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from looplm.model import build_model
from looplm.model.checkpoint import save_checkpoint
from looplm.results.plotting import new_figure, save_png
from looplm.settings.config import dump_config, load_config


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_atomic_writes_follow_the_umask(tmp_path: Path, umask_022: None) -> None:
    atomic_write_text(tmp_path / "a.txt", "x")
    atomic_write_json(tmp_path / "sub" / "b.json", {"k": 1})
    atomic_write_bytes(tmp_path / "c.bin", b"\0")
    for name in ("a.txt", "sub/b.json", "c.bin"):
        assert _mode(tmp_path / name) == 0o644, name
    os.umask(0o077)
    atomic_write_text(tmp_path / "private.txt", "x")
    assert _mode(tmp_path / "private.txt") == 0o600


def test_a_rewritten_file_keeps_its_own_mode(tmp_path: Path, umask_022: None) -> None:
    p = tmp_path / "report.md"
    p.write_text("old")
    p.chmod(0o640)
    atomic_write_text(p, "new")
    assert p.read_text() == "new" and _mode(p) == 0o640


def test_checkpoint_config_and_figure_are_0644(tmp_path: Path, umask_022: None) -> None:
    cfg = load_config("tiny_bool", [f"out_dir={tmp_path}"])
    model = build_model("tiny", "scse", vocab_size=cfg.model.vocab_size)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg)
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    assert files
    atomic_write_text(tmp_path / "config.yaml", dump_config(cfg))
    fig, ax = new_figure((2, 2))
    ax.plot([0, 1], [0, 1])
    save_png(fig, tmp_path / "fig.png")
    for p in [*files, tmp_path / "config.yaml", tmp_path / "fig.png"]:
        assert _mode(p) == 0o644, (p, oct(_mode(p)))
