"""Reference models (GPT, Llama, a vision+language model) and named presets, in plain PyTorch.

Every model is a sequence of top-level "layer units" (``embed``, ``layers``, ``norm``,
``head``; the MLLM adds ``vision`` and ``projector`` in front), every attention goes
through the runtime's ``SelfAttention`` (``codegen/runtime/layers.py``), whose ``attn_impl`` the
runtime may set on that instance, and ``init_weights(seed)`` fully initialises a model built on the meta device
after ``to_empty``.
"""
from __future__ import annotations

from planner.zoo.config import PRESETS, PUBLISHED_PARAMS, ModelConfig
from planner.zoo.spec import ModelSpec, build_hf_model, build_model, example_batch, load_config_toml, \
    load_model_spec, preset

__all__ = [
    "PRESETS",
    "PUBLISHED_PARAMS",
    "ModelConfig",
    "ModelSpec",
    "build_hf_model",
    "build_model",
    "example_batch",
    "load_config_toml",
    "load_model_spec",
    "preset",
]
