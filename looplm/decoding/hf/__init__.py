"""Export a looplm checkpoint as a Hugging Face ``transformers`` model folder.

    looplm export runs/x/ckpt hf_out [--loops T] [--standalone]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("hf_out", trust_remote_code=True)

The folder holds ``config.json`` (the looplm ``ModelConfig`` under ``looplm_model``, the default
depth ``loops`` and an ``auto_map`` to the two code files), ``model.safetensors`` (the looplm
state dict under the prefix ``model.``), ``generation_config.json``, ``configuration_looplm.py``
and ``modeling_looplm.py`` (copied from this package; they build the model with the installed
looplm, so looplm must be installed wherever the folder is loaded), the tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``, so ``AutoTokenizer.from_pretrained(folder)`` gives
the ids looplm's own tokenizer gives) and a short ``README.md``.

``standalone=True`` (``--standalone``) writes a ``modeling_looplm.py`` generated from looplm's own
model source at export time (:mod:`looplm.decoding.hf.standalone`): the folder then loads where only
``torch`` and ``transformers`` are installed. Writing the folder needs neither ``transformers``
nor a network; loading it needs ``transformers`` (``pip install 'looplm[hf]'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from looplm.decoding.hf.settings import ExportSettings
from looplm.errors import LoopLMError, os_error_in

HERE = Path(__file__).resolve().parent
CODE_FILES = ("configuration_looplm.py", "modeling_looplm.py")
# Everything an export writes (``--overwrite`` replaces these and leaves other files alone).
EXPORT_FILES = (
    "model.safetensors",
    *CODE_FILES,
    "generation_config.json",
    "README.md",
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
)
EOT_IDS = {"bytes": 256, "gpt2": 50256}  # end-of-text of each tokenizer (looplm.data.tokenizers)

__all__ = ["export_checkpoint", "hf_config", "write_tokenizer"]


def hf_config(model_cfg, loops: int) -> dict:
    """The ``config.json`` contents for a looplm ``ModelConfig`` and default depth ``loops``."""
    from looplm import __version__

    eot = _eot_id(model_cfg.tokenizer)
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
    settings: ExportSettings | None = None,
    **changes: Any,
) -> Path:
    """Write the export folder ``out`` for ``checkpoint`` (atomically: a temporary folder renamed
    into place). ``settings`` (:class:`~looplm.decoding.hf.settings.ExportSettings`; ``changes`` replace
    single fields, e.g. ``loops=4``): ``loops`` defaults to the training ceiling ``train.depth_max``; ``standalone``
    writes model code that needs no looplm where the folder is loaded. ``overwrite`` replaces a
    previous export's own files (:data:`EXPORT_FILES`) and leaves any other file in ``out``
    alone; a folder that is not a looplm export is refused."""
    from looplm.model.checkpoint import load_checkpoint
    from looplm.model.lm import check_loops
    from looplm.settings import build_settings

    base = dataclasses.asdict(settings or ExportSettings())
    s = build_settings(ExportSettings, {**base, **changes}, "export")
    loops, overwrite, standalone = s.loops, s.overwrite, s.standalone
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
        _write_export(tmp, model, cfg, T, checkpoint, standalone)
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
        fault = None if isinstance(exc, OSError) else os_error_in(exc, out)
        if fault is not None:  # safetensors' writer: a full disk comes as a SafetensorError
            raise fault from exc
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


def _write_export(tmp: Path, model, cfg, T: int, checkpoint, standalone: bool = False) -> None:
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
    if standalone:
        from looplm.decoding.hf.standalone import standalone_source

        (tmp / "modeling_looplm.py").write_text(standalone_source(), encoding="utf-8")
    write_tokenizer(tmp, cfg.model.tokenizer, cfg.model.context)
    (tmp / "README.md").write_text(_card(cfg, T, checkpoint, standalone))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (the byte-level BPE alphabet): the
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bytes_backend():
    """A ``tokenizers`` tokenizer with looplm's bytes ids: byte b → b, ``<|endoftext|>`` → 256.
    Byte-level pre-tokenisation without splitting, a BPE with no merges (one token per byte)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    return tok


