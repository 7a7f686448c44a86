"""The report: tables, results.json, figures and the `looplm report` command, from a tiny store."""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

from looplm.errors import LoopLMError
from looplm.results.figures import Series, _nice_ticks, choose_ppl_shift, plot_depth_response
from looplm.results.report import write_report
from looplm.results.store import EvalRecord, ResultsStore

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T975_DF2 = 4.302652730
SCSE = {4: [97.5, 97.2, 97.9], 8: [97.0, 96.8, 97.3], 16: [99.0, 99.4, 98.9]}
DELTA = [-1.0, -2.0, -3.0]  # scse − looped per seed, at every depth


def rec(method, depth, seed, ppl, n=50_000, **kw):
    return EvalRecord(
        model_hash=f"h-{method}",
        method=method,
        protocol="wt2-1200",
        dataset="wikitext2",
        split="test",
        depth=depth,
        seed=seed,
        n_tokens=n,
        sum_nll=math.log(ppl) * n,
        **kw,
    )


def build_store(path: Path, *, seeds=(0, 1, 2), accuracy=True, adaptive=True) -> Path:
    recs = []
    for d, vals in SCSE.items():
        for s in seeds:
            extra = {"n_correct": 30 + s, "n_examples": 100} if accuracy else {}
            recs.append(rec("scse", d, s, vals[s], extra=extra))
            extra = {"n_correct": 20 + s, "n_examples": 100} if accuracy else {}
            recs.append(rec("looped", d, s, vals[s] - DELTA[s], extra=extra))
    if adaptive:
        for m, off in (("scse", 0.0), ("looped", 2.0)):
            for s in seeds:
                for b in (8, 16):
                    recs.append(
                        rec(
                            m,
                            48,
                            s,
                            97.5 + off + (b - 8) * 0.2 + 0.1 * s,
                            adaptive_mode=f"maxtoken:budget={b}",
                            extra={"mean_depth": b + 0.1 * s},
                        )
                    )
    with ResultsStore(path) as store:
        store.put_many(recs)
    return path


def test_report_tables_json_and_figures(tmp_path):
    store = build_store(tmp_path / "r.sqlite")
    res = write_report(store, tmp_path / "rep")
    md = res.report_md.read_text()

    # methods x depths, extra-loop marker, mean ± std, best per column in bold
    assert "| Method | seeds | T=4 | T=8 | T=16† |" in md
    m8 = float(np.mean(SCSE[8]))
    sd8 = float(np.std(SCSE[8], ddof=1))
    assert f"**{m8:.1f} ± {sd8:.1f}**" in md
    looped_row = next(line for line in md.splitlines() if line.startswith("| looped | 3 |"))
    assert "**" not in looped_row
    # paired delta: mean -2, sd 1 -> t half-width 4.3027 / sqrt(3) = 2.484
    hw = T975_DF2 * 1.0 / math.sqrt(3)
    assert f"| looped | 8 | 3 | −2.00 ± {hw:.2f} |" in md
    assert "| looped | 16† | 3 |" in md
    # accuracy table (percent) and adaptive table with achieved depth
    assert "### Task accuracy" in md and "**31.0 ± 1.0**" in md
    assert "| Method | Static T=8 | maxtoken:budget=8 | maxtoken:budget=16 | Static T=48 |" in md
    assert "(d̄ 8.1)" in md

    data = json.loads(res.results_json.read_text(), parse_constant=pytest.fail)  # strict JSON
    (fixed,) = data["fixed_depth"]
    scse_row = next(r for r in fixed["rows"] if r["method"] == "scse")
    assert scse_row["ppl"]["8"]["mean"] == pytest.approx(m8, abs=1e-9)
    assert scse_row["ppl"]["8"]["std"] == pytest.approx(sd8, abs=1e-9)
    assert scse_row["ppl"]["8"]["seeds"] == [0, 1, 2]
    deltas = [d for d in fixed["deltas"] if d["depth"] == 8]
    assert deltas[0]["deltas"] == pytest.approx(DELTA, abs=1e-9)
    assert deltas[0]["t_halfwidth"] == pytest.approx(hw, rel=1e-7)
    assert fixed["depth_response_figure"]["ppl_shift"] < min(min(v) for v in SCSE.values())
    (adaptive,) = data["adaptive"]
    first = adaptive["rows"][0]["adaptive"][0]  # budget=8 column: depths 8.0, 8.1, 8.2
    assert first["adaptive_mode"] == "maxtoken:budget=8"
    assert first["mean_depth"]["mean"] == pytest.approx(8.1)
    assert first["ppl"]["mean"] == pytest.approx(97.5 + 2.0 + 0.1, abs=1e-9)  # looped row

    # PPL depth response, accuracy depth response (the rows carry task accuracy), adaptive
    assert len(res.figures) == 3
    assert fixed["accuracy_figure"]["path"].startswith("figures/accuracy_response")
    for fig in res.figures:
        assert fig.read_bytes()[:8] == PNG_MAGIC and fig.stat().st_size > 10_000
        assert f"]({fig.relative_to(res.out_dir)})" in md
    assert not list(res.out_dir.rglob("*.tmp"))


