"""One settings mechanism: run configs, method settings, experiment grids and the evaluation
kinds' sections are dataclasses read by one builder (same one-line errors), and
docs/configuration.md is generated from them (this test fails when it is stale)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import looplm
from looplm.errors import LoopLMError
from looplm.experiments.runner import load_experiment
from looplm.settings import build_settings, parse_key_values, settings_table

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"


def test_configuration_reference_is_generated_from_the_dataclasses() -> None:
    """docs/configuration.md is `looplm settings`' output (plugins left out)."""
    env = {k: v for k, v in os.environ.items() if k != "LOOPLM_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "looplm", "settings"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == DOC.read_text(), (
        "docs/configuration.md is stale: run `looplm settings --out docs/configuration.md`"
    )
    keys = ("`train.steps`", "`model.recurrence_args`", "`lanes`", "`evaluate.adaptive.ceiling`")
    for key in (*keys, "`report.n_boot`", "`evaluate.transfer[].dataset`"):
        assert key in out.stdout, key  # run config, a method's, a kind's and the grid's settings


def test_every_setting_needs_a_comment_to_be_documented() -> None:
    @dataclasses.dataclass
    class Documented:
        steps: int = 3  # how many
        # the rate
        rate: float = 0.5

    @dataclasses.dataclass
    class Undocumented:
        steps: int = 3

    rows = settings_table(Documented, "x.")
    assert rows[2] == "| `x.steps` | `int` | `3` | how many |"
    assert rows[3] == "| `x.rate` | `float` | `0.5` | the rate |"
    with pytest.raises(LoopLMError, match="x.steps of Undocumented has no comment"):
        settings_table(Undocumented, "x.")


def test_a_comment_continued_below_its_field_is_read_whole() -> None:
    @dataclasses.dataclass
    class Continued:
        layers: list = dataclasses.field(default_factory=list)  # layers (prelude, core
        # order) that get it
        # Section heading of the next fields.
        rate: float = 0.5  # the rate

    rows = settings_table(Continued, "x.")
    assert rows[2].endswith("| layers (prelude, core order) that get it |")
    assert rows[3].endswith("| the rate |")


def test_no_setting_description_stops_mid_sentence() -> None:
    """Every description in docs/configuration.md closes the parentheses it opens."""
    from looplm.experiments.reference import configuration_markdown

    for line in configuration_markdown().splitlines():
        if line.startswith("| `"):
            meaning = line.rsplit(" | ", 1)[-1]
            assert meaning.count("(") == meaning.count(")"), line


def _grid(tmp_path: Path, **top) -> Path:
    raw = {"base": {"model": {"preset": "tiny"}}, "methods": ["scse"], **top}
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("top", "message"),
    [
        ({"evaluate": {"frontier": {"depths": [1], "difficulties": [1], "bogus": 1}}},
         "unknown key evaluate.frontier.bogus; allowed: batch_size, depths, difficulties, "
         "n_examples"),
        ({"evaluate": {"frontier": {"depths": [1, 2]}}}, "evaluate.frontier needs difficulties"),
        ({"evaluate": {"lambada": {"path": "x", "max_examples": "many"}}},
         "evaluate.lambada.max_examples='many' must be an integer"),
        ({"evaluate": {"transfer": [{"split": "test"}]}}, r"evaluate.transfer\[0\] needs dataset"),
        ({"evaluate": {"adaptive": {"time_dense": "yes"}}},
         "evaluate.adaptive.time_dense='yes' must be true or false"),
        ({"evaluate": {"max_tokens": "lots"}}, "evaluate.max_tokens='lots' must be an integer"),
        ({"report": {"n_boot": "x"}}, "report.n_boot='x' must be an integer"),
        ({"report": {"bogus": 1}}, "unknown key report.bogus; allowed: allow_incomplete, "),
        ({"variants": [{"name": "a", "extra": 1}]}, r"unknown key variants\[0\].extra"),
        ({"methods": [{"name": "x", "recurrence": "scse", "argz": {}}]},
         r"unknown key methods\[0\].argz; allowed: args, name, overrides, recurrence"),
        ({"seeds": 3}, "experiment.seeds=3 must be a list"),
    ],
)  # fmt: skip
def test_grid_errors_name_the_key_and_what_is_allowed(tmp_path, top, message) -> None:
    with pytest.raises(LoopLMError, match=message) as err:
        load_experiment(_grid(tmp_path, **top))
    assert "\n" not in str(err.value)


def test_a_valid_grid_with_every_kind_section_loads(tmp_path) -> None:
    evaluate = {
        "depths": "1-4",
        "frontier": {"depths": "1-8", "difficulties": [1, 2]},
        "propagation": {"difficulties": [2], "max_loops": 8},
        "scaling": {"split": "validation"},
        "transfer": [{"dataset": "graph_reach", "depths": [1, 2]}],
        "adaptive": {"ceiling": 8, "budgets": [2, 4]},
        "lambada": {"path": "lambada", "max_examples": 5},
    }
    exp = load_experiment(_grid(tmp_path, evaluate=evaluate, report={"seeds": [0]}))
    assert exp.evaluate["depths"] == [1, 2, 3, 4] and exp.evaluate["adaptive"]["budgets"] == [2, 4]


def test_method_settings_use_the_same_builder() -> None:
    with pytest.raises(LoopLMError, match=r"model.recurrence_args.lanes='two' must be an integer"):
        looplm.build_model("tiny", "hyper_scse", lanes="two")
    with pytest.raises(LoopLMError, match="unknown setting 'bogus' for recurrence 'looped'"):
        looplm.build_model("tiny", "looped", bogus=1)
    with pytest.raises(LoopLMError, match="setting 'lanes' must look like key=value"):
        parse_key_values(["lanes"], what="setting", example="lanes=2")
    assert parse_key_values(["a.b=1", "c=[1, 2]", "d=true"]) == {
        "a": {"b": 1},
        "c": [1, 2],
        "d": True,
    }


def test_build_settings_types_defaults_and_unions() -> None:
    @dataclasses.dataclass
    class S:
        depths: list[int] | str  # a list or a range string
        cap: int | None = None  # a cap
        rate: float = 0.5  # a rate

    s = build_settings(S, {"depths": "1-4", "rate": 1}, "k")
    assert (s.depths, s.cap, s.rate) == ("1-4", None, 1.0) and isinstance(s.rate, float)
    assert build_settings(S, {"depths": [1, 2.0]}, "k").depths == [1, 2]
    with pytest.raises(LoopLMError, match="k.cap=True must be an integer"):
        build_settings(S, {"depths": [1], "cap": True}, "k")
    with pytest.raises(LoopLMError, match="k must be a mapping, got list"):
        build_settings(S, [1], "k")
