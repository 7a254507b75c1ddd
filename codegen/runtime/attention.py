"""The attention implementation a block runs, built from the plan.

One function, :func:`build_attention`, composes the plan's choices into an
implementation ``fn(q, k, v, *, causal, scale=None) -> out [B, H, S, D]``:

1. the kernel: ``attention == "flash"`` -> :class:`codegen.runtime.kernels.FlashAttention`
   (Triton on CUDA, its exact torch fallback on CPU), ``"eager"`` -> SDPA; both masked by
   the model's packed documents (``codegen/runtime/documents.py``) when a batch has them;
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
from codegen.runtime.adapters.base import AttentionImpl
from codegen.runtime.context_parallel import RingAttention, UlyssesAttention
from codegen.runtime.documents import Documents, EagerAttention
from codegen.runtime.kernels import FlashAttention
from codegen.runtime.recompute import SelectiveAttention, check_policy


def local_attention(cfg: ParallelConfig, documents: Optional[Documents] = None) -> AttentionImpl:
    """The plan's kernel on this rank's tokens: flash or SDPA, masked by ``documents``."""
    return FlashAttention(documents=documents) if cfg.attention == "flash" else EagerAttention(documents)


def build_attention(cfg: ParallelConfig, policy: str, cp_groups=None, load_balance: str = "zigzag",
                    ring: Optional[AttentionImpl] = None, documents: Optional[Documents] = None) -> AttentionImpl:
    """The implementation for a block with recompute ``policy`` under ``cfg``; ``ring`` reuses
    one context-parallel attention (its position tables) across blocks, else it is built over
    ``cp_groups`` (:func:`context_attention`); ``documents``: the model's packed-document
    holder (``codegen/runtime/documents.py``)."""
    impl: AttentionImpl = local_attention(cfg, documents)
    if cfg.cp > 1:
        impl = ring if ring is not None else context_attention(cfg, *cp_groups, load_balance=load_balance,
                                                               documents=documents)
    if check_policy(policy) == "selective":
        impl = SelectiveAttention(impl, documents)
    return impl


def context_attention(cfg: ParallelConfig, ring_group, ulysses_group=None, load_balance: str = "zigzag",
                      documents: Optional[Documents] = None) -> AttentionImpl:
    """Context-parallel attention per ``cfg.cp_method``: ring attention over ``ring_group``
    (the cp group, or with Ulysses the ring groups) with the plan's kernel for its blocks and
    non-causal calls, inside Ulysses' all-to-alls over ``ulysses_group`` when ``cfg.ulysses > 1``."""
    ring = RingAttention(ring_group, load_balance, fallback=local_attention(cfg), flash=cfg.attention == "flash",
                         ulysses=cfg.ulysses, documents=documents)
    return ring if cfg.ulysses == 1 else UlyssesAttention(ring, ulysses_group)
