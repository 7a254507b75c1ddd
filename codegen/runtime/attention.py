"""The attention implementation a block runs, built from the plan.

One function, :func:`build_attention`, composes the plan's choices into an
implementation ``fn(q, k, v, *, causal, scale=None) -> out [B, H, S, D]``:

1. the kernel: ``attention == "flash"`` -> :class:`codegen.runtime.kernels.FlashAttention`
   (Triton on CUDA, its exact torch fallback on CPU), ``"eager"`` -> SDPA;
2. context parallelism (``cp > 1``): :class:`codegen.runtime.context_parallel.RingAttention`
   over the cp group, its blocks through the flash kernel when (1) is flash, non-causal
   calls through (1);
3. selective recompute: :class:`codegen.runtime.recompute.SelectiveAttention` around it.

The model's adapter installs the result on each block (``ModelAdapter.set_attention``),
on that model instance only.
"""
from __future__ import annotations

from typing import Optional

from planner.plan import ParallelConfig
from planner.zoo.attention import sdpa_attention
from codegen.runtime.adapters.base import AttentionImpl
from codegen.runtime.context_parallel import RingAttention
from codegen.runtime.kernels import FlashAttention
from codegen.runtime.recompute import SelectiveAttention, check_policy


def build_attention(cfg: ParallelConfig, policy: str, cp_group=None, load_balance: str = "zigzag",
                    ring: Optional[RingAttention] = None) -> AttentionImpl:
    """The implementation for a block with recompute ``policy`` under ``cfg``; ``ring`` reuses
    one RingAttention (its position tables) across blocks."""
    impl: AttentionImpl = FlashAttention() if cfg.attention == "flash" else sdpa_attention
    if cfg.cp > 1:
        impl = ring if ring is not None else ring_attention(cfg, cp_group, load_balance)
    if check_policy(policy) == "selective":
        impl = SelectiveAttention(impl)
    return impl


def ring_attention(cfg: ParallelConfig, cp_group, load_balance: str = "zigzag") -> RingAttention:
    """Ring attention over ``cp_group`` with the plan's kernel for its blocks and non-causal calls."""
    local = FlashAttention() if cfg.attention == "flash" else sdpa_attention
    return RingAttention(cp_group, load_balance, fallback=local, flash=cfg.attention == "flash")
