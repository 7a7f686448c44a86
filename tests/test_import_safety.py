"""`looplm import SRC OUT` loses no folder and accepts nothing silently: an existing OUT needs
--overwrite (and then only a checkpoint is replaced), OUT and SRC never nest, a missing or broken
tokenizer and non-finite weights are refused in one line, and errors name the config.json key
the user wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pretrained_common import fixture
from safetensors.torch import load_file, save_file

from looplm.cli import main


def _src(tmp_path: Path, family: str = "ouro", tokenizer: bool = True) -> Path:
    src = tmp_path / f"src_{family}"
    shutil.copytree(fixture(family), src)
    if not tokenizer:
        (src / "tokenizer.json").unlink()
    return src


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def test_import_refuses_an_existing_folder_and_keeps_its_files(tmp_path, capsys):
    src, out = _src(tmp_path), tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["import", str(src), str(out)]) == 2
    assert "--overwrite" in _error(capsys)
    # --overwrite replaces a checkpoint only, never a folder of other files
    assert main(["import", str(src), str(out), "--overwrite"]) == 2
    assert "holds no looplm checkpoint" in _error(capsys)
    assert (out / "notes.txt").read_text() == "mine"


def test_import_over_a_checkpoint_needs_overwrite(tmp_path, capsys):
    src, out = _src(tmp_path), tmp_path / "ckpt"
    assert main(["import", str(src), str(out)]) == 0
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["import", str(src), str(out)]) == 2
    assert "exists; pass --overwrite" in _error(capsys)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert main(["import", str(src), str(out), "--overwrite"]) == 0
    assert (out / "state.json").is_file()


@pytest.mark.parametrize("where", ["same", "inside_src", "src_inside"])
def test_import_never_writes_over_its_source(tmp_path, capsys, where):
    src = _src(tmp_path)
    files = sorted(p.name for p in src.iterdir())
    out = {"same": src, "inside_src": src / "out", "src_inside": tmp_path}[where]
    assert main(["import", str(src), str(out), "--overwrite"]) == 2
    assert "source folder" in _error(capsys)
    assert sorted(p.name for p in src.iterdir()) == files
    assert not (src / "out").exists()


def test_import_without_a_tokenizer_says_what_to_pass(tmp_path, capsys):
    src = _src(tmp_path, "parcae", tokenizer=False)
    out = tmp_path / "p"
    assert main(["import", str(src), str(out)]) == 2
    err = _error(capsys)
    assert "no tokenizer.json" in err and "--tokenizer PATH" in err and "256" in err
    assert not out.exists()
    tok = fixture("parcae") / "tokenizer.json"
    assert main(["import", str(src), str(out), "--tokenizer", str(tok)]) == 0
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_invalid_tokenizer_is_refused(tmp_path, capsys):
    src = _src(tmp_path)
    (src / "tokenizer.json").write_text("{not json")
    out = tmp_path / "o"
    assert main(["import", str(src), str(out)]) == 2
    assert "tokenizer.json" in _error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("family", ["parcae", "huginn", "ouro"])
def test_shipped_fixture_imports_and_generates_text(tmp_path, capsys, family):
    """The fixtures docs/pretrained.md points at carry a tokenizer: import, then generate."""
    out = tmp_path / family
    assert main(["import", str(fixture(family)), str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "the quick", "--max-new", "3"]) == 0
    assert capsys.readouterr().out.startswith("the quick")


def test_non_finite_weights_are_refused(tmp_path, capsys):
    src = _src(tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors = {k: v.clone().fill_(float("nan")) for k, v in tensors.items()}
    save_file(tensors, str(src / "model.safetensors"))
    out = tmp_path / "o"
    assert main(["import", str(src), str(out)]) == 2
    err = _error(capsys)
    assert "NaN or infinite" in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    ("key", "value"), [("num_hidden_layers", 0), ("total_ut_steps", 0), ("total_ut_steps", "x")]
)
def test_import_errors_name_the_config_json_key(tmp_path, capsys, key, value):
    src = _src(tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = value
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["import", str(src), str(tmp_path / "o")]) == 2
    err = _error(capsys)
    assert f"config key {key}={value!r}" in err
    assert "train.depth_min" not in err and not err.startswith("error: model.")


def test_eval_of_an_import_without_dataset_says_what_to_pass(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["import", str(fixture("ouro")), str(out)]) == 0
    assert main(["eval", str(out), "--depths", "1", "--max-tokens", "16"]) == 2
    assert "--dataset text:PATH" in _error(capsys)
