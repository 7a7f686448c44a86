"""Fine-tuning: ``looplm train CONFIG init=CKPT …`` starts from a trained checkpoint
(:func:`load_run_config` reads such a config).

``init`` is a looplm checkpoint folder, one ``looplm import`` wrote, or a published folder
``looplm import`` reads (Parcae, Huginn-0125, Ouro, HRM-Text). The model's architecture,
tokenizer and recurrence come from it; the run's settings (steps, lr, data, recipe …) from the
config. A model key the config sets is compared with the checkpoint's: one that differs (a width,
a recurrence, a vocabulary) is a one-line error (``dropout`` and the initial-state draw
``recurrence_args.state_init`` are run settings and may differ). The family's recipe
(:mod:`looplm.training.recipes`) and its trained loop count become the run's defaults.

LoRA (``lora.rank > 0``, through ``peft``): adapters on the projections of the looped core (or of
every layer, ``lora.targets=all``), the base weights frozen. A LoRA run's checkpoint holds the
merged weights (what eval, export and serve read) and the adapter on its own in
``ckpt/adapter/`` (``adapter_model.safetensors`` + ``adapter_config.json``); ``--resume`` rebuilds
the base from ``init`` and reloads the adapter, so it continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from looplm.errors import LoopLMError
from looplm.model.checkpoint import load_checkpoint, read_meta
from looplm.settings.config import ModelConfig, RunConfig, config_from_dict, load_raw
from looplm.training.recipes import FAMILY_RECIPE, freeze_for_recipe

#: Model keys a fine-tuning config may set differently from its init checkpoint.
RUN_MODEL_KEYS = ("dropout",)
RUN_RECURRENCE_KEYS = ("state_init",)
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: The projections LoRA adapts in each Transformer layer.
LORA_PROJECTIONS = ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.up", "mlp.down")


# ----------------------------------------------------------------------------- the init checkpoint
@dataclasses.dataclass
class InitInfo:
    """What a run takes from its init checkpoint."""

    model: dict[str, Any]  # the model section
    family: str | None  # the published family, when imported
    trained_loops: int  # the loop count it was trained at
    recipe: str = ""  # the recipe it was fine-tuned with, if any


def init_info(init: str) -> InitInfo:
    """The model section, family and trained loop count of the checkpoint ``init``."""
    path = Path(init).expanduser()
    if (path / "state.json").is_file() or (path.parent / f".{path.name}.tmp").exists():
        meta = read_meta(path)
        model = dict(meta["config"]["model"])
        if (path / "tokenizer.json").is_file():  # the checkpoint's own copy, wherever it moved
            model["tokenizer"] = str((path / "tokenizer.json").resolve())
        pre = meta.get("state", {}).get("pretrained") or {}
        train = meta["config"].get("train", {})
        loops = int(pre.get("trained_loops") or train.get("depth_mean") or train["depth_max"])
        recipe = {"ouro_gate": "ouro"}.get(train.get("recipe", ""), train.get("recipe", ""))
        return InitInfo(model, pre.get("family"), loops, recipe)
    if (path / "config.json").is_file():
        from looplm.model.families import family_of, published_model_config, read_config
        from looplm.model.families.base import open_tensors

        published = read_config(path)
        fam, mc = published_model_config(path, set(open_tensors(path)))
        if (path / "tokenizer.json").is_file():
            mc.tokenizer = str((path / "tokenizer.json").resolve())
        return InitInfo(dataclasses.asdict(mc), fam.name, family_of(published).loops(published))
    raise LoopLMError(
        f"init={init}: not a looplm checkpoint folder (state.json) nor a published checkpoint "
        "folder (config.json + weights)"
    )


def model_section(given: dict[str, Any], base: dict[str, Any], init: str) -> dict[str, Any]:
    """The run's model section: the checkpoint's ``base``, with the keys the config sets
    (``given``) checked against it: any that differ, other than run settings, is an error."""
    from looplm.settings.config import PRESETS

    given = dict(given)
    preset = given.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise LoopLMError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
        for key, value in PRESETS[preset].items():
            given.setdefault(key, value)
    out = dict(base)
    for key, value in given.items():
        if key in RUN_MODEL_KEYS or key not in base:
            out[key] = value  # a run setting, or an unknown key the config builder reports
            continue
        if key == "recurrence_args" and isinstance(value, dict):
            args = dict(base[key])
            for sub, v in value.items():
                if sub not in RUN_RECURRENCE_KEYS and args.get(sub) != v:
                    _contradiction(f"recurrence_args.{sub}", v, args.get(sub), init)
                args[sub] = v
            out[key] = args
            continue
        if value != base[key]:
            _contradiction(key, value, base[key], init)
    return out


def _contradiction(key: str, value: Any, stored: Any, init: str) -> None:
    raise LoopLMError(
        f"model.{key}={value!r} contradicts the init checkpoint {init} (its {key} is "
        f"{stored!r}); the architecture comes from the checkpoint: drop the setting"
    )


def load_run_config(path_or_name: str | None, overrides: list[str] | None = None) -> RunConfig:
    """:func:`looplm.settings.config.load_config`, with the model section of a run with ``init=CKPT``
    taken from the checkpoint (:func:`resolve_init`): what ``looplm train`` reads."""
    raw = load_raw(path_or_name, overrides)
    return config_from_dict(resolve_init(raw) if raw.get("init") else raw)


def resolve_init(raw: dict[str, Any]) -> dict[str, Any]:
    """A raw config dict with ``init`` set, its model section taken from the checkpoint and the
    family's recipe and trained depth filled in where the config leaves them."""
    init = str(raw["init"])
    info = init_info(init)
    raw = dict(raw)
    raw["model"] = model_section(dict(raw.get("model") or {}), info.model, init)
    train = dict(raw.get("train") or {})
    if not train.get("recipe"):
        train["recipe"] = FAMILY_RECIPE.get(info.family or "") or info.recipe or "looplm"
    if not train.get("depth_mean"):
        train["depth_mean"] = info.trained_loops
    raw["train"] = train
    return raw


