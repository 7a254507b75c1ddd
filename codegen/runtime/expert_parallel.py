"""Expert parallelism: each MoE layer's routed experts split over ``ep`` of the dp x cp ranks.

The ranks (``planner.plan.expert_groups``): the flattened dp x cp ranks of one (pp, tp)
position, cp inner, cut into groups of ``ep`` consecutive ones. :func:`expert_mesh` is
that as a device mesh ``[pp, edp, ep, tp]`` (ranks numbered as the ``[pp, dp, cp, tp]``
mesh numbers them): ``ep`` is a group exchanging tokens, ``edp`` the ``dp * cp / ep`` ranks
holding the same experts, over which data parallelism shards and reduces them.

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
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard

from planner.plan import ParallelConfig


def expert_mesh(cfg: ParallelConfig, device_type: str) -> DeviceMesh:
    """The ``[pp, edp, ep, tp]`` mesh (module docstring); every rank calls it."""
    return init_device_mesh(device_type, (cfg.pp, cfg.dp * cfg.cp // cfg.ep, cfg.ep, cfg.tp),
                            mesh_dim_names=("pp", "edp", "ep", "tp"))


def routed_modules(stage_mods: Sequence[nn.Module]) -> list[nn.Module]:
    """The routed-expert modules of these stage modules: those with the routed-experts
    protocol (``expert_weights``, ``run_local``, ``dispatcher``; the zoo's ``RoutedExperts``,
    a transformers model's experts through ``adapters/hf_experts.py``)."""
    return [m for sm in stage_mods for m in sm.modules()
            if hasattr(m, "dispatcher") and getattr(m, "expert_weights", None) and callable(getattr(m, "run_local", None))]


class TokenDispatch:
    """The all-to-all path of one routed layer over the ``ep`` group (module docstring)."""

    def __init__(self, group, ep: int, experts: int):
        self.group, self.ep, self.local = group, ep, experts // ep

    def __call__(self, routed: nn.Module, rows: torch.Tensor, split: list[int]) -> torch.Tensor:
        ep, local = self.ep, self.local
        counts = torch.tensor(split, dtype=torch.long, device=rows.device)
        got_counts = torch.empty_like(counts)
        dist.all_to_all_single(got_counts, counts, group=self.group)  # [source, local expert]
        got = got_counts.view(ep, local).cpu()
        send = counts.view(ep, local).sum(1).tolist()
        recv = got.sum(1).tolist()
        x = _exchange(rows, recv, send, self.group)
        order = _by_expert(got).to(rows.device)
        # an expert's gradient sums the rows of the whole EP group; data parallelism then averages
        # over the experts' dp x cp / ep ranks: 1 / ep here makes it the dense weights' average
        weights = [_GradScale.apply(w.to_local() if isinstance(w, DTensor) else w, 1.0 / ep)
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


def _by_expert(got: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows received as [source][local expert] blocks (sizes ``got``)
    into [local expert][source] blocks."""
    flat = got.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(got).t().reshape(-1)  # each block's first row, expert-major
    sizes = got.t().reshape(-1)
    first_out = torch.cumsum(sizes, 0) - sizes  # where each block lands in the new order
    n = int(sizes.sum())
    return torch.arange(n) + (starts - first_out).repeat_interleave(sizes)


def apply_ep(stage_mods: Sequence[nn.Module], mesh: DeviceMesh) -> list[nn.Module]:
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
        m.dispatcher = TokenDispatch(ep_mesh.get_group(), ep, experts)
    return mods
