"""One settings dataclass per analysis: the command line, the sweep kind and the library read the
same defaults (derived here from the dataclass, never restated), every number has its allowed
range, and a bad value is one line naming the option and what it must be."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import typing

import pytest

from looplm import cli
from looplm.errors import LoopLMError
from looplm.evaluate.kinds import evaluation_kinds
from looplm.settings import UNION_TYPES, defaults
from looplm.settings.options import add_options, from_args


def _commands() -> dict[str, tuple[argparse.ArgumentParser, tuple[type, ...]]]:
    """Each command made from settings (its module names them in ``SETTINGS``: a tuple, or for a
    module with several commands or subcommands a mapping from each command's words): its
    (sub)parser and its settings classes, keyed by the command's words (``data prepare``)."""
    out = {}

    def walk(p: argparse.ArgumentParser, words: list[str], func) -> None:
        func = p._defaults.get("func", func)
        module = importlib.import_module(func.__module__) if func else None
        settings = getattr(module, "SETTINGS", ())
        if isinstance(settings, dict):
            settings = settings.get(" ".join(words), ())
        elif len(words) > 1:  # a tuple names the classes of the module's one command
            settings = ()
        if settings:
            out[" ".join(words)] = (p, tuple(settings))
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        for word, child in sub.choices.items() if sub else ():
            walk(child, [*words, word], func)

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for cmd, p in sub.choices.items():
        walk(p, [cmd], None)
    return out


def _minimal_argv(p: argparse.ArgumentParser) -> list[str]:
    """The positional inputs and required options of a command, with placeholder values."""
    argv: list[str] = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction) and not a.required:
            continue  # an optional action word (``looplm paper`` without one)
        if not a.option_strings and a.dest != "help":
            argv += ["X"]
        elif a.required:
            argv += [a.option_strings[0], "X"]
    for group in p._mutually_exclusive_groups:
        if group.required:
            argv += [group._group_actions[0].option_strings[0], "X"]
    return argv


COMMANDS = _commands()


