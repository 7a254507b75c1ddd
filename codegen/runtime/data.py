"""Training data for emitted programs: a deterministic synthetic batch, or a user hook.

Every rank builds the same global batch for a step (``ParallelModel.step`` takes the
global batch and each rank cuts its dp / cp share), so the data depends only on the
seed and the step: a resumed run sees exactly the batches an uninterrupted one sees.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from planner.zoo.spec import FUNC_SPEC as _HOOK

DataFn = Callable[[int], dict]


def synthetic(vocab: int, global_batch: int, seq_len: int, seed: int = 0, *, mllm=None,
              model_shifts_labels: bool = False) -> DataFn:
    """``step -> batch``: uniform random tokens; ``labels`` are the next tokens (``input_ids``
    itself when ``model_shifts_labels``: a transformers causal LM shifts them), images for the
    MLLM (``mllm``: its zoo config)."""

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        text = seq_len - (mllm.num_patches if mllm is not None else 0)
        ids = torch.randint(0, vocab, (global_batch, text + 1), generator=g)
        if model_shifts_labels:
            out = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, :-1].contiguous()}
        else:
            out = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        if mllm is not None:
            out["pixel_values"] = torch.randn(global_batch, mllm.channels, mllm.image_size, mllm.image_size,
                                              generator=g)
        return out

    return batch


def user_hook(spec: str, global_batch: int, seq_len: int) -> DataFn:
    """Import ``package.module:function`` (only when the user names it) and return
    ``step -> function(step, global_batch, seq_len)``."""
    if not _HOOK.match(spec):
        raise ValueError(f"--data {spec!r} is not package.module:function")
    mod, fn = spec.split(":")
    f = getattr(importlib.import_module(mod), fn)
    return lambda step: f(step, global_batch, seq_len)
