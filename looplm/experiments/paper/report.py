"""Paper values beside measured ones: each ``reported`` row of an entry looked up in its grid's
results store (the CPU analogue's, or the full protocol's)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from looplm.experiments.paper.entries import CONFIG_DIR, TIERS, Entry, _default_data_dir, catalogue
from looplm.experiments.paper.metrics import diagnostic_value


def _mean_std(vals: list[float]) -> tuple[float | None, float | None, int]:
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    if not vals:
        return None, None, 0
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return mean, std, len(vals)


class _Measured:
    """Store rows of one experiment, indexed for the ``reported`` metrics."""

    def __init__(self, exp: Any, full: bool, data: str | os.PathLike | None = None) -> None:
        from looplm.evaluate.records import eval_tag
        from looplm.results.export import data_file, read_export
        from looplm.results.store import ResultsStore

        self.exp, self.full = exp, full
        self.records = []
        if data is None:  # the grid's own results store
            self.source = f"store {exp.store}"
            if exp.store.is_file():
                with ResultsStore(exp.store, read_only=True) as store:
                    self.records = store.query()
        else:  # its export in the data folder (looplm.results.export)
            path = data_file(data, exp.store)
            self.source = f"data {_shown(path)} (export of {exp.store})"
            if path.is_file():
                self.records = read_export(path)
            else:
                self.source += ", not committed yet"
        ev = exp.evaluate
        self.fixed_tag = eval_tag(ev.get("tag", ""), max_tokens=ev.get("max_tokens"))
        self.split = ev.get("split", "test")

    def _plans(self, method: str, scale: str | None) -> list[Any]:
        variant = TIERS[scale][1 if self.full else 0]
        return [p for p in self.exp.runs if p.method == method and p.variant == variant]

    def matching(self, method: str, scale: str | None, **match: Any) -> list[Any]:
        """Every record of ``method`` at ``scale`` whose fields equal ``match``."""
        keys = {(p.model_hash, p.protocol, p.seed) for p in self._plans(method, scale)}
        return [
            r
            for r in self.records
            if r.method == method
            and (r.model_hash, r.protocol, r.seed) in keys
            and all(getattr(r, k) == v for k, v in match.items())
        ]

    def rows(self, method: str, scale: str | None, **match: Any) -> dict[int, Any]:
        """seed → record of ``method`` at ``scale`` whose fields equal ``match`` (one a seed:
        ``match`` must pin the row down)."""
        return {r.seed: r for r in self.matching(method, scale, **match)}

    def fixed(self, method: str, scale: str | None, depth: int) -> dict[int, float]:
        from looplm.data.corpora import canonical_split

        plans = self._plans(method, scale)
        if not plans:
            return {}
        rows = self.rows(
            method,
            scale,
            depth=depth,
            adaptive_mode="",
            eval_tag=self.fixed_tag,
            dataset=plans[0].cfg.data.dataset,
            split=canonical_split(self.split),
        )
        return {s: r.ppl for s, r in rows.items()}

    def diagnostics(self, method: str, scale: str | None) -> dict[int, dict[str, Any]]:
        # filter before keying by seed: a seed also has fixed-depth rows at the same settings
        rows = self.matching(method, scale, adaptive_mode="")
        diag = one_per_checkpoint([r for r in rows if r.eval_tag.startswith("diagnostics")])
        return {r.seed: r.extra for r in diag}


def _shown(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it (a page generated from
    the committed data reads the same on every machine)."""
    root = CONFIG_DIR.parents[1]
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def _fixed_metric(row: dict[str, Any], m: _Measured, method: str) -> list[float]:
    """ppl, paired delta_ppl, the T = 4 → 8 gain and the T = 8 → 48 rise (per seed)."""
    metric, scale = row["metric"], row.get("scale")
    if metric == "ppl":
        return list(m.fixed(method, scale, int(row["depth"])).values())
    if metric == "delta_ppl":
        a = m.fixed(method, scale, int(row["depth"]))
        return _paired(a, m.fixed(row["reference"], scale, int(row["depth"])))
    four, eight = m.fixed(method, scale, 4), m.fixed(method, scale, 8)
    if metric == "ppl_gain_4_to_8":
        return _paired(four, eight)
    return _paired(m.fixed(method, scale, 48), eight)  # ppl_rise_8_to_48


