"""Typed run configuration: dataclasses, presets, YAML files and ``key=value`` overrides.

Settings are merged in one order only: dataclass defaults → preset → YAML file → ``key=value``
overrides (dotted, e.g. ``model.d_model=64`` or ``train.steps=200``). Every value is validated when
the config is built; an unknown key or a bad value raises :class:`LoopLMError` naming the key, the
value and what is allowed. The resolved config is written into each run folder (``config.yaml``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from looplm.errors import LoopLMError, yaml_problem
from looplm.settings import (
    build_settings,
    check_fields,
    load_yaml,
    merge,
    parse_key_values,
    setting,
)

GPT2_VOCAB = 50257
BYTE_VOCAB = 257  # 256 byte values + end-of-text (id 256)

# name -> (d_model, n_heads, d_ff). Context 128 and GPT-2 vocabulary unless stated.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=128, n_heads=4, d_ff=512, vocab_size=BYTE_VOCAB, tokenizer="bytes"),
    "22m": dict(d_model=384, n_heads=6, d_ff=1536),
    "50m": dict(d_model=768, n_heads=12, d_ff=3072),
    "95.6m": dict(d_model=1280, n_heads=20, d_ff=5120),
    "136.5m": dict(d_model=1664, n_heads=26, d_ff=6656),
    # Unshared controls (recurrence "unshared"), ff = 4·d. Width 320 takes 5 heads (head dim 64, as
    # at 22m); width 288 keeps 22m's 6 heads (head dim 48; 64 does not divide 288). The head count
    # changes no parameter count.
    "22m-unshared-4x320": dict(d_model=320, n_heads=5, d_ff=1280, n_layers=4),  # 22.68M
    "22m-unshared-6x288": dict(d_model=288, n_heads=6, d_ff=1152, n_layers=6),  # 22.48M
    "22m-unshared-8x384": dict(d_model=384, n_heads=6, d_ff=1536, n_layers=8),  # Transformer-8
}


INIT_SCHEMES = ("normal", "depth_scaled")
POSITIONS = ("learned", "rope", "none")
ATTENTIONS = ("causal", "adjacency")
NORM_PLACEMENTS = ("pre", "sandwich", "sandwich_sum")
MLPS = ("swiglu", "relu2")
ROPE_LAYOUTS = ("half", "interleaved")
# Synthetic tasks with one answer per graph node, whose rows carry the graph that
# ``attention=adjacency`` reads (looplm.data.synthetic generates them).
NODE_TASKS = ("graph_nodes",)
UNSHARED = "unshared"  # the ordinary N-layer Transformer: no shared block, no recurrence


@dataclass
class ModelConfig:
    """Shape of the model and the recurrence it runs.

    ``recurrence`` names a registered method (``looplm.recurrence_names()``); ``recurrence_args``
    holds that method's own settings, validated against its ``Config`` dataclass.
    """

    preset: str = "tiny"  # width preset, applied before the other model keys (listed above)
    recurrence: str = "scse"  # the method: a registered recurrence, or unshared
    recurrence_args: dict[str, Any] = field(default_factory=dict)  # the method's own settings
    vocab_size: int = setting(GPT2_VOCAB, lo=1)  # vocabulary size (GPT-2: 50257, bytes: 257)
    tokenizer: str = "gpt2"  # gpt2 | bytes | path of a tokenizer.json (imported checkpoints)
    d_model: int = setting(384, lo=1)  # width
    n_heads: int = setting(6, lo=1)  # attention heads (must divide d_model)
    d_ff: int = setting(1536, lo=1)  # SwiGLU hidden width
    context: int = setting(128, lo=1)  # context window in tokens
    dropout: float = 0.1  # dropout in training
    n_layers: int = setting(8, lo=1)  # unshared models only: number of distinct layers
    norm_eps: float = 1e-6  # RMSNorm ε (the paper is silent; 1e-6 is the toolkit's choice)
    # Initialisation (the paper is silent on all of it). ``normal``: every projection N(0, init_std)
    # and both embeddings N(0, emb_std). ``depth_scaled``: as normal, but the block's two residual
    # output projections (attention out, SwiGLU down) are N(0, init_std / sqrt(2·init_depth)) —
    # GPT-2's residual scaling with the unrolled loop depth as the layer count.
    init: str = setting("normal", choices=INIT_SCHEMES)  # the initialisation scheme above
    init_std: float = 0.02  # std of the projections at initialisation
    emb_std: float = 0.02  # std of the token and position embeddings at initialisation
    init_depth: int = setting(8, lo=1)  # depth_scaled: the loop depth counted as layers
    # Structural biases ("Thinking Deeper, Not Longer"): ``positions`` learned (absolute, the paper's) | rope
    # (rotary, relative) | none; ``attention`` causal | adjacency (a token attends only where the
    # input's graph allows — see looplm.model.masks.adjacency_mask; not causal).
    positions: str = setting(
        "learned", choices=POSITIONS
    )  # learned (absolute) | rope (rotary, relative) | none
    rope_base: float = 10000.0  # base of the rotary frequencies (positions=rope)
    attention: str = setting(
        "causal", choices=ATTENTIONS
    )  # causal | adjacency (graph in-neighbours, node tasks only)
    # Prelude–core–coda layout (Huginn/Ouro-style): non-looped layers applied once before the loop
    # (prelude) and after it (coda), and a looped core of ``core_layers`` layers that together form
    # the shared update G. Today's models are 0/1/0.
    prelude_layers: int = setting(0, lo=0)  # non-looped layers before the loop
    core_layers: int = setting(1, lo=1)  # layers of the looped core (together the shared update G)
    coda_layers: int = setting(0, lo=0)  # non-looped layers after the loop
    # Block and readout options, for checkpoints trained elsewhere (looplm.model.families); the
    # defaults are looplm's own block (see looplm.model.block for the equations).
    n_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: n_heads
    norm_placement: str = setting(
        "pre", choices=NORM_PLACEMENTS
    )  # pre | sandwich (sublayer outputs normed) | sandwich_sum (sums)
    qk_norm: bool = False  # RMS-normalise queries and keys per head (no gain), after rotation
    qk_bias: bool = False  # learned bias on the query and key projections
    mlp: str = setting("swiglu", choices=MLPS)  # swiglu | relu2 (W_down(½·relu(W_up x)²))
    rope_layout: str = setting(
        "half", choices=ROPE_LAYOUTS
    )  # half (rotate-half) | interleaved (pairs 2i, 2i+1)
    value_embed_layers: list[int] = field(default_factory=list)  # layers (prelude, core, coda
    # order) whose values add a gated per-token value embedding
    reference_rounding: bool = False  # operation order of reference implementations (layer
    # sums left to right, RoPE frequencies 1/base^(2i/hs)): rounding only, for foreign checkpoints
    tie_head: bool = True  # output head tied to the token embedding; False: its own matrix
    emb_scale: float = 1.0  # the token embedding is multiplied by this
    final_norm: bool = True  # the readout normalises h first; False: it reads h as is
    coda_norm: bool = False  # the final norm (same gain) also applied to h_T before the coda
    logit_scale: float = 1.0  # logits multiplied by this
    logit_softcap: float = 0.0  # > 0: logits ← c·tanh(logits / c)
    attn_gate: bool = False  # attention output gated per head and channel by σ(W_g x)
    norm_weight: bool = True  # RMSNorms carry a learned gain; False: x / rms(x), no parameters

    @property
    def is_looped(self) -> bool:
        """True for a shared block run by a recurrence, False for the unshared Transformer."""
        return self.recurrence != UNSHARED

    def validate(self) -> None:
        check_fields(self, "model.")  # ranges and choices (an instance built in Python too)
        if self.d_model % self.n_heads:
            raise LoopLMError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise LoopLMError(f"model.dropout={self.dropout} must be in [0, 1)")
        tok = self.tokenizer
        if tok not in ("gpt2", "bytes") and not (tok.endswith(".json") and Path(tok).is_file()):
            raise LoopLMError(
                f"model.tokenizer={tok!r}; allowed: gpt2, bytes, or the path of a tokenizer.json"
            )
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise LoopLMError(
                f"model.positions=rope needs an even head size, got d_model/n_heads = "
                f"{self.d_model // self.n_heads}"
            )
        self._validate_block_options()
        for key in ("init_std", "emb_std", "norm_eps"):
            if not getattr(self, key) > 0:
                raise LoopLMError(f"model.{key}={getattr(self, key)} must be > 0")

    def _validate_block_options(self) -> None:
        kv = self.n_kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 0 or (kv and self.n_heads % kv):
            raise LoopLMError(
                f"model.n_kv_heads={kv!r} must be 0 (= n_heads) or divide n_heads={self.n_heads}"
            )
        n_layers = self.prelude_layers + self.core_layers + self.coda_layers
        bad = [
            i for i in self.value_embed_layers if not isinstance(i, int) or not 0 <= i < n_layers
        ]
        if bad:
            raise LoopLMError(
                f"model.value_embed_layers has {bad[0]!r}; allowed: layer indices 0 … "
                f"{n_layers - 1} (prelude, core, coda)"
            )
        for key in ("emb_scale", "logit_scale"):
            if not getattr(self, key) > 0:
                raise LoopLMError(f"model.{key}={getattr(self, key)} must be > 0")
        if self.coda_norm and not self.final_norm:
            raise LoopLMError(
                "model.coda_norm=true reuses the final norm: it needs final_norm=true"
            )
        if not self.logit_softcap >= 0:
            raise LoopLMError(f"model.logit_softcap={self.logit_softcap} must be >= 0 (0: none)")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or ``n_heads`` when 0."""
        return self.n_kv_heads or self.n_heads


