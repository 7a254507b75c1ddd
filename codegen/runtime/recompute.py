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
- ``selective-op``: the block is checkpointed like ``full``, but under a per-op save policy
  (torch's selective activation checkpointing, torchtitan's "op" mode): the outputs of every
  other matmul (the 1st, 3rd, ... of each forward of the block), of the attention kernels, of
  sequence-parallel reduce-scatters and of expert-parallel all-to-alls are kept; everything else (the other matmuls, norms,
  activations, rotary, residual adds) is recomputed. :class:`OpSavePolicy` is that rule;
  ``cost_models/op_recompute.py`` prices it.
- ``none``: nothing.

A block checkpointed per op can be recomputed only once per forward (torch frees each saved
output when the recompute reads it), so ``selective-op`` does not run under schedules that
split the backward (``planner.plan.recompute_problem``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from codegen.runtime.documents import Documents, SameDocuments
from codegen.runtime.installs import Installs
from codegen.runtime.torch_compat import checkpoint_generator, saved_attention_ops, saved_collective_ops
from planner.graph import MATMUL_OPS, keeps_matmul
from planner.plan import RECOMPUTE as POLICIES


class SelectiveAttention:
    """An attention implementation whose call is checkpointed (recomputed in backward), under
    the packed documents (``documents``) its forward saw."""

    def __init__(self, inner: Callable, documents: Optional[Documents] = None):
        self.inner, self.documents = inner, documents

    def __call__(self, q, k, v, *, causal: bool, scale: Optional[float] = None):
        if torch.is_grad_enabled():
            return checkpoint(self._call, q, k, v, causal, scale, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), SameDocuments(self.documents)))
        return self.inner(q, k, v, causal=causal, scale=scale)

    def _call(self, q, k, v, causal, scale):
        return self.inner(q, k, v, causal=causal, scale=scale)


@functools.cache
def _saved_ops() -> tuple[frozenset, frozenset]:
    """(matmul ops saved alternately, ops always saved) of :class:`OpSavePolicy`; looked up
    lazily (once) so the attention / loss custom ops are registered first; every forward of a
    checkpointed block builds a policy, so this stays off that path."""
    import importlib

    importlib.import_module("codegen.kernels.attention")  # registers torch.ops.autopar.*

    aten = torch.ops.aten
    always = {torch.ops.autopar.flash_attn_fwd.default, torch.ops.autopar.attn_merge.default, aten.max.default,
              *saved_attention_ops(), *saved_collective_ops()}
    # not aten.topk (a router's choice): transformers' Mixtral router divides its top-k values in
    # place, and torch refuses a kept output that is mutated
    return frozenset(getattr(aten, name).default for name in MATMUL_OPS), frozenset(always)


class OpSavePolicy:
    """The ``selective-op`` save rule for one forward of one block (a fresh instance per
    forward, so the matmul count restarts): keep the matmul outputs ``planner.graph.keeps_matmul``
    names (the 1st, 3rd, 5th ... ``MATMUL_OPS`` call) and every attention / reduce-scatter
    output, recompute the rest. Torch asks it only during the
    forward; the recompute replays the forward's decisions."""

    def __init__(self) -> None:
        self.matmuls, self.always = _saved_ops()
        self.count = 0

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in self.matmuls:
            self.count += 1
            return CheckpointPolicy.MUST_SAVE if keeps_matmul(self.count - 1) else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in self.always else CheckpointPolicy.PREFER_RECOMPUTE


class _Contexts:
    """The (forward, recompute) contexts of one checkpointed forward: nothing or the per-op
    save policy in forward; the hook switch, plus the policy's replay, in recompute."""

    def __init__(self, switch: "_HookSwitch", per_op: bool, documents: Optional[Documents] = None) -> None:
        self.switch, self.per_op, self.documents = switch, per_op, documents

    def __call__(self):
        recompute = _Both(self.switch, SameDocuments(self.documents))
        if not self.per_op:
            return contextlib.nullcontext(), recompute
        fwd, replay = create_selective_checkpoint_contexts(OpSavePolicy())
        return fwd, _Both(recompute, replay)


class _Both:
    """Two contexts entered in order and left in reverse (re-enterable: a fresh stack each time)."""

    def __init__(self, first, second) -> None:
        self.first, self.second, self.stack = first, second, None

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.first)
        self.stack.enter_context(self.second)

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


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


def checkpoint_block(block: nn.Module, per_op: bool = False, documents: Optional[Documents] = None,
                     installs: Optional[Installs] = None) -> None:
    """Recompute ``block`` in backward (hooks on that instance, removed when the build's
    ``installs`` close; once per build): all of it, or with ``per_op`` only what
    :class:`OpSavePolicy` does not keep; under the packed documents (``documents``) its forward saw."""
    if installs is not None and not installs.first_time(block, "checkpoint"):
        return
    switch = _HookSwitch()
    contexts = _Contexts(switch, per_op, documents)

    def pre(mod, args, kwargs):
        if switch.on:
            switch.gen = checkpoint_generator(mod, contexts, *args, **kwargs)
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


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy {policy!r}: use {', '.join(POLICIES)}")
    return policy