def _adaptive_metric(row: dict[str, Any], m: _Measured, method: str) -> list[float]:
    """adaptive_ppl at a budget, the largest |achieved − target| depth, and the fewest KL-halting
    loops that match uniform depth-8 quality (per seed)."""
    metric, scale = row["metric"], row.get("scale")
    if metric == "kl_halting_loops_at_depth8_quality":
        out = []
        for s, r8 in m.fixed(method, scale, 8).items():
            rows = m.matching(method, scale, seed=s)  # every adaptive row of this seed
            kl = [r for r in rows if r.adaptive_mode.startswith("kl:") and r.ppl <= r8]
            if kl:
                out.append(min(r.extra.get("mean_depth", math.inf) for r in kl))
        return out
    vals, errs = [], []
    for b in [row["budget"]] if "budget" in row else [8, 16, 24]:
        rows = m.rows(method, scale, adaptive_mode=f"maxtoken:budget={b}")
        vals += [r.ppl for r in rows.values()]
        errs += [abs(r.extra.get("mean_depth", math.nan) - b) for r in rows.values()]
    if metric == "adaptive_ppl":
        return vals
    return [max(errs)] if errs else []


def _corpus_metric(row: dict[str, Any], m: _Measured, method: str) -> list[float]:
    """Transfer PPL (thousands) and paired deltas, validation loss, LAMBADA PPL / accuracy."""
    metric, scale, depth = row["metric"], row.get("scale"), int(row["depth"])
    if metric.startswith("lambada"):
        rows = m.rows(method, scale, dataset="lambada", depth=depth, adaptive_mode="").values()
        if metric == "lambada_ppl_k":
            return [r.ppl / 1e3 for r in rows]
        return [100.0 * r.extra["n_correct"] / r.extra["n_examples"] for r in rows
                if r.extra.get("n_examples")]  # fmt: skip
    plans = m._plans(method, scale)
    ds = row.get("dataset") or (plans[0].cfg.data.dataset if plans else "")

    def rows_of(meth: str) -> dict[int, Any]:
        rs = m.rows(meth, scale, dataset=ds, split="validation", depth=depth, adaptive_mode="")
        return {s: r for s, r in rs.items() if not r.eval_tag.startswith("diagnostics")}

    if metric == "val_loss":
        return [r.mean_nll for r in rows_of(method).values()]
    if metric == "transfer_ppl_k":
        return [r.ppl / 1e3 for r in rows_of(method).values()]
    a = {s: r.ppl / 1e3 for s, r in rows_of(method).items()}
    return _paired(a, {s: r.ppl / 1e3 for s, r in rows_of(row["reference"]).items()})


def _diagnostics_metric(row: dict[str, Any], m: _Measured, method: str) -> list[float]:
    """R_t, gain_t, KL at a loop, convergence and steering statistics (per seed)."""
    metric, step = row["metric"], int(row.get("step", 0))
    out = []
    for extra in m.diagnostics(method, row.get("scale")).values():
        v = diagnostic_value(metric, step, extra)
        if v is not None:
            out.append(v)
    return out


_FIXED = {"ppl", "delta_ppl", "ppl_gain_4_to_8", "ppl_rise_8_to_48"}
_ADAPTIVE = {"adaptive_ppl", "adaptive_depth_error_max", "kl_halting_loops_at_depth8_quality"}
_CORPUS = {"transfer_ppl_k", "transfer_delta_ppl_k", "val_loss", "lambada_ppl_k",
           "lambada_acc_pct"}  # fmt: skip


def measure(row: dict[str, Any], m: _Measured, methods: list[str]) -> dict[str, Any]:
    """The measured counterpart of one ``reported`` row: ``{"mean", "std", "n", "note"}``."""
    metric, method = row["metric"], row["method"]
    if metric == "ms_per_batch" and not m.full:
        return {"mean": None, "std": None, "n": 0, "note": "GPU latency: not measurable on CPU"}
    family = method == "any" or method.startswith("additive")
    if method not in methods and not family:
        return {"mean": None, "std": None, "n": 0, "note": f"{method} not in this grid"}
    if family:  # a statement about every method (or the additive-source family): per method
        parts = []
        for t in methods:
            if method.startswith("additive") and t.startswith("scse"):
                continue
            res = measure({**row, "method": t}, m, methods)
            if res["mean"] is not None:
                parts.append(
                    f"{t} {_fmt(res['mean'])}" + (f" ({res['note']})" if res["note"] else "")
                )
        return {"mean": None, "std": None, "n": 0, "note": "; ".join(parts) or "not yet run"}
    if metric in _FIXED:
        vals = _fixed_metric(row, m, method)
    elif metric in _ADAPTIVE:
        vals = _adaptive_metric(row, m, method)
    elif metric in _CORPUS:
        vals = _corpus_metric(row, m, method)
    else:
        vals = _diagnostics_metric(row, m, method)
    mean, std, n = _mean_std(vals)
    note = "" if n else "not yet run"
    if metric == "kl_halting_loops_at_depth8_quality":
        seeds = len(m.fixed(method, row.get("scale"), 8))
        if seeds and n < seeds:  # a seed whose KL rule never matches depth 8 has no value
            note = f"{n} of {seeds} seeds reach depth-8 quality at any threshold"
    return {"mean": mean, "std": std, "n": n, "note": note}


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    a = abs(v)
    if a != 0 and (a < 1e-3 or a >= 1e5):
        return f"{v:.2e}"
    return f"{v:.4g}" if a < 10 else f"{v:.1f}"