def test_every_analysis_has_a_command_made_from_its_settings():
    assert {"eval", "adaptive", "diagnose", "lens", "generate", "report", "export"} <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_line_defaults_are_the_dataclass_defaults(command):
    """Parsing a command with no options gives each settings class's own defaults."""
    p, classes = COMMANDS[command]
    args = p.parse_args(_minimal_argv(p))
    for cls in classes:
        required = {
            f.name: "X"
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        built = from_args(cls, args, **required)
        assert built == cls(**required), (command, cls.__name__)


def _kind_defaults(kind: type) -> dict:
    """The smallest section that asks for the kind: its required keys (as placeholders) or, when
    it has none, its first setting at its default (an empty section does not ask for it)."""
    cls = kind.Settings
    fields = dataclasses.fields(cls)
    required = [f for f in fields if f.default is dataclasses.MISSING and f.default_factory is
                dataclasses.MISSING]  # fmt: skip
    if required:
        return {f.name: [1] if "int" in str(f.type) else "x" for f in required}
    return {fields[0].name: defaults(cls)[fields[0].name]}


CARRIED = [
    k
    for k in evaluation_kinds()
    if k.section and k.Settings is not None and k.name not in ("transfer",)
]  # fmt: skip (transfer: a list of sweeps)


@pytest.mark.parametrize("kind", CARRIED, ids=lambda k: k.name)
def test_sweep_kinds_carry_a_settings_instance_with_the_dataclass_defaults(kind):
    section = _kind_defaults(kind)
    evaluate = {kind.section: section, "depths": [1, 2]}
    if kind.section == "lens":
        section["loops"] = defaults(kind.Settings)["loops"]
    configured = kind.configure(evaluate)
    assert isinstance(configured.settings, kind.Settings)
    for name, value in defaults(kind.Settings).items():
        if name in section or value is None:
            continue
        got = getattr(configured.settings, name)
        assert got == value or list(got) == list(value), (kind.name, name)


def _library(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


LIBRARY = {  # the library function of each analysis and the settings class it takes
    "looplm.evaluate.checkpoint.evaluate_one": "EvalSettings",
    "looplm.adaptive.depth.evaluate_adaptive": "AdaptiveSettings",
    "looplm.adaptive.depth.evaluate_adaptive_checkpoint": "AdaptiveSettings",
    "looplm.diagnostics.runner.diagnose_model": "DiagnoseSettings",
    "looplm.diagnostics.checkpoints.diagnose_checkpoints": "DiagnoseSettings",
    "looplm.lens.analysis.analyse_lens": "LensSettings",
    "looplm.lens.analysis.lens_checkpoint": "LensSettings",
    "looplm.decoding.generate.generate_text": "GenerateSettings",
    "looplm.decoding.generate.generate_file": "GenerateSettings",
    "looplm.results.report.write_report": "ReportSettings",
    "looplm.decoding.hf.export_checkpoint": "ExportSettings",
}


@pytest.mark.parametrize("path", sorted(LIBRARY))
def test_library_functions_take_the_settings_object_and_restate_no_default(path):
    """The library reads its defaults from the same dataclass: it takes the instance, and no
    keyword argument repeats one of its fields with a default of its own."""
    fn = _library(path)
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    classes = [
        t
        for t in (
            a
            for h in hints.values()
            for a in ((h,) if typing.get_origin(h) not in UNION_TYPES else typing.get_args(h))
        )
        if isinstance(t, type) and t.__name__ == LIBRARY[path]
    ]
    assert classes, f"{path} takes no {LIBRARY[path]}"
    names = {f.name for f in dataclasses.fields(classes[0])}
    restated = [
        n
        for n, prm in sig.parameters.items()
        if n in names and prm.default is not inspect.Parameter.empty
    ]
    assert not restated, (path, restated)


def test_drifted_defaults_are_one():
    from looplm.diagnostics.settings import DiagnoseSettings, DiagnosticsKindSettings
    from looplm.lens.settings import LensSettings, TwoHopLensSettings

    p, _ = COMMANDS["lens"]
    lens_cli = p.parse_args(_minimal_argv(p)).tuned_steps
    assert lens_cli == LensSettings().tuned_steps == TwoHopLensSettings().tuned_steps
    p, _ = COMMANDS["diagnose"]
    diag_cli = p.parse_args(_minimal_argv(p)).check_steps
    assert diag_cli == DiagnoseSettings().check_steps == DiagnosticsKindSettings().check_steps


def _numeric(typ) -> bool:
    args = typing.get_args(typ) or (typ,)
    flat = [a for x in args for a in (typing.get_args(x) or (x,))]
    return any(a in (int, float) for a in flat) and typ is not bool


def _analysis_classes() -> list[type]:
    classes = {c for _, cs in COMMANDS.values() for c in cs}
    classes |= {k.Settings for k in evaluation_kinds() if k.Settings is not None}
    return sorted(classes, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _analysis_classes(), ids=lambda c: c.__name__)
def test_every_number_of_an_analysis_has_its_allowed_range(cls):
    hints = typing.get_type_hints(cls)
    loose = [
        f.name
        for f in dataclasses.fields(cls)
        if _numeric(hints[f.name])
        and not any((f.metadata or {}).get(k) is not None for k in ("lo", "hi", "choices"))
        and f.name not in ("ppl_shift",)  # a figure's axis offset: any finite number
    ]
    assert not loose, (cls.__name__, loose)


def test_a_bad_or_large_value_is_one_line_naming_the_option():
    from looplm.lens.settings import LensSettings

    p = argparse.ArgumentParser()
    add_options(p, LensSettings)
    with pytest.raises(LoopLMError, match=r"^--k 0 must be in 1\.\.4096$"):
        from_args(LensSettings, p.parse_args(["--k", "0"]))
    with pytest.raises(LoopLMError, match="--probes 'many': expected an integer"):
        from_args(LensSettings, p.parse_args(["--probes", "many"]))
    with pytest.raises(LoopLMError, match="--mode='jacobi'; allowed: exact, hutchinson"):
        from_args(LensSettings, p.parse_args(["--mode", "jacobi"]))
    big = ["--loops", "100000"]
    with pytest.raises(LoopLMError, match="above the usual cap 512.*--allow-large"):
        from_args(LensSettings, p.parse_args(big))
    assert from_args(LensSettings, p.parse_args([*big, "--allow-large"])).loops == 100000
    # a flag's old name keeps working where a boolean is generated
    assert from_args(LensSettings, p.parse_args(["--no-composition"])).composition is False


def test_the_configuration_reference_covers_every_analysis_and_kind():
    """docs/configuration.md (checked for staleness in test_settings) has a table for every
    command's settings and every kind's section, with the allowed ranges."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for command, (_, classes) in COMMANDS.items():
        for cls in classes:
            assert f"`looplm {command}`: {cls.__name__}" in doc, (command, cls.__name__)
    for kind in evaluation_kinds():
        if kind.section and kind.Settings is not None:
            assert f"### evaluate.{kind.section}" in doc, kind.name
    from looplm.lens.settings import LensSettings

    steps = LensSettings().tuned_steps
    assert f"| `--tuned-steps` | `int` | `{steps}` |" in doc and "usual cap 100000" in doc
