"""The attention implementation a block runs, built from the plan.

One function, :func:`build_attention`, composes the plan's choices into an
implementation ``fn(q, k, v, *, causal, scale=None) -> out [B, H, S, D]``:

1. the kernel: ``attention == "flash"`` -> :class:`codegen.runtime.kernels.FlashAttention`
   (Triton on CUDA, its exact torch fallback on CPU), ``"eager"`` -> SDPA;
2. context parallelism (``cp > 1``): :class:`codegen.runtime.context_parallel.RingAttention`
   over the cp group (``cp_method`` ring), or :class:`~codegen.runtime.context_parallel.
   UlyssesAttention` around a ring over the ring groups (ulysses, hybrid); ring blocks
   through the flash kernel when (1) is flash, non-causal calls through (1);
3. selective recompute: :class:`codegen.runtime.recompute.SelectiveAttention` around it.

The model's adapter installs the result on each block (``ModelAdapter.set_attention``),
on that model instance only.
"""
from __future__ import annotations

from typing import Optional

from planner.plan import ParallelConfig
from planner.zoo.attention import sdpa_attention
from codegen.runtime.adapters.base import AttentionImpl
from codegen.runtime.context_parallel import RingAttention, UlyssesAttention
from codegen.runtime.kernels import FlashAttention
from codegen.runtime.recompute import SelectiveAttention, check_policy


def build_attention(cfg: ParallelConfig, policy: str, cp_groups=None, load_balance: str = "zigzag",
                    ring: Optional[AttentionImpl] = None) -> AttentionImpl:
    """The implementation for a block with recompute ``policy`` under ``cfg``; ``ring`` reuses
    one context-parallel attention (its position tables) across blocks, else it is built over
    ``cp_groups`` (:func:`context_attention`)."""
    impl: AttentionImpl = FlashAttention() if cfg.attention == "flash" else sdpa_attention
    if cfg.cp > 1:
        impl = ring if ring is not None else context_attention(cfg, *cp_groups, load_balance=load_balance)
    if check_policy(policy) == "selective":
        impl = SelectiveAttention(impl)
    return impl


def context_attention(cfg: ParallelConfig, ring_group, ulysses_group=None,
                      load_balance: str = "zigzag") -> AttentionImpl:
    """Context-parallel attention per ``cfg.cp_method``: ring attention over ``ring_group``
    (the cp group, or with Ulysses the ring groups) with the plan's kernel for its blocks and
    non-causal calls, inside Ulysses' all-to-alls over ``ulysses_group`` when ``cfg.ulysses > 1``."""
    local = FlashAttention() if cfg.attention == "flash" else sdpa_attention
    ring = RingAttention(ring_group, load_balance, fallback=local, flash=cfg.attention == "flash",
                         ulysses=cfg.ulysses)
    return ring if cfg.ulysses == 1 else UlyssesAttention(ring, ulysses_group)