def _row_label(row: dict[str, Any]) -> str:
    parts = [row["method"]]
    if row.get("reference"):
        parts.append(f"− {row['reference']}")
    for key, fmt in (("scale", "{}"), ("dataset", "{}"), ("depth", "T={}"), ("budget", "budget {}"),
                     ("step", "t={}")):  # fmt: skip
        if row.get(key) is not None:
            parts.append(fmt.format(row[key]))
    return " ".join(str(p) for p in parts)


def _paper_value(row: dict[str, Any]) -> str:
    v = row["value"]
    s = format(v, "g") if isinstance(v, (int, float)) else str(v)
    if row.get("std") is not None:
        s += f" ± {row['std']} s.d."
    elif row.get("ci") is not None:
        s += f" ± {row['ci']} (95% CI)"
    if row.get("table") is not None:
        s += f" (Table {row['table']})"
    return s


def entry_report(
    entry: Entry,
    *,
    full: bool = False,
    data_dir: str | None = None,
    figures_dir: str | os.PathLike | None = None,
    link_base: str | os.PathLike | None = None,
    data: str | os.PathLike | None = None,
    draw: bool = True,
) -> str:
    """Markdown: the entry's paper values beside the measured ones (CPU analogue or ``full``);
    with ``figures_dir``, the diagnostics figures of its rows are drawn there and linked
    (relative to ``link_base``, the report file's folder, when given; ``draw=False`` links them
    without drawing). The rows come from the grid's results store, or with ``data`` from its
    export in that folder (:func:`looplm.results.export.data_file`)."""
    lines = [f"### {entry.id}: {entry.title}", ""]
    lines.append(f"Paper: {entry.meta.get('protocol', '')}. Claim: {entry.meta.get('claim', '')}")
    if not entry.is_experiment:
        return "\n".join(lines + ["", "Nothing to measure."])
    exp = entry.experiment(full=full, data_dir=data_dir)
    m = _Measured(exp, full, data)
    methods = sorted({p.method for p in exp.runs})
    where = "full protocol" if full else "CPU analogue"
    lines += ["", f"Measured ({where}): {m.source}, {len(m.records)} rows.", ""]
    if not entry.reported:
        lines.append("The paper's text gives no numbers for this entry (its table is an image).")
    else:
        lines += [
            f"| row | metric | paper | measured ({where}) | seeds | measured on |",
            "|---|---|---|---|---|---|",
        ]
        for row in entry.reported:
            res = measure(row, m, methods)
            got = _fmt(res["mean"])
            if res["mean"] is not None and res["n"] > 1:
                got += f" ± {_fmt(res['std'])} s.d."
            if res["note"]:
                got = res["note"] if res["mean"] is None else f"{got} ({res['note']})"
            plans = m._plans(row["method"], row.get("scale")) if row["method"] in methods else []
            model = model_description(plans[0].cfg) if plans else "–"
            lines.append(
                f"| {_row_label(row)} | {row['metric']} | {_paper_value(row)} | {got} | "
                f"{res['n'] or '–'} | {model} |"
            )
    if entry.claims:
        from looplm.experiments.paper.verdicts import verdict_table

        lines += ["", "Claims, with the verdict computed from the stored rows:", ""]
        lines += verdict_table(entry.claims, m)
    lines += ["", _fixed_table(exp, m)]
    if figures_dir is not None and (exp.evaluate or {}).get("diagnostics"):  # not shared rows
        mine = {(p.model_hash, p.protocol, p.seed): p.variant for p in exp.runs}
        recs = [r for r in m.records if (r.model_hash, r.protocol, r.seed) in mine]
        tiers = {key: _tier_label(var, full) for key, var in mine.items()}
        figs = diagnostics_figures(recs, Path(figures_dir) / entry.id, tiers=tiers, draw=draw)
        for path in figs:
            link = os.path.relpath(path, link_base) if link_base is not None else path
            lines += ["", f"![{entry.id} {path.stem}]({link})"]
    return "\n".join(lines)


