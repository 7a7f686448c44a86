"""Looped checkpoints trained elsewhere, loaded natively into looplm's own model.

One module per family maps that family's published ``config.json`` and tensor names onto a
:class:`~looplm.settings.config.ModelConfig` and a :class:`~looplm.model.lm.LoopedLM` state dict (block
options, one recurrence file per family's loop), so the unroll, the halting module, the KV cache
and every analysis run on it unchanged:

* ``parcae`` — Parcae (``ParcaeConfig``; SandyResearch/parcae-140m … -1.3b),
* ``huginn`` — Huginn-0125 (``RavenForCausalLM``; tomg-group-umd/huginn-0125),
* ``ouro`` — Ouro (``OuroForCausalLM``; ByteDance/Ouro-1.4B, -2.6B),
* ``hrm_text`` — HRM-Text (``HrmTextForCausalLM``; sapientinc/HRM-Text-1B).

:func:`from_pretrained` returns the model (built on the meta device, then each tensor read into
its own memory in the stored dtype); :func:`import_pretrained` writes it as a looplm checkpoint
that every command reads, with the source's tokenizer files beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.model.families.base import FAMILY_CLASSES, Family, load_weights, open_tensors
from looplm.settings.config import EvalConfig, ModelConfig, RunConfig, TrainConfig
from looplm.settings.plugins import import_submodules

# each family module registers its class (their layouts never overlap: each is detected by its
# own model_type or architecture, so the order does not matter)
import_submodules(__name__, __path__, skip=("base",))
FAMILIES: dict[str, Family] = {name: cls() for name, cls in sorted(FAMILY_CLASSES.items().items())}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise LoopLMError(f"{folder}: no config.json (a published checkpoint folder has one)")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoopLMError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoopLMError(f"{path}: the top level must be an object")
    return cfg


def family_of(cfg: dict[str, Any], where: Path | str = "config.json") -> Family:
    """The family whose layout ``cfg`` is (one-line error for any other architecture)."""
    for fam in FAMILIES.values():
        if fam.detects(cfg):
            return fam
    arch = (cfg.get("architectures") or [cfg.get("_class_name") or cfg.get("model_type")])[0]
    known = ", ".join(f"{f.architecture} ({f.name})" for f in FAMILIES.values())
    raise LoopLMError(f"{where}: architecture {arch!r} is not one looplm loads; allowed: {known}")


def resolve_source(src: str | os.PathLike) -> Path:
    """A local folder in the published layout, or a hub id fetched through ``huggingface_hub``
    (from its cache, else from the network; offline: one line naming the local-folder form)."""
    path = Path(src)
    if path.is_dir():
        return path
    text = str(src)
    if path.exists() or not _HUB_ID.match(text):
        raise LoopLMError(
            f"{text}: not a folder with config.json and weights, nor a hub id like owner/name"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise LoopLMError(
            f"{text}: fetching a hub id needs huggingface_hub (pip install huggingface_hub); "
            "or pass a local folder with config.json and the weight files"
        ) from None
    patterns = ["*.json", "*.safetensors", "*.bin", "*.pt", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not in the cache: the network decides
        pass
    if os.environ.get("HF_HUB_OFFLINE") or not _online():
        raise LoopLMError(
            f"{text}: no network to fetch it from the hub; download the repository elsewhere and "
            f"pass its local folder (config.json + weights), e.g. `looplm import ./{text.split('/')[-1]} OUT`"
        )
    try:
        return Path(snapshot_download(text, allow_patterns=patterns, etag_timeout=10))
    except Exception as exc:  # hub errors have many types; one line, no retries
        raise LoopLMError(f"{text}: hub download failed ({type(exc).__name__}: {exc})") from None


def _online(host: str = "huggingface.co") -> bool:
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def published_model_config(
    src: str | os.PathLike | dict[str, Any], names: set[str] | None = None
) -> tuple[Family, ModelConfig]:
    """(family, validated ModelConfig) of a published config (a folder or its parsed dict)."""
    if isinstance(src, dict):
        cfg, where = src, "config.json"
    else:
        folder = Path(src)
        cfg, where = read_config(folder), folder / "config.json"
    fam = family_of(cfg, where)
    fam.check_keys(cfg, Path(where))
    with fam.published_names(cfg, where):
        mc = fam.model_config(cfg, names, where)
        from looplm.model.recurrences.base import build_config, get_recurrence_class

        build_config(get_recurrence_class(mc.recurrence), mc.recurrence_args)
        mc.validate()
    return fam, mc


def build_meta(mc: ModelConfig) -> torch.nn.Module:
    """The model of ``mc`` on the meta device (no memory; parameter counts and shapes)."""
    from looplm.model.build import model_from_config

    with torch.device("meta"):
        return model_from_config(mc)


def from_pretrained(
    src: str | os.PathLike, *, dtype: torch.dtype | str | None = None
) -> torch.nn.Module:
    """The published checkpoint ``src`` (folder or hub id) as a looplm model in eval mode.

    Tensors keep their stored dtype unless ``dtype`` is given. ``model.pretrained`` records the
    family, the source and the trained loop count.
    """
    model, _ = _load(src, dtype)
    return model


def _load(src: str | os.PathLike, dtype: torch.dtype | str | None) -> tuple[torch.nn.Module, dict]:
    folder = resolve_source(src)
    tensors = open_tensors(folder)
    fam, mc = published_model_config(folder, set(tensors))
    cfg = read_config(folder)
    model = build_meta(mc)
    load_weights(model, fam.weights(cfg, set(tensors), mc), tensors, folder, _dtype(dtype))
    model.eval()
    if (folder / "tokenizer.json").is_file():  # the checkpoint's own tokenizer
        model.config.tokenizer = str((folder / "tokenizer.json").resolve())
    info = {"family": fam.name, "source": str(src), "trained_loops": fam.trained_loops(cfg, folder)}
    model.pretrained = info
    return model, info


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
    if dtype not in table:
        raise LoopLMError(f"dtype={dtype!r}; allowed: {', '.join(table)}")
    return table[dtype]


def run_config(mc: ModelConfig, loops: int) -> RunConfig:
    """The run config an imported checkpoint carries: its model, its trained loop count as the
    default depth, and depths beyond it for the depth sweep."""
    depths = sorted({1, max(1, loops // 2), loops, 2 * loops})
    train = TrainConfig(depth_min=loops, depth_max=loops, steps=1, warmup=0)
    return RunConfig(model=mc, train=train, eval=EvalConfig(depths=depths)).validate()


def check_import_folders(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool) -> None:
    """Refuse, before reading any weights, an OUT that would lose files: OUT = SRC, one inside
    the other (always), an existing OUT without ``overwrite``, and with it anything but a
    looplm checkpoint folder or an empty one."""
    from looplm.model.checkpoint import checkpoint_exists
    from looplm.settings.limits import check_output_folder

    check_output_folder("OUT", out)
    o = Path(out).expanduser().resolve()
    s = Path(src).expanduser()
    if s.exists():
        s = s.resolve()
        if o == s or s in o.parents or o in s.parents:
            how = "is" if o == s else "lies inside" if s in o.parents else "holds"
            raise LoopLMError(
                f"OUT {out} {how} the source folder {src}; the import would write over the "
                "source: choose an OUT outside it"
            )
    if not o.exists() or not any(o.iterdir()):
        return
    if not overwrite:
        raise LoopLMError(f"OUT {out} exists; pass --overwrite to replace it (or choose a new OUT)")
    if not checkpoint_exists(o):
        raise LoopLMError(
            f"OUT {out} is not empty and holds no looplm checkpoint (no state.json); --overwrite "
            "replaces only a checkpoint folder: choose a new OUT"
        )


def import_tokenizer(folder: Path, tokenizer: str | None, vocab_size: int) -> Path | str:
    """The tokenizer an import carries: ``tokenizer`` (a ``tokenizer.json`` path, a folder
    holding one, or ``gpt2``), else the source's ``tokenizer.json``, else GPT-2's when the model's
    vocabulary can hold it; each file is loaded and checked before anything is written."""
    if tokenizer in ("gpt2",):
        return tokenizer
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise LoopLMError(
                f"--tokenizer {tokenizer}: no such tokenizer.json; allowed: the path of a "
                "tokenizer.json (or a folder holding one), or gpt2"
            )
    elif (folder / "tokenizer.json").is_file():
        path = folder / "tokenizer.json"
    elif vocab_size < GPT2_VOCAB:
        raise LoopLMError(
            f"{folder} has no tokenizer.json and its vocabulary ({vocab_size} tokens) is smaller "
            f"than GPT-2's ({GPT2_VOCAB}); pass --tokenizer PATH (the tokenizer.json the model "
            "was trained with)"
        )
    else:
        print(
            f"note: {folder} has no tokenizer.json; the import uses GPT-2's tokenizer (pass "
            "--tokenizer PATH to give the model's own)",
            file=sys.stderr,
        )
        return "gpt2"
    try:  # an unreadable file: one line naming it (the model layer reads no looplm.data)
        from tokenizers import Tokenizer

        n_tokens = Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception as exc:  # tokenizers raises plain Exception for unreadable files
        msg = " ".join(str(exc).split())
        raise LoopLMError(f"could not load the tokenizer {str(path)!r}: {msg}") from None
    if n_tokens > vocab_size:  # added tokens past the embedding: a note, not a refusal
        print(
            f"note: {path} has {n_tokens} tokens but the model's vocabulary holds "
            f"{vocab_size}; text that uses the extra ones cannot be read (pass --tokenizer PATH "
            "to give the model's own)",
            file=sys.stderr,
        )
    return path


GPT2_VOCAB = 50257


def check_finite(model: torch.nn.Module, src: str | os.PathLike) -> None:
    """One line naming the first tensor with a NaN or an infinity (and how many hold one)."""
    bad = [
        n
        for n, t in model.state_dict().items()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if bad:
        raise LoopLMError(
            f"{src}: {len(bad)} weight tensor(s) hold NaN or infinite values (first: {bad[0]}); "
            "the checkpoint is damaged or was saved mid-divergence: import a finite one"
        )


def import_pretrained(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    tokenizer: str | None = None,
) -> Path:
    """Write the published checkpoint ``src`` as a looplm checkpoint folder ``out`` (what every
    command reads), with its tokenizer (``tokenizer``, else the source's files) beside the
    weights. An existing ``out`` is replaced only with ``overwrite`` and only when it is a looplm
    checkpoint; ``out`` never lies inside ``src`` nor ``src`` inside ``out``."""
    from looplm.io import atomic_write_bytes
    from looplm.model.checkpoint import save_checkpoint

    check_import_folders(src, out, overwrite)
    folder = resolve_source(src)
    check_import_folders(folder, out, overwrite)  # a hub id's cache folder too
    model, info = _load(src, dtype)
    tok = import_tokenizer(folder, tokenizer, model.config.vocab_size)
    check_finite(model, src)
    mc = dataclasses.replace(model.config, tokenizer="gpt2")
    cfg = run_config(mc, info["trained_loops"])
    if isinstance(tok, Path):  # the copy written below, by its absolute path
        cfg.model.tokenizer = str((Path(out) / "tokenizer.json").resolve())
    out = save_checkpoint(out, model, cfg, state={"pretrained": info})
    if isinstance(tok, Path):
        atomic_write_bytes(out / "tokenizer.json", tok.read_bytes())
        for name in TOKENIZER_FILES[1:]:
            if (tok.parent / name).is_file():
                atomic_write_bytes(out / name, (tok.parent / name).read_bytes())
    return out


__all__ = [
    "FAMILIES",
    "build_meta",
    "family_of",
    "from_pretrained",
    "import_pretrained",
    "published_model_config",
    "run_config",
]
