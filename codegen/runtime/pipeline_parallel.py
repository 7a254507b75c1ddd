"""Pipeline parallelism: the model adapter's stage modules and torch.distributed.pipelining schedules.

Each virtual stage is the model adapter's :class:`~codegen.runtime.adapters.StageModule`
for a contiguous run of the model's units (``codegen/runtime/adapters``: what flows
between stages, and how the last stage returns its loss, is the adapter's calling
protocol). ``positions`` (global indices under context parallelism) are not data but a
function of the cp rank and the sequence length, identical for every micro-batch; the
runtime sets ``stage.positions`` before a step.

Schedules (``schedule_class``): gpipe -> ``ScheduleGPipe``, 1f1b -> ``Schedule1F1B``
(one stage per rank, stage r on pp rank r); interleaved-1f1b ->
``ScheduleInterleaved1F1B`` with ``vpp`` stages per rank, virtual stage j on pp rank
``j % pp`` (looped placement); zb-h1 -> ``ScheduleInterleavedZeroBubble`` (torch's ZB1P
with the backward split into input and weight parts) with ONE stage per rank, stage r on
pp rank r (with vpp > 1 it would be looped placement as interleaved).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved-1f1b", "zb-h1")  # PipelineScheduleMulti subclasses: take a list of stages


def stage_ranks(n_virtual: int, pp: int) -> list[int]:
    """pp rank of each virtual stage: looped placement ``j % pp`` (all schedules used here)."""
    return [j % pp for j in range(n_virtual)]


def build_stages(adapter, stage_units: Sequence[Sequence[str]], stage_recompute: Sequence[str],
                 pp_rank: int, pp: int) -> tuple[list[int], list[nn.Module]]:
    """(virtual stage indices, stage modules) this pp rank owns, in virtual-stage order."""
    flat = [u for s in stage_units for u in s]
    if flat != adapter.units:
        raise ValueError(f"stages must cover the model's units in order; got {flat}, expected {adapter.units}")
    starts = adapter.stage_starts()
    for s in stage_units[1:]:
        if not starts[adapter.units.index(s[0])]:
            raise ValueError(f"a pipeline stage cannot start at {s[0]} for this model "
                             f"({adapter.kind} adapter); plan again with `autopar plan`")
    idx = [j for j, r in enumerate(stage_ranks(len(stage_units), pp)) if r == pp_rank]
    mods = [adapter.build_stage(stage_units[j], stage_recompute[j] if stage_recompute else "none") for j in idx]
    return idx, mods


def build_schedule(stage_mods: Sequence[nn.Module], stage_idx: Sequence[int], n_virtual: int, pp_group,
                   device: torch.device, schedule: str, n_microbatches: int, loss_fn,
                   scale_grads: bool = False):
    """PipelineStages for this rank and the torch schedule object for ``schedule``."""
    stages = [PipelineStage(m, j, n_virtual, device, group=pp_group) for m, j in zip(stage_mods, stage_idx)]
    cls = SCHEDULE_CLASSES[schedule]
    if schedule in MULTI_STAGE:
        sched = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    else:
        if len(stages) != 1:
            raise ValueError(f"schedule {schedule} runs one stage per pp rank, got {len(stages)}")
        sched = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return stages, sched


class TiedWeights:
    """Parameters tied across pipeline stages (a tied embedding and head, pp > 1).

    The first and the last stage each hold a copy (``pairs`` from the adapter); after a
    step's backward :meth:`sync_grads` sums the copies' gradients over the two pp ranks at
    this rank's (dp, cp, tp) coordinate, so both copies take the same optimizer step (the
    gradient of the one tied parameter), as Megatron's embedding group does. Collective
    at construction (every rank creates every pair's process group)."""

    def __init__(self, pairs: Sequence[tuple[str, str]], stage_mods: Sequence[nn.Module], mesh):
        names = {n for pair in pairs for n in pair}
        self.params = [p for sm in stage_mods for n, p in sm.named_parameters() if n in names]
        seconds = {b for _, b in pairs}
        # the later stages' copies: a global gradient norm counts each tied parameter once
        self.copies = [p for sm in stage_mods for n, p in sm.named_parameters() if n in seconds]
        grid = mesh.mesh  # [pp, dp, cp, tp] global ranks
        me = dist.get_rank()
        self.group = None
        for coord in torch.cartesian_prod(*(torch.arange(n) for n in grid.shape[1:])).reshape(-1, grid.dim() - 1):
            ranks = sorted({int(grid[(0, *coord.tolist())]), int(grid[(-1, *coord.tolist())])})
            group = dist.new_group(ranks)
            if me in ranks:
                self.group = group

    def sync_grads(self) -> None:
        for p in self.params:
            if p.grad is not None:
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=self.group)