def entry_verdicts(
    entry: Entry,
    *,
    full: bool = False,
    data_dir: str | None = None,
    data: str | os.PathLike | None = None,
) -> list[tuple[dict[str, Any], Any]]:
    """``(claim, Verdict)`` of every claim of ``entry``, computed from its grid's store (or with
    ``data`` its export in that folder), as the report prints them."""
    from looplm.experiments.paper.verdicts import claim_verdict

    if not entry.claims:
        return []
    m = _Measured(entry.experiment(full=full, data_dir=data_dir), full, data)
    return [(c, claim_verdict(c, m)) for c in entry.claims]


def model_facts(cfg: Any) -> tuple[str, int, int, int, int]:
    """(tokenizer, width, parameters, training steps, tokens seen) of a run config; the
    parameters counted on the meta device."""
    import torch

    from looplm.model.build import model_from_config

    with torch.device("meta"):
        n = model_from_config(cfg.model).num_parameters()
    t = cfg.train
    tokens = t.steps * t.batch_size * t.grad_accum * cfg.model.context
    return cfg.model.tokenizer, cfg.model.d_model, n, t.steps, tokens


def model_description(cfg: Any) -> str:
    """What a measured row was measured on: tokenizer, width, parameters, training steps and
    tokens seen (``bytes d128 345k params, 600 steps, 614k tokens``)."""
    tok, d, n, steps, tokens = model_facts(cfg)
    return f"{tok} d{d} {count_text(n)} params, {steps} steps, {count_text(tokens)} tokens"


