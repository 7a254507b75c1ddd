"""Multimodal batches in the runtime: a vision + language model's samples, with any number of
images each, assigned to the data-parallel ranks by the per-batch planner
(``planner.batch_multimodal``, over ``planner.batch_assign.assign``: the rule the cost model
prices too), or split in fixed blocks.

**Batch format** (:class:`MultimodalBatch`, a dict with these keys):

- ``input_ids`` [B, S_text] int: each sample's text (pad a short text at its end, with its
  ``labels`` -100 there);
- ``labels`` [B, S_text] int: the text's targets (-100: ignored);
- ``pixel_values`` [N, C, H, W] float: every image of the batch, sample 0's first, then sample
  1's, and so on (``N`` may be 0 when no sample has an image);
- ``image_counts`` [B] int: images per sample, each >= 0, summing to ``N``.

Sample ``b``'s decoder sequence is its images' tokens (``num_patches`` each, in order) followed
by its text (``planner.zoo.mllm``, the model's ``image_counts`` path). The one-image-per-sample
batch (``pixel_values`` [B, C, H, W], no ``image_counts``) keeps its own path
(``ParallelModel.step``); this module is for batches that say ``image_counts``.

**Step** (:func:`train_step`): every rank computes the same assignment from the same global
batch (deterministic); rank ``d`` runs its samples one forward and backward each (no padding:
its work is the sum of its samples', as the planner counts it), each sample's loss its summed
text token loss over ``N_tokens``, the non-ignored targets of the whole global batch; the
gradients are then summed over the data-parallel group. So the loss and gradients are those
of the global mean token loss of the batch, on any assignment: a rank's share only changes
where a sample runs. A rank with no samples contributes zero gradients.

**In an emitted program** (codegen/program_template.py): when the plan's ``batch.multimodal``
is chosen, ``MULTIMODAL`` (:func:`multimodal_of`) holds its images-per-sample weights and rates;
the build refuses a layout ``planner.batch_multimodal.layout_problem`` names, wraps nothing for
data parallelism (this step sums the gradients, so ranks may run different numbers of
samples) and every step runs :func:`train_step`; clipping, the optimizer, checkpoints and
the log (with each rank's predicted work, :meth:`SampleBalancer.work`) are the program's own.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from planner.batch_assign import WorkCost
from planner.batch_multimodal import (Balance, MultimodalBatchShape, assign_samples, fixed_split, fixed_split_work,
                                      layout_problem)
from planner.plan import ParallelConfig

IGNORE_INDEX = -100
KEYS = ("input_ids", "labels", "pixel_values", "image_counts")


@dataclass(frozen=True)
class MultimodalBatch:
    """One global multimodal batch (module docstring); :meth:`of` checks a batch dict."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor
    image_counts: torch.Tensor

    @staticmethod
    def of(batch: dict[str, torch.Tensor]) -> "MultimodalBatch":
        missing = [k for k in KEYS if k not in batch]
        if missing:
            raise ValueError(f"a multimodal batch needs {', '.join(missing)}: see codegen/runtime/multimodal.py")
        b = MultimodalBatch(*(batch[k] for k in KEYS))
        counts = b.image_counts.reshape(-1)
        if b.input_ids.dim() != 2 or b.labels.shape != b.input_ids.shape:
            raise ValueError(f"input_ids {tuple(b.input_ids.shape)} and labels {tuple(b.labels.shape)}: both [B, S_text]")
        if counts.numel() != b.input_ids.shape[0] or (counts.numel() and int(counts.min()) < 0):
            raise ValueError(f"image_counts has {counts.numel()} entries for {b.input_ids.shape[0]} samples: one "
                             "count >= 0 per sample")
        if int(counts.sum()) != b.pixel_values.shape[0]:
            raise ValueError(f"image_counts sum to {int(counts.sum())} but pixel_values holds "
                             f"{b.pixel_values.shape[0]} images: list every sample's images, in sample order")
        return b

    @property
    def samples(self) -> int:
        return self.input_ids.shape[0]

    def shape(self, patches: int) -> MultimodalBatchShape:
        """What the planner balances: images and text tokens per sample."""
        return MultimodalBatchShape.of(self.image_counts.reshape(-1).tolist(), self.input_ids.shape[1], patches)

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i`` as a batch of one (its images with it)."""
        counts = self.image_counts.reshape(-1)
        first = int(counts[:i].sum())
        n = int(counts[i])
        return {"input_ids": self.input_ids[i:i + 1], "labels": self.labels[i:i + 1],
                "pixel_values": self.pixel_values[first:first + n], "image_counts": counts[i:i + 1]}

    def target_count(self) -> int:
        """Non-ignored targets of the whole batch (the global mean's denominator)."""
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class MultimodalPlan:
    """What an emitted program runs of the plan's ``batch.multimodal`` (when chosen): the
    images-per-sample distribution its synthetic batches draw from ({images: weight}), the
    balancer's rates (``WorkCost``, seconds), the decoder tokens a rank may be given and the
    image tokens per image."""
    images: dict[int, float]
    cost: WorkCost
    capacity: int
    patches: int

    def balancer(self, cfg: ParallelConfig, dp_rank: int) -> "SampleBalancer":
        """This rank's :class:`SampleBalancer`; one line (ValueError) naming the fix where the
        layout cannot run assignment (``planner.batch_multimodal.layout_problem``)."""
        if why := layout_problem(cfg):
            raise ValueError(f"{cfg.label()}: {why}")
        return SampleBalancer(cfg.dp, dp_rank, self.cost, self.capacity, self.patches)


def multimodal_of(literal: Optional[Mapping[str, Any]]) -> Optional[MultimodalPlan]:
    """The program's ``MULTIMODAL`` literal (``codegen.emit.multimodal_literal``) as a
    :class:`MultimodalPlan`, None for a plan without it."""
    if literal is None:
        return None
    names = {f.name for f in fields(WorkCost)}
    cost = WorkCost(**{k: v for k, v in literal["cost"].items() if k in names})
    return MultimodalPlan({int(k): float(v) for k, v in literal["images"].items()}, cost, int(literal["capacity"]),
                          int(literal["patches"]))


class SampleBalancer:
    """Which samples this data-parallel rank runs: the per-batch planner's assignment
    (``assign=True``) or the fixed split (consecutive blocks); ``capacity``: the decoder tokens
    a rank may be given in all (its samples run one at a time, so memory bounds the largest
    sample, not this sum); ``last``: the last batch's :class:`planner.batch_multimodal.Balance`
    (per-rank work before and after)."""

    def __init__(self, dp: int, rank: int, cost: WorkCost, capacity: int, patches: int, assign: bool = True):
        if not 0 <= rank < dp:
            raise ValueError(f"rank {rank} outside the {dp} data-parallel ranks")
        self.dp, self.rank, self.cost, self.capacity, self.patches, self.assign = dp, rank, cost, capacity, patches, assign
        self.last: Optional[Balance] = None

    def work(self) -> dict[str, list[float]]:
        """The last batch's predicted seconds per rank: ``fixed`` (the fixed split) and
        ``assigned`` (what this balancer gave them; the same as ``fixed`` when it does not assign)."""
        if self.last is None:
            raise ValueError("no batch balanced yet: call samples() first")
        return {"fixed": list(self.last.fixed), "assigned": list(self.last.assigned)}

    def samples(self, batch: MultimodalBatch) -> list[int]:
        """This rank's samples of ``batch``, in batch order (the same rule on every rank)."""
        shape = batch.shape(self.patches)
        fixed = fixed_split_work(shape, self.dp, self.cost)
        if not self.assign:
            self.last = Balance(fixed, fixed, sum(fixed) / self.dp)
            return list(fixed_split(batch.samples, self.dp)[self.rank])
        a = assign_samples(shape, self.dp, self.cost, self.capacity)
        self.last = Balance(fixed, a.work, a.ideal)
        return [p.piece for p in a.placements if p.first == self.rank]


def sum_gradients(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Sum every parameter's gradient over ``group`` (one flat buffer; a parameter this rank
    left without a gradient contributes zeros and gets the sum)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def train_step(model: nn.Module, batch: dict[str, torch.Tensor], balancer: SampleBalancer,
               group: Optional[dist.ProcessGroup] = None) -> float:
    """Forward and backward of this rank's samples of the global ``batch`` (module docstring),
    gradients summed over ``group`` (the data-parallel ranks); returns the global mean token
    loss (collective). The optimizer step is the caller's."""
    mb = MultimodalBatch.of(batch)
    total = mb.target_count()
    if total == 0:
        raise ValueError("the batch has no text targets (every label is -100): nothing to train on")
    device = next(model.parameters()).device  # the batch may be built on the CPU (nccl reduces device tensors)
    local = torch.zeros((), dtype=torch.float64, device=device)
    for i in balancer.samples(mb):
        one = {k: v.to(device) for k, v in mb.sample(i).items()}
        n = int((one["labels"] != IGNORE_INDEX).sum())
        if n == 0:  # no targets: the sample adds nothing to the loss
            continue
        loss = model(one["input_ids"], one["pixel_values"], labels=one["labels"], image_counts=one["image_counts"])
        scaled = loss * (n / total)  # its summed token loss over the global batch's targets
        scaled.backward()
        local += scaled.detach().to(torch.float64)
    sum_gradients(model, group)
    dist.all_reduce(local, group=group)
    return float(local)
