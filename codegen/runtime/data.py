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


def synthetic(cfg, global_batch: int, seq_len: int, seed: int = 0) -> DataFn:
    """``step -> batch``: uniform random tokens (labels = the next token), images for the MLLM."""

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        text = seq_len - (cfg.num_patches if cfg.arch == "mllm" else 0)
        ids = torch.randint(0, cfg.vocab, (global_batch, text + 1), generator=g)
        out = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        if cfg.arch == "mllm":
            out["pixel_values"] = torch.randn(global_batch, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
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
