"""Pipeline parallelism: FQN-preserving stage modules and torch.distributed.pipelining schedules.

A :class:`StageModule` holds references to the full model's layer units (``embed``,
``layers.<i>``, ``norm``, ``head``, and for the MLLM ``vision.patch_embed``,
``vision.blocks.<i>``, ``vision.norm``, ``projector``) under their original names, so
``stage.named_parameters()`` / state dicts / TP layouts use the full model's fqns. It
runs its units in order. What flows between stages:

- first stage inputs: ``(input_ids,)``, or ``(input_ids, pixel_values)`` for the MLLM;
- between stages: ``(x,)`` hidden states, or ``(x, input_ids)`` while the MLLM's text
  embedding has not run yet (the image path runs first);
- last stage output: logits (the loss is the schedule's ``loss_fn``, see train.py); with
  the fused loss (``stage.head_loss`` set, see codegen/runtime/kernels.py) and the
  keyword ``labels`` given, the summed cross-entropy computed from the head's input
  without logits.

``positions`` (global indices under context parallelism) are not data but a function of
the cp rank and the sequence length, identical for every micro-batch; the runtime sets
``stage.positions`` before a step and every stage passes it to its units.

Schedules (``schedule_class``): gpipe -> ``ScheduleGPipe``, 1f1b -> ``Schedule1F1B``
(one stage per rank, stage r on pp rank r); interleaved-1f1b ->
``ScheduleInterleaved1F1B`` with ``vpp`` stages per rank, virtual stage j on pp rank
``j % pp`` (looped placement); zb-h1 -> ``ScheduleInterleavedZeroBubble`` (torch's ZB1P
with the backward split into input and weight parts) with ONE stage per rank, stage r on
pp rank r (with vpp > 1 it would be looped placement as interleaved).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved-1f1b", "zb-h1")  # PipelineScheduleMulti subclasses: take a list of stages


def unit_order(model: nn.Module) -> list[str]:
    """The layer units of a zoo model in execution order (the names a plan's stages list)."""
    units: list[str] = []
    if hasattr(model, "vision"):
        units.append("vision.patch_embed")
        units += [f"vision.blocks.{i}" for i in range(len(model.vision.blocks))]
        units.append("vision.norm")
        units.append("projector")
    units.append("embed")
    units += [f"layers.{i}" for i in range(len(model.layers))]
    units += ["norm", "head"]
    return units


def stage_ranks(n_virtual: int, pp: int) -> list[int]:
    """pp rank of each virtual stage: looped placement ``j % pp`` (all schedules used here)."""
    return [j % pp for j in range(n_virtual)]


def _attach(root: nn.Module, fqn: str, mod: nn.Module) -> None:
    parts = fqn.split(".")
    parent = root
    for p in parts[:-1]:
        if p not in parent._modules:
            parent.add_module(p, nn.Module())  # plain container, so "layers.3" keeps its fqn
        parent = getattr(parent, p)
    parent.add_module(parts[-1], mod)


def is_block(fqn: str) -> bool:
    """Transformer blocks: ``layers.<i>`` and ``vision.blocks.<i>`` (units FSDP / recompute wrap)."""
    head, _, idx = fqn.rpartition(".")
    return idx.isdigit() and head in ("layers", "vision.blocks")


class StageModule(nn.Module):
    """Runs a contiguous run of ``model``'s units, keeping their fqns (see module docstring).

    ``units``: unit fqns in execution order; ``all_units``: the model's full unit order
    (to know what comes before/after). ``recompute``: this stage's policy (read by
    :mod:`codegen.runtime.recompute`).
    """

    def __init__(self, model: nn.Module, units: Sequence[str], all_units: Sequence[str],
                 recompute: str = "none"):
        super().__init__()
        self.units = list(units)
        self.recompute = recompute
        self.positions: Optional[torch.Tensor] = None
        self.head_loss = None  # fn(head, x, labels) -> summed CE (fused loss), set by the runtime
        self.is_mllm = hasattr(model, "vision")
        self.patch_size = model.vision.patch_size if self.is_mllm else None
        self.vocab = model.embed.tok.num_embeddings
        first, last = all_units.index(self.units[0]), all_units.index(self.units[-1])
        if all_units[first:last + 1] != self.units:
            raise ValueError(f"stage units {self.units} are not a contiguous run of the model's units")
        self.is_first = first == 0
        self.is_last = last == len(all_units) - 1
        embed_at = all_units.index("embed")
        self.needs_ids_in = self.is_mllm and first <= embed_at and not self.is_first
        self.carries_ids_out = self.is_mllm and last < embed_at
        for fqn in self.units:
            _attach(self, fqn, model.get_submodule(fqn))

    def forward(self, *args: torch.Tensor, labels: Optional[torch.Tensor] = None):
        from codegen.runtime import recompute as _rc
        if self.is_first:
            input_ids = args[0]
            pixel_values = args[1] if self.is_mllm else None
            x = None
        elif self.needs_ids_in:
            x, input_ids = args
            # torch's stage metadata inference runs forward on uninitialised tensors; keep its
            # garbage ids in range (a no-op on real token ids).
            input_ids = input_ids.clamp(0, self.vocab - 1)
            pixel_values = None
        else:
            (x,) = args
            input_ids = pixel_values = None
        pos = self.positions
        with _rc.selective_scope(self.recompute == "selective"):
            for fqn in self.units:
                mod = self.get_submodule(fqn)
                if fqn == "vision.patch_embed":
                    from planner.zoo.mllm import patchify
                    x = mod(patchify(pixel_values, self.patch_size))
                elif fqn == "vision":
                    x = mod(pixel_values)
                elif fqn == "embed":
                    text = mod(input_ids, pos)
                    x = text if x is None else torch.cat((x.to(text.dtype), text), dim=1)
                elif fqn.startswith("layers."):
                    x = mod(x, pos)
                elif fqn == "head" and self.head_loss is not None and labels is not None:
                    x = self.head_loss(mod, x, labels)
                else:  # vision.blocks.<i>, vision.norm, projector, norm, head (logits)
                    x = mod(x)
        if self.carries_ids_out:
            return x, input_ids
        return x


def build_stages(model: nn.Module, stage_units: Sequence[Sequence[str]], stage_recompute: Sequence[str],
                 pp_rank: int, pp: int, schedule: str) -> tuple[list[int], list[StageModule]]:
    """(virtual stage indices, StageModules) this pp rank owns, in virtual-stage order."""
    all_units = unit_order(model)
    flat = [u for s in stage_units for u in s]
    if flat != all_units:
        raise ValueError(f"stages must cover the model's units in order; got {flat}, expected {all_units}")
    ranks = stage_ranks(len(stage_units), pp)
    idx = [j for j, r in enumerate(ranks) if r == pp_rank]
    mods = [StageModule(model, stage_units[j], all_units, stage_recompute[j] if stage_recompute else "none")
            for j in idx]
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
