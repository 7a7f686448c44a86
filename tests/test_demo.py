"""The demo writes its report, results and figure, and reports SCSE's zero forcing bias."""

from __future__ import annotations

import json
from pathlib import Path

import looplm.experiments.demo as demo
from looplm.cli import main


def test_demo_smoke(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo, "BUDGETS", {"default": (3, 16), "quick": (2, 16)})
    monkeypatch.setattr(demo, "DEPTHS", [1, 2, 4])
    assert main(["demo", "--quick", "--out", str(tmp_path), "--methods", "scse,looped"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["methods"]) == {"scse", "looped"}
    assert res["methods"]["scse"]["forcing_bias"]["max_abs"] == 0.0
    assert res["methods"]["looped"]["forcing_bias"]["max_abs"] > 0.0
    assert [r["depth"] for r in res["methods"]["scse"]["sweep"]] == [1, 2, 4]
    report = (tmp_path / "report.md").read_text()
    assert "| scse |" in report and "chance" in report
    png = (tmp_path / "depth_response.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "scse" / "ckpt" / "model.safetensors").exists()


def test_demo_other_task(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(demo, "BUDGETS", {"default": (2, 16), "quick": (2, 16)})
    monkeypatch.setattr(demo, "DEPTHS", [1, 2])
    args = ["demo", "--quick", "--out", str(tmp_path), "--methods", "scse", "--task", "graph_reach"]
    assert main(args) == 0
    assert "graph reachability" in (tmp_path / "report.md").read_text()