def test_report_seed_integrity(tmp_path):
    store = build_store(tmp_path / "r.sqlite", accuracy=False, adaptive=False)
    with ResultsStore(store) as s:
        s.delete(method="looped", depth=16, seed=2)
    with pytest.raises(LoopLMError, match=r"looped T=16.*missing seed\(s\) \[2\]"):
        write_report(store, tmp_path / "rep", figures=False)
    res = write_report(store, tmp_path / "rep", figures=False, allow_incomplete=True)
    md = res.report_md.read_text()
    assert "⚠" in md and "## Incomplete summaries" in md and len(res.incomplete) == 1
    # an explicit seed list: seeds 0, 1 only -> complete again
    res = write_report(store, tmp_path / "rep2", figures=False, seeds=[0, 1])
    assert not res.incomplete
    with pytest.raises(LoopLMError, match="missing seed"):
        write_report(store, tmp_path / "rep3", figures=False, seeds="expanded")


def test_report_reads_a_json_export_and_rejects_bad_input(tmp_path):
    store = build_store(tmp_path / "r.sqlite", adaptive=False)
    with ResultsStore(store) as s:
        s.export_json(tmp_path / "export.json")
    a = write_report(store, tmp_path / "a", figures=False)
    b = write_report(tmp_path / "export.json", tmp_path / "b", figures=False)
    strip = lambda p: [ln for ln in p.read_text().splitlines()[3:]]  # noqa: E731 (drop header)
    assert strip(a.report_md) == strip(b.report_md)
    with pytest.raises(LoopLMError, match="does not exist"):
        write_report(tmp_path / "nope.sqlite", tmp_path / "c")
    ResultsStore(tmp_path / "empty.sqlite").close()
    with pytest.raises(LoopLMError, match="no evaluations"):
        write_report(tmp_path / "empty.sqlite", tmp_path / "c")
    with pytest.raises(LoopLMError, match="unknown seed set"):
        write_report(store, tmp_path / "c", seeds="most")


def test_reference_missing_gives_a_note_not_a_crash(tmp_path):
    store = build_store(tmp_path / "r.sqlite", accuracy=False, adaptive=False)
    res = write_report(store, tmp_path / "rep", figures=False, reference="tuned_adapter")
    assert "reference method `tuned_adapter` is not in this table" in res.report_md.read_text()


