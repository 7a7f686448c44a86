"""Export a looplm checkpoint as a Hugging Face ``transformers`` model folder.

    looplm export runs/x/ckpt hf_out [--loops T]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("hf_out", trust_remote_code=True)

The folder holds ``config.json`` (the looplm ``ModelConfig`` under ``looplm_model``, the default
depth ``loops`` and an ``auto_map`` to the two code files), ``model.safetensors`` (the looplm
state dict under the prefix ``model.``), ``generation_config.json``, ``configuration_looplm.py``
and ``modeling_looplm.py`` (copied from this package; they build the model with the installed
looplm, so looplm must be installed wherever the folder is loaded) and a short ``README.md``.
Writing the folder needs neither ``transformers`` nor a network; loading it needs
``transformers`` (``pip install 'looplm[hf]'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from looplm.errors import LoopLMError

HERE = Path(__file__).resolve().parent
CODE_FILES = ("configuration_looplm.py", "modeling_looplm.py")
# Everything an export writes (``--overwrite`` replaces these and leaves other files alone).
EXPORT_FILES = (
    "model.safetensors",
    *CODE_FILES,
    "generation_config.json",
    "README.md",
    "config.json",
)
EOT_IDS = {"bytes": 256, "gpt2": 50256}  # end-of-text of each tokenizer (looplm.data.tokenizers)

__all__ = ["export_checkpoint", "hf_config"]


def hf_config(model_cfg, loops: int) -> dict:
    """The ``config.json`` contents for a looplm ``ModelConfig`` and default depth ``loops``."""
    from looplm import __version__

    eot = EOT_IDS.get(model_cfg.tokenizer)
    return {
        "architectures": ["LoopLMForCausalLM"],
        "model_type": "looplm",
        "auto_map": {
            "AutoConfig": "configuration_looplm.LoopLMConfig",
            "AutoModelForCausalLM": "modeling_looplm.LoopLMForCausalLM",
        },
        "looplm_model": dataclasses.asdict(model_cfg),
        "looplm_version": __version__,
        "loops": int(loops),
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.d_model,
        "num_attention_heads": model_cfg.n_heads,
        "max_position_embeddings": model_cfg.context,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "float32",
    }


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    loops: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the export folder ``out`` for ``checkpoint`` (atomically: a temporary folder renamed
    into place). ``loops`` defaults to the training ceiling ``train.depth_max``. ``overwrite``
    replaces a previous export's own files (:data:`EXPORT_FILES`) and leaves any other file in
    ``out`` alone; a folder that is not a looplm export is refused."""
    from looplm.checkpoint import load_checkpoint
    from looplm.model.lm import check_loops

    out = Path(out)
    if out.exists() and not overwrite:
        raise LoopLMError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    if out.exists():
        _check_replaceable(out)
    model, cfg, _ = load_checkpoint(checkpoint)
    T = check_loops(int(loops) if loops is not None else int(cfg.train.depth_max))
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _write_export(tmp, model, cfg, T, checkpoint)
        if out.exists():  # a previous export: replace its own files, keep anything else there
            for name in EXPORT_FILES:
                os.replace(tmp / name, out / name)
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(out)) from exc  # name the export folder
        raise
    return out


def _check_replaceable(out: Path) -> None:
    """``--overwrite`` replaces a previous export's own files only; refuse anything else."""
    if not out.is_dir():
        raise LoopLMError(f"{out} exists and is not a folder; choose another output folder")
    cfg_file = out / "config.json"
    if not cfg_file.exists():
        if any(out.iterdir()):
            raise LoopLMError(
                f"{out} is not empty and holds no looplm export (no config.json); --overwrite "
                "replaces only a previous export's files: choose another output folder"
            )
        return
    try:
        model_type = json.loads(cfg_file.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, AttributeError, OSError):
        model_type = None
    if model_type != "looplm":
        raise LoopLMError(
            f"{cfg_file} is not a looplm export's (model_type {model_type!r}); --overwrite "
            "replaces only a previous export's files: choose another output folder"
        )


def _write_export(tmp: Path, model, cfg, T: int, checkpoint) -> None:
    """The export's files (:data:`EXPORT_FILES`) into the folder ``tmp``."""
    from safetensors.torch import save_file

    config = hf_config(cfg.model, T)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    # Tied weights share storage, which safetensors refuses: store distinct contiguous copies.
    tensors = {
        f"model.{k}": v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()
    }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in CODE_FILES:
        shutil.copyfile(HERE / name, tmp / name)
    (tmp / "README.md").write_text(_card(cfg, T, checkpoint))


def _card(cfg, loops: int, checkpoint) -> str:
    m = cfg.model
    return (
        f"# looplm export: {cfg.method_label} ({m.preset}, d={m.d_model}, context {m.context})\n\n"
        f"Exported from `{checkpoint}` with `looplm export`. Default loop depth T = {loops}.\n\n"
        "Needs the `looplm` package installed where it is loaded (the code files here import "
        "it) and `trust_remote_code=True`:\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM\n"
        'model = AutoModelForCausalLM.from_pretrained("<this folder>", trust_remote_code=True)\n'
        "logits = model(input_ids, loops=12).logits\n"
        "out = model.generate(input_ids, max_new_tokens=20, loops=12)\n"
        "```\n\n"
        f"Tokenizer: looplm's `{m.tokenizer}` tokenizer (`looplm.data.get_tokenizer("
        f'"{m.tokenizer}")`); no `transformers` tokenizer files are written.\n'
    )
