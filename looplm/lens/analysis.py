"""The whole lens analysis of one model: fit, fidelity, structure, interventions, files.

:func:`analyse_lens` is what ``looplm lens`` runs and what other analyses call with their own
prompts. It writes into ``out``:

* ``lens_T{T}/`` the fitted Jacobian lens and ``tuned_T{T}/`` the tuned lens per depth
  (safetensors + JSON);
* ``lens.json``: fidelity per step of the three arms at T and at the extrapolated depths (means
  with t intervals, paired deltas with bootstrap intervals over prompts), the band of steps where
  the J-lens beats the logit lens, workspace ranks, the subspace-overlap matrix against the
  random baseline, persistence, stationarity, the composition gap, the swap dose-response, the
  slice of top-1 tokens, and the wall time of each part;
* the figures of :mod:`looplm.lens.plots`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.evaluate.settings import DataSettings
from looplm.lens import interventions as I
from looplm.lens import jacobian as L
from looplm.lens import readout as R
from looplm.lens import structure as S
from looplm.lens.settings import REFERENCE_BAND, LensInputs, LensSettings

LensOptions = LensSettings  # the name :func:`analyse_lens` took before the settings were one


def check_for_model(settings: LensSettings, model: torch.nn.Module) -> None:
    """The depths, the subspace dimension and the band of ``settings`` against ``model``."""
    L.check_lens_loops(model, settings.loops)
    for T in settings.extrapolate:
        L.check_lens_loops(model, T)
        if T <= settings.loops:
            raise LoopLMError(
                f"extrapolated depth {T} must be deeper than the fitted T={settings.loops}"
            )
    S.check_k(settings.k, model.config.d_model)
    if settings.band_steps is not None:
        I.check_band(settings.band_steps, settings.loops)


def _say(msg: str, enabled: bool) -> None:
    if enabled:
        print(f"[lens] {msg}", flush=True)


def _fit_depth(
    lens: L.JacobianLens | None,
    model,
    fit_batches,
    eval_batches,
    T: int,
    mode: str,
    opts: LensSettings,
    pad_id,
    out: Path,
    timings: dict,
) -> tuple[L.JacobianLens, dict]:
    t0 = time.perf_counter()
    jl = lens or L.fit_jacobian_lens(
        model,
        fit_batches,
        T,
        mode,
        probes=opts.probes,
        skip_positions=opts.skip_positions,
        pad_id=pad_id,
        seed=opts.seed,
        corpus=opts.corpus,
        progress=opts.progress,
    )
    timings[f"fit_T{T}"] = time.perf_counter() - t0
    jl.save(out / f"lens_T{T}")
    t0 = time.perf_counter()
    tuned = R.fit_tuned_lens(
        model,
        fit_batches,
        T,
        steps=opts.tuned_steps,
        pad_id=pad_id,
        seed=opts.seed,
        progress=opts.progress,
    )
    tuned.save(out / f"tuned_T{T}")
    timings[f"tuned_T{T}"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    arms = {"jacobian": jl, "logit": L.logit_lens(model, T), "tuned": tuned}
    fid = R.fidelity(model, arms, eval_batches, T, pad_id=pad_id)
    summary = fid.summary(n_boot=opts.n_boot, seed=opts.seed)
    timings[f"fidelity_T{T}"] = time.perf_counter() - t0
    summary["band"] = {m: R.lens_band(summary, metric=m) for m in R.FIDELITY_METRICS}
    summary["estimator"] = jl.estimator
    summary["tuned_final_kl"] = tuned.final_kl
    return jl, summary


def token_label(tokenizer, tok: int, pad_id: int | None = None) -> str:
    """A short printable label of one token id."""
    if pad_id is not None and tok == pad_id:
        return "·"
    try:
        text = tokenizer.decode([int(tok)])
    except LoopLMError:
        return f"<{tok}>"
    if text == "<|endoftext|>":
        return "⏎"
    return repr(text)[1:-1] if not text.isprintable() or text.strip() != text else text


def lens_slice(
    model, lens: L.JacobianLens, ids: torch.Tensor, tokenizer=None, pad_id: int | None = None
) -> dict[str, Any]:
    """Top-1 token and its probability under the lens at every (loop step, position) of one
    prompt (1, L), with the logit lens alongside."""
    hidden, final = L.loop_states(model, ids, lens.loops)
    out: dict[str, Any] = {"tokens": ids[0].tolist(), "jacobian": [], "logit": []}
    ident = L.logit_lens(model, lens.loops)
    for arm, lz in (("jacobian", lens), ("logit", ident)):
        for t, h in enumerate(hidden):
            with torch.no_grad():
                p = torch.softmax(lz.apply(model, h, t)[0].double(), -1)
            prob, top = p.max(-1)
            out[arm].append({"top": top.tolist(), "prob": prob.tolist()})
    out["model_top"] = final[0].argmax(-1).tolist()
    if tokenizer is not None:
        lab = lambda i: token_label(tokenizer, i, pad_id)  # noqa: E731
        out["text"] = [lab(i) for i in out["tokens"]]
        for arm in ("jacobian", "logit"):
            for row in out[arm]:
                row["label"] = [lab(i) for i in row["top"]]
    return out


# long: the analysis reads top to bottom, one block per part of lens.json
def analyse_lens(
    model: torch.nn.Module,
    fit_batches: Sequence[L.Batch],
    eval_batches: Sequence[L.Batch],
    out: str | Path,
    opts: LensSettings | None = None,
    *,
    pad_id: int | None = None,
    tokenizer=None,
    lens: L.JacobianLens | None = None,
) -> dict[str, Any]:
    """Run the full analysis and write ``out/lens.json`` (+ lens files and figures).

    ``lens``: a Jacobian lens already fitted on this model at T, used instead of a new fit.
    """
    from looplm.io import atomic_write_json

    opts = opts or LensSettings()
    if opts.loops is None:
        raise LoopLMError("LensSettings.loops: give the depth T of the fit")
    check_for_model(opts, model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    say = opts.progress
    timings: dict[str, float] = {}
    t_all = time.perf_counter()
    T = opts.loops
    d = model.config.d_model
    n_fit = sum(L.batch_ids(b).shape[0] for b in fit_batches)
    _say(f"fitting at T={T} ({opts.mode}) on {n_fit} prompts", say)
    if lens is not None:
        lens.check_model(model, T)
    lens, fid_T = _fit_depth(
        lens, model, fit_batches, eval_batches, T, opts.mode, opts, pad_id, out, timings
    )
    result: dict[str, Any] = {
        "model_hash": lens.model_hash,
        "family": lens.family,
        "d_model": d,
        "loops": T,
        "n_fit_prompts": lens.n_prompts,
        "n_eval_prompts": sum(L.batch_ids(b).shape[0] for b in eval_batches),
        "options": {k: v for k, v in asdict(opts).items() if k not in ("progress", "extra")},
        "fidelity": {str(T): fid_T},
    }
    lenses = {T: lens}
    for Tx in opts.extrapolate:
        _say(f"fitting at extrapolated T={Tx} ({opts.extrapolate_mode})", say)
        lx, fx = _fit_depth(None, model, fit_batches, eval_batches, Tx, opts.extrapolate_mode,
                            opts, pad_id, out, timings)  # fmt: skip
        lenses[Tx] = lx
        result["fidelity"][str(Tx)] = fx

    if opts.layers:
        _say(f"fitting per core layer at T={T} ({opts.mode})", say)
        result["layers"] = _layers(model, fit_batches, eval_batches, opts, pad_id, out, timings)
    _say("workspace structure", say)
    result["structure"] = _structure(model, lenses, fit_batches, opts, pad_id, timings)
    _say("interventions", say)
    result["interventions"] = _interventions(model, lens, eval_batches, opts, pad_id, timings)
    first = L.batch_ids(eval_batches[0])
    row = min(opts.slice_prompt, first.shape[0] - 1)
    ids = first[row : row + 1]
    if pad_id is not None:
        keep = int((ids[0] != pad_id).sum())
        ids = ids[:, : max(keep, 1)]
    result["slice"] = lens_slice(model, lens, ids, tokenizer, pad_id)
    timings["total"] = time.perf_counter() - t_all
    result["seconds"] = timings
    result["out"] = str(out) + "/"
    atomic_write_json(out / "lens.json", _clean(result))
    if opts.plots:
        from looplm.lens.plots import render_lens_figures

        result["figures"] = [str(p) for p in render_lens_figures(result, out)]
    return result


def _layers(model, fit_batches, eval_batches, opts: LensSettings, pad_id, out, timings) -> dict:
    """The lens per core layer at T (:mod:`looplm.lens.layers`): its fidelity per virtual layer
    beside the logit lens on the same residual streams, and where the J-lens beats it."""
    from looplm.lens.layers import fit_layer_lens, layer_fidelity

    t0 = time.perf_counter()
    ll = fit_layer_lens(model, fit_batches, opts.loops, opts.mode, probes=opts.probes,
                        skip_positions=opts.skip_positions, pad_id=pad_id, seed=opts.seed,
                        corpus=opts.corpus, progress=opts.progress)  # fmt: skip
    ll.save(out / f"lens_layers_T{opts.loops}")
    summary = layer_fidelity(model, ll, eval_batches, pad_id=pad_id).summary(
        n_boot=opts.n_boot, seed=opts.seed
    )
    summary["band"] = {m: R.lens_band(summary, metric=m) for m in R.FIDELITY_METRICS}
    for key in ("prelude_layers", "core_layers", "coda_layers"):
        summary[key] = ll.meta[key]
    summary["index"] = (
        "virtual layer v: prelude layer v (v < p), core layer i at loop step t "
        "(v = p + (t − 1)·k + i), coda layer j (v = p + T·k + j); the stream entering it"
    )
    timings[f"layers_T{opts.loops}"] = time.perf_counter() - t0
    return summary


def _structure(model, lenses: dict, fit_batches, opts: LensSettings, pad_id, timings) -> dict:
    """Ranks, subspace overlaps, persistence, stationarity and the composition gap at T."""
    t0 = time.perf_counter()
    T = opts.loops
    lens = lenses[T]
    out: dict[str, Any] = {
        "ranks": S.workspace_ranks(model, lens),
        "k": opts.k,
        "overlap": S.overlap_matrix(lens, k=opts.k).tolist(),
        "random_overlap": S.random_overlap(lens.d_model, opts.k, seed=opts.seed),
        "persistence": {
            str(Tx): S.persistence(lens, lenses[Tx], opts.k) for Tx in opts.extrapolate
        },
    }
    if len(lenses) > 1:
        out["stationarity"] = S.stationarity(list(lenses.values()))
    timings["structure"] = time.perf_counter() - t0
    if opts.composition:
        t0 = time.perf_counter()
        steps = S.fit_step_jacobians(
            model, fit_batches, T, pad_id=pad_id, skip_positions=opts.skip_positions
        )
        out["composition_gap"] = S.composition_gap(lens, steps)
        timings["composition"] = time.perf_counter() - t0
    return out


def _interventions(model, lens, eval_batches, opts: LensSettings, pad_id, timings) -> dict:
    """The dose-responses of ``opts.interventions`` along J-lens and logit-lens directions over
    ``opts.band_steps``, else the original study's workspace band (38–92 % of the depth), fixed before
    looking at the data (the J-beats-logit band is reported, not used)."""
    t0 = time.perf_counter()
    T = opts.loops
    steps = opts.band_steps
    band = steps if steps is not None else I.band_from_fractions(*REFERENCE_BAND, T)
    band_source = "option" if steps is not None else "reference 38-92% of T"
    out: dict[str, Any] = {"band": list(band), "band_source": band_source}
    arms = (("jacobian", lens), ("logit", L.logit_lens(model, T)))
    for kind in opts.interventions:
        out[kind] = {
            arm: I.dose_response(
                model, lz, eval_batches, T, band, kind=kind, strengths=opts.strengths, pad_id=pad_id
            )  # fmt: skip
            for arm, lz in arms
        }
    timings["interventions"] = time.perf_counter() - t0
    return out


def _clean(obj):
    """JSON-safe: NaN/inf → None, tuples → lists, tensors → lists."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def lens_checkpoint(
    checkpoint: str | Path, settings: LensSettings, inputs: LensInputs, data: DataSettings
) -> dict[str, Any]:
    """``looplm lens``: :func:`analyse_lens` of a checkpoint on prompts of its own data (or
    ``data``'s): ``settings.loops`` defaults to the largest training depth (an unshared model:
    its layer count), a looped model's deeper depths are ``settings.extrapolate``."""
    from dataclasses import replace

    from looplm.evaluate.inputs import checkpoint_tokenizer, set_threads
    from looplm.model.checkpoint import load_checkpoint

    set_threads(inputs.threads)
    model, cfg, _ = load_checkpoint(checkpoint)
    looped = cfg.model.is_looped
    loops = settings.loops or (cfg.train.depth_max if looped else cfg.model.n_layers)
    settings = replace(settings, loops=loops, extrapolate=settings.extrapolate if looped else ())
    lens = None
    if inputs.lens:
        lens = L.JacobianLens.load(inputs.lens)
        lens.check_model(model, loops)
    check_for_model(settings, model)
    fit_b, eval_b, info, pad_id = _batches(cfg, settings, inputs, data)
    settings.corpus = f"{info['dataset']}/{info['split']}"
    tokenizer, _ = checkpoint_tokenizer(cfg)  # without a tokenizer the slice shows token ids
    return analyse_lens(
        model, fit_b, eval_b, inputs.out, settings, pad_id=pad_id, tokenizer=tokenizer, lens=lens
    )