def test_shifted_log_axis_helpers(tmp_path):
    # paper-like numbers: Figure 3 uses log(PPL - 84.85) for PPLs around 97-145
    c = choose_ppl_shift(96.6, 146.3)
    assert c < 96.6 and c == pytest.approx(96.6 - 0.25 * (146.3 - 96.6), abs=0.01)
    ticks = _nice_ticks(96.6, 146.3, 84.85)
    assert ticks == sorted(ticks) and all(96.6 <= t <= 146.3 for t in ticks) and len(ticks) >= 4
    assert all(float(t).is_integer() for t in ticks)
    series = [
        Series("scse", [4, 8, 16, 48], [97.3, 96.9, 101.0, 125.9], [0.3, 0.3, 0.5, 0.9]),
        Series("looped", [4, 8, 48], [117.4, 117.1, 145.1], [0.5, 0.5, 1.2]),
    ]
    shift = plot_depth_response(series, tmp_path / "f.png", shift=84.85)
    assert shift == 84.85 and (tmp_path / "f.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(LoopLMError, match="below the lowest"):
        plot_depth_response(series, tmp_path / "g.png", shift=97.0)


def test_cli_report_command(tmp_path, capsys):
    from looplm import cli
    from looplm.commands import report as report_cmd

    assert "looplm.commands.report" in cli.COMMAND_MODULES
    parser = argparse.ArgumentParser()
    report_cmd.register(parser.add_subparsers())
    store = build_store(tmp_path / "r.sqlite", adaptive=False)
    args = parser.parse_args(
        [
            "report",
            str(store),
            "--out",
            str(tmp_path / "o"),
            "--seeds",
            "0,1,2",
            "--reference",
            "scse",
            "--no-figures",
            "--n-boot",
            "500",
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "report.md" in out
    # the paired-delta tables are printed under their context heading; the rest stays in the file
    assert "### Paired deltas vs `scse`" in out and "\n## " in "\n" + out
    assert "| looped | 8 | 3 |" in out and "### PPL (mean" not in out
    args = parser.parse_args(["report", str(store), "--out", str(tmp_path / "q"), "--quiet"])
    args.seeds, args.no_figures, args.n_boot = "0,1,2", True, 500
    assert args.func(args) == 0
    assert "Paired deltas" not in capsys.readouterr().out
    assert (tmp_path / "o" / "results.json").exists()
    args = parser.parse_args(["report", str(store), "--seeds", "0,x"])
    with pytest.raises(LoopLMError, match="bad --seeds"):
        args.func(args)


def test_results_layer_does_not_import_model_code_or_torch():
    """The layering rule (config -> model -> evaluation -> store -> report), checked on the
    import statements of every module of the results layer."""
    root = Path(__file__).resolve().parents[1] / "looplm"
    files = sorted((root / "results").glob("*.py")) + [root / "commands" / "report.py"]
    assert len(files) >= 6
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                assert not n.startswith(
                    (
                        "torch",
                        "looplm.model",
                        "looplm.training.loop",
                        "looplm.evaluate",
                        "looplm.model.accounting",
                    )
                ), (f.name, n)
                if n.startswith("looplm"):
                    # looplm.settings.plugins: the registry and plugin loader (imports looplm.errors only);
                    # looplm.settings / looplm.settings.options: the settings reader and the command line
                    # made from it (errors and yaml only), how every layer reads its settings
                    allowed = (
                        "looplm.errors",
                        "looplm.io",
                        "looplm.settings.plugins",
                        "looplm.settings",
                    )
                    assert n in (*allowed, "looplm.settings.options") or n.startswith(
                        ("looplm.results", "looplm.commands.report")
                    ), (f.name, n)


def test_depth_figure_survives_a_seed_spread_larger_than_the_mean(tmp_path):
    from looplm.results.figures import Series, plot_depth_response

    s = [Series("a", [1, 2, 4], [900.0, 3.0, 1.2], [2400.0, 1.0, 0.1])]
    c = plot_depth_response(s, tmp_path / "f.png", train_depth_max=2)
    assert 0.0 <= c < 1.1 and (tmp_path / "f.png").stat().st_size > 0
