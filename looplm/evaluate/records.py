"""Evaluation results → :class:`~looplm.results.store.EvalRecord` rows (evaluation identities).

Identity fields, as the paper's *Seed Protocol and Aggregation* defines them:

* ``model_hash`` — :func:`model_hash`: sha256 (first 12 hex digits) of the model config and the
  training protocol **without the seed** (so every seed of one configuration shares it) and
  without settings that do not change the trained weights (device, compile, logging, checkpoint
  and evaluation cadence, data/cache folders, evaluation settings, run folder and name).
* ``method`` — the recurrence name; ``protocol`` — :func:`protocol_name` (``<dataset>-<steps>``
  unless given, e.g. ``wikitext-2-300``); ``dataset`` / ``split`` — the *evaluation* corpus and
  its canonical split (``validation``, not ``valid``); ``depth`` — T, or the ceiling for adaptive
  rows; ``seed`` — the training seed.
* ``eval_tag`` — :func:`eval_tag`: the user's tag plus any evaluation cap (``cap=4096tok``,
  ``cap=500ex``), because a capped evaluation is a different measurement from the full one.
* ``adaptive_mode`` — ``''`` for fixed depth, else ``maxtoken:budget=8``, ``kl:thr=0.001``,
  ``router:p=0.5``; ``calibration`` — what the threshold/router was fitted on
  (``validation@8192tok``; ``+label_kl=0.01`` for the router), ``''`` for fixed depth and the
  training-free KL rule.

Metric-specific ``extra`` keys written here: ``flops_per_token_body``,
``flops_per_token_body_head`` (Eqs. 20–21 at T or at the achieved mean depth), ``mean_depth``,
``threshold``, ``target``, ``wall_clock_s``, ``n_correct``/``n_examples`` (accuracy),
``exact_word_correct``/``n_passages`` (LAMBADA), ``checkpoint``, ``step``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from looplm.data.corpora import canonical_split
from looplm.results.store import EvalRecord
from looplm.settings.config import RunConfig

# Settings that do not change what is trained (excluded from the model hash), besides the seed.
_TRAIN_NON_SEMANTIC = (
    "seed",
    "device",
    "compile",
    "cpu_allocator",  # host memory reuse: the same arithmetic
    "log_every",
    "eval_every",
    "eval_batches",
    "ckpt_every",
    "tensorboard",
    "max_wall_s",
)
_DATA_SEMANTIC = ("dataset", "train_split", "train_difficulty", "task_args")


# Model keys added after results were stored: left out of the hash at their defaults, so the runs
# stored before them keep their model_hash (the block and readout options of imported families).
_MODEL_ADDED = {
    "n_kv_heads": 0,
    "norm_placement": "pre",
    "qk_norm": False,
    "qk_bias": False,
    "mlp": "swiglu",
    "rope_layout": "half",
    "value_embed_layers": [],
    "reference_rounding": False,
    "tie_head": True,
    "emb_scale": 1.0,
    "final_norm": True,
    "coda_norm": False,
    "logit_scale": 1.0,
    "logit_softcap": 0.0,
    "attn_gate": False,
    "norm_weight": True,
}


# Training keys added after results were stored (the fine-tuning recipes): left out of the hash
# at their defaults, as the model keys above are.
_TRAIN_ADDED = {
    "seq_len": 0,
    "recipe": "",
    "depth_mean": 0,
    "exit_beta": 0.1,
    "gate_k": 50.0,
    "gate_gamma": 0.005,
}


def hash_payload(cfg: RunConfig) -> dict[str, Any]:
    """What :func:`model_hash` hashes: the model config and the training protocol, no seed (and,
    for a fine-tuning run, the checkpoint it starts from and its LoRA settings)."""
    d = cfg.to_dict()
    model = {k: v for k, v in d["model"].items() if k not in _MODEL_ADDED or _MODEL_ADDED[k] != v}
    train = {
        k: v
        for k, v in d["train"].items()
        if k not in _TRAIN_NON_SEMANTIC and (k not in _TRAIN_ADDED or _TRAIN_ADDED[k] != v)
    }
    out = {"model": model, "data": {k: d["data"][k] for k in _DATA_SEMANTIC}, "train": train}
    if cfg.init:
        out["init"] = cfg.init
    if cfg.lora.rank:
        out["lora"] = d["lora"]
    return out


def model_hash(cfg: RunConfig) -> str:
    """12 hex digits identifying (model config, training protocol) independent of the seed."""
    text = json.dumps(hash_payload(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def protocol_name(cfg: RunConfig, protocol: str | None = None) -> str:
    """The protocol identity field: ``protocol`` if given, else ``<train dataset>-<steps>``."""
    if protocol:
        return protocol
    return f"{cfg.data.dataset}-{cfg.train.steps}"


def eval_tag(
    tag: str | None = "", *, max_tokens: int | None = None, max_examples: int | None = None
) -> str:
    """User tag plus the evaluation cap: ``eval_tag("ctx", max_tokens=4096) == "ctx,cap=4096tok"``."""
    parts = [tag or ""]
    if max_tokens:
        parts.append(f"cap={int(max_tokens)}tok")
    if max_examples:
        parts.append(f"cap={int(max_examples)}ex")
    return ",".join(p for p in parts if p)


def calibration_tag(split: str, max_tokens: int | None, extra: str = "") -> str:
    """``validation@8192tok`` (+ ``+extra``): what an adaptive rule was fitted on."""
    text = canonical_split(split) + (f"@{int(max_tokens)}tok" if max_tokens else "")
    return text + (f"+{extra}" if extra else "")


def adaptive_calibration(
    rule: str, calib_split: str, calib_max_tokens: int | None, label_threshold: float | None = None
) -> str:
    """The ``calibration`` identity field of an adaptive rule (``''`` for the KL rule)."""
    if rule == "maxtoken":
        return calibration_tag(calib_split, calib_max_tokens)
    if rule == "router":
        return calibration_tag(calib_split, calib_max_tokens, f"label_kl={label_threshold:g}")
    return ""


def flops_config(cfg: RunConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`flops_per_token` for one run config."""
    m = cfg.model
    return {
        "preset": m.preset,
        "recurrence": m.recurrence,
        "seq_len": m.context,
        "d_model": m.d_model,
        "d_ff": m.d_ff,
        "vocab_size": m.vocab_size,
        "n_layers": m.n_layers,
        "prelude_layers": m.prelude_layers,
        "core_layers": m.core_layers,
        "coda_layers": m.coda_layers,
    }