# ----------------------------------------------------------------------------- the model
def _checkpoint_model(init: str) -> torch.nn.Module:
    path = Path(init).expanduser()
    if (path / "config.json").is_file() and not (path / "state.json").is_file():
        from looplm.model.families import from_pretrained

        return from_pretrained(path)
    model, _, _ = load_checkpoint(path)
    return model


def init_model(cfg: RunConfig, device: torch.device, adapter: Path | str | None = None):
    """The model of a run with ``init``: the checkpoint's weights (float32) in a model built from
    ``cfg.model``; LoRA adapters when ``lora.rank`` (from ``adapter`` or ``lora.adapter`` when
    given); the recipe's frozen parameters."""
    from looplm.model.build import model_from_config

    source = _checkpoint_model(cfg.init)
    check_same_model(source.config, cfg.model, cfg.init)
    model = model_from_config(cfg.model)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    if missing or unexpected:
        raise LoopLMError(
            f"init={cfg.init}: its weights do not fit model settings (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    del source
    model.to(device).train()
    if cfg.lora.rank:
        add_lora(model, cfg)
        adapter = adapter or cfg.lora.adapter or None
        if adapter:
            load_adapter(model, adapter)
    freeze_for_recipe(model, cfg)
    return model


def check_same_model(stored: ModelConfig, cfg: ModelConfig, init: str) -> None:
    """One line naming the first architecture setting of ``cfg`` that differs from ``stored``."""
    a, b = dataclasses.asdict(stored), dataclasses.asdict(cfg)
    for key in b:
        if key in RUN_MODEL_KEYS or key == "tokenizer":
            continue
        if key == "recurrence_args":
            sa = {k: v for k, v in a[key].items() if k not in RUN_RECURRENCE_KEYS}
            sb = {k: v for k, v in b[key].items() if k not in RUN_RECURRENCE_KEYS}
            if sa != sb:
                _contradiction(key, b[key], a[key], init)
        elif a.get(key) != b[key]:
            _contradiction(key, b[key], a.get(key), init)


def run_model(cfg: RunConfig, ckpt: Path, device: torch.device):
    """(model, saved config, meta) of ``<out_dir>/ckpt`` for ``--resume``: a LoRA run rebuilds
    the frozen base from ``init`` and reloads its adapter; the recipe's frozen parameters."""
    if cfg.lora.rank:
        meta = read_meta(ckpt)
        model = init_model(cfg, device, adapter=ckpt / ADAPTER_DIR)
        return model, config_from_dict(meta["config"]), meta
    model, saved, meta = load_checkpoint(ckpt, map_location=device)
    freeze_for_recipe(model, cfg)
    return model, saved, meta


# ----------------------------------------------------------------------------- LoRA
def lora_targets(model: torch.nn.Module, which: str) -> list[str]:
    """Names of the projections LoRA adapts: the looped core's (``core``) or every layer's."""
    prefixes = ("block.",) if which == "core" else ("block.", "prelude.", "coda.")
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and n.startswith(prefixes)
        and n.endswith(LORA_PROJECTIONS)
    ]
    if not names:
        raise LoopLMError(f"lora.targets={which}: the model has no projections to adapt")
    return names


