"""Mixture-of-experts layers in the parallel runtime.

:func:`balance_experts`, called before every optimizer step: the auxiliary-loss-free load
balancing of every MoE layer this rank holds (``planner/zoo/moe.py``: a module with
``take_load`` and ``update_bias``). Each layer's tokens per expert since the last step are
summed over the ranks that saw the other tokens of the same layer (dp x cp, and tp: under
TP each rank routes its own sequence shard), so every rank moves the bias as one process
training on the whole batch would.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn


def moe_layers(stage_mods: Sequence[nn.Module]) -> list[nn.Module]:
    """The MoE layers (modules with ``take_load`` and ``update_bias``) of these stage modules."""
    return [m for sm in stage_mods for m in sm.modules() if hasattr(m, "take_load") and hasattr(m, "update_bias")]


def balance_experts(layers: Sequence[nn.Module], groups: Sequence = (), first_step: bool = False) -> None:
    """Update each layer's balancing bias from its load summed over each of ``groups`` in turn
    (one all-reduce per group for all layers; nothing without layers). On the ``first_step`` the loads are dropped and
    the bias stays: a pipeline schedule's first step also runs a shape probe (a forward and
    backward of one micro-batch of uninitialised activations) through its later stages, whose
    routing would count."""
    if not layers:
        return
    if first_step:
        for m in layers:
            m.take_load()
        return
    loads = torch.stack([m.take_load().to(m.expert_bias.device) for m in layers])
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(loads, group=group)
    for m, load in zip(layers, loads):
        m.update_bias(load)
