"""Activation recomputation per pipeline stage.

- ``full``: every transformer block of the stage (``layers.<i>``, ``vision.blocks.<i>``)
  runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: only the block
  input is kept, the block is re-run in backward. The block's ``forward`` is wrapped in
  place (no wrapper module), so fqns stay unchanged.
- ``selective``: only the attention core (the ``planner.zoo.attention.attention`` call:
  scores, softmax, weighted sum; with CP the whole ring) is checkpointed; projections,
  norms and MLP keep their activations. Implemented by installing
  :class:`SelectiveAttention` around the current attention implementation once; it
  checkpoints only while a stage whose policy is ``selective`` is running (the stage sets
  the scope in its forward).
- ``none``: nothing.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import planner.zoo.attention  # noqa: F401

_ZOO_ATTN = sys.modules["planner.zoo.attention"]
_selective_active = False


@contextlib.contextmanager
def selective_scope(on: bool) -> Iterator[None]:
    """Within the block, attention calls are checkpointed iff ``on``."""
    global _selective_active
    prev = _selective_active
    _selective_active = on
    try:
        yield
    finally:
        _selective_active = prev


class SelectiveAttention:
    """Attention implementation that checkpoints ``inner`` while a selective stage runs."""

    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, q, k, v, *, causal: bool):
        if _selective_active and torch.is_grad_enabled():
            return checkpoint(self._call, q, k, v, causal, use_reentrant=False)
        return self.inner(q, k, v, causal=causal)

    def _call(self, q, k, v, causal):
        return self.inner(q, k, v, causal=causal)


def install_selective() -> None:
    """Wrap the current attention implementation once (idempotent). Install CP's ring first."""
    cur = _ZOO_ATTN.get_attention_impl()
    if not isinstance(cur, SelectiveAttention):
        _ZOO_ATTN.set_attention_impl(SelectiveAttention(cur))


def checkpoint_block(block: nn.Module) -> None:
    """Run ``block``'s forward under non-reentrant activation checkpointing (in place)."""
    if getattr(block, "_autopar_ckpt", False):
        return
    orig = block.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        return checkpoint(orig, *args, use_reentrant=False, **kwargs)

    block.forward = forward  # type: ignore[method-assign]
    block._autopar_ckpt = True


def apply_recompute(stage_blocks: list[tuple[nn.Module, str]]) -> None:
    """Apply each ``(block, policy)``: ``full`` checkpoints the block, ``selective`` installs
    :class:`SelectiveAttention` (the stage module enables it while it runs)."""
    for block, policy in stage_blocks:
        if policy == "full":
            checkpoint_block(block)
        elif policy == "selective":
            install_selective()
        elif policy != "none":
            raise ValueError(f"recompute policy {policy!r}: use none, selective or full")