EOT_TEXT = "<|endoftext|>"


def _eot_id(name: str) -> int | None:
    """The end-of-text id of looplm's tokenizer ``name`` (a checkpoint's own ``tokenizer.json``:
    the id its :class:`~looplm.data.tokenizers.FileTokenizer` ends text with)."""
    if name in EOT_IDS:
        return EOT_IDS[name]
    from looplm.data.tokenizers import is_tokenizer_file

    if is_tokenizer_file(name):
        from looplm.data import get_tokenizer

        return int(get_tokenizer(name).eot_id)
    return None


def write_tokenizer(folder: str | os.PathLike, name: str, context: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for looplm's tokenizer ``name`` (gpt2 |
    bytes | a checkpoint's own ``tokenizer.json``, e.g. an imported model's):
    ``AutoTokenizer.from_pretrained(folder)`` then encodes as looplm does. A file tokenizer's
    ``tokenizer_config.json`` beside it (chat template, special tokens) is copied as it is."""
    from looplm.data.tokenizers import is_tokenizer_file

    folder = Path(folder)
    eot_text = EOT_TEXT
    if name == "gpt2":
        from looplm.data import get_tokenizer

        backend = get_tokenizer("gpt2").backend
    elif name == "bytes":
        backend = _bytes_backend()
    elif is_tokenizer_file(name):
        from looplm.data import get_tokenizer

        tok = get_tokenizer(name)
        backend, eot_text = tok.backend, tok.backend.id_to_token(tok.eot_id)
        shutil.copyfile(name, folder / "tokenizer.json")
        beside = Path(name).parent / "tokenizer_config.json"
        if beside.is_file():
            shutil.copyfile(beside, folder / "tokenizer_config.json")
            return
    else:
        raise LoopLMError(f"tokenizer {name!r}; allowed: gpt2, bytes, or a tokenizer.json path")
    if name in EOT_IDS and backend.token_to_id(EOT_TEXT) != EOT_IDS[name]:
        raise LoopLMError(f"the {name} tokenizer does not map {EOT_TEXT} to {EOT_IDS[name]}")
    if not (folder / "tokenizer.json").is_file():
        (folder / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eot_text,
        "eos_token": eot_text,
        "unk_token": eot_text,
        "model_max_length": int(context),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _card(cfg, loops: int, checkpoint, standalone: bool = False) -> str:
    m = cfg.model
    needs = (
        "Needs only `torch` and `transformers` where it is loaded (the model code in "
        "`modeling_looplm.py` was generated from looplm's source by `looplm export --standalone`)"
        if standalone
        else "Needs the `looplm` package installed where it is loaded (the code files here import it)"
    )
    return (
        f"# looplm export: {cfg.method_label} ({m.preset}, d={m.d_model}, context {m.context})\n\n"
        f"Exported from `{checkpoint}` with `looplm export`. Default loop depth T = {loops}.\n\n"
        f"{needs} and `trust_remote_code=True`:\n\n"
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        'model = AutoModelForCausalLM.from_pretrained("<this folder>", trust_remote_code=True)\n'
        'tok = AutoTokenizer.from_pretrained("<this folder>", trust_remote_code=True)\n'
        'ids = tok("The meaning of", return_tensors="pt").input_ids\n'
        "logits = model(ids, loops=12).logits\n"
        "out = model.generate(ids, max_new_tokens=20, loops=12)\n"
        "print(tok.decode(out[0]))\n"
        "```\n\n"
        + (
            f"Tokenizer: looplm's `{m.tokenizer}` tokenizer, written as `tokenizer.json` (the "
            f'same ids as `looplm.data.get_tokenizer("{m.tokenizer}")`).\n'
            if m.tokenizer in EOT_IDS
            else "Tokenizer: the checkpoint's own `tokenizer.json` (and its "
            "`tokenizer_config.json` where it had one), copied as they were.\n"
        )
    )