@dataclass
class DataConfig:
    """What to train and evaluate on: a synthetic task or a text corpus."""

    dataset: str = "bool_logic"  # a synthetic task name or a corpus name (wikitext-2, ...)
    data_dir: str | None = None  # folder holding local corpora (e.g. ../shared/data)
    cache_dir: str | None = None  # token cache folder (default ~/.cache/looplm)
    train_split: str = "train"  # split trained on
    eval_split: str = "valid"  # split evaluated on during and after training
    # synthetic tasks: difficulty range [lo, hi] for training
    train_difficulty: list[int] = field(default_factory=lambda: [1, 3])
    # synthetic tasks: difficulty range [lo, hi] for evaluation
    eval_difficulty: list[int] = field(default_factory=lambda: [1, 3])
    # synthetic tasks: the task generator's own settings (e.g. seq_len for packed rows)
    task_args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("train_difficulty", "eval_difficulty"):
            v = getattr(self, name)
            if len(v) != 2 or v[0] < 1 or v[1] < v[0]:
                raise LoopLMError(f"data.{name}={v} must be [lo, hi] with 1 <= lo <= hi")


@dataclass
class TrainConfig:
    """Optimisation settings (paper defaults for the 22M recipe)."""

    steps: int = setting(1200, lo=1)  # optimizer steps
    batch_size: int = setting(32, lo=1)  # rows per step (per process, per accumulation step)
    grad_accum: int = setting(1, lo=1)  # gradient accumulation steps per optimizer step
    lr: float = 3e-4  # peak learning rate (AdamW)
    min_lr_ratio: float = setting(
        0.1, lo=0, hi=1
    )  # the cosine schedule's floor, as a fraction of lr
    warmup: int = setting(500, lo=0)  # linear warmup steps
    weight_decay: float = 0.1  # AdamW weight decay on matrices (norms and gains are not decayed)
    beta1: float = 0.9  # AdamW β1
    beta2: float = 0.95  # AdamW β2
    clip: float = 1.0  # gradient-norm clipping limit
    depth_min: int = setting(1, lo=1)  # smallest loop depth T drawn per step (uniformly)
    depth_max: int = setting(8, lo=1)  # largest loop depth T drawn per step
    seed: int = 0  # seed of the parameters, the data stream and the depth draws
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))  # auto | cpu | cuda
    autocast: str = setting(
        "auto", choices=("auto", "bf16", "off")
    )  # auto (bf16 on GPU) | bf16 | off
    compile: bool = False  # torch.compile the whole step, one graph per T (blocks if distributed)
    cpu_allocator: str = setting(
        "reuse", choices=("reuse", "system")
    )  # CPU: reuse (keep freed host memory for the next step) | system (glibc's default)
    objective: str = setting(
        "final", choices=("final", "per_step")
    )  # final (silent thinking) | per_step (intermediate supervision)
    truncate_k: int = setting(0, lo=0)  # >0: backprop only through the last k loops
    checkpoint_loops: bool = False  # activation checkpointing per loop step
    log_every: int = setting(10, lo=1)  # steps between metrics.jsonl lines
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8  # batches of each evaluation during training
    ckpt_every: int = 0  # 0: only at the end
    nonfinite: str = setting("skip", choices=("skip", "stop"))  # skip | stop
    tensorboard: bool = False  # also log to TensorBoard (<out_dir>/tb)
    parallel: str = setting(
        "ddp", choices=("ddp", "fsdp")
    )  # under torchrun (WORLD_SIZE > 1): ddp | fsdp (FSDP2 fully_shard)
    peak_tflops: float = 790.0  # MFU denominator per GPU (H200 dense bf16, measured); 0: no MFU
    max_wall_s: float = 0.0  # >0: stop (checkpoint written) after this many seconds of training
    # A family's training recipe: its depth schedule and objective (looplm.training.recipes). "" = the
    # init checkpoint's family default (looplm for a run from scratch)
    seq_len: int = 0  # training/validation window in tokens; 0: model.context (at most that)
    recipe: str = ""  # "" | looplm | huginn | parcae | ouro | ouro_gate
    depth_mean: int = 0  # huginn/parcae: mean loop count of the draw (0: the checkpoint's)
    exit_beta: float = 0.1  # ouro: weight β of the exit distribution's entropy
    gate_k: float = 50.0  # ouro_gate: slope k of the continuation target σ(k·(I − γ))
    gate_gamma: float = 0.005  # ouro_gate: threshold γ of the loss improvement I

    def validate(self) -> None:
        check_fields(self, "train.")  # ranges and choices (an instance built in Python too)
        if self.depth_max < self.depth_min:
            raise LoopLMError(
                f"train.depth_max={self.depth_max} < train.depth_min={self.depth_min}"
            )
        if self.lr <= 0:
            raise LoopLMError(f"train.lr={self.lr} must be > 0")
        for key in ("peak_tflops", "max_wall_s"):
            if getattr(self, key) < 0:
                raise LoopLMError(f"train.{key}={getattr(self, key)} must be >= 0")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise LoopLMError(f"train.{key}={getattr(self, key)} must be in [0, 1)")
        if self.clip <= 0:
            raise LoopLMError(f"train.clip={self.clip} must be > 0 (the gradient-norm limit)")
        for key in (
            "weight_decay",
            "ckpt_every",
            "eval_every",
            "eval_batches",
            "depth_mean",
            "seq_len",
        ):
            if getattr(self, key) < 0:
                raise LoopLMError(f"train.{key}={getattr(self, key)} must be >= 0")
        if self.recipe not in ("",) + RECIPES:
            raise LoopLMError(
                f"train.recipe={self.recipe!r}; allowed: {', '.join(RECIPES)} (or empty: the "
                "init checkpoint's family default)"
            )
        if self.exit_beta < 0 or self.gate_k <= 0 or self.gate_gamma < 0:
            raise LoopLMError(
                f"train.exit_beta={self.exit_beta} and train.gate_gamma={self.gate_gamma} must be "
                f">= 0, train.gate_k={self.gate_k} > 0"
            )


