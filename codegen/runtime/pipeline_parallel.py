"""Pipeline parallelism: the model adapter's stage modules and torch.distributed.pipelining schedules.

Each virtual stage is the model adapter's :class:`~codegen.runtime.adapters.StageModule`
for a contiguous run of the model's units (``codegen/runtime/adapters``: what flows
between stages, and how the last stage returns its loss, is the adapter's calling
protocol). Per-step state (``positions``, packed documents' ``doc_start``) goes to every
stage as keyword arguments of ``schedule.step``, split per micro-batch by the schedule.

Schedules: every schedule is the schedule IR (``planner/schedule_ir.py``: a built-in made from
the plan's name, pp, micro-batches and vpp, or the plan's own IR - a user's file or a generated
one), run through torch's schedule runtime (``torch_compat.schedule_runtime``), which adds the
sends and receives: the order the simulator priced is the order that runs. Virtual stage j
lives on the IR's ``stage_rank[j]`` (looped ``j % pp``, or V-shaped for dualpipev).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage

from codegen.runtime import vocab_passes as vpass
from codegen.runtime.torch_compat import local_tensor, own_outputs, schedule_runtime
from planner.schedule_ir import Schedule
from planner.vocab_passes import parse_unit, pass_count, stage_layers


def build_stages(adapter, stage_units: Sequence[Sequence[str]], stage_recompute: Sequence[str],
                 pp_rank: int, stage_rank: Sequence[int]) -> tuple[list[int], list[nn.Module]]:
    """(virtual stage indices, stage modules) this pp rank owns (virtual stage j lives on
    ``stage_rank[j]``), in virtual-stage order."""
    flat = [u for s in stage_units for u in s]
    p = pass_count(flat)
    if flat != (want := stage_layers(adapter.units, p > 0, p)):
        raise ValueError(f"stages must cover the model's units in order; got {flat}, expected {want}")
    starts = adapter.stage_starts()
    for s in stage_units[1:]:
        if parse_unit(s[0]) is not None:
            if len(s) != 1:
                raise ValueError(f"vocabulary pass {s[0]} must be a stage of its own, got {s}")
            continue
        if not starts[adapter.units.index(s[0])]:
            raise ValueError(f"a pipeline stage cannot start at {s[0]} for this model "
                             f"({adapter.kind} adapter); plan again with `autopar plan`")
    if len(stage_rank) != len(stage_units):
        raise ValueError(f"the schedule places {len(stage_rank)} stages, the plan has {len(stage_units)}; "
                         "give the schedule one stage per plan stage")
    idx = [j for j, r in enumerate(stage_rank) if r == pp_rank]
    mods = [vpass.build_pass(adapter, stage_units[j][0], vp) if (vp := parse_unit(stage_units[j][0]))
            else adapter.build_stage(stage_units[j], stage_recompute[j] if stage_recompute else "none") for j in idx]
    return idx, mods


def build_schedule(stage_mods: Sequence[nn.Module], stage_idx: Sequence[int], n_virtual: int, pp_group,
                   device: torch.device, schedule: Schedule, loss_fn, scale_grads: bool = False):
    """PipelineStages for this rank and torch's schedule runtime running the IR ``schedule``."""
    if schedule.n_stages != n_virtual:
        raise ValueError(f"schedule {schedule.name!r} has {schedule.n_stages} stages, the pipeline {n_virtual}")
    for m in stage_mods:  # (torch's split backward detaches stage outputs in place; a view refuses)
        m.register_forward_hook(own_outputs)
    stages = [PipelineStage(m, j, n_virtual, device, group=pp_group) for m, j in zip(stage_mods, stage_idx)]
    order = {r: [str(st) for st in steps] for r, steps in enumerate(schedule.ranks)}
    return stages, schedule_runtime(stages, schedule.n_microbatches, loss_fn, scale_grads, order)


