"""The mechanistic diagnostics of several checkpoints (what ``looplm diagnose`` runs).

For each checkpoint (:func:`diagnose_checkpoints`): forcing bias b_t and raw b̃_t, energy ratio R_t (Eq. 9), anchor energy E_Δ,t,
random-direction gain, anchor-start steering with the injection-gain dose-response, the
bias-subtraction counterfactual with a numerical Lemma 1 check, and per-token convergence (KL per
loop, convergence depth by token type). Writes ``OUT/<label>/diagnostics.json`` (+ steering
arrays and figure), ``OUT/summary.json`` and the figures ``r_t.png``, ``anchor_steps.png``,
``convergence.png``; with a store, one results-store row per checkpoint (eval_tag
``diagnostics``).
"""

from __future__ import annotations

import io
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from looplm.diagnostics.settings import DiagnoseSettings
from looplm.errors import LoopLMError
from looplm.evaluate.settings import DataSettings


def _labels(entries: list[tuple[str, str, str]]) -> list[str]:
    """Folder-safe labels: the method name, disambiguated by run name where methods repeat."""
    methods = [m for _, m, _ in entries]
    out, seen = [], set()
    for _path, method, run_name in entries:
        label = method if methods.count(method) == 1 else f"{method}-{run_name}"
        label = re.sub(r"[^A-Za-z0-9_.+-]", "_", label)
        base, k = label, 2
        while label in seen:
            label, k = f"{base}-{k}", k + 1
        seen.add(label)
        out.append(label)
    return out


def _run_name(path: Path, cfg) -> str:
    if cfg.name:
        return cfg.name
    p = path.resolve()
    return p.parent.name if p.name in ("ckpt", "final", "checkpoint", "last") else p.name


def _fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _entries(checkpoints: list[str]) -> list[tuple[str, str, str]]:
    """(checkpoint, method, run name) per checkpoint; every config is read first, so a bad
    checkpoint fails before any long computation."""
    from looplm.model.checkpoint import read_meta
    from looplm.settings.config import config_from_dict

    entries = []
    for ck in checkpoints:
        cfg = config_from_dict(read_meta(ck)["config"])
        if not cfg.model.is_looped:
            raise LoopLMError(
                f"checkpoint {ck} is an unshared Transformer; the anchor diagnostics need a "
                "looped model (a shared block with an anchor)"
            )
        entries.append((ck, cfg.model.recurrence, _run_name(Path(ck), cfg)))
    return entries


def _diagnose_one(
    settings: DiagnoseSettings, data: DataSettings, ck: str, method: str, label: str, dev, dtype
):
    """Diagnose one checkpoint: (results written to <out>/<label>/, its config, its arrays)."""
    from looplm.diagnostics.runner import diagnose_model
    from looplm.evaluate.inputs import checkpoint_tokenizer, data_batches
    from looplm.evaluate.records import model_hash
    from looplm.model.checkpoint import load_checkpoint

    model, cfg, meta = load_checkpoint(ck, map_location=dev)
    model = model.to(dtype).eval()
    batches, data_info, pad_id = data_batches(
        cfg, data, batch_size=settings.batch_size, n_batches=settings.batches, seed=cfg.train.seed
    )
    # without a tokenizer, token types are reported as "other"
    tokenizer, tok_note = checkpoint_tokenizer(cfg)
    opts = replace(
        settings,
        ref_depth=cfg.train.depth_max,
        steer_inputs=min(settings.steer_inputs, settings.batch_size * settings.batches),
    )
    print(f"diagnosing {ck} ({method}) on {data_info['dataset']}/{data_info['split']} ...")
    results, arrays = diagnose_model(
        model, batches, opts, tokenizer=tokenizer, pad_id=pad_id, progress=True
    )
    rec = model.recurrence
    results = {
        "label": label,
        "checkpoint": str(ck),
        "method": method,
        "equation": getattr(rec, "equation", ""),
        "reference": getattr(rec, "reference", ""),
        "preset": cfg.model.preset,
        "step": meta.get("state", {}).get("step"),
        "seed": cfg.train.seed,
        "model_hash": model_hash(cfg),  # the evaluation rows' identity of the same run
        "data": data_info,
        "tokenizer_note": tok_note,
        **results,
    }
    return results, cfg, arrays


