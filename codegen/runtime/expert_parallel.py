"""Expert parallelism: each MoE layer's routed experts split over ``ep`` of the ranks holding
distinct tokens, and MoE layers under tensor parallelism.

The ranks (``planner.feasibility.expert_groups``): the flattened dp x cp x tp ranks of one pipeline
stage, tp inner, cut into groups of ``ep`` consecutive ones. :func:`expert_mesh` is that as
a device mesh ``[pp, edp, ep]`` (ranks numbered as the ``[pp, dp, cp, tp]`` mesh numbers
them): ``ep`` is a group exchanging tokens, ``edp`` the ``dp * cp * tp / ep`` ranks holding
the same experts, over which data parallelism shards and reduces them.

Under TP (with sequence parallel, which the planner requires for MoE models) a MoE layer
is not tensor-parallel: each tp rank runs the router, the shared experts and its routed
rows on its own sequence shard (:func:`run_on_sequence_shard`: the layer's input, a
sequence-parallel norm's DTensor, becomes the local shard). Its parameters other than the
EP-split expert stacks are held whole by every tp rank, each computing the gradient of its
own tokens: :func:`sum_over_tp` adds them up once per step (``tp_replicated_params``).

:func:`apply_ep` keeps, on every rank, its ``experts / ep`` experts of every routed layer
(the stacked weights become DTensors sharded on dim 0 over ``ep``: checkpoints and
gradient checks see the whole stack) and installs a :class:`TokenDispatch` on each. Per
forward, as torchtitan's and Megatron-Core's all-to-all dispatchers do it:

1. the tokens per expert of this rank (the router's ``split``) are exchanged with the group
   (an all-to-all of ``experts`` counts): each rank learns how many rows each source sends
   to each of its local experts;
2. **dispatch**: one variable-split all-to-all sends each row to its expert's rank (the
   rows are already sorted by expert, so each destination's rows are contiguous);
3. the received rows, ordered (source, local expert), are permuted to (local expert,
   source) so each local expert's rows are contiguous, run through the module's own
   ``run_local`` with this rank's stacks, and permuted back;
4. **combine**: the reverse all-to-all returns each row's output to its token's rank.

Both all-to-alls are torch's functional ``all_to_all_single_autograd`` (the backward is the
reverse exchange of the gradients; as a functional op its output is what per-op
recompute keeps). Experts without rows still run (0 rows)
and get zero gradients.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from codegen.runtime.torch_compat import funcol
from torch.distributed.tensor import DTensor, Shard

from planner.plan import ParallelConfig


def expert_mesh(cfg: ParallelConfig, device_type: str) -> DeviceMesh:
    """The ``[pp, edp, ep]`` mesh (module docstring); every rank calls it."""
    return init_device_mesh(device_type, (cfg.pp, *cfg.expert_mesh),
                            mesh_dim_names=("pp", "edp", "ep"))


def routed_modules(stage_mods: Sequence[nn.Module]) -> list[nn.Module]:
    """The routed-expert modules of these stage modules: those with the routed-experts
    protocol (``expert_weights``, ``run_local``, ``dispatcher``; the zoo's ``RoutedExperts``,
    a transformers model's experts through ``adapters/hf_experts.py``)."""
    return [m for sm in stage_mods for m in sm.modules()
            if hasattr(m, "dispatcher") and getattr(m, "expert_weights", None) and callable(getattr(m, "run_local", None))]


class TokenDispatch:
    """The all-to-all path of one routed layer over the ``ep`` group (module docstring)."""

    def __init__(self, group, ep: int, experts: int, tp: int = 1):
        self.group, self.ep, self.local, self.tp = group, ep, experts // ep, tp

    def __call__(self, routed: nn.Module, rows: torch.Tensor, split: list[int]) -> torch.Tensor:
        ep, local = self.ep, self.local
        counts = torch.tensor(split, dtype=torch.long, device=rows.device)
        got_counts = torch.empty_like(counts)
        dist.all_to_all_single(got_counts, counts, group=self.group)  # [source, local expert]
        got = got_counts.view(ep, local).cpu()
        send = counts.view(ep, local).sum(1).tolist()
        recv = got.sum(1).tolist()
        x = _exchange(rows, recv, send, self.group)
        order = by_expert(got).to(rows.device)
        # an expert's gradient sums the rows of the whole EP group; data parallelism then averages
        # over the experts' dp x cp x tp / ep ranks: tp / ep here makes it the dense weights' (a
        # sum over the tp ranks' sequence shards, an average over dp x cp)
        weights = [_GradScale.apply(w.to_local() if isinstance(w, DTensor) else w, self.tp / ep)
                   for w in (getattr(routed, n) for n in routed.expert_weights)]
        y = routed.run_local(x[order], got.sum(0).tolist(), weights)
        y = torch.empty_like(y).index_copy(0, order, y)  # back to (source, local expert) order
        return _exchange(y, send, recv, self.group)


class _GradScale(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """Variable-split all-to-all of the rows of ``x`` (``send[r]`` rows to rank r of ``group``,
    ``recv[r]`` from it), differentiable (the backward is the reverse exchange)."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group)
    return funcol.wait_tensor(out)


def by_expert(got: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows received as [source][local expert] blocks (sizes ``got``)
    into [local expert][source] blocks."""
    flat = got.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(got).t().reshape(-1)  # each block's first row, expert-major
    sizes = got.t().reshape(-1)
    first_out = torch.cumsum(sizes, 0) - sizes  # where each block lands in the new order
    n = int(sizes.sum())
    return torch.arange(n) + (starts - first_out).repeat_interleave(sizes)


def apply_ep(stage_mods: Sequence[nn.Module], mesh: DeviceMesh, tp: int = 1) -> list[nn.Module]:
    """Keep this rank's experts of every routed layer of ``stage_mods`` (the whole stacks,
    equal on every rank, are cut here) and route tokens through :class:`TokenDispatch` over
    ``mesh["ep"]``; returns the routed modules (for data parallelism over ``mesh["edp"]``)."""
    ep_mesh = mesh["ep"]
    ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
    mods = routed_modules(stage_mods)
    for m in mods:
        experts = getattr(m, m.expert_weights[0]).shape[0]
        if experts % ep:
            raise ValueError(f"ep={ep} does not divide the {experts} experts of a routed layer")
        for name in m.expert_weights:
            full = getattr(m, name)
            mine = full.detach().chunk(ep, dim=0)[me].clone()
            setattr(m, name, nn.Parameter(DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False)))
        m.dispatcher = TokenDispatch(ep_mesh.get_group(), ep, experts, tp)
    return mods


def moe_parts(stage_mods: Sequence[nn.Module]) -> list[nn.Module]:
    """The MoE layers of these stage modules: the modules holding a routed-experts module
    (:func:`routed_modules`) as a direct child (the zoo's ``MoEFeedForward``, transformers'
    sparse MoE blocks)."""
    routed = {id(m) for m in routed_modules(stage_mods)}
    return [m for sm in stage_mods for m in sm.modules() if any(id(c) in routed for c in m.children())]


def run_on_sequence_shard(parts: Sequence[nn.Module]) -> None:
    """Under sequence parallel: each MoE layer of ``parts`` takes its hidden-state input (first
    positional argument or ``hidden_states``) as this rank's local sequence shard (a
    sequence-parallel norm hands it over as a DTensor; its gradient flows back as one)."""
    def local(x):
        return x.to_local() if isinstance(x, DTensor) else x

    def hook(mod, args, kwargs):
        if args:
            return (local(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=local(kwargs["hidden_states"]))
        return args, kwargs

    for m in parts:
        m.register_forward_pre_hook(hook, with_kwargs=True)


def tp_replicated_params(parts: Sequence[nn.Module], ep: int) -> list[nn.Parameter]:
    """The parameters of the MoE layers ``parts`` that every tp rank holds whole: all of them
    but, under expert parallelism (``ep`` > 1), the routed-expert stacks it splits."""
    out = []
    for part in parts:
        split = {id(getattr(r, n)) for r in routed_modules([part]) for n in r.expert_weights} if ep > 1 else set()
        out += [p for p in part.parameters() if id(p) not in split]
    return out


@torch.no_grad()
def sum_over_tp(params: Sequence[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over the tp ``group`` in place (one all-reduce of their
    flattened local shards), after the backward and the data-parallel reduction, which
    commutes with it: each tp rank's gradient covers only its own sequence shard."""
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