def add_lora(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """LoRA adapters (rank ``lora.rank``, scale alpha/rank, no dropout) on the target projections,
    in place; every other parameter frozen (``peft``)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise LoopLMError(
            f"lora.rank={cfg.lora.rank} needs the peft library: pip install 'looplm[finetune]'"
        ) from None

    names = lora_targets(model, cfg.lora.targets)
    pattern = "|".join(re.escape(n) for n in names)
    lc = LoraConfig(
        r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0, target_modules=pattern
    )
    inject_adapter_in_model(lc, model)
    model.lora_targets = names
    return model


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's own weights (name → tensor, on the CPU)."""
    return {
        n: p.detach().cpu().contiguous().clone()
        for n, p in model.named_parameters()
        if "lora_" in n
    }


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict with every adapter merged: ``W + α/r·B·A`` under the
    projection's own name (what every command loads), computed without touching ``model``."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    merged: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            w = m.base_layer.weight.detach()
            for a in m.active_adapters:
                w = w + m.get_delta_weight(a).detach()
            merged[f"{name}.weight"] = w
    for key, v in model.state_dict().items():
        if "lora_" in key:
            continue
        if ".base_layer." in key:
            key = key.replace(".base_layer.", ".")
            v = merged.get(key, v)
        out[key] = v
    return out


class MergedView:
    """What :func:`looplm.model.checkpoint.save_checkpoint` writes for a LoRA model: the merged
    weights under the plain model's names."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return merged_state_dict(self.model)


def adapter_files(model: torch.nn.Module, cfg: RunConfig) -> dict[str, bytes]:
    """``adapter/adapter_model.safetensors`` and ``adapter/adapter_config.json`` of a LoRA model:
    the adapter's weights and what it fits (the base model's settings, the targets)."""
    config = {
        "peft_type": "LORA",
        "r": cfg.lora.rank,
        "lora_alpha": cfg.lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(getattr(model, "lora_targets", [])),
        "base_model": _fingerprint(cfg.model),
        "init": cfg.init,
    }
    return {
        f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}": st_save(adapter_tensors(model)),
        f"{ADAPTER_DIR}/{ADAPTER_CONFIG}": json.dumps(config, indent=2).encode(),
    }


def _fingerprint(mc: ModelConfig) -> dict[str, Any]:
    keys = ("recurrence", "vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff",
            "prelude_layers", "core_layers", "coda_layers", "mlp")  # fmt: skip
    return {k: getattr(mc, k) for k in keys}


def load_adapter(model: torch.nn.Module, folder: Path | str) -> None:
    """Load a saved adapter into a LoRA model; one line when it was made for another model (a
    different base or rank) or the folder holds none."""
    folder = Path(folder)
    wfile, cfile = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    if not wfile.is_file() or not cfile.is_file():
        raise LoopLMError(f"lora.adapter={folder}: no {ADAPTER_WEIGHTS} + {ADAPTER_CONFIG} there")
    saved = json.loads(cfile.read_text())
    want = _fingerprint(model.config)
    base = saved.get("base_model", {})
    for key, value in want.items():
        if base.get(key) != value:
            raise LoopLMError(
                f"lora.adapter={folder} was made for another model ({key}={base.get(key)!r}, "
                f"this model has {value!r})"
            )
    tensors = st_load(wfile.read_bytes())
    own = dict(model.named_parameters())
    for name, t in tensors.items():
        if name not in own or own[name].shape != t.shape:
            have = tuple(own[name].shape) if name in own else "none"
            raise LoopLMError(
                f"lora.adapter={folder}: tensor {name} {tuple(t.shape)} does not fit this model "
                f"({have}; lora.rank={saved.get('r')} and lora.targets must match the adapter's)"
            )
    missing = [n for n in own if "lora_" in n and n not in tensors]
    if missing:
        raise LoopLMError(f"lora.adapter={folder}: no weights for {missing[0]} (other targets)")
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)


def checkpoint_extras(model: torch.nn.Module, cfg: RunConfig) -> dict[str, bytes]:
    """Files a fine-tuning run's checkpoint carries besides the weights: the LoRA adapter on its
    own, and the tokenizer files of the init checkpoint (so the result stands alone)."""
    if not cfg.init:
        return {}
    out = adapter_files(model, cfg) if cfg.lora.rank else {}
    tok = Path(cfg.model.tokenizer)
    if tok.name == "tokenizer.json" and tok.is_file():
        from looplm.model.families import TOKENIZER_FILES

        for name in TOKENIZER_FILES:
            if (tok.parent / name).is_file():
                out[name] = (tok.parent / name).read_bytes()
    return out


def window_model(cfg: RunConfig) -> ModelConfig:
    """The model settings the data source reads: windows of ``train.seq_len`` tokens when set
    (shorter than a long-context checkpoint's context), else the model's context."""
    seq = cfg.train.seq_len
    return dataclasses.replace(cfg.model, context=seq) if seq else cfg.model


def checkpoint_payload(model: torch.nn.Module, cfg: RunConfig):
    """(what a checkpoint stores as the weights, its extra files): a LoRA model's merged view
    with the adapter on its own, else the model itself."""
    weights = MergedView(model) if cfg.lora.rank else model
    return weights, checkpoint_extras(model, cfg)


# ----------------------------------------------------------------------------- before and after
@torch.no_grad()
def depth_response(model, batches, depths: list[int]) -> dict[int, float]:
    """Validation NLL per token at each depth (one unroll per batch serves every depth)."""
    sums = {d: [0.0, 0] for d in depths}
    for x, y in batches:
        for t, h in model.iter_depths(x, depths):
            s = model.score(h, y, hits=False)
            sums[t][0] += float(s.nll)
            sums[t][1] += int(s.n_tokens)
    return {d: nll / max(n, 1) for d, (nll, n) in sums.items()}


@torch.no_grad()
def exit_profile(model, batches, loops: int) -> list[float]:
    """The exit gate's distribution over steps 1 … ``loops`` (looplm.training.recipes.exit_distribution),
    averaged over the supervised tokens."""
    from looplm.targets import IGNORE_INDEX
    from looplm.training.recipes import exit_distribution

    total, n = torch.zeros(loops, dtype=torch.float64), 0
    for x, y in batches:
        ctx = model.prepare(x)
        lam = [model.recurrence.exit_probability(st.hidden) for st in model.unroll(ctx, loops)]
        p = exit_distribution(torch.stack(lam[1:]).double())  # (T, B, L)
        mask = y != IGNORE_INDEX
        total += p[:, mask].sum(1)
        n += int(mask.sum())
    return (total / max(n, 1)).tolist()


def finetune_report(cfg: RunConfig) -> Path:
    """The init checkpoint's and the result's depth response on the run's validation data (at
    ``eval.depths``, ``train.eval_batches`` batches) and, for a model with an exit gate, the
    gate's exit distribution over the trained depth: ``<out_dir>/finetune_report.json``."""
    from itertools import islice

    from looplm.data.sources import make_source
    from looplm.io import atomic_write_json

    source = make_source(cfg.data, window_model(cfg), cfg.train.seed)
    ev = cfg.eval
    batches = list(
        islice(
            source.eval_batches(ev.batch_size, ev.max_tokens, ev.n_examples), cfg.train.eval_batches
        )
    )
    depths = sorted({int(d) for d in ev.depths})
    out = Path(cfg.out_dir)
    report: dict[str, Any] = {"init": cfg.init, "checkpoint": str(out / "ckpt"), "depths": depths}
    for when, model in (("before", _checkpoint_model(cfg.init)), ("after", None)):
        model = (model or load_checkpoint(out / "ckpt")[0]).float().eval()
        report[when] = {str(d): v for d, v in depth_response(model, batches, depths).items()}
        if hasattr(model.recurrence, "exit_probability"):
            T = cfg.train.depth_mean or cfg.train.depth_max
            report[f"exit_{when}"] = exit_profile(model, batches, T)
        del model
    atomic_write_json(out / "finetune_report.json", report)
    return out / "finetune_report.json"


# ----------------------------------------------------------------------------- memory
def finetune_memory(mc: ModelConfig, rank: int = 16, targets: str = "core") -> dict[str, float]:
    """Parameter counts (built on the meta device) and the bytes that training state takes,
    activations aside: full fine-tuning keeps fp32 weights, gradients and AdamW's two moments
    (16 bytes per parameter); LoRA keeps the frozen fp32 weights (4 bytes each) and 16 bytes per
    adapter parameter (``r·(in + out)`` per adapted projection)."""
    from looplm.model.families import build_meta

    model = build_meta(mc)
    n = model.num_parameters()
    adapter = sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if name in set(lora_targets(model, targets))
    )
    gib = 2.0**30
    return {
        "params": n,
        "full_gib": 16 * n / gib,
        "lora_params": adapter,
        "lora_gib": (4 * n + 16 * adapter) / gib,
    }