def _write(sub: Path, results: dict, arrays: dict) -> Path:
    import numpy as np

    from looplm.io import atomic_write_bytes, atomic_write_json

    atomic_write_json(sub / "diagnostics.json", results)
    if arrays:
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(sub / "steering.npz", buf.getvalue())
    return sub / "diagnostics.json"


def table_lines(rows: list[dict]) -> list[str]:
    """The summary table ``looplm diagnose`` prints, one line per checkpoint."""
    head = f"{'label':<16} {'R_0':>8} {'R_last':>8} {'max|b|':>8} {'max|b~|':>8} "
    head += f"{'E_D,last':>9} {'gain_0':>8} {'gain_last':>9} {'E_T':>9} {'lemma1':>8} "
    head += f"{'KL_2':>8} {'med.depth':>9}"
    lines = [head]
    for r in rows:
        s = r["summary"]
        lines.append(
            f"{r['label']:<16} {_fmt(s['R_t0']):>8} {_fmt(s['R_last']):>8} "
            f"{_fmt(s['bias_max_abs']):>8} {_fmt(s['raw_bias_max_abs']):>8} "
            f"{_fmt(s['anchor_energy_last']):>9} {_fmt(s['gain_t0'], '.4g'):>8} "
            f"{_fmt(s['gain_last'], '.5g'):>9} {_fmt(s['E_energy_T']):>9} "
            f"{_fmt(s['lemma1_max_rel_error'], '.1e'):>8} {_fmt(s['kl_loop2']):>8} "
            f"{_fmt(s['median_convergence_depth']):>9}"
        )
    return lines


def diagnose_checkpoints(
    checkpoints: list[str],
    settings: DiagnoseSettings,
    data: DataSettings,
    out: str | Path,
    *,
    store: str | None = None,
    device: str = "auto",
    plots: bool = True,
) -> dict[str, Any]:
    """Diagnose every checkpoint (every config is read first, so a bad one fails before any
    long computation); writes ``out/<label>/diagnostics.json`` (+ steering arrays),
    ``out/summary.json`` and the figures, and with ``store`` one row per checkpoint. Returns
    ``{"rows": [results, …], "summary": path, "figures": [paths]}``."""
    import torch

    from looplm.device import resolve_device
    from looplm.io import atomic_write_json

    dev = resolve_device(device)
    dtype = {"float64": torch.float64, "float32": torch.float32}[settings.dtype]
    out_dir = Path(out)
    entries = _entries(checkpoints)
    result_paths, rows = [], []
    for (ck, method, _), label in zip(entries, _labels(entries)):
        results, cfg, arrays = _diagnose_one(settings, data, ck, method, label, dev, dtype)
        result_paths.append(_write(out_dir / label, results, arrays))
        rows.append(results)
        if store:
            _store(store, cfg, results)
    summary = {
        r["label"]: {"checkpoint": r["checkpoint"], "method": r["method"], **r["summary"]}
        for r in rows
    }
    atomic_write_json(out_dir / "summary.json", summary)
    figures = []
    if plots:
        from looplm.diagnostics.plots import render_figures

        figures = render_figures(out_dir, result_paths)
    return {"rows": rows, "summary": out_dir / "summary.json", "figures": figures}


def _store(path: str, cfg, results: dict) -> None:
    from looplm.diagnostics.kind import Diagnostics
    from looplm.results.store import ResultsStore

    with ResultsStore(path) as store:
        store.put(Diagnostics.record(cfg, results))
