"""What a new user meets first: one default depth for generate and serve (the model's), progress
bars only on a terminal and never under LOOPLM_NO_PROGRESS=1, the store's split names in the JSON,
a report that says when it replaces another, and help texts that name what can be passed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pretrained_common import fixture

from looplm.cli import build_parser, main
from looplm.model import model_from_config
from looplm.model.checkpoint import save_checkpoint
from looplm.settings.config import load_config

REPO = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "eval.n_examples=8"]


def _checkpoint(tmp_path: Path, depth: int = 3) -> Path:
    cfg = load_config("tiny_bool", [*SMALL, f"train.depth_max={depth}", "train.depth_min=1"])
    return save_checkpoint(tmp_path / "run" / "ckpt", model_from_config(cfg.model), cfg)


def test_generate_defaults_to_an_imported_models_trained_depth(tmp_path, capsys):
    imported = tmp_path / "ouro"
    assert main(["import", str(fixture("ouro")), str(imported)]) == 0  # Ouro's trained T = 4
    capsys.readouterr()
    assert main(["generate", str(imported), "--prompt", "the", "--max-new", "1"]) == 0
    out = capsys.readouterr()
    assert "at T=4 " in out.out + out.err


def test_generate_reports_the_checkpoints_depth(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path, depth=3)
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", "T&F=", "--max-new", "1"]) == 0
    out = capsys.readouterr()
    assert "at T=3 " in out.out + out.err
    assert main(["generate", str(ckpt), "--prompt", "T&F=", "--max-new", "1", "--loops", "2"]) == 0
    out = capsys.readouterr()
    assert "at T=2 " in out.out + out.err


@pytest.mark.parametrize(("tty", "env"), [(True, "1"), (False, None)])
def test_eval_draws_no_bar_off_a_terminal_or_when_asked(tmp_path, capsys, monkeypatch, tty, env):
    ckpt = _checkpoint(tmp_path)
    if env is None:
        monkeypatch.delenv("LOOPLM_NO_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("LOOPLM_NO_PROGRESS", env)
    monkeypatch.setattr("sys.stderr.isatty", lambda: tty, raising=False)
    capsys.readouterr()
    assert main(["eval", str(ckpt), "--depths", "1,2"]) == 0
    out = capsys.readouterr()
    assert "\r" not in out.err and "eval" not in out.err
    assert json.loads(out.out)["split"] == "validation"  # the store's name for it


def test_report_says_when_it_replaces_an_earlier_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOOPLM_NO_PROGRESS", "1")
    ckpt = _checkpoint(tmp_path)
    store = tmp_path / "results.sqlite"
    assert main(["eval", str(ckpt), "--depths", "1,2", "--store", str(store)]) == 0
    report = ["report", str(store), "--quiet", "--no-figures", "--seeds", "0"]
    assert main(report) == 0
    assert "replacing" not in capsys.readouterr().err
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**Bold**" not in md and "nothing to compare" in md  # one method: no bold promised
    assert main(report) == 0
    assert f"replacing the earlier report in {tmp_path / 'report'}" in capsys.readouterr().err


def test_license_file_is_the_one_pyproject_names():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^license = (\{ text = )?"MIT"', pyproject, re.M)
    assert (REPO / "LICENSE").read_text().startswith("MIT License")


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices[command].format_help()


def test_help_texts_name_what_can_be_passed():
    serve = _help("serve")
    assert not [x for x in serve.split("\n  --") if x.count("(default:") > 1]
    assert "maxtoken" in serve and "maxtoken" in _help("generate")
    assert "tiny_bool" in _help("train") and "own_text" in _help("train")
    assert "text:PATH" in re.sub(r"\s+", " ", _help("eval"))
    assert "HRM-Text" in _help("import")


def test_every_shipped_config_is_package_data():
    """pyproject's package-data globs take every file under configs/ into the wheel (through the
    looplm/configs link), so an installed looplm finds what the checkout finds."""
    from pathlib import PurePosixPath

    from looplm.settings.config import CONFIG_DIR

    assert CONFIG_DIR == REPO / "looplm" / "configs" or CONFIG_DIR.resolve() == REPO / "configs"
    assert (REPO / "looplm" / "configs").resolve() == (REPO / "configs").resolve()
    block = re.search(
        r"\[tool.setuptools.package-data\]\nlooplm = \[(.*?)\]",
        (REPO / "pyproject.toml").read_text(),
    )
    globs = [g.strip().strip('"') for g in block.group(1).split(",")]
    files = [p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*") if p.is_file()]
    assert files
    for f in files:
        path = PurePosixPath("configs", f.as_posix())  # a glob's "*" stays inside one folder
        assert any(
            len(path.parts) == len(PurePosixPath(g).parts) and path.match(g) for g in globs
        ), f
