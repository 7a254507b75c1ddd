"""From a model spec string to a ModelGraph: resolve, build on meta, make an example, capture.

A spec is a zoo preset (``llama3-8b``), a TOML file of hyperparameters, ``hf:<preset>``
(a HuggingFace model built from a config) or ``package.module:function`` returning an
``nn.Module``. Models are built on the meta device, so nothing is allocated.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from planner.capture import capture
from planner.errors import AutoparError
from planner.graph import ModelGraph


def example_for_module(model: nn.Module, batch: int, seq_len: int) -> dict[str, Any]:
    """A token batch for a user model: ``input_ids`` (and ``labels`` when ``forward`` takes
    them) over the vocabulary of its first ``nn.Embedding``."""
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise AutoparError("cannot make an example batch for a model without an nn.Embedding; "
                           "call planner.capture(model, example) with your own example inputs")
    params = inspect.signature(model.forward).parameters
    ex: dict[str, Any] = {"input_ids": torch.zeros(batch, seq_len, dtype=torch.long, device="meta")}
    if "labels" in params:
        ex["labels"] = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    if "use_cache" in params:
        ex["use_cache"] = False
    return ex


def load_graph(spec: str, *, batch: int = 1, seq_len: int | None = None) -> ModelGraph:
    """Capture the model named by ``spec`` at ``batch`` sequences of ``seq_len`` tokens
    (default: the preset's training length)."""
    from planner import zoo

    if batch < 1:
        raise AutoparError(f"--batch must be a positive integer, got {batch}")
    if seq_len is not None and seq_len < 1:
        raise AutoparError(f"--seq-len must be a positive integer, got {seq_len}")
    ms = zoo.load_model_spec(spec)
    with torch.device("meta"):
        model = ms.factory()
    if not isinstance(model, nn.Module):
        raise AutoparError(f"model spec {spec!r} returned {type(model).__name__}, not an nn.Module; "
                           "make the function return the model")
    cfg = ms.cfg
    if cfg is not None:
        s = seq_len or cfg.seq_len
        if not spec.strip().startswith("hf:"):
            ex = zoo.example_batch(cfg, batch, s, device="meta")
        else:
            ex = example_for_module(model, batch, s)
        config = {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, bool))}
        return capture(model, ex, name=ms.name, config=config, hidden=cfg.hidden, vocab=cfg.vocab)
    ex = example_for_module(model, batch, seq_len or 128)
    return capture(model, ex, name=ms.name)
