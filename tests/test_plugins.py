"""Adding a recurrence is one file: a module outside looplm, found through ``$LOOPLM_PLUGINS`` or
an entry point, shows up in ``looplm methods`` and in every test parametrised over the registry
(and passes them: its class declares what those tests check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NAME = "plugin_halfstep"

PLUGIN = '''"""A recurrence that lives outside looplm (the discovery test's plugin)."""

from dataclasses import dataclass

from looplm.model.recurrences import Recurrence, register


@dataclass
class HalfStepConfig:
    step_scale: float = 0.25


@register
class HalfStep(Recurrence):
    """h_0 = e;  h_{t+1} = h_t + s·G(h_t + e) with s = 0.25."""

    name = "plugin_halfstep"
    Config = HalfStepConfig
    equation = "h_0 = e;  h_{t+1} = h_t + s·G(h_t + e),  s = 0.25"
    reference = "looplm's plugin-discovery test"

    @classmethod
    def parameter_formula(cls, d_model, cfg):
        return 0

    def init_state(self, ctx):
        return ctx.e

    def step(self, block, state, ctx, t, *, mask=True):
        return state + self.cfg.step_scale * block(state + ctx.e)
'''


@pytest.fixture()
def plugin_dir(tmp_path: Path) -> Path:
    (tmp_path / "looplm_plugin_demo.py").write_text(PLUGIN)
    return tmp_path


def _env(path: Path, plugins: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOOPLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(REPO), env.get("PYTHONPATH", "")])
    env["LOOPLM_NO_PROGRESS"] = "1"
    if plugins:
        env["LOOPLM_PLUGINS"] = plugins
    return env


def _methods(env: dict[str, str]) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "looplm", "methods", "--json", "--preset", "tiny"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return {r["name"]: r for r in json.loads(out.stdout)}


def test_a_plugin_module_named_in_the_environment_is_a_method(plugin_dir: Path) -> None:
    rows = _methods(_env(plugin_dir, "looplm_plugin_demo"))
    assert rows[NAME]["equation"].startswith("h_0 = e") and rows[NAME]["c_body"] == 1
    assert "scse" in rows  # the built-in methods stay
    assert NAME not in _methods(_env(plugin_dir, None))


def test_an_entry_point_is_a_method(plugin_dir: Path) -> None:
    info = plugin_dir / "looplm_plugin_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: looplm-plugin-demo\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[looplm.recurrences]\nhalfstep = looplm_plugin_demo\n")
    assert NAME in _methods(_env(plugin_dir, None))


def test_a_broken_plugin_is_a_one_line_error(plugin_dir: Path) -> None:
    cmd = [sys.executable, "-m", "looplm", "methods"]
    env = _env(plugin_dir, "no_such_plugin_module")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 2
    err = out.stderr.strip()
    assert err.startswith("error: plugin module 'no_such_plugin_module'") and "\n" not in err


def test_the_registry_parametrised_tests_collect_and_pass_the_plugin(plugin_dir: Path) -> None:
    files = ["tests/test_equations.py", "tests/test_param_counts.py", "tests/test_recurrences.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-o", "addopts=", "-p", "no:cacheprovider"]
    cmd += [*files, "-k", NAME]
    env = _env(plugin_dir, "looplm_plugin_demo")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
    passed = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("PASSED")}
    for test in (
        f"tests/test_equations.py::test_forcing_bias[{NAME}]",
        f"tests/test_param_counts.py::test_parameter_count_matches_the_closed_form[{NAME}-22m]",
        f"tests/test_recurrences.py::test_declares_its_equation[{NAME}]",
    ):
        assert test in passed, sorted(passed)
