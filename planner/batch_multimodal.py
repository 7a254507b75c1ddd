"""Multimodal batches on the per-batch planner (contract: numpy and the standard library, over
:mod:`planner.batch_assign`, the one balancer).

A multimodal global batch (the zoo's vision + language model, ``planner.zoo.mllm``) is ``B``
*samples*; sample ``b`` has ``image_counts[b] >= 0`` images and ``text[b]`` text tokens, and
its decoder sequence is its images' ``patches`` tokens each (in order) followed by its text:
``tokens[b] = image_counts[b] * patches + text[b]``. A sample is a piece that runs whole on one
data-parallel rank, with its images (:func:`planner.batch_assign.assign`'s ``images``): its
work is ``linear * L + attention * L^2 + vision * images`` (seconds, forward and backward;
``WorkCost.vision`` per image: vision encoder and projector), so the vision encoder's work is
balanced across the ranks together with the text.

``fixed`` (the "before"): dp rank ``d`` takes samples ``[d B / dp, (d + 1) B / dp)`` in batch
order, as a fixed data-parallel split does; the same cost terms (:func:`fixed_split_work`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from planner.batch_assign import AssignError, Assignment, Pool, WorkCost, assign
from planner.plan import ParallelConfig
from planner.precision import mixed_precision
from planner.sharding import SHARDED_PARAMS


@dataclass(frozen=True)
class MultimodalBatchShape:
    """What the balancer needs of a batch: images per sample, text tokens per sample (one
    count for all samples, or one per sample) and the image tokens per image (``patches``)."""
    image_counts: tuple[int, ...]
    text: tuple[int, ...]
    patches: int

    @staticmethod
    def of(image_counts: Sequence[int], text: int | Sequence[int], patches: int) -> "MultimodalBatchShape":
        counts = tuple(int(c) for c in image_counts)
        texts = (int(text),) * len(counts) if isinstance(text, (int, np.integer)) else tuple(int(t) for t in text)
        if not counts or len(texts) != len(counts):
            raise AssignError(f"{len(counts)} image counts and {len(texts)} text lengths: give one of each per "
                              "sample (at least one sample)")
        if min(counts) < 0 or min(texts) < 0 or patches < 1:
            raise AssignError("image counts and text tokens must be >= 0 and patches per image >= 1")
        return MultimodalBatchShape(counts, texts, int(patches))

    def tokens(self) -> np.ndarray:
        """[B] decoder tokens per sample: images x patches + text."""
        return np.asarray(self.image_counts, dtype=np.int64) * self.patches + np.asarray(self.text, dtype=np.int64)


def sample_work(shape: MultimodalBatchShape, cost: WorkCost) -> np.ndarray:
    """[B] seconds of each sample whole on one rank (module docstring)."""
    n = shape.tokens().astype(np.float64)
    return cost.linear * n + cost.attention * n * n + cost.vision * np.asarray(shape.image_counts, dtype=np.float64)


def assign_samples(shape: MultimodalBatchShape, dp: int, cost: WorkCost, capacity: int) -> Assignment:
    """The samples over ``dp`` ranks (each whole, with its images), balanced by the per-batch
    planner; ``capacity``: the decoder tokens one rank may hold. Deterministic."""
    tokens = shape.tokens()
    if tokens.min() < 1:
        raise AssignError("a sample has neither images nor text: drop empty samples from the batch")
    if tokens.max() > capacity:
        i = int(tokens.argmax())
        raise AssignError(f"sample {i} ({shape.image_counts[i]} images, {int(tokens[i])} decoder tokens) exceeds the "
                          f"{capacity} tokens a rank may hold: raise the memory per rank or cap the images per sample")
    return assign(shape.tokens().tolist(), Pool(dp, 1, capacity), cost, images=list(shape.image_counts))


def fixed_split(samples: int, dp: int) -> list[range]:
    """The fixed layout's samples per dp rank: consecutive blocks of ``samples / dp``."""
    if dp < 1 or samples % dp:
        raise AssignError(f"{samples} samples do not split evenly over dp = {dp}: use a global batch that dp divides")
    per = samples // dp
    return [range(d * per, (d + 1) * per) for d in range(dp)]


def fixed_split_work(shape: MultimodalBatchShape, dp: int, cost: WorkCost) -> tuple[float, ...]:
    """Per dp rank seconds of the batch on the fixed split (:func:`fixed_split`)."""
    work = sample_work(shape, cost)
    return tuple(float(work[r.start:r.stop].sum()) for r in fixed_split(len(shape.image_counts), dp))


@dataclass(frozen=True)
class Balance:
    """One batch's per-rank work (seconds) on the fixed split and after assignment, and the
    ideal (every rank the mean). ``spread``: busiest over mean (1.0: perfectly even)."""
    fixed: tuple[float, ...]
    assigned: tuple[float, ...]
    ideal: float

    @staticmethod
    def _spread(work: tuple[float, ...]) -> float:
        mean = sum(work) / len(work)
        return max(work) / mean if mean > 0 else 1.0

    @property
    def spread_fixed(self) -> float:
        return self._spread(self.fixed)

    @property
    def spread_assigned(self) -> float:
        return self._spread(self.assigned)

    @property
    def speedup(self) -> float:
        """Busiest rank's seconds, fixed over assigned."""
        return max(self.fixed) / max(self.assigned) if max(self.assigned) > 0 else 1.0


def balance(shape: MultimodalBatchShape, dp: int, cost: WorkCost, capacity: int) -> Balance:
    """The fixed split and the assignment of one batch, side by side."""
    a = assign_samples(shape, dp, cost, capacity)
    return Balance(fixed_split_work(shape, dp, cost), a.work, a.ideal)


def layout_problem(cfg: ParallelConfig) -> str | None:
    """Why a layout cannot run multimodal per-batch assignment, or None: its samples run whole
    on each data-parallel rank over a plain (unwrapped) module whose gradients the step sums
    by hand (codegen/runtime/multimodal.py), so tp, pp, cp and ep 1, no low-communication
    groups, replicated parameters (ddp or zero1) and fp32 (no wrapper casts)."""
    fix = "plan again with --fix tp=1,pp=1,cp=1,ep=1,zero=ddp on an fp32 cluster, or without --images-per-sample"
    if cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1 or cfg.ep > 1 or cfg.low_comm:
        return (f"multimodal assignment runs on data-parallel layouts only (tp, pp, cp, ep 1, no low-comm); the plan "
                f"has tp {cfg.tp}, pp {cfg.pp}, cp {cfg.cp}, ep {cfg.ep}: {fix}")
    if cfg.dp_shares:
        return "multimodal assignment balances samples over the dp ranks itself: plan without dp_shares"
    if cfg.zero in SHARDED_PARAMS or mixed_precision(cfg.dtype):
        return (f"multimodal assignment runs replicated fp32 parameters (ddp or zero1); the plan has {cfg.zero} "
                f"{cfg.dtype}: {fix}")
    return None
