"""Reference models (GPT, Llama, a vision+language model) and named presets, in plain PyTorch.

Every model is a sequence of top-level "layer units" (``embed``, ``layers``, ``norm``,
``head``; the MLLM adds ``vision`` and ``projector`` in front), every attention goes
through :func:`attention` (swappable), and ``init_weights(seed)`` fully initialises a
model built on the meta device after ``to_empty``.

Note: ``planner.zoo.attention`` is the attention *function*; the submodule is reachable
with ``from planner.zoo.attention import ...`` or ``sys.modules["planner.zoo.attention"]``.
"""
from __future__ import annotations

from planner.zoo.config import PRESETS, PUBLISHED_PARAMS, ModelConfig
from planner.zoo.spec import ModelSpec, build_hf_model, build_model, example_batch, load_config_toml, \
    load_model_spec, preset
from planner.zoo.attention import attention, get_attention_impl, set_attention_impl, use_attention_impl

__all__ = [
    "PRESETS",
    "PUBLISHED_PARAMS",
    "ModelConfig",
    "ModelSpec",
    "attention",
    "build_hf_model",
    "build_model",
    "example_batch",
    "get_attention_impl",
    "load_config_toml",
    "load_model_spec",
    "preset",
    "set_attention_impl",
    "use_attention_impl",
]