RECIPES = ("looplm", "huginn", "parcae", "ouro", "ouro_gate")
LORA_TARGETS = ("core", "all")


@dataclass
class LoraConfig:
    """Parameter-efficient fine-tuning: LoRA adapters (through ``peft``) on the projections of
    the looped core (``targets=core``) or of every layer, prelude and coda too (``all``)."""

    rank: int = 0  # 0: full fine-tuning; > 0: LoRA of this rank, the base weights frozen
    alpha: float = 16.0  # LoRA scale numerator (the update is alpha/rank · B·A)
    targets: str = "core"  # core | all (prelude and coda projections too)
    adapter: str = ""  # an adapter folder saved by an earlier LoRA run, to continue from

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise LoopLMError(f"lora.rank={self.rank!r} must be an integer >= 0 (0: no LoRA)")
        if not self.alpha > 0:
            raise LoopLMError(f"lora.alpha={self.alpha} must be > 0")
        if self.targets not in LORA_TARGETS:
            raise LoopLMError(f"lora.targets={self.targets!r}; allowed: {', '.join(LORA_TARGETS)}")
        if self.adapter and not self.rank:
            raise LoopLMError("lora.adapter needs lora.rank > 0 (the adapter's rank)")


@dataclass
class EvalConfig:
    """Evaluation settings."""

    # loop depths of the evaluation after training
    depths: list[int] = field(default_factory=lambda: [4, 8, 12, 16, 24, 32, 48])
    batch_size: int = setting(32, lo=1)  # evaluation batch size
    max_tokens: int | None = None  # cap on evaluated tokens (None: whole split)
    n_examples: int = setting(512, lo=1)  # synthetic tasks: examples per difficulty

    def validate(self) -> None:
        if not self.depths:
            raise LoopLMError("eval.depths is empty; give at least one loop depth >= 1")
        bad = [d for d in self.depths if int(d) < 1]
        if bad:
            raise LoopLMError(f"eval.depths={self.depths}: loop depth must be >= 1 (got {bad[0]})")
        check_fields(self, "eval.")


