"""The catalogue entries of the paper: one YAML per table or figure under ``configs/paper/``
(see :mod:`looplm.experiments.paper`), loaded and validated."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from looplm.errors import LoopLMError
from looplm.settings import load_yaml
from looplm.settings.config import CONFIG_DIR as CONFIGS

CONFIG_DIR = CONFIGS / "paper"
ENTRY_IDS = (
    *(f"table{i:02d}" for i in range(1, 23)),
    "figure3",
    "figure4",
    "figure5",
    "convergence",
)
PAPER_KEYS = {
    "id",
    "title",
    "protocol",
    "reuses",
    "needs",
    "gpu_only",
    "experiment",
    "claim",
    "claims",
    "reported",
}
ROW_KEYS = {
    "method",
    "metric",
    "value",
    "std",
    "ci",
    "depth",
    "reference",
    "budget",
    "dataset",
    "step",
    "scale",
    "table",  # the paper's table that gives the number, when it is not the entry's own
}
METRICS = (
    "ppl",
    "delta_ppl",
    "ppl_gain_4_to_8",
    "ppl_rise_8_to_48",
    "adaptive_ppl",
    "adaptive_depth_error_max",
    "transfer_ppl_k",
    "transfer_delta_ppl_k",
    "lambada_ppl_k",
    "lambada_acc_pct",
    "ms_per_batch",
    "R",
    "gain",
    "ray_cosine_min",
    "ray_cosine_max",
    "dose_fraction_rms",
    "dose_fraction_min",
    "dose_fraction_max",
    "kl_loop",
    "median_convergence_loop",
    "still_updating_at_8",
    "kl_halting_loops_at_depth8_quality",
    "val_loss",
)
# scale tier -> training variant of the grid: (CPU analogue, full protocol); the names are
# looplm.experiments.paper.metrics.TIER_NAMES (a test keeps the two equal)
TIERS = {
    None: ("", ""),
    "22m": ("", ""),
    "50m": ("d192", "50m"),
    "95.6m": ("d256", "95.6m"),
    "ctx512": ("ctx256", "ctx512"),
    "ctx1024": ("ctx512", "ctx1024"),
}
# Training rate of the width-128 model on this project's 2-core CPU machine, in FLOP/s of the
# Eq. 20-21 proxy: one float32 step of 16 x 128 tokens at T = 4 (95 GFLOP) takes 2.0 s of CPU time
# on one thread. Wall time on a loaded machine is longer, so the catalogue uses the faster of this
# and the rate the paper grids' own runs log.
CPU_FLOPS = 4.7e10
H200_PEAK = 790e12  # dense bf16 FLOP/s
H200_MFU = 0.10  # assumed utilisation for these small models (not measured)
# Scored tokens of a full evaluation split (GPT-2 tokens), for cost estimates when uncapped.
SPLIT_TOKENS = {"wikitext-2": 280_000, "wikitext-103": 280_000, "openwebtext": 4_500_000,
                "c4": 2_000_000, "lambada": 5_153 * 80}  # fmt: skip


@dataclass
class Entry:
    """One table or figure of the paper: its config and catalogue metadata."""

    id: str
    path: Path
    meta: dict[str, Any]
    reported: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)  # tested claims (verdicts.py)

    @property
    def is_experiment(self) -> bool:
        return bool(self.meta.get("experiment", True))

    @property
    def title(self) -> str:
        return str(self.meta.get("title", ""))

    def experiment(self, *, full: bool = False, data_dir: str | None = None):
        """The entry's :class:`~looplm.experiments.runner.Experiment` (CPU analogue or ``full``)."""
        from looplm.experiments.runner import load_experiment

        if not self.is_experiment:
            raise LoopLMError(f"{self.id} ({self.title}) has no experiment to run")
        return load_experiment(self.path, data_dir, full=full)


def _check_row(row: Any, where: str) -> dict[str, Any]:
    from looplm.evaluate.kinds.base import check_keys

    row = dict(check_keys(row, ROW_KEYS, where))
    for key in ("method", "metric", "value"):
        if key not in row:
            raise LoopLMError(f"{where} needs a {key}")
    if row["metric"] not in METRICS:
        raise LoopLMError(f"{where}.metric={row['metric']!r}; allowed: {', '.join(METRICS)}")
    if row.get("scale") not in TIERS:
        allowed = ", ".join(str(k) for k in TIERS if k)
        raise LoopLMError(f"{where}.scale={row.get('scale')!r}; allowed: {allowed}")
    return row


def load_entry(path: str | os.PathLike) -> Entry:
    """A catalogue entry from its YAML (validated ``paper:`` section)."""
    from looplm.evaluate.kinds.base import check_keys
    from looplm.experiments.paper.verdicts import check_claim

    p = Path(path)
    try:
        raw = load_yaml(p.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise LoopLMError(f"paper config {p}: cannot be read ({exc})") from None
    meta = dict(check_keys(raw.get("paper"), PAPER_KEYS, f"{p.name}: paper"))
    if meta.get("id") != p.stem:
        raise LoopLMError(f"{p}: paper.id={meta.get('id')!r} must be the file's stem {p.stem!r}")
    rows = meta.get("reported") or []
    if not isinstance(rows, list):
        raise LoopLMError(f"{p.name}: paper.reported must be a list")
    reported = [_check_row(r, f"{p.name}: paper.reported[{i}]") for i, r in enumerate(rows)]
    raw_claims = meta.get("claims") or []
    if not isinstance(raw_claims, list):
        raise LoopLMError(f"{p.name}: paper.claims must be a list")
    claims = [check_claim(c, f"{p.name}: paper.claims[{i}]") for i, c in enumerate(raw_claims)]
    return Entry(p.stem, p, meta, reported, claims)


def catalogue(config_dir: str | os.PathLike | None = None) -> list[Entry]:
    """Every table and figure of the paper, in the paper's order."""
    folder = Path(config_dir) if config_dir else CONFIG_DIR
    out = []
    for eid in ENTRY_IDS:
        p = folder / f"{eid}.yaml"
        if not p.is_file():
            raise LoopLMError(f"paper catalogue: {p} is missing")
        out.append(load_entry(p))
    return out


def find_entry(name: str, config_dir: str | os.PathLike | None = None) -> Entry:
    """The entry ``name`` (``table02``, ``table2``, ``figure4``, ``convergence``)."""
    key = name.strip().lower().removesuffix(".yaml")
    if key.startswith("table") and key[5:].isdigit():
        key = f"table{int(key[5:]):02d}"
    if key not in ENTRY_IDS:
        raise LoopLMError(f"unknown paper entry {name!r}; allowed: {', '.join(ENTRY_IDS)}")
    return load_entry((Path(config_dir) if config_dir else CONFIG_DIR) / f"{key}.yaml")


def _default_data_dir() -> str | None:
    env = os.environ.get("LOOPLM_DATA_DIR")
    if env:
        return env
    cand = CONFIG_DIR.parent.parent.parent / "shared" / "data"
    return str(cand) if cand.is_dir() else None
