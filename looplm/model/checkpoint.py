"""Checkpoints: ``model.safetensors`` (+ ``optimizer.safetensors``) and ``state.json``.

A checkpoint is a folder::

    ckpt/
      model.safetensors      weights (tied head stored once)
      optimizer.safetensors  AdamW moments (training checkpoints only)
      state.json             run config, step, RNG states, sha256 + size of each tensor file

The folder is written under a temporary name (``.ckpt.tmp``) and swapped into place: the previous
folder is renamed to ``.ckpt.old``, then the new one to ``ckpt``. Every file inside is written
atomically, so a crash leaves a complete checkpoint behind; a kill between the two renames leaves
no ``ckpt/`` for a moment, and every reader (:func:`read_meta`, :func:`checkpoint_exists`, the next
save) first finishes that swap (:func:`recover_checkpoint`), so ``--resume`` still finds the latest
checkpoint. Loading verifies sizes and checksums: a truncated or altered file is rejected with a
one-line :class:`LoopLMError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from looplm.errors import LoopLMError
from looplm.io import atomic_write_bytes, atomic_write_json
from looplm.settings.config import RunConfig, config_from_dict

FORMAT_VERSION = 1


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    # Tied weights share storage; safetensors refuses shared tensors, so store distinct copies.
    return {k: v.detach().cpu().contiguous().clone() for k, v in sd.items()}


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous().clone()
            else:
                meta.setdefault(str(pid), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": meta}


def _swap_names(path: Path) -> tuple[Path, Path]:
    return path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")


def recover_checkpoint(path: str | os.PathLike) -> bool:
    """Finish a checkpoint swap a kill interrupted; True when ``path`` now holds a checkpoint.

    With no ``path`` folder, the complete new folder (``.<name>.tmp`` with its ``state.json``,
    which is written last) is the latest checkpoint and is moved into place; failing that, the
    previous one (``.<name>.old``) is moved back.
    """
    path = Path(path)
    if path.exists():
        return (path / "state.json").is_file()
    tmp, old = _swap_names(path)
    for cand in (tmp, old):
        if (cand / "state.json").is_file():
            try:
                os.replace(cand, path)
            except OSError:  # another process (a second rank) finished the swap first
                return (path / "state.json").is_file()
            if cand is tmp:
                shutil.rmtree(old, ignore_errors=True)
            return True
    return False


def checkpoint_exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint (after finishing an interrupted swap)."""
    return recover_checkpoint(path)


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    cfg: RunConfig | dict,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, Any] | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write a checkpoint folder atomically; returns its path. ``extra_files`` (relative name →
    bytes, e.g. a LoRA adapter or a tokenizer) are written inside it and checksummed too."""
    path = Path(path)
    recover_checkpoint(path)  # an interrupted swap's new folder must not be deleted below
    tmp, old = _swap_names(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _write_folder(tmp, model, cfg, optimizer, state, extra_files or {})
    except BaseException:
        # a full disk, a read-only folder or a kill: the previous checkpoint stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old.exists():
        shutil.rmtree(old)
    return path


def _write_folder(
    tmp: Path,
    model: torch.nn.Module,
    cfg: RunConfig | dict,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any] | None,
    extra_files: dict[str, bytes],
) -> None:
    """The checkpoint's files, written into the temporary folder ``tmp`` (state.json last)."""
    files: dict[str, dict[str, Any]] = {}
    for name, blob in extra_files.items():
        atomic_write_bytes(tmp / name, blob)
        files[name] = {"sha256": _sha256(blob), "size": len(blob)}
    blob = st_save(_state_tensors(model))
    atomic_write_bytes(tmp / "model.safetensors", blob)
    files["model.safetensors"] = {"sha256": _sha256(blob), "size": len(blob)}
    opt_meta = None
    if optimizer is not None:
        tensors, opt_meta = _optimizer_tensors(optimizer)
        blob = st_save(tensors) if tensors else st_save({"_empty": torch.zeros(0)})
        atomic_write_bytes(tmp / "optimizer.safetensors", blob)
        files["optimizer.safetensors"] = {"sha256": _sha256(blob), "size": len(blob)}
    cfg_dict = cfg.to_dict() if isinstance(cfg, RunConfig) else cfg
    meta = {
        "format": FORMAT_VERSION,
        "config": cfg_dict,
        "files": files,
        "optimizer": opt_meta,
        "state": state or {},
    }
    atomic_write_json(tmp / "state.json", meta)  # last: a complete folder has its state.json


def _read_verified(path: Path, name: str, info: dict[str, Any]) -> bytes:
    f = path / name
    if not f.is_file():
        raise LoopLMError(f"checkpoint {path}: {name} is missing")
    data = f.read_bytes()
    if len(data) != info["size"]:
        raise LoopLMError(
            f"checkpoint {path}: {name} is {len(data)} bytes, expected {info['size']} "
            "(truncated or incomplete write)"
        )
    if _sha256(data) != info["sha256"]:
        raise LoopLMError(f"checkpoint {path}: {name} fails its sha256 check (corrupt file)")
    return data


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``state.json`` of a checkpoint (validated)."""
    path = Path(path)
    recover_checkpoint(path)
    if not path.exists():
        raise LoopLMError(f"checkpoint {path} does not exist")
    if path.is_file() and path.name in ("model.safetensors", "state.json"):
        path = path.parent
    meta_file = path / "state.json"
    if not meta_file.is_file():
        raise LoopLMError(f"checkpoint {path}: no state.json (not a looplm checkpoint folder)")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoopLMError(f"checkpoint {path}: state.json is corrupt ({exc})") from None
    if meta.get("format") != FORMAT_VERSION or "files" not in meta:
        raise LoopLMError(f"checkpoint {path}: unsupported format {meta.get('format')!r}")
    return meta


def load_checkpoint(
    path: str | os.PathLike, map_location: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, RunConfig, dict[str, Any]]:
    """(model in eval mode, its RunConfig, the saved state dict) from a checkpoint folder."""
    from looplm.model.build import model_from_config

    path = Path(path)
    if path.is_file():
        path = path.parent
    meta = read_meta(path)
    cfg = config_from_dict(meta["config"])
    model = model_from_config(cfg.model)
    data = _read_verified(path, "model.safetensors", meta["files"]["model.safetensors"])
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise LoopLMError(f"checkpoint {path}: model.safetensors does not load ({exc})") from None
    stored = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(stored) == 1 and stored != {torch.float32}:  # e.g. an imported bf16 model stays bf16
        model.to(stored.pop())
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise LoopLMError(
            f"checkpoint {path}: weights do not match the config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.to(map_location).eval()
    return model, cfg, meta


def load_optimizer_state(path: str | os.PathLike, optimizer: torch.optim.Optimizer) -> None:
    """Restore AdamW moments and step counts saved by :func:`save_checkpoint`."""
    path = Path(path)
    meta = read_meta(path)
    if "optimizer.safetensors" not in meta["files"]:
        raise LoopLMError(f"checkpoint {path} holds no optimizer state (cannot resume)")
    data = _read_verified(path, "optimizer.safetensors", meta["files"]["optimizer.safetensors"])
    tensors = st_load(data)
    opt_meta = meta["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        if key == "_empty":
            continue
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    for pid, scalars in opt_meta["scalars"].items():
        state.setdefault(int(pid), {}).update(scalars)
    optimizer.load_state_dict({"state": state, "param_groups": opt_meta["param_groups"]})
