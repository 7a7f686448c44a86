"""The reference of every setting (``looplm settings``, ``docs/configuration.md``).

Written from the settings dataclasses themselves (:mod:`looplm.settings`): the run config
(:mod:`looplm.settings.config`), every registered method's settings, the experiment grid
(:mod:`looplm.experiments.grid`), the section of every registered evaluation kind and the options
of every command made from settings (each command module's ``SETTINGS``, handed in by the
command), each key with its type, default, allowed range and meaning. ``docs/configuration.md`` is
this output (a test fails when it is stale).
"""

from __future__ import annotations

import dataclasses
from typing import Any

HEADER = """# Configuration

Every setting looplm reads, with its type, default and meaning. Generated from the settings
dataclasses by `looplm settings --out docs/configuration.md`; do not edit by hand. An unknown key,
a value of the wrong type or one outside the allowed range stops with a one-line error naming the
key and what is allowed.
"""

RUN = """## Run configs

`looplm train CONFIG key=value …` (and every `base:` of an experiment grid). Settings merge in one
order: dataclass defaults → the model preset (`model.preset`: {presets}) → the YAML file →
`key=value` overrides (dotted, e.g. `train.steps=200`; values are read as YAML). The resolved
config is written to `<out_dir>/config.yaml`.
"""

METHODS = """## Method settings

`model.recurrence_args.<key>=<value>` (or `args:` of a grid's method entry, or
`looplm params --method NAME key=value`), per method; methods not listed have no settings of
their own. `looplm methods` prints each method's equation.
"""

GRID = """## Experiment grids

`looplm sweep configs/experiments/NAME.yaml`: a grid of methods × seeds × training variants ×
evaluations ([experiments](experiments.md#the-grid-schema) shows a whole file).
"""


COMMANDS = """## Commands

Each command's options are made from its settings dataclasses (:mod:`looplm.settings.options`): the option
`--x-y` is the field `x_y`, a boolean has `--x` / `--no-x`, a list is written comma-separated
(`24,48`; loop depths also as ranges, `1-48`; `''` for none). A value above a soft cap (a cost that
grows with it) needs `--allow-large` (or `LOOPLM_ALLOW_LARGE=1`).
"""


def _section(
    title: str, cls: type, prefix: str = "", intro: str = "", key: Any = None
) -> list[str]:
    from looplm.settings import settings_table

    out = [f"### {title}", ""]
    if intro:
        out += [intro, ""]
    return out + settings_table(cls, prefix, key=key) + [""]


def _run_config() -> list[str]:
    from looplm.settings.config import (
        PRESETS,
        DataConfig,
        EvalConfig,
        LoraConfig,
        ModelConfig,
        RunConfig,
        TrainConfig,
    )

    out = [RUN.format(presets=", ".join(f"`{p}`" for p in PRESETS))]
    out += _section("model", ModelConfig, "model.")
    out += _section("data", DataConfig, "data.")
    out += _section("train", TrainConfig, "train.")
    out += _section("eval", EvalConfig, "eval.")
    out += _section("lora", LoraConfig, "lora.")
    out += _section("top level", RunConfig)
    return out


def _methods() -> list[str]:
    from looplm.model.recurrences import get_recurrence_class, recurrence_names

    out = [METHODS]
    for name in recurrence_names():
        if name == "unshared":
            continue
        cls = get_recurrence_class(name)
        if dataclasses.fields(cls.Config):
            out += _section(f"`{name}`", cls.Config, "")
    return out


def _grid() -> list[str]:
    from looplm.evaluate.kinds import evaluation_kinds
    from looplm.evaluate.settings import EvaluateSettings
    from looplm.experiments.grid import ExperimentSettings, MethodSettings, VariantSettings
    from looplm.results.settings import ReportSettings

    out = [GRID]
    out += _section("top level", ExperimentSettings)
    out += _section("methods entries", MethodSettings, "", "A plain name `m` is `{name: m}`.")
    out += _section("variants entries", VariantSettings)
    out += _section(
        "evaluate", EvaluateSettings, "evaluate.", "The fixed-depth sweep every run gets."
    )
    for kind in evaluation_kinds():
        if kind.section and kind.Settings is not None:
            doc = (kind.__doc__ or "").strip().splitlines()[0]
            intro = f"The `{kind.name}` evaluation kind: {doc[0].lower()}{doc[1:]}"
            prefix = f"evaluate.{kind.section}."
            if kind.section == "transfer":
                intro += " A list of entries, each:"
                prefix = "evaluate.transfer[]."
            out += _section(f"evaluate.{kind.section}", kind.Settings, prefix, intro)
    out += _section("report", ReportSettings, "report.")
    return out


def _commands(commands: list[tuple[str, list[type]]]) -> list[str]:
    """Each command with settings: (its title, its settings classes), in the command line's
    order."""
    from looplm.settings.options import flag

    out = [COMMANDS]
    for title, classes in commands:
        for cls in classes:
            doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
            out += _section(f"`{title}`: {cls.__name__}", cls, "", doc, key=flag)
    return out


def configuration_markdown(commands: list[tuple[str, list[type]]] | None = None) -> str:
    """The whole reference, as ``docs/configuration.md`` holds it; ``commands`` are the commands
    whose options are made from settings dataclasses: (title, classes) each (default: every
    command the command line finds, :func:`looplm.settings.plugins.command_settings`)."""
    if commands is None:
        from looplm.settings.plugins import command_settings

        commands = command_settings()
    lines = [HEADER, *_run_config(), *_methods(), *_grid(), *_commands(commands)]
    return "\n".join(lines).rstrip() + "\n"
