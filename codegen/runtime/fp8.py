"""Float8 training of the blocks' linears (``ParallelConfig.fp8``: torchao's ``tensorwise`` or
``rowwise`` recipe), as the plan prices it (cost_models/compute.py: the three GEMMs of each
linear at the device's fp8 peak, plus the casts).

torchao's ``convert_to_float8_training`` swaps each selected ``nn.Linear`` for a ``Float8Linear``
(same attribute name, same parameter: names and checkpoints are unchanged) whose matmuls cast
their operands to float8 with dynamic scales. Only the linears inside the model's repeated
blocks are converted: the embedding, the head and the routed experts stay in the compute dtype
(as torchtitan leaves its output projection). Under FSDP the tensorwise recipe gathers the
weights in float8 (``enable_fsdp_float8_all_gather``), which the time model prices too.

Float8 needs float8 tensor cores (compute capability 8.9+: H100 / H200 / L40 class); elsewhere
the build is refused in one line (:func:`fp8_device_problem`). torchao's ``emulate`` mode (the
casts and scales in high precision) runs the same code on a CPU; only tests use it.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Iterable, Optional

import torch
from torch import nn


def fp8_device_problem(recipe: str, device: torch.device) -> Optional[str]:
    """Why ``recipe`` cannot run on ``device`` (one line with the fix), or None."""
    if recipe == "none":
        return None
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return (f"fp8={recipe}: float8 matmuls need a GPU with float8 tensor cores (H100 / H200 class), "
                f"this rank has {device}; plan without --fp8")
    if importlib.util.find_spec("torchao") is None:
        return f"fp8={recipe}: torchao is not installed (pip install torchao); plan without --fp8"
    return None


def float8_config(recipe: str, *, fsdp: bool, emulate: bool = False):
    """torchao's ``Float8LinearConfig`` for ``recipe``; tensorwise under FSDP gathers float8 weights."""
    from torchao.float8 import Float8LinearConfig

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise", emulate=emulate)


def convert_blocks(blocks: Iterable[nn.Module], recipe: str, *, fsdp: bool = False, emulate: bool = False) -> int:
    """Convert every ``nn.Linear`` of each block (routed experts are not ``nn.Linear``) to float8
    training under ``recipe``; returns how many linears were converted."""
    from torchao.float8 import convert_to_float8_training

    cfg = float8_config(recipe, fsdp=fsdp, emulate=emulate)
    n = 0
    for block in blocks:
        n += sum(isinstance(m, nn.Linear) for m in block.modules())
        convert_to_float8_training(block, config=cfg)
    return n
