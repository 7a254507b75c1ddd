"""Data parallelism per the plan's ``data_parallel.sharding`` (``ParallelConfig.zero``).

All variants reduce gradients over the data-parallel mesh, which is ``dp`` flattened
with ``cp`` when context parallel is on (cp ranks hold different tokens of the same
sequences, so their gradients are summed like data-parallel ones). Gradients are
AVERAGED over that mesh; the runtime's loss scaling accounts for it.

- ``fsdp``  -> FSDP2 ``fully_shard`` on every transformer block and on each stage module
  (root); ``reshard_after_forward=True`` without PP, ``False`` with PP (micro-batches
  re-use the gathered parameters). A block above ``planner.sharding.FSDP_UNIT_PARAMS``
  parameters is sharded module by module (its large linears / expert stacks first), so
  only one module at a time is gathered.
- ``zero2`` -> FSDP2 ``fully_shard`` with ``reshard_after_forward=False`` everywhere:
  gradients reduce-scattered and optimizer states sharded, parameters kept gathered from
  forward to backward (ZeRO-2-like traffic; between steps parameters are stored
  sharded, which is ZeRO-3's memory).
- ``ddp``   -> without a pipeline and on plain (not TP) parameters: torch's DDP reducer in
  its composable form (torch's composable ``replicate``, through ``torch_compat.ddp_replicate``) on each stage module,
  bucketed all-reduces started as gradients become ready. Otherwise composable
  ``replicate`` (FSDP2's replicate, through ``torch_compat.replicate``) on every
  transformer block and on each stage module, which works on DTensor (TP) parameters and
  under the pipeline schedules' manual backward, but copies every parameter in and out of
  its FSDP buffers each forward and backward (measured: a 32M-parameter Llama's fwd+bwd on
  2 gloo ranks, 0.94 s without a wrapper, 1.19 s under it, 1.04 s under DDP's reducer,
  all-reduce included). Without a pipeline, gradients accumulate unsynced over
  micro-batches and are all-reduced once (:func:`sync_gradients`).
- ``zero1`` -> ``replicate`` for the gradient all-reduce plus :class:`ShardedOptimizer`,
  autopar's own optimizer-state sharding: each dp rank owns a balanced subset of the
  parameters, steps only those with the wrapped optimizer, then broadcasts them.
  (torch's ``ZeroRedundancyOptimizer`` is not used: it assumes plain tensors.)

Across cluster groups (``planner.sharding.dp_replicas`` > 1) ``dp_mesh`` is 2-D
``(dp_rep, dp_shard)`` (codegen/runtime/mesh.py ``hybrid_dp_mesh``) and DP runs
hierarchically, as the cost model prices it: ``fully_shard`` over it is FSDP2's HSDP (states
sharded inside a group, gradients reduce-scattered inside it, then all-reduced across); DDP's
reducer gets :func:`hierarchical_hook` (each bucket reduce-scattered inside the group, its
shard all-reduced across, gathered back). ``replicate`` takes a 1-D mesh only: it runs flat
over the flattened mesh.

Which wrapper a plan gets is ``planner.sharding.dp_wrapper``. Under mixed precision every
wrapper is FSDP2's (DDP's reducer casts nothing), with the plan's ``MixedPrecisionPolicy``
(codegen/runtime/precision.py); one data-parallel rank is wrapped too, by ``fully_shard``
on that rank, which casts each unit for its forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from codegen.runtime import torch_compat
from codegen.runtime.precision import mp_policy
from planner.sharding import (DDP_BUCKET_BYTES, DP_WRAPPERS, FSDP_MODULE_SHARE, SHARDED_PARAMS, fsdp_per_module,
                              zero1_buckets)


def _replicate():
    return torch_compat.replicate()


def _ddp_replicate():
    return torch_compat.ddp_replicate()


def apply_dp(stage_mods: Sequence[nn.Module], dp_mesh: DeviceMesh, wrapper: str, blocks: Sequence[str], *,
             reshard: bool = False, dtype: str = "fp32") -> None:
    """Wrap each stage module (and its ``blocks``, the model's repeated units) for data
    parallelism over ``dp_mesh`` in place with ``wrapper`` (``planner.sharding.dp_wrapper``:
    fully_shard, ddp-reducer, replicate, or none); ``reshard``: fully_shard frees a unit's
    gathered parameters after its forward (``planner.sharding.reshard_after_forward``).
    ``dtype``: the plan's compute dtype, cast per unit under mixed precision
    (codegen/runtime/precision.py)."""
    if wrapper == "none":
        return
    if wrapper not in DP_WRAPPERS:
        raise ValueError(f"data-parallel wrapper {wrapper!r}: use {', '.join(DP_WRAPPERS)}")
    mp = mp_policy(dtype)
    blocks = set(blocks)
    hier = dp_mesh.ndim == 2
    flat = torch_compat.flatten_mesh(dp_mesh, "dp_flat") if hier and wrapper != "fully_shard" else dp_mesh
    if wrapper == "replicate":
        dp_mesh = flat
    for sm in stage_mods:
        own = [sm.get_submodule(u) for u in sm.units if u in blocks]
        if wrapper == "fully_shard":
            for block in own:
                for sub in module_units(block):  # a very large block: one unit per large module first
                    fully_shard(sub, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
            fully_shard(sm, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
        elif wrapper == "ddp-reducer":  # ddp, zero1 in fp32 through DDP's bucketed reducer
            # no buffer broadcast: buffers are deterministic or kept equal by the runtime (MoE bias)
            _ddp_replicate()(sm, process_group=flat.get_group(), gradient_as_bucket_view=True,
                             bucket_cap_mb=DDP_BUCKET_BYTES / 2**20, broadcast_buffers=False)
            if hier:
                sm.register_comm_hook(HierGroups(dp_mesh["dp_shard"].get_group(), dp_mesh["dp_rep"].get_group(),
                                                 dp_mesh.size()), hierarchical_hook)
        else:  # replicate: ddp, zero1 with TP parameters, a pipeline or mixed precision
            # per block, then the rest: each block's gradients are all-reduced as soon as its
            # backward ends (overlapping the earlier blocks' backward) and the fresh gradients
            # never all coexist with accumulated ones
            for block in own:
                _replicate()(block, mesh=dp_mesh, mp_policy=mp)
            _replicate()(sm, mesh=dp_mesh, mp_policy=mp)


@dataclass(frozen=True)
class HierGroups:
    """The state of :func:`hierarchical_hook`: the ranks of this rank's cluster group
    (``inner``), the ranks at its place in the other groups (``outer``), all of them (``world``)."""
    inner: object
    outer: object
    world: int


def hierarchical_hook(groups: HierGroups, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook reducing one gradient bucket hierarchically, averaged over
    ``groups.world`` ranks: reduce-scatter inside the cluster group, all-reduce of the shard
    across the groups (``1 / inner`` of the bucket on the WAN per rank), all-gather inside the
    group. Blocking (gloo's futures do not chain collectives): the bucket's reduction runs
    where the reducer calls the hook, during backward."""
    buf = bucket.buffer()
    buf.div_(groups.world)
    n = dist.get_world_size(groups.inner)
    pad = (-buf.numel()) % n
    flat = torch.cat([buf, buf.new_zeros(pad)]) if pad else buf
    shard = flat.new_empty(flat.numel() // n)
    torch_compat.reduce_scatter_into(shard, flat, group=groups.inner)
    dist.all_reduce(shard, group=groups.outer)
    torch_compat.all_gather_into(flat, shard, group=groups.inner)
    if pad:
        buf.copy_(flat[:buf.numel()])
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks a hook's return annotation against the type object; this module's annotations are strings
hierarchical_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def module_units(block: nn.Module) -> list[nn.Module]:
    """The modules of ``block`` that FSDP shards as units of their own (``planner.plan.
    fsdp_per_module``): those holding at least ``FSDP_MODULE_SHARE`` of its parameters
    directly, unless already sharded (routed experts under expert parallelism); none for a
    block at or under ``FSDP_UNIT_PARAMS``."""
    from torch.distributed.fsdp import FSDPModule

    total = sum(_local_numel(p) for p in block.parameters())
    if not fsdp_per_module(total):
        return []
    return [m for m in block.modules() if m is not block and not isinstance(m, FSDPModule)
            and sum(_local_numel(p) for p in m.parameters(recurse=False)) >= FSDP_MODULE_SHARE * total]


def shard_experts(routed: Sequence[nn.Module], edp_mesh: DeviceMesh, zero: str, pipelined: bool,
                  dtype: str = "fp32") -> None:
    """FSDP2 on each routed-expert module over the experts' data-parallel mesh (the ranks
    holding the same experts under expert parallelism), before the blocks are wrapped (their
    units then leave these parameters to it). Gradients are averaged over that mesh; the
    dispatcher has already divided them by ep (codegen/runtime/expert_parallel.py)."""
    if zero not in SHARDED_PARAMS:
        raise ValueError(f"expert parallelism shards the experts with FSDP: zero={zero} cannot; use fsdp or zero2")
    reshard = zero == "fsdp" and not pipelined
    for m in routed:
        fully_shard(m, mesh=edp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy(dtype))


def sync_gradients(module: nn.Module, zero: str, last: bool) -> None:
    """Gradient accumulation without a pipeline schedule: with ``ddp`` / ``zero1``
    (``replicate``) gradients are all-reduced once, after the LAST micro-batch's backward,
    and accumulate unreduced before it (no extra memory: they are unsharded anyway).
    ``zero2`` / ``fsdp`` keep reducing every micro-batch, so gradients stay sharded between
    micro-batches (the memory model assumes it). Pipeline schedules do this themselves."""
    from torch.distributed.fsdp import FSDPModule

    if zero not in SHARDED_PARAMS and isinstance(module, (FSDPModule, torch_compat.replicate_ddp_class())):
        module.set_requires_gradient_sync(last)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: the wrapped optimizer (``factory(params)``) steps only this rank's parameters.

    Parameters are assigned to the ranks of ``group`` greedily by size (largest first to
    the least loaded rank), so optimizer state is split about evenly. After the local
    step each owner broadcasts its parameters, packed into buckets
    (``planner.sharding.zero1_buckets``: one call per bucket, not per parameter). Gradients
    must already be all-reduced (``replicate``). ``state_dict`` holds the local shard's state only.
    """

    def __init__(self, params: Iterable[nn.Parameter], factory: Callable[[list], torch.optim.Optimizer], group):
        self.all_params = [p for p in params]
        self.group = group
        n = dist.get_world_size(group)
        me = dist.get_rank(group)
        load = [0] * n
        self.owner: list[int] = [0] * len(self.all_params)
        order = sorted(range(len(self.all_params)), key=lambda i: (-self.all_params[i].numel(), i))
        for i in order:
            r = min(range(n), key=lambda k: (load[k], k))
            self.owner[i] = r
            load[r] += self.all_params[i].numel()
        self.me = me
        self.buckets = self._buckets(n)
        mine = [p for p, o in zip(self.all_params, self.owner) if o == me]
        self.inner = factory(mine) if mine else None
        # torch.optim.Optimizer bookkeeping: one group over all parameters carrying the wrapped
        # optimizer's hyperparameters; step() hands them on, so a set_lr or a torch LR scheduler
        # on this optimizer reaches the one that steps
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"} if self.inner else {}
        super().__init__(self.all_params, hyper)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        for p in self.all_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        if self.inner is not None:
            hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
            for g in self.inner.param_groups:
                g.update(hyper)
            self.inner.step()
        for owner, idx in self.buckets:
            local = [torch_compat.local_tensor(self.all_params[i].data) for i in idx]
            if len(local) == 1:
                dist.broadcast(local[0], src=dist.get_global_rank(self.group, owner), group=self.group)
                continue
            if owner == self.me:
                flat = torch.cat([t.reshape(-1) for t in local])
            else:
                flat = torch.empty(sum(t.numel() for t in local), dtype=local[0].dtype, device=local[0].device)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, owner), group=self.group)
            if owner != self.me:
                for t, part in zip(local, flat.split([t.numel() for t in local])):
                    t.copy_(part.view_as(t))

    def _buckets(self, n: int) -> list[tuple[int, list[int]]]:
        """(owner rank in the group, parameter indices) per broadcast: each owner's parameters of
        one dtype and device, packed by ``zero1_buckets``."""
        lists: dict[tuple, list[tuple[int, int]]] = {}  # (owner, dtype, device) -> [(index, bytes)]
        for i, (p, o) in enumerate(zip(self.all_params, self.owner)):
            t = torch_compat.local_tensor(p.data)
            lists.setdefault((o, str(t.dtype), str(t.device)), []).append((i, t.nbytes))
        keys = sorted(lists)
        sizes = [[b for _, b in lists[k]] for k in keys]
        return [(k[0], [lists[k][j][0] for j in b]) for k, bs in zip(keys, zero1_buckets(sizes)) for b in bs]

    def state_dict(self):  # type: ignore[override]
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, sd) -> None:  # type: ignore[override]
        if self.inner is not None:
            self.inner.load_state_dict(sd)