@dataclass
class RunConfig:
    """Everything a run needs; written to ``<out_dir>/config.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    out_dir: str = "runs/default"  # the run folder (checkpoint, metrics, resolved config)
    # A checkpoint to start from (a looplm checkpoint folder, an imported one, or a published
    # folder `looplm import` reads): its architecture, tokenizer and weights; "" = from scratch
    init: str = ""
    name: str = ""  # a free name for the run
    # The method's name in results (store rows, reports); "" means the recurrence name. Lets one
    # recurrence with different settings appear as distinct methods (e.g. the two looped baselines).
    method: str = ""

    @property
    def method_label(self) -> str:
        return self.method or self.model.recurrence

    def validate(self) -> RunConfig:
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.eval.validate()
        self.lora.validate()
        if self.train.seq_len > self.model.context:
            raise LoopLMError(
                f"train.seq_len={self.train.seq_len} exceeds model.context={self.model.context}"
            )
        if self.lora.rank and not self.init:
            raise LoopLMError("lora.rank > 0 adapts a trained model: give init=CHECKPOINT")
        if self.lora.rank and self.train.parallel == "fsdp":
            raise LoopLMError(
                "lora.rank > 0 with train.parallel=fsdp is not supported; use train.parallel=ddp "
                "(the frozen base is not sharded then)"
            )
        if self.model.attention == "adjacency":
            if self.data.dataset not in NODE_TASKS:
                raise LoopLMError(
                    f"model.attention=adjacency reads a graph from the input and needs a node "
                    f"task (data.dataset: {', '.join(NODE_TASKS)}), not "
                    f"data.dataset={self.data.dataset!r}"
                )
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_config(preset: str, recurrence: str = "scse", **overrides: Any) -> ModelConfig:
    """A validated ModelConfig for ``preset`` with keyword overrides."""
    if preset not in PRESETS:
        raise LoopLMError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    values: dict[str, Any] = {"preset": preset, "recurrence": recurrence, **PRESETS[preset]}
    values.update(overrides)
    return _build(ModelConfig, values, "model")


# ----------------------------------------------------------------------------- merging


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    return build_settings(cls, values, prefix, noun="config key")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["train.steps=10", "model.recurrence_args.s=0.3"]`` → nested dict (YAML-typed values)."""
    return parse_key_values(overrides)


