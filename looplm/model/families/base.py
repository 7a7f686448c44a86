"""What every foreign checkpoint family shares: reading the published folder and placing its
weights into a :class:`~looplm.model.lm.LoopedLM` built on the meta device.

A family (one module in this folder) says three things about a published ``config.json``:

* whether it is this family's (:meth:`Family.detects`),
* the :class:`~looplm.settings.config.ModelConfig` that expresses it (block options, recurrence and its
  settings) — :meth:`Family.model_config`, which rejects keys it does not know,
* where every looplm tensor comes from (:meth:`Family.weights`): a list of :class:`Weight` rows,
  each naming the published tensors (with the shapes the config implies) that are stacked along
  the first axis into one looplm tensor, plus the published names that carry nothing looplm needs
  (buffers, the second copy of a tied head).

:func:`load_weights` then reads each looplm tensor straight into its own memory in the stored
dtype (safetensors: one positioned read per published tensor, no mapping; a ``.bin`` pickle:
``torch.load(mmap=True)``, its tensors used in place where one published tensor is one looplm
tensor), so peak memory stays near one copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.settings.config import ModelConfig
from looplm.settings.plugins import Registry

# Keys every Hugging Face ``config.json`` may carry that say nothing about the network (generation
# defaults, bookkeeping); a family accepts them besides its own.
HF_GENERIC_KEYS = frozenset(
    """_name_or_path add_cross_attention architectures auto_map bad_words_ids begin_suppress_tokens
    bos_token_id chunk_size_feed_forward cross_attention_hidden_size decoder_start_token_id
    diversity_penalty do_sample dtype torch_dtype early_stopping encoder_no_repeat_ngram_size
    eos_token_id exponential_decay_length_penalty finetuning_task forced_bos_token_id
    forced_eos_token_id id2label is_decoder is_encoder_decoder label2id length_penalty max_length
    min_length model_type no_repeat_ngram_size num_beam_groups num_beams num_return_sequences
    output_attentions output_hidden_states output_scores pad_token_id prefix problem_type
    pruned_heads remove_invalid_values repetition_penalty return_dict return_dict_in_generate
    sep_token_id suppress_tokens task_specific_params temperature tf_legacy_loss
    tie_encoder_decoder tokenizer_class top_k top_p torchscript transformers_version typical_p
    use_bfloat16 use_cache initializer_range""".split()
)

DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
}


@dataclass
class Weight:
    """One looplm tensor ``target``: the published tensors ``sources`` (name → expected shape),
    each flattened to the target's trailing shape and stacked along the first axis. ``rows``
    takes only the rows [a, b) of a source (one published tensor fused from several of looplm's)."""

    target: str
    sources: dict[str, tuple[int, ...]]
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class WeightPlan:
    """Every looplm tensor's sources, and the published names that are read by nothing."""

    weights: list[Weight]
    ignored: set[str] = field(default_factory=set)  # e.g. a RoPE table, a tied head's copy


class Family:
    """Base class of a checkpoint family; see the module docstring."""

    name = ""
    architecture = ""  # the published ``architectures[0]`` / class name, for messages
    known_keys: frozenset[str] = frozenset()  # config.json keys the family reads or accepts

    def detects(self, cfg: dict[str, Any]) -> bool:
        raise NotImplementedError

    def model_config(
        self, cfg: dict[str, Any], names: set[str] | None, path: Path | str = "config.json"
    ) -> ModelConfig:
        """The looplm model config of a published config (``names``: the published tensor names
        when there is a checkpoint; None for a build from the config alone)."""
        raise NotImplementedError

    def weights(self, cfg: dict[str, Any], names: set[str], mc: ModelConfig) -> WeightPlan:
        """Where every tensor of the model ``mc`` comes from in a checkpoint with ``names``."""
        raise NotImplementedError

    def loops(self, cfg: dict[str, Any]) -> int:
        """The trained loop count (the reference's default at inference)."""
        raise NotImplementedError

    #: The config.json key that holds the trained loop count (for messages).
    loops_key = ""
    #: looplm setting → the config.json key it comes from, so an error names what the user wrote.
    published_keys: dict[str, str] = {}

    def trained_loops(self, cfg: dict[str, Any], path: Path | str) -> int:
        """:meth:`loops`, or a one-line error naming the config.json key when it is not a
        positive integer."""
        try:
            n = self.loops(cfg)
        except (TypeError, ValueError):
            n = None
        if not isinstance(n, int) or n < 1 or n != cfg.get(self.loops_key, n):
            raise LoopLMError(
                f"{path}: config key {self.loops_key}={cfg.get(self.loops_key)!r} must be a "
                "positive integer (the trained loop count)"
            )
        return n

    @contextlib.contextmanager
    def published_names(self, cfg: dict[str, Any], path: Path | str) -> Iterator[None]:
        """Errors raised inside name the config.json key (``num_hidden_layers``) rather than
        looplm's own setting (``model.core_layers``) it became."""
        try:
            yield
        except LoopLMError as exc:
            msg = str(exc)
            for ours, theirs in self.published_keys.items():
                if msg.startswith(f"{ours}=") or msg.startswith(f"{ours} "):
                    raise LoopLMError(
                        f"{path}: config key {theirs}{_after_value(msg, ours, cfg.get(theirs))} "
                        f"(looplm's {ours})"
                    ) from None
            raise

    def check_keys(self, cfg: dict[str, Any], path: Path) -> None:
        """One-line error for a config.json key the family does not know."""
        unknown = sorted(set(cfg) - self.known_keys - HF_GENERIC_KEYS)
        if unknown:
            raise LoopLMError(
                f"{path}: config key {unknown[0]!r} is not part of the {self.name} layout "
                f"({self.architecture}); looplm cannot tell what it changes"
            )


# every family class, registered by name (a new family is one module of this package, found by
# the package scan, or a plugin module under the ``looplm.families`` entry-point group)
FAMILY_CLASSES: Registry[Family] = Registry("checkpoint family", "looplm.families")


def _after_value(msg: str, key: str, value: Any) -> str:
    """``=<value> must be …`` of an error ``<key>=<looplm value> must be …``."""
    rest = msg[len(key) :]
    if rest.startswith("="):
        rest = rest.split(" ", 1)[1] if " " in rest else ""
        return f"={value!r} {rest}".rstrip()
    return rest


def need(cfg: dict[str, Any], key: str, path: Path | str, allowed: Any = None) -> Any:
    """``cfg[key]``, or a one-line error naming the missing key (or a value looplm cannot map:
    ``allowed`` is the one value, or a tuple of values, the family supports)."""
    if key not in cfg:
        raise LoopLMError(f"{path}: config.json has no {key!r}")
    value = cfg[key]
    ok = allowed is None or (value in allowed if isinstance(allowed, tuple) else value == allowed)
    if not ok:
        raise LoopLMError(
            f"{path}: config key {key}={value!r} is not supported; allowed: {allowed!r}"
        )
    return value


# ----------------------------------------------------------------------------- reading
class TensorFile:
    """The tensors of one weight file, read on demand: name → (dtype, shape), and
    :meth:`read_into` that fills a destination tensor's memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pickle: dict[str, torch.Tensor] | None = None
        if path.suffix == ".safetensors":
            self.header = self._safetensors_header(path)
        else:
            try:  # mapped: a tensor's pages are read when it is copied out
                self._pickle = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:  # pickle and zip errors have many types
                raise LoopLMError(f"{path}: not a readable torch weight file ({exc})") from None
            if not isinstance(self._pickle, dict):
                raise LoopLMError(
                    f"{path}: holds a {type(self._pickle).__name__}, not a state dict"
                )
            self.header = {
                k: {"dtype": v.dtype, "shape": list(v.shape)}
                for k, v in self._pickle.items()
                if torch.is_tensor(v)
            }

    @staticmethod
    def _safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as exc:
            raise LoopLMError(f"{path}: not a readable safetensors file ({exc})") from None
        header.pop("__metadata__", None)
        base = 8 + n
        out = {}
        for name, info in header.items():
            if info["dtype"] not in DTYPES:
                raise LoopLMError(f"{path}: tensor {name} has dtype {info['dtype']} (unsupported)")
            begin, end = info["data_offsets"]
            out[name] = {
                "dtype": DTYPES[info["dtype"]],
                "shape": info["shape"],
                "span": (base + begin, base + end),
            }
        return out

    def names(self) -> set[str]:
        return set(self.header)

    def dtype(self, name: str) -> torch.dtype:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def mapped(self, name: str) -> torch.Tensor | None:
        """The memory-mapped tensor of a ``.bin`` pickle (no copy), or None for safetensors
        (read into fresh memory instead)."""
        if self._pickle is None:
            return None
        t = self._pickle[name]
        return t if t.is_contiguous() else None

    def read_into(self, name: str, dst: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Copy tensor ``name`` (or its rows [a, b) along the first axis) into ``dst``
        (contiguous, same number of elements), converting the dtype when ``dst``'s differs."""
        if self._pickle is not None:
            src = self._pickle[name]
            dst.copy_((src if rows is None else src[rows[0] : rows[1]]).reshape(dst.shape))
            return
        begin, end = self.header[name]["span"]
        if rows is not None:  # row-major: rows [a, b) are one contiguous span
            row_bytes = (end - begin) // max(1, self.shape(name)[0])
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
        src_dtype = self.dtype(name)
        buf = dst if dst.dtype == src_dtype else torch.empty(dst.shape, dtype=src_dtype)
        raw = buf.view(-1).view(torch.uint8).numpy()
        if raw.nbytes != end - begin:
            raise LoopLMError(
                f"{self.path}: tensor {name} holds {end - begin} bytes, expected {raw.nbytes}"
            )
        with open(self.path, "rb", buffering=0) as f:
            f.seek(begin)
            got = f.readinto(memoryview(raw))
        if got != raw.nbytes:
            raise LoopLMError(
                f"{self.path}: tensor {name} is truncated ({got} of {raw.nbytes} bytes)"
            )
        if buf is not dst:
            dst.copy_(buf)


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a published folder: a sharded safetensors index's shards, one
    ``model.safetensors``, or a ``pytorch_model.bin`` / ``model.pt`` pickle (sharded .bin too)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as exc:
                raise LoopLMError(f"{index}: not a weight index ({exc})") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise LoopLMError(f"{folder}: shard {missing[0]} named by {index_name} is missing")
            return [folder / s for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin", "model.pt"):
        if (folder / name).is_file():
            return [folder / name]
    raise LoopLMError(
        f"{folder}: no weights (expected model.safetensors, model.safetensors.index.json with its "
        "shards, pytorch_model.bin or model.pt)"
    )


def open_tensors(folder: Path) -> dict[str, TensorFile]:
    """Published tensor name → the file holding it."""
    where: dict[str, TensorFile] = {}
    for path in weight_files(folder):
        tf = TensorFile(path)
        for name in tf.names():
            where[name] = tf
    return where


def iter_targets(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, meta tensor) of every entry of the model's state dict (tied tensors once)."""
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield name, t


def load_weights(
    model: torch.nn.Module,
    plan: WeightPlan,
    tensors: dict[str, TensorFile],
    folder: Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Fill ``model`` (built on the meta device) from the published ``tensors`` by ``plan``:
    each looplm tensor gets its own memory in the stored dtype (or ``dtype``) and is assigned.
    One-line errors for a missing tensor, a shape that does not match the config, or a published
    tensor no row reads."""
    by_target = {w.target: w for w in plan.weights}
    used: set[str] = set(plan.ignored)
    state: dict[str, torch.Tensor] = {}
    for name, meta in iter_targets(model):
        w = by_target.get(name)
        if w is None:
            raise LoopLMError(f"looplm tensor {name} has no source in the {folder} layout")
        state[name] = _assemble(w, meta, tensors, folder, dtype)
        used.update(w.sources)
    extra = sorted(set(tensors) - used)
    if extra:
        raise LoopLMError(
            f"{folder}: tensor {extra[0]!r} is not part of the layout the config implies"
        )
    model.load_state_dict(state, strict=True, assign=True)


def _assemble(
    w: Weight,
    meta: torch.Tensor,
    tensors: dict[str, TensorFile],
    folder: Path,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    dtypes = set()
    for src, shape in w.sources.items():
        if src not in tensors:
            raise LoopLMError(f"{folder}: tensor {src!r} is missing (a shard or key left out?)")
        got = tensors[src].shape(src)
        if got != tuple(shape):
            raise LoopLMError(
                f"{folder}: tensor {src} has shape {list(got)}, the config implies {list(shape)}"
            )
        dtypes.add(tensors[src].dtype(src))
    stored = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if len(w.sources) == 1 and not w.rows and dtype in (None, stored):  # mapped: used in place
        (src,) = w.sources
        mapped = tensors[src].mapped(src)
        if mapped is not None:
            return mapped.reshape(meta.shape)
    out = torch.empty(meta.shape, dtype=dtype or stored)
    sizes = {
        src: math.prod(shape) // shape[0] * (w.rows[src][1] - w.rows[src][0])
        if src in w.rows
        else math.prod(shape)
        for src, shape in w.sources.items()
    }
    if sum(sizes.values()) != out.numel():
        raise LoopLMError(
            f"{folder}: the sources of {w.target} do not fill its shape {list(out.shape)}"
        )
    flat = out.view(-1)
    at = 0
    for src, n in sizes.items():
        tensors[src].read_into(src, flat[at : at + n], w.rows.get(src))
        at += n
    return out


def layer_prefixes(cfg: ModelConfig) -> list[str]:
    """looplm's name prefix of every layer, in prelude, core, coda order (the order of
    ``value_embed_layers`` indices)."""
    p, k, c = cfg.prelude_layers, cfg.core_layers, cfg.coda_layers
    core = ["block."] if k == 1 else [f"block.layers.{j}." for j in range(k)]
    return [f"prelude.{i}." for i in range(p)] + core + [f"coda.{i}." for i in range(c)]


def hf_rope_base(cfg: dict[str, Any], path: Path) -> float:
    """``rope_theta`` of a Hugging Face config, refusing a scaled RoPE looplm does not compute."""
    scaling = cfg.get("rope_scaling")
    if scaling not in (None, {}) and (scaling or {}).get("rope_type", "default") != "default":
        raise LoopLMError(
            f"{path}: config key rope_scaling={scaling!r} is not supported; allowed: null"
        )
    return float(need(cfg, "rope_theta", path))
