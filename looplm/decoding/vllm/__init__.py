"""vLLM plugin: serve ``looplm export`` folders with vLLM (``pip install 'looplm[vllm]'``).

    looplm export runs/x/ckpt hf_out --loops 8
    vllm serve hf_out --dtype float32 [--tensor-parallel-size N] [--hf-overrides '{"loops": 12}']

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point (installed with
looplm) in every process it starts. It registers the exported architecture
``LoopLMForCausalLM`` (:class:`looplm.decoding.vllm.model.LoopLMForCausalLM`, built from vLLM's
own layers) and the export's configuration class under ``model_type`` ``looplm`` (so the folder
loads without ``--trust-remote-code``). The loop depth is fixed per served model: the export's
``loops``, or the ``loops`` of vLLM's ``--hf-overrides``.
"""

from __future__ import annotations

ARCHITECTURE = "LoopLMForCausalLM"

__all__ = ["ARCHITECTURE", "register"]


def register() -> None:
    """Register looplm's model class and config with vLLM and transformers (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from looplm.decoding.hf.configuration_looplm import LoopLMConfig

    try:
        AutoConfig.register("looplm", LoopLMConfig, exist_ok=True)
    except TypeError:  # pragma: no cover - a transformers without exist_ok
        try:
            AutoConfig.register("looplm", LoopLMConfig)
        except ValueError:
            pass  # registered already
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "looplm.decoding.vllm.model:LoopLMForCausalLM")