def configs_root() -> Path:
    """The folder of looplm's shipped configs (run configs, experiment grids, the paper's tables):
    ``looplm/configs`` inside the package (what an installed wheel has; in the checkout a link to
    the top-level ``configs/``), else the checkout's ``configs/``."""
    package = Path(__file__).resolve().parents[1]
    inside = package / "configs"
    return inside.resolve() if inside.is_dir() else package.parent / "configs"


# the configs folder every command reads names from
CONFIG_DIR = configs_root()


def config_names() -> list[str]:
    """The names ``looplm train NAME`` takes (the run configs shipped with looplm)."""
    return sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


def resolve_config_path(path_or_name: str) -> Path:
    """A YAML path, or the name of a file in the repository's ``configs/`` folder."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / path_or_name, CONFIG_DIR / f"{path_or_name}.yaml"):
        if cand.is_file():
            return cand
    known = config_names()
    raise LoopLMError(
        f"config {path_or_name!r} not found (a YAML path, or one of: {', '.join(known) or 'none'})"
    )


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a nested dict (preset expanded first)."""
    raw = dict(raw)
    model_raw = dict(raw.get("model") or {})
    preset = model_raw.get("preset", ModelConfig.preset)
    if preset not in PRESETS:
        raise LoopLMError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")
    raw["model"] = {**PRESETS[preset], **model_raw}
    return _build(RunConfig, raw, "")


def load_config(path_or_name: str | None, overrides: list[str] | None = None) -> RunConfig:
    """defaults → preset → YAML → ``key=value`` overrides; validated. (A run with ``init=CKPT``
    takes its model section from the checkpoint: :func:`looplm.training.finetune.load_run_config`.)"""
    return config_from_dict(load_raw(path_or_name, overrides))


def load_raw(path_or_name: str | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The merged settings of a YAML file (or configs/ name) and ``key=value`` overrides, as a
    nested dict before defaults and validation."""
    raw: dict[str, Any] = {}
    if path_or_name:
        path = resolve_config_path(path_or_name)
        try:
            loaded = load_yaml(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise LoopLMError(f"config {path}: not valid YAML ({yaml_problem(exc)})") from None
        if not loaded:  # an empty file (or only comments) would train the defaults silently
            raise LoopLMError(
                f"config {path} is empty; give at least one setting (e.g. model.recurrence: "
                "scse), or a config name such as tiny_bool"
            )
        if not isinstance(loaded, dict):
            raise LoopLMError(f"config {path}: top level must be a mapping")
        raw = loaded
    return merge(raw, parse_overrides(overrides or []))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML text."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
