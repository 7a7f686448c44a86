"""Small things a reader sees: help text that lists every accepted value, config paths that work
from any folder, and figures that say why a panel is empty instead of leaving it blank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from looplm.cli import build_parser
from looplm.diagnostics import plots
from looplm.errors import LoopLMError
from looplm.experiments.runner import eval_kinds, load_experiment
from looplm.results.figures import Series, plot_accuracy_response


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command" or a.choices)
    return sub.choices[command].format_help()


def test_sweep_redo_help_lists_every_evaluation_kind() -> None:
    text = " ".join(_help("sweep").split())
    for kind in eval_kinds():
        assert kind in text, kind


def test_report_seeds_help_names_auto_as_the_default() -> None:
    text = " ".join(_help("report").split())
    assert "(default: auto)" in text


def test_experiment_paths_written_from_the_checkout_root_work_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    by_path = load_experiment("configs/experiments/wt2_tiny.yaml", str(tmp_path))
    by_name = load_experiment("wt2_tiny", str(tmp_path))
    assert by_path.name == by_name.name == "wt2_tiny"
    with pytest.raises(LoopLMError) as err:
        load_experiment("configs/experiments/no_such_grid.yaml")
    assert "wt2_tiny" in str(err.value)  # the message lists the known names


def _diag(zero: bool) -> dict[str, Any]:
    steps = 6
    val = 0.0 if zero else 0.5
    return {
        "label": "m",
        "method": "scse" if zero else "looped",
        "per_step": {
            "ratio": [val] * steps,
            "anchor_energy": [1.0] * (steps + 1),
            "gain": [1.0] * steps,
            "E_energy": [val] * (steps + 1),
        },
        "summary": {"R_last": val, "R_t0": val, "last_step": steps - 1},
    }


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    saved: list[Any] = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig))
    return saved


def _texts(ax: Any) -> str:
    return " ".join(t.get_text() for t in ax.texts)


def test_an_all_zero_log_panel_is_drawn_and_explained(figures: list[Any]) -> None:
    plots.plot_anchor_steps([_diag(zero=True)], "unused.png")
    panel_d = figures[0].axes[3]
    assert panel_d.get_yscale() == "linear" and panel_d.lines
    assert "forcing bias b_t is 0" in _texts(panel_d)
    plots.plot_anchor_steps([_diag(zero=False)], "unused.png")
    assert figures[1].axes[3].get_yscale() == "log" and not _texts(figures[1].axes[3])


def test_a_zero_r_t_bar_says_why(figures: list[Any]) -> None:
    plots.plot_rt_bars([_diag(zero=True)], "unused.png")
    assert "0 exactly" in _texts(figures[0].axes[0])
    plots.plot_rt_bars([_diag(zero=False)], "unused.png")
    assert "0 exactly" not in _texts(figures[1].axes[0])


def test_accuracy_response_figure(tmp_path: Path) -> None:
    s = Series("scse", [1, 2, 4, 8, 16], [50.0, 60, 70, 72, 71], [1.0] * 5, "C0")
    plot_accuracy_response([s], tmp_path / "acc.png", train_depth_max=8, title="t")
    assert (tmp_path / "acc.png").stat().st_size > 1000


def _tiny(out: Path, steps: int):
    from looplm.settings.config import load_config

    return load_config(
        "tiny_bool",
        [f"train.steps={steps}", "train.batch_size=8", "train.warmup=2", "train.log_every=1",
         "eval.n_examples=16", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
         f"out_dir={out}"],
    )  # fmt: skip


def test_max_steps_caps_each_run_from_where_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from looplm.model.checkpoint import read_meta
    from looplm.settings.config import load_config
    from looplm.training.loop import fit

    monkeypatch.setenv("LOOPLM_MAX_STEPS", "2")
    out = tmp_path / "run"
    fit(_tiny(out, 50), progress=False)
    assert read_meta(out / "ckpt")["state"]["step"] == 2
    assert load_config(str(out / "config.yaml")).train.steps == 2
    assert (
        "LOOPLM_MAX_STEPS=2: training stops at step 2 (train.steps=50)" in capsys.readouterr().err
    )
    fit(_tiny(out, 90), resume=True, progress=False)  # a resume runs two more, not none
    assert read_meta(out / "ckpt")["state"]["step"] == 4
    monkeypatch.setenv("LOOPLM_MAX_STEPS", "0")
    with pytest.raises(LoopLMError, match="LOOPLM_MAX_STEPS='0' must be a positive whole number"):
        fit(_tiny(tmp_path / "bad", 5), progress=False)
