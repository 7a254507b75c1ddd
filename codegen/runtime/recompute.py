"""Activation recomputation per block, installed on the model instance.

- ``full``: the block is checkpointed through forward pre/post hooks on that module
  (non-reentrant ``torch.utils.checkpoint``, fqns unchanged, the way torch's composable
  ``checkpoint`` does it, but with a reusable hook switch so a block may be recomputed
  twice, as zero-bubble schedules do when they split the backward into input and weight
  gradients): only the block's inputs are kept, the block is re-run in backward.
- ``selective``: only the attention core (scores, softmax, weighted sum; with CP the whole
  ring) is checkpointed: the block's attention implementation is wrapped in
  :class:`SelectiveAttention` (``codegen/runtime/attention.py`` builds it per block);
  projections, norms and MLP keep their activations.
- ``none``: nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.plan import RECOMPUTE as POLICIES


class SelectiveAttention:
    """An attention implementation whose call is checkpointed (recomputed in backward)."""

    def __init__(self, inner: Callable):
        self.inner = inner

    def __call__(self, q, k, v, *, causal: bool, scale: Optional[float] = None):
        if torch.is_grad_enabled():
            return checkpoint(self._call, q, k, v, causal, scale, use_reentrant=False)
        return self.inner(q, k, v, causal=causal, scale=scale)

    def _call(self, q, k, v, causal, scale):
        return self.inner(q, k, v, causal=causal, scale=scale)


class _HookSwitch:
    """Checkpoint hooks of one block: on, except while the block is being recomputed.
    A plain class (not a generator context manager), so one recomputation context can be
    entered again by a second backward pass."""

    def __init__(self) -> None:
        self.on = True
        self.gen = None

    def __enter__(self) -> None:
        self._prev, self.on = self.on, False

    def __exit__(self, *exc) -> None:
        self.on = self._prev


def checkpoint_block(block: nn.Module) -> None:
    """Recompute ``block`` in backward (hooks on that instance; idempotent)."""
    import contextlib

    from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator

    if getattr(block, "_autopar_ckpt", False):
        return
    switch = _HookSwitch()

    def pre(mod, args, kwargs):
        if switch.on:
            switch.gen = _checkpoint_without_reentrant_generator(
                mod, True, lambda: (contextlib.nullcontext(), switch), _DEFAULT_DETERMINISM_MODE, False, True,
                *args, **kwargs)
            next(switch.gen)

    def post(mod, args, output):
        if switch.on and switch.gen is not None:
            try:
                next(switch.gen)
            except StopIteration:
                pass
        switch.gen = None

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post, prepend=True, always_call=True)
    block._autopar_ckpt = True


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r}: use {', '.join(POLICIES)}")
    return policy
