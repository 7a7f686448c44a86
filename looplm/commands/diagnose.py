"""`looplm diagnose CHECKPOINT [CHECKPOINT …]`: the paper's mechanistic diagnostics.

For each checkpoint: forcing bias b_t and raw b̃_t, energy ratio R_t (Eq. 9), anchor energy E_Δ,t,
random-direction gain, anchor-start steering with the injection-gain dose-response, the
bias-subtraction counterfactual with a numerical Lemma 1 check, and per-token convergence (KL per
loop, convergence depth by token type). Writes ``OUT/<label>/diagnostics.json`` (+ steering
arrays and figure), ``OUT/summary.json`` and the figures ``r_t.png``, ``anchor_steps.png``,
``convergence.png``; with ``--store`` one results-store row per checkpoint (eval_tag
``diagnostics``).
"""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

from looplm.commands import checkpoint_data
from looplm.errors import LoopLMError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="mechanistic diagnostics: forcing bias, R_t, gain, steering, counterfactual, KL",
        description=(
            "Anchor-response diagnostics of looped checkpoints (paper Table 3, Figures 4-5, "
            "Lemma 1) and per-token convergence (KL halting study). Several checkpoints are compared in "
            "one set of figures."
        ),
    )
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="checkpoint folder(s)")
    checkpoint_data.add_data_options(
        p,
        data_help="corpus (e.g. wikitext-2, a local text file) or synthetic task (bool_logic); "
        "default: the checkpoint's own data config",
        split_help="split to draw inputs from (default: the run's eval split)",
    )
    p.add_argument("--out", default="runs/diagnostics", help="output folder")
    p.add_argument("--loops", type=int, default=48, help="unroll depth T (default 48)")
    p.add_argument("--batches", type=int, default=2, help="measured batches (default 2)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--store", help="results store (.sqlite) to add one row per checkpoint to")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--dtype",
        default="float64",
        choices=("float64", "float32"),
        help="working precision (float64 keeps ε = 1e-3 finite differences exact enough)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the probe directions")
    p.add_argument("--kl-threshold", type=float, default=1e-3, help="τ of the convergence depth")
    p.add_argument(
        "--steer-inputs", type=int, default=6, help="inputs of the steering rollouts (paper: 6)"
    )
    p.add_argument(
        "--check-steps", type=int, default=4, help="steps of the Lemma 1 check (0: skip)"
    )
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (tiny models on a busy CPU often run fastest with 1)",
    )
    p.add_argument("--no-plots", action="store_true", help="write numbers only")
    p.set_defaults(func=run)


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


def _check_args(args: argparse.Namespace) -> None:
    from looplm.limits import check_int_range, check_loops, check_output_folder

    check_output_folder("--out", args.out)  # before the diagnostics, not after them

    if args.loops < 1:
        raise LoopLMError(f"--loops {args.loops}: the loop depth T must be an integer >= 1")
    check_loops("--loops", args.loops, offer_flag=False)
    for name in ("batches", "batch_size", "steer_inputs", "check_steps"):
        lo = 1 if name in ("batches", "batch_size") else 0
        check_int_range(f"--{name.replace('_', '-')}", getattr(args, name), lo)
    if args.device not in ("auto", "cpu", "cuda"):
        raise LoopLMError(f"--device {args.device!r}; allowed: auto, cpu, cuda")
    if args.threads is not None and args.threads < 1:
        raise LoopLMError(f"--threads {args.threads} must be >= 1")


def _entries(checkpoints: list[str]) -> list[tuple[str, str, str]]:
    """(checkpoint, method, run name) per checkpoint; every config is read first, so a bad
    checkpoint fails before any long computation."""
    from looplm.checkpoint import read_meta
    from looplm.config import config_from_dict

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


def _diagnose_one(args: argparse.Namespace, ck: str, method: str, label: str, dev, dtype):
    """Diagnose one checkpoint: (results written to <out>/<label>/, its config, its arrays)."""
    from looplm.checkpoint import load_checkpoint
    from looplm.diagnostics.runner import DiagnoseOptions, diagnose_model
    from looplm.evaluate.records import model_hash

    model, cfg, meta = load_checkpoint(ck, map_location=dev)
    model = model.to(dtype).eval()
    batches, data_info, pad_id = checkpoint_data.load_data_batches(
        cfg, args, batch_size=args.batch_size, n_batches=args.batches, seed=cfg.train.seed
    )
    # without a tokenizer, token types are reported as "other"
    tokenizer, tok_note = checkpoint_data.checkpoint_tokenizer(cfg)
    opts = DiagnoseOptions(
        loops=args.loops,
        kl_threshold=args.kl_threshold,
        ref_depth=cfg.train.depth_max,
        steer_inputs=min(args.steer_inputs, args.batch_size * args.batches),
        check_steps=args.check_steps,
        seed=args.seed,
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


def _print_table(rows: list[dict]) -> None:
    head = f"{'label':<16} {'R_0':>8} {'R_last':>8} {'max|b|':>8} {'max|b~|':>8} "
    head += f"{'E_D,last':>9} {'gain_0':>8} {'gain_last':>9} {'E_T':>9} {'lemma1':>8} "
    head += f"{'KL_2':>8} {'med.depth':>9}"
    print(head)
    for r in rows:
        s = r["summary"]
        print(
            f"{r['label']:<16} {_fmt(s['R_t0']):>8} {_fmt(s['R_last']):>8} "
            f"{_fmt(s['bias_max_abs']):>8} {_fmt(s['raw_bias_max_abs']):>8} "
            f"{_fmt(s['anchor_energy_last']):>9} {_fmt(s['gain_t0'], '.4g'):>8} "
            f"{_fmt(s['gain_last'], '.5g'):>9} {_fmt(s['E_energy_T']):>9} "
            f"{_fmt(s['lemma1_max_rel_error'], '.1e'):>8} {_fmt(s['kl_loop2']):>8} "
            f"{_fmt(s['median_convergence_depth']):>9}"
        )


def run(args: argparse.Namespace) -> int:
    import torch

    from looplm.errors import check_positive_int

    check_positive_int("--batch-size", args.batch_size)

    from looplm.device import resolve_device
    from looplm.io import atomic_write_json

    _check_args(args)
    checkpoint_data.set_threads(args.threads)
    dev = resolve_device(args.device)
    dtype = {"float64": torch.float64, "float32": torch.float32}[args.dtype]
    out_dir = Path(args.out)
    entries = _entries(args.checkpoints)
    result_paths, rows = [], []
    for (ck, method, _), label in zip(entries, _labels(entries)):
        results, cfg, arrays = _diagnose_one(args, ck, method, label, dev, dtype)
        result_paths.append(_write(out_dir / label, results, arrays))
        rows.append(results)
        if args.store:
            _store(args.store, cfg, results)
    summary = {
        r["label"]: {"checkpoint": r["checkpoint"], "method": r["method"], **r["summary"]}
        for r in rows
    }
    atomic_write_json(out_dir / "summary.json", summary)
    figures = []
    if not args.no_plots:
        from looplm.diagnostics.plots import render_figures

        figures = render_figures(out_dir, result_paths)
    _print_table(rows)
    print(f"wrote {out_dir / 'summary.json'}" + (f" and {len(figures)} figures" if figures else ""))
    return 0


def _store(path: str, cfg, results: dict) -> None:
    from looplm.evaluate.kinds.diagnostics import Diagnostics
    from looplm.results.store import ResultsStore

    with ResultsStore(path) as store:
        store.put(Diagnostics.record(cfg, results))