def _batches(cfg: Any, settings: LensSettings, inputs: LensInputs, data: DataSettings):
    """Disjoint fitting and held-out batches from one stream of the checkpoint's data."""
    from looplm.evaluate.inputs import data_batches

    n_prompts, n_eval = inputs.prompts, inputs.eval_prompts
    bs = min(inputs.batch_size, n_prompts, n_eval)
    n_fit, n_ev = -(-n_prompts // bs), -(-n_eval // bs)
    batches, info, pad_id = data_batches(
        cfg, data, batch_size=bs, n_batches=n_fit + n_ev, seed=settings.seed + 1
    )
    if len(batches) < n_fit + n_ev:
        raise LoopLMError(
            f"{info['dataset']} gave {len(batches)} batches of {bs}; {n_fit + n_ev} needed for "
            f"{n_prompts} fitting and {n_eval} held-out prompts"
        )
    return batches[:n_fit], batches[n_fit:], info, pad_id


def summary_lines(result: dict[str, Any]) -> list[str]:
    """What ``looplm lens`` prints: the KL of each arm at mid-depth, the band where the J-lens
    beats the logit lens, the swap dose at strength 1, where the files are."""
    T = result["loops"]
    lines = [
        f"lens of {result['family']} at T={T} on {result['n_fit_prompts']} prompts "
        f"({result['n_eval_prompts']} held out)"
    ]
    for depth, fid in result["fidelity"].items():
        arms = fid["arms"]
        kl = {a: [r["mean"] for r in arms[a]["kl"]] for a in arms}
        band = fid["band"]["kl"]["steps"]
        mid = int(depth) // 2
        line = ", ".join(f"{a} {kl[a][mid]:.3g}" for a in arms)
        lines.append(
            f"  T={depth}: KL at t={mid}: {line}; J beats logit (KL) at steps {band or 'none'}"
        )
    if "layers" in result:
        lay = result["layers"]
        n = len(lay["arms"]["jacobian"]["kl"])
        band = lay["band"]["kl"]["steps"]
        shape = f"{lay.get('prelude_layers', 0)} + T × {lay['core_layers']} + {lay.get('coda_layers', 0)}"
        lines.append(
            f"  per layer ({n} = {shape}): J beats logit (KL) at {len(band)} of {n} virtual layers"
        )
    iv = result["interventions"]
    if "swap" in iv:
        sw = iv["swap"]["jacobian"]
        i1 = sw["strengths"].index(1.0) if 1.0 in sw["strengths"] else -1
        lines.append(
            f"  swap over steps {iv['band'][0]}–{iv['band'][1]} (J-lens): top-1 → runner-up "
            f"{sw['target']['to_rival'][i1]:.2f}, control pair {sw['control']['to_rival'][i1]:.2f}"
        )
    lines.append(f"  wrote {result['out']}lens.json in {result['seconds']['total']:.0f} s")
    return lines
