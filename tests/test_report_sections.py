"""Evaluation kinds own their report sections: records carry their kind, the report writes each
registered section from its kinds' records, a kind and its section added by a plugin module show
up in a report, and records written before kinds were recorded report exactly as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looplm import build_model
from looplm.cli import main
from looplm.model.checkpoint import save_checkpoint
from looplm.results.report import write_report
from looplm.results.store import EvalRecord, ResultsStore
from looplm.settings.config import load_config

REPO = Path(__file__).resolve().parents[1]

PLUGIN = '''"""An evaluation kind with its own report section, outside looplm."""

from looplm.evaluate.kinds import EvaluationKind, register_kind
from looplm.results.sections import ReportSection, register_section


@register_kind
class Echo(EvaluationKind):
    """Echoes the loop depth (the plugin test's kind)."""

    name = "echo"
    section = "echo"
    order = 95

    @classmethod
    def configure(cls, evaluate):
        return cls() if evaluate.get("echo") else None


@register_section
class EchoSection(ReportSection):
    """One line per echo record."""

    name = "echo"
    kinds = ("echo",)
    order = 90
    json_keys = ("echo",)

    def write(self, records):
        self.report.md += ["## Echo section", ""]
        for r in sorted(records, key=lambda r: (r.method, r.depth, r.seed)):
            self.report.md.append(f"- echo {r.method} T={r.depth} seed={r.seed}")
            self.report.json["echo"].append({"method": r.method, "depth": r.depth})
        self.report.md.append("")
'''


def _rec(method: str, depth: int, seed: int, nll: float, **kw) -> EvalRecord:
    base = dict(protocol="p", dataset="wikitext-2", split="test", n_tokens=100)
    base.update(kw)
    return EvalRecord(
        model_hash=f"h{method}", method=method, depth=depth, seed=seed, sum_nll=nll, **base
    )


def _records() -> list[tuple[str, EvalRecord]]:
    """(kind, record) pairs of four built-in kinds, three seeds each."""
    out = []
    for seed in range(3):
        for m, off in (("scse", 0.0), ("looped", 7.0)):
            for d in (2, 8, 16):
                out.append(("fixed", _rec(m, d, seed, 500.0 - 3 * d + off + seed)))
            for mode, mean in (("kl:thr=0.01", 5.5), ("kl:thr=0.1", 3.2)):
                out.append(
                    (
                        "adaptive",
                        _rec(m, 16, seed, 470.0 + off + seed, adaptive_mode=mode,
                             extra={"mean_depth": mean + 0.1 * seed}),
                    )
                )  # fmt: skip
            for diff in (1, 2):
                for d in (1, 4):
                    out.append(
                        (
                            "frontier",
                            _rec(m, d, seed, 50.0, dataset="bool_logic", split=f"difficulty={diff}",
                                 extra={"n_correct": 40 + d * diff + seed, "n_examples": 64,
                                        "train_difficulty": [1, 1]}),
                        )
                    )  # fmt: skip
            out.append(
                (
                    "lambada",
                    _rec(m, 8, seed, 900.0 + off, dataset="lambada",
                         extra={"n_correct": 10 + seed, "n_examples": 50}),
                )
            )  # fmt: skip
    return out


def _report(tmp: Path, name: str, records: list[EvalRecord]) -> tuple[str, dict]:
    store = tmp / f"{name}.sqlite"
    with ResultsStore(store) as s:
        s.put_many(records)
    res = write_report(store, tmp / name, seeds=[0, 1, 2], n_boot=200, figures=False)
    md = [ln for ln in res.report_md.read_text().splitlines() if "Generated" not in ln]
    data = json.loads(res.results_json.read_text())
    for key in ("generated", "source"):
        data.pop(key)
    return "\n".join(md[1:]), data


def test_records_without_a_kind_report_as_records_with_their_kinds(tmp_path: Path) -> None:
    pairs = _records()
    stamped = [
        EvalRecord(**{**r.__dict__, "extra": {**r.extra, "kind": k}}) for k, r in pairs
    ]  # fmt: skip
    assert {r.kind for r in stamped} == {"fixed", "adaptive", "frontier", "lambada"}
    old_md, old_json = _report(tmp_path, "old", [r for _, r in pairs])
    new_md, new_json = _report(tmp_path, "new", stamped)
    assert "## Computational frontier" in old_md and "Static T=8" in old_md
    assert old_md == new_md and old_json == new_json


def test_a_record_goes_to_its_kinds_section_whatever_its_fields(tmp_path: Path) -> None:
    """A fixed-depth record on a split that looks like a frontier difficulty stays in the
    depth tables once it says its kind; without a kind the fields decide."""
    counts = {"n_correct": 30, "n_examples": 64}
    recs = [
        _rec(m, d, s, 400.0 + d + s, split="difficulty=3", extra={"kind": "fixed", **counts})
        for m in ("scse", "looped")
        for d in (2, 4)
        for s in range(3)
    ]
    md, data = _report(tmp_path, "kinded", recs)
    assert "Computational frontier" not in md and len(data["fixed_depth"]) == 1
    legacy = [EvalRecord(**{**r.__dict__, "extra": counts}) for r in recs]
    md, data = _report(tmp_path, "legacy", legacy)
    assert "Computational frontier" in md and data["fixed_depth"] == []


def _env(path: Path, plugins: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOOPLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(REPO), env.get("PYTHONPATH", "")])
    env["LOOPLM_NO_PROGRESS"] = "1"
    if plugins:
        env["LOOPLM_PLUGINS"] = plugins
    return env


def test_a_plugin_kind_brings_its_report_section(tmp_path: Path) -> None:
    pkg = tmp_path / "plugins" / "looplm_echo_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN)
    store = tmp_path / "r.sqlite"
    recs = [_rec(m, d, s, 300.0 + d, extra={"kind": "fixed"}) for m in ("scse",) for d in (2, 4)
            for s in range(3)]  # fmt: skip
    recs += [_rec("scse", d, s, 10.0, extra={"kind": "echo"}) for d in (3, 5) for s in range(3)]
    with ResultsStore(store) as s:
        s.put_many(recs)
    cmd = [sys.executable, "-m", "looplm", "report", str(store), "--out", str(tmp_path / "rep")]
    cmd += ["--seeds", "0,1,2", "--no-figures", "--quiet"]
    env = _env(tmp_path / "plugins", "looplm_echo_demo")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Echo section" in md and "- echo scse T=5 seed=2" in md
    assert md.index("### PPL") < md.index("## Echo section")  # its order: after the depth tables
    assert "T=3" not in md.split("## Echo section")[0]  # echo rows are not in the depth tables
    data = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert len(data["echo"]) == 6 and len(data["fixed_depth"]) == 1
    code = "from looplm.evaluate.kinds import kind_names, evaluate_keys; "
    code += "print('echo' in kind_names(), 'echo' in evaluate_keys())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
    # without the plugin the report names the kind it cannot place, in one line
    out = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path, None), capture_output=True, text=True)
    assert out.returncode == 2 and "'echo'" in out.stderr and "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ck") / "ckpt"
    over = ["model.preset=tiny", "model.recurrence=looped", "model.dropout=0.0"]
    over += ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "eval.n_examples=16"]
    cfg = load_config(None, over)
    torch.manual_seed(0)
    model = build_model("tiny", "looped", dropout=0.0, d_model=32, n_heads=2, d_ff=64)
    save_checkpoint(path, model, cfg, state={"step": 0})
    return str(path)


def test_eval_and_diagnose_write_records_of_their_kinds(ckpt: str, tmp_path: Path) -> None:
    store = str(tmp_path / "r.sqlite")
    torch.set_num_threads(1)
    assert main(["eval", ckpt, "--depths", "1,2", "--store", store]) == 0
    argv = ["eval", ckpt, "--depths", "2", "--dataset", "graph_reach", "--store", store]
    assert main(argv) == 0
    argv = ["diagnose", ckpt, "--out", str(tmp_path / "d"), "--loops", "2", "--batches", "1"]
    argv += ["--batch-size", "1", "--steer-inputs", "1", "--check-steps", "0", "--no-plots"]
    assert main([*argv, "--store", store]) == 0
    with ResultsStore(store) as s:
        kinds = sorted((r.dataset, r.depth, r.kind) for r in s.query())
    assert kinds == [
        ("bool_logic", 1, "fixed"),
        ("bool_logic", 2, "diagnostics"),
        ("bool_logic", 2, "fixed"),
        ("graph_reach", 2, "transfer"),
    ]
