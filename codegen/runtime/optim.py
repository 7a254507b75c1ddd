"""Optimizers, learning-rate schedule and gradient clipping for the parallel runtime.

- :class:`Optimizers`: one optimizer per stage module on this rank (as torchtitan), stepped
  together; :func:`build_optimizer` makes them (ZeRO-1 wraps each in
  :class:`~codegen.runtime.data_parallel.ShardedOptimizer`).
- :func:`warmup_cosine`: the learning rate of a step (linear warmup, then cosine decay to a
  floor). A pure function of the step, so a resumed run gets the same rates as an
  uninterrupted one without any scheduler state in the checkpoint.
- :func:`clip_grad_norm_`: clip by the global L2 norm of ALL the model's gradients - over
  DTensor shards (FSDP, TP), over the pipeline ranks, each tied parameter counted once -
  so it clips exactly as ``torch.nn.utils.clip_grad_norm_`` on the single-process model.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from codegen.runtime.data_parallel import ShardedOptimizer
from codegen.runtime.torch_compat import foreach_mul_, foreach_norm

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


MAX_GRAD_NORM = 1.0  # the emitted program's --clip default: global L2 norm gradients are clipped to


def adamw(params: list, **kwargs) -> torch.optim.AdamW:
    """torch's AdamW, fused (one kernel over every parameter: on CPU four times the default
    per-parameter loop's speed) when the parameters are all plain tensors or all DTensors; the
    fused kernel refuses a mix, which keeps the default loop."""
    kinds = {isinstance(p, DTensor) for p in params}
    return torch.optim.AdamW(params, fused=len(kinds) == 1, **kwargs)


def default_optimizer(params: list) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3, weight_decay=0.1), the default optimizer factory."""
    return adamw(params, lr=1e-3, weight_decay=0.1)


class Optimizers:
    """One optimizer per stage module on this rank, stepped together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate (per step, in the optimizer's units) of every parameter group
        (ZeRO-1's :class:`ShardedOptimizer` hands it on to the optimizer it wraps)."""
        for o in self.optimizers:
            for g in o.param_groups:
                g["lr"] = lr


def build_optimizer(stage_mods: Sequence[nn.Module], factory: OptimizerFactory, zero: str,
                    dp_size: int, dp_group=None) -> Optimizers:
    """``factory(params)`` per stage module (each parameter once); with ``zero == "zero1"`` over more than one dp
    rank, each wrapped so only this rank's share of the parameters is stepped (ZeRO-1)."""
    opts: list[torch.optim.Optimizer] = []
    seen: set[int] = set()  # a parameter shared by two of this rank's stages (a V schedule's tied ends) steps once
    for sm in stage_mods:
        params = [p for p in sm.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        if zero == "zero1" and dp_size > 1:
            opts.append(ShardedOptimizer(params, factory, dp_group))
        else:
            opts.append(factory(params))
    return Optimizers(opts)


def warmup_cosine(step: int, total_steps: int, lr: float, min_lr: float, warmup_steps: int) -> float:
    """Learning rate of 0-based ``step``: ``lr * (step + 1) / warmup_steps`` during the warmup,
    then cosine decay from ``lr`` to ``min_lr`` at the last of ``total_steps`` steps."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: Optional[float], pp_group=None) -> float:
    """Clip the gradients of ``params`` (this rank's, each parameter of the model once per pp
    rank) in place so their global L2 norm is at most ``max_norm``; returns the norm before
    clipping (every rank gets the same value). Collective over ``pp_group`` (the norms of the
    pipeline ranks' parameters add in square) and over DTensor meshes. ``max_norm`` None or
    <= 0: nothing is clipped, the norm is still returned.

    Works on the local shards with plain foreach ops: a DTensor gradient's squares are summed
    over the mesh dimensions it is sharded on (one all-reduce per set of them, not a DTensor
    dispatch per parameter) and counted once over those it is replicated on."""
    params = [p for p in params if p.grad is not None]
    _reduce_partial_grads(params)
    grads = [p.grad for p in params]
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for groups, local in _local_grad_groups(grads, pp_group).items():
        part = torch.stack([n.float() ** 2 for n in foreach_norm(local, 2.0)]).sum()
        for pg in groups:
            dist.all_reduce(part, group=pg)
        square = square + part
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(square, group=pp_group)
    norm = square.sqrt()
    if max_norm is not None and max_norm > 0 and float(norm) + 1e-6 > max_norm:  # else torch's coefficient is 1
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return float(norm)


def _reduce_partial_grads(params: Sequence[nn.Parameter]) -> None:
    """Reduce, in place of ``p.grad``, the gradients still holding partial sums (a norm weight or a
    row-parallel bias under sequence parallel): their ``Partial`` dimensions made ``Replicate``,
    once - the norm and the optimizer then read the same reduced gradient instead of reducing it
    twice. Gradients of one mesh, placements and dtype are reduced together: their local tensors
    flattened into one buffer, one all-reduce per ``Partial`` mesh dimension (gpt-small tp2 with
    sequence parallel has 50 such gradients: one DTensor redistribute each took 17-27 ms a step on
    2 CPU ranks, the flat buffer 3 ms). A ``Partial`` other than a sum or a mean, or a
    non-contiguous local tensor, is redistributed on its own."""
    together: dict[tuple, list[tuple[nn.Parameter, torch.Tensor]]] = {}  # (mesh, placements, dtype) -> (p, local)
    for p in params:
        g = p.grad
        if not (isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements)):
            continue
        local = g.to_local()
        if local.is_contiguous() and all(pl.reduce_op in ("sum", "avg") for pl in g.placements
                                         if isinstance(pl, Partial)):
            together.setdefault((g.device_mesh, tuple(g.placements), local.dtype), []).append((p, local))
        else:
            p.grad = g.redistribute(g.device_mesh, _replicated(g.placements))
    for (mesh, placements, _), members in together.items():
        flat = torch.cat([local.reshape(-1) for _, local in members])
        for dim, pl in enumerate(placements):
            if isinstance(pl, Partial):
                group = mesh.get_group(dim)
                dist.all_reduce(flat, group=group)
                if pl.reduce_op == "avg":
                    flat /= dist.get_world_size(group)
        out = _replicated(placements)
        for (p, local), part in zip(members, torch.split(flat, [local.numel() for _, local in members])):
            p.grad = DTensor.from_local(part.view(local.shape), mesh, out, shape=p.grad.shape,
                                        stride=p.grad.stride())


def _replicated(placements) -> list:
    """``placements`` with every ``Partial`` made ``Replicate``."""
    return [Replicate() if isinstance(pl, Partial) else pl for pl in placements]


def _local_grad_groups(grads: Sequence[torch.Tensor], pp_group=None) -> dict:
    """Gradients (none of them ``Partial``) by the process groups their squared norms are summed
    over: a tuple of the groups of the mesh dimensions a DTensor is sharded on (``()`` for plain
    tensors and fully replicated ones; ``pp_group`` left out: the caller sums every rank's squares
    over it, a vocabulary pass's rows included) -> their local tensors."""
    out: dict = {}
    for g in grads:
        if not isinstance(g, DTensor):
            out.setdefault((), []).append(g)
            continue
        mesh = g.device_mesh
        # every placement but Replicate splits the elements (Shard, and _StridedShard, which is not a Shard)
        dims = tuple(grp for d, pl in enumerate(g.placements) if not pl.is_replicate()
                     and (grp := mesh.get_group(d)) is not pp_group)
        out.setdefault(dims, []).append(g.to_local())
    return out