class TiedWeights:
    """Parameters tied across pipeline ranks (a tied embedding and head, pp > 1).

    ``pairs`` (fqns, agreed by every rank before tensor parallelism splits the ends into
    separate DTensors) and ``holders`` (the pp ranks holding each fqn) come from
    ``codegen.runtime.recipe.tie_weights``. Each end is found by name when used, so it is
    the parameter tensor / data parallelism made of it. After a step's backward
    :meth:`sync_grads` sums the LOCAL gradient shards of the ends over the pp ranks holding
    them at this rank's (dp, cp, tp) coordinate - one process group per coordinate - so
    every copy takes the same optimizer step (the gradient of the one tied parameter), as
    Megatron's embedding group does. Both ends must be sharded alike (a vocabulary-parallel
    embedding and head: ``Shard(0)`` over the vocabulary), checked at the first sync.
    Collective at construction (every rank creates every coordinate's process group)."""

    def __init__(self, pairs: Sequence[tuple[str, str]], holders: dict[str, int], stage_mods: Sequence[nn.Module],
                 mesh):
        self.pairs = [tuple(p) for p in pairs]
        self.stage_mods = list(stage_mods)
        ends = {tuple(sorted({holders[a], holders[b]})) for a, b in self.pairs}
        if len(ends) != 1 or len(next(iter(ends))) != 2:
            raise NotImplementedError(f"tied parameters {self.pairs} held by pp ranks {sorted(ends)}: the runtime "
                                      "sums tied gradients between one pair of pp ranks")
        pp_ranks = list(next(iter(ends)))
        grid = mesh.mesh  # [pp, dp, cp, tp] global ranks
        me = dist.get_rank()
        self.group = None
        for coord in torch.cartesian_prod(*(torch.arange(n) for n in grid.shape[1:])).reshape(-1, grid.dim() - 1):
            ranks = [int(grid[(r, *coord.tolist())]) for r in pp_ranks]
            group = dist.new_group(ranks)
            if me in ranks:
                self.group = group
        self.checked = False

    def _named(self, names: set[str]) -> list[nn.Parameter]:
        return [p for sm in self.stage_mods for n, p in sm.named_parameters() if n in names]

    @property
    def params(self) -> list[nn.Parameter]:
        """This rank's end of each tied pair, in the order of the pairs (empty off the group)."""
        found = {n: p for sm in self.stage_mods for n, p in sm.named_parameters()}
        return [found[a] if a in found else found[b] for a, b in self.pairs if a in found or b in found]

    @property
    def copies(self) -> list[nn.Parameter]:
        """This rank's later ends (the copies): a global gradient norm counts each tied
        parameter once, so it leaves these out."""
        return self._named({b for _, b in self.pairs})

    def _check_alike(self) -> None:
        """Every end of this group has the same local shape and placements (collective over
        the group): else the summed shards would not be the same slice of the parameter."""
        mine = [(tuple(p.shape), tuple(local_tensor(p).shape), str(getattr(p, "placements", None))) for p in self.params]
        seen: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(seen, mine, group=self.group)
        if len({m for ranks in seen for m in ranks}) > 1:
            raise ValueError(f"tied parameters {self.pairs} are sharded differently on the pipeline ranks "
                             f"holding them: {seen}; untie them or give both ends the same TP style")
        self.checked = True

    def sync_grads(self) -> None:
        """Sum the ends' local gradient shards over the group (collective over it; nothing on a
        pp rank holding no end, whose group is None - with pp > 2 the middle ranks)."""
        if self.group is None:
            return
        if not self.checked:
            self._check_alike()
        for p in self.params:
            if p.grad is None:  # the other end has one: take part in the sum all the same
                p.grad = torch.zeros_like(p)
            elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                # e.g. a vocabulary-parallel embedding's gradient comes back Replicate: take this
                # rank's shard of it (no communication), the slice the other end holds
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            dist.all_reduce(local_tensor(p.grad), group=self.group)