def count_text(n: int) -> str:
    """A count in three significant digits with its unit (``86.4k``, ``6.71M``)."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _fixed_table(exp: Any, m: _Measured) -> str:
    """Measured fixed-depth PPL (mean ± s.d. over seeds) of every method and tier of the grid,
    each row naming the model it was measured on."""
    depths = list(exp.evaluate.get("depths", []))
    cells = sorted({(p.variant, p.method) for p in exp.runs})
    cfg_of = {(p.variant, p.method): p.cfg for p in exp.runs}
    rows = []
    for variant, method in cells:
        tier = _tier_of(variant, m.full)
        vals = []
        for d in depths:
            mean, std, n = _mean_std(list(m.fixed(method, tier, d).values()))
            vals.append("–" if mean is None else f"{mean:.2f} ± {std:.2f} ({n})")
        if any(v != "–" for v in vals):
            model = model_description(cfg_of[(variant, method)])
            rows.append(f"| {method} | {model} | " + " | ".join(vals) + " |")
    if not rows:
        return "Fixed-depth PPL: not yet run."
    unit = "PPL per byte" if exp.runs and exp.runs[0].cfg.model.tokenizer == "bytes" else "PPL"
    head = "| method | model | " + " | ".join(f"T={d}" for d in depths) + " |"
    sep = "|---|---|" + "---|" * len(depths)
    split = exp.evaluate.get("split", "test")
    title = f"Fixed-depth {split} {unit}, mean ± s.d. over seeds (number of seeds):"
    return "\n".join([title, "", head, sep, *rows])


def paper_report(
    entries: list[Entry] | None = None,
    *,
    full: bool = False,
    data_dir: str | None = None,
    figures_dir: str | os.PathLike | None = None,
    link_base: str | os.PathLike | None = None,
    data: str | os.PathLike | None = None,
    draw: bool = True,
) -> str:
    """The side-by-side report of every entry (Markdown; diagnostics figures into
    ``figures_dir/<entry>/`` when given, linked relative to ``link_base``; measured rows from
    the grids' stores, or with ``data`` from their committed exports in that folder)."""
    entries = entries if entries is not None else catalogue()
    where = "full protocol" if full else "CPU analogues"
    parts = [
        f"# The SCSE paper: reported vs measured ({where})",
        "",
        "Paper values are the ones its text states, at the paper's scale; measured values are "
        "this grid's, so absolute numbers differ by design and the comparison is of orderings "
        "and signs.",
    ]
    for e in entries:
        dd = data_dir or _default_data_dir()
        parts += [
            "",
            entry_report(
                e,
                full=full,
                data_dir=dd,
                figures_dir=figures_dir,
                link_base=link_base,
                data=data,
                draw=draw,
            ),
        ]
    return "\n".join(parts) + "\n"


def _tier_of(variant: str, full: bool) -> str | None:
    """The scale tier (a key of ``TIERS``) whose training variant is ``variant``, if any."""
    return next((k for k, v in TIERS.items() if k and v[1 if full else 0] == variant), None)


def _tier_label(variant: str, full: bool) -> str:
    """A training variant's scale tier, with the CPU analogue's own name: ``22m``, ``50m: d192``."""
    tier = _tier_of(variant, full)
    if tier is None:
        return variant
    return tier if full or not variant else f"{tier}: {variant}"


def _record_tier(tiers: dict[tuple[str, str, int], str], r: Any) -> str:
    """A store record's scale tier label (``""`` when ``tiers`` does not know its run)."""
    return tiers.get((r.model_hash, r.protocol, r.seed), "")


def _scale_groups(rows: list[Any], tier_of: Callable[[Any], str]) -> list[dict[str, Any]]:
    """R_t at t = 0 and the last step of every seed, grouped by (tier, method) in row order."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(
            (tier_of(r), r.method),
            {
                "tier": tier_of(r),
                "method": r.method,
                "R_t0": [],
                "R_last": [],
                "last_step": r.extra.get("last_step"),
            },  # fmt: skip
        )
        g["R_t0"].append(r.extra.get("R_t0"))
        g["R_last"].append(r.extra.get("R_last"))
    return list(groups.values())


def one_per_checkpoint(rows: list[Any]) -> list[Any]:
    """Diagnostics rows, one per checkpoint (model, protocol, method, seed), in their order: a
    checkpoint measured with and without steering rollouts keeps the row that has them (its other
    statistics are the same measurement)."""
    keep: dict[tuple[str, str, str, int], Any] = {}
    for r in rows:
        key = (r.model_hash, r.protocol, r.method, r.seed)
        if key not in keep or (r.extra or {}).get("steering"):
            keep[key] = r
    return [r for r in rows if keep[(r.model_hash, r.protocol, r.method, r.seed)] is r]


def diagnostics_figures(
    records: list[Any],
    out_dir: str | os.PathLike,
    *,
    tiers: dict[tuple[str, str, int], str] | None = None,
    draw: bool = True,
) -> list[Path]:
    """Figures 5 (R_t bars), the per-step anchor quantities and the per-token convergence curves
    from diagnostics-kind store rows (one curve per method and seed); returns the PNG paths.

    ``tiers`` maps a record's ``(model_hash, protocol, seed)`` to its scale tier. When the rows
    span more than one tier, labels carry the tier, ``r_t_by_scale.png`` (Figure 5 by scale,
    mean over seeds) is drawn, and the per-checkpoint figures keep each tier and method's lowest
    seed so that they stay readable. ``draw=False``: only the paths they would have."""
    from looplm.diagnostics import plots

    tier_of = functools.partial(_record_tier, tiers or {})
    order = {label: i for i, label in enumerate(dict.fromkeys((tiers or {}).values()))}
    rows = sorted(
        (r for r in records if r.eval_tag.startswith("diagnostics")),
        key=lambda r: (order.get(tier_of(r), 0), r.method, r.seed, r.protocol),
    )
    if not rows:
        return []
    rows = one_per_checkpoint(rows)  # no checkpoint counts twice in a mean over seeds
    out = Path(out_dir)
    scaled = len({tier_of(r) for r in rows}) > 1
    drawn = (("r_t.png", plots.plot_rt_bars), ("anchor_steps.png", plots.plot_anchor_steps),
             ("convergence.png", plots.plot_convergence))  # fmt: skip
    if not draw:
        return [out / n for n in ["r_t_by_scale.png"] * scaled + [n for n, _ in drawn]]
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if scaled:
        plots.plot_rt_by_scale(_scale_groups(rows, tier_of), out / "r_t_by_scale.png")
        paths.append(out / "r_t_by_scale.png")
        first: dict[tuple[str, str], Any] = {}
        for r in rows:
            first.setdefault((tier_of(r), r.method), r)
        rows = list(first.values())
    results = [
        {
            "label": (f"{tier_of(r)} " if scaled else "") + f"{r.method} s{r.seed}",
            "method": r.method,
            "loops": r.depth,
            "summary": r.extra,
            "per_step": r.extra["per_step"],
            "convergence": r.extra["convergence"],
        }
        for r in rows
    ]
    for name, fn in drawn:
        fn(results, out / name)
        paths.append(out / name)
    return paths