def flops_per_token(
    *,
    preset: str,
    recurrence: str,
    mean_depth: float,
    seq_len: int,
    d_model: int | None = None,
    d_ff: int | None = None,
    vocab_size: int | None = None,
    n_layers: int | None = None,
    prelude_layers: int = 0,
    core_layers: int = 1,
    coda_layers: int = 0,
) -> dict[str, float]:
    """Eq. 20/21 per-token FLOP proxies at a (possibly fractional) mean depth
    (:func:`looplm.model.accounting.eq20_21`): ``n_body · per_body`` with ``n_body = c_body ·
    mean_depth`` (unshared: ``min(mean_depth, N_layers)``). Sizes not given are the preset's."""
    from looplm.model.accounting import eq20_21
    from looplm.settings.config import model_config

    ref = model_config(preset, recurrence)
    f = eq20_21(
        recurrence=recurrence,
        depth=float(mean_depth),
        seq_len=int(seq_len),
        d_model=d_model or ref.d_model,
        d_ff=d_ff or ref.d_ff,
        vocab_size=vocab_size or ref.vocab_size,
        n_layers=float(n_layers or mean_depth),
        prelude_layers=prelude_layers,
        core_layers=core_layers,
        coda_layers=coda_layers,
    )
    return {"flops_per_token_body": f["body"], "flops_per_token_body_head": f["body_head"]}


def _base(
    cfg: RunConfig,
    *,
    dataset: str,
    split: str,
    tag: str,
    protocol: str | None,
    seed: int | None = None,
) -> dict[str, Any]:
    return {
        "model_hash": model_hash(cfg),
        "method": cfg.method_label,
        "protocol": protocol_name(cfg, protocol),
        "dataset": dataset,
        "split": canonical_split(split),
        "seed": cfg.train.seed if seed is None else seed,
        "eval_tag": tag,
    }


def fixed_depth_records(
    rows: list[dict[str, Any]],
    cfg: RunConfig,
    *,
    dataset: str,
    split: str,
    tag: str = "",
    protocol: str | None = None,
    extra: dict[str, Any] | None = None,
) -> list[EvalRecord]:
    """One record per depth row of :func:`~looplm.evaluate.sweep.depth_sweep` (or LAMBADA)."""
    base = _base(cfg, dataset=dataset, split=split, tag=tag, protocol=protocol)
    fl = flops_config(cfg)
    out = []
    for row in rows:
        T = int(row["depth"])
        ex = {
            k: v for k, v in row.items() if k not in ("depth", "n_tokens", "sum_nll", "nll", "ppl")
        }
        ex.update(flops_per_token(mean_depth=T, **fl))
        ex.update(extra or {})
        out.append(
            EvalRecord(
                **base,
                depth=T,
                n_tokens=int(row["n_tokens"]),
                sum_nll=float(row["sum_nll"]),
                extra=ex,
            )
        )
    return out


def adaptive_records(
    result: dict[str, Any],
    cfg: RunConfig,
    *,
    tag: str = "",
    protocol: str | None = None,
    extra: dict[str, Any] | None = None,
) -> list[EvalRecord]:
    """Records of :func:`~looplm.adaptive.depth.evaluate_adaptive_checkpoint` output."""
    base = _base(cfg, dataset=result["dataset"], split=result["split"], tag=tag, protocol=protocol)
    out = []
    for r in result["results"]:
        cal = adaptive_calibration(
            r["rule"],
            result["calib_split"],
            result.get("calib_max_tokens"),
            r.get("label_threshold"),
        )
        ex = {k: v for k, v in r.items() if k not in ("sum_nll", "n_tokens", "nll", "ppl", "mode")}
        ex["uniform_wall_clock_s"] = {
            str(k): v for k, v in result.get("uniform_wall_clock_s", {}).items()
        }
        ex.update(extra or {})
        out.append(
            EvalRecord(
                **base,
                depth=int(result["ceiling"]),
                adaptive_mode=r["mode"],
                calibration=cal,
                n_tokens=int(r["n_tokens"]),
                sum_nll=float(r["sum_nll"]),
                extra=ex,
            )
        )
    return out


def fixed_depth_identities(
    cfg: RunConfig,
    depths: list[int],
    *,
    dataset: str,
    split: str,
    tag: str = "",
    protocol: str | None = None,
) -> list[dict[str, Any]]:
    """The identities :func:`fixed_depth_records` would write (to look them up in a store)."""
    base = _base(cfg, dataset=dataset, split=split, tag=tag, protocol=protocol)
    return [{**base, "depth": int(T), "adaptive_mode": "", "calibration": ""} for T in depths]
