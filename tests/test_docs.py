"""The documentation's examples run: the complete example recurrence of docs/methods.md is a
working method (the registry-parametrised tests pass on it), and the README links resolve."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _example(tmp: Path) -> Path:
    text = (REPO / "docs" / "methods.md").read_text()
    section = text.split("## Adding a method", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    pkg = tmp / "my_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "damped.py").write_text(code)
    return tmp


def _env(path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOOPLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(REPO), env.get("PYTHONPATH", "")])
    env["LOOPLM_PLUGINS"] = "my_methods.damped"
    env["LOOPLM_NO_PROGRESS"] = "1"
    return env


def test_the_example_recurrence_is_a_working_method(tmp_path: Path) -> None:
    env = _env(_example(tmp_path))
    cmd = [sys.executable, "-m", "looplm", "params", "--method", "damped", "--preset", "tiny"]
    out = subprocess.run([*cmd, "step_init=0.3"], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "recurrence" in out.stdout, out.stderr[-2000:]
    out = subprocess.run([*cmd, "step_init=2"], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "step_init=2.0 must be in (0, 1]" in out.stderr
    files = ["tests/test_equations.py", "tests/test_param_counts.py", "tests/test_recurrences.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-o", "addopts=", "-p", "no:cacheprovider"]
    out = subprocess.run([*cmd, *files, "-k", "damped"], cwd=REPO, env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    passed = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("PASSED")}
    for test in (
        "tests/test_equations.py::test_forcing_bias[damped]",
        "tests/test_param_counts.py::test_parameter_count_matches_the_closed_form[damped-22m]",
        "tests/test_recurrences.py::test_declares_its_equation[damped]",
    ):
        assert test in passed, sorted(passed)


def test_readme_and_docs_links_resolve() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) >= 9
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), (page.name, target)
    assert len((REPO / "README.md").read_text().splitlines()) < 250


def _analysis_example(tmp: Path) -> Path:
    text = (REPO / "docs" / "extending.md").read_text()
    section = text.split("## A worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    pkg = tmp / "my_analysis"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "stepsize.py").write_text(code)
    return tmp


def test_the_example_analysis_is_a_plugin_with_kind_section_and_command(tmp_path: Path) -> None:
    """docs/extending.md's module, as a plugin: a tiny sweep writes its rows and the report its
    section; the command runs on the sweep's checkpoint, with one-line errors from its ranges."""
    import yaml

    env = _env(_analysis_example(tmp_path))
    env["LOOPLM_PLUGINS"] = "my_analysis.stepsize"
    grid = {
        "name": "steps",
        "out_root": str(tmp_path / "runs"),
        "torch_threads": 1,
        "base": {
            "model": {"preset": "tiny", "d_model": 16, "n_heads": 2, "d_ff": 32, "context": 32},
            "data": {"dataset": "bool_logic"},
            "train": {"steps": 2, "batch_size": 4, "depth_min": 2, "depth_max": 2},
            "eval": {"n_examples": 8},
        },
        "methods": ["scse", "looped"],
        "seeds": [0],
        "evaluate": {"depths": [2], "stepsize": {"loops": 3, "batches": 1, "batch_size": 2}},
        "report": {"seeds": [0]},
    }
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(grid))
    run = [sys.executable, "-m", "looplm"]
    out = subprocess.run([*run, "sweep", str(tmp_path / "g.yaml")], cwd=REPO, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    md = (tmp_path / "runs" / "report" / "report.md").read_text()
    table = md.split("## Step sizes", 1)[1]
    assert "| scse | 0 |" in table and "| looped | 0 |" in table
    ckpt = str(sorted((tmp_path / "runs").rglob("ckpt"))[0])
    out = subprocess.run([*run, "stepsize", ckpt, "--loops", "3", "--batches", "1"], cwd=REPO,
                         env=env, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0 and out.stdout.count("t=") == 3, out.stderr[-2000:]
    for bad, msg in ((["--loops", "0"], "--loops 0 must be a positive integer (the loop depth T must be >= 1)"),
                     (["--loops", "100000"], "above the usual cap 512")):  # fmt: skip
        out = subprocess.run([*run, "stepsize", ckpt, *bad], cwd=REPO, env=env,
                             capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 2 and msg in out.stderr and out.stderr.count("\n") == 1
    out = subprocess.run([*run, "settings"], cwd=REPO, env=env, capture_output=True, text=True)
    assert "`evaluate.stepsize.loops`" in out.stdout


def test_readme_lists_every_command() -> None:
    """The README's command list is the CLI's: no command left out, none that does not exist."""
    from looplm.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"Commands: `looplm ([^`]+)`", text.replace("\n", " ")).group(1)
    listed = {c.strip() for c in block.split("|")}
    assert listed == set(sub.choices)
