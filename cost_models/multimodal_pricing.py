"""Multimodal batches priced: the per-batch planner's assignment of samples with varying images
against the fixed data-parallel split, on batches sampled from an images-per-sample distribution.

**Rates** (:func:`multimodal_work_cost`): a vision + language model's layers are of two kinds.
The decoder's (``embed`` onward) give ``linear`` and ``attention`` per decoder token as for
text (``cost_models.batch_pricing.work_cost`` on the graph without the vision layers; its
``seq_len`` tokens per row); the vision layers' (``vision.*`` and ``projector``: one image of
``num_patches`` tokens per row of the captured graph) give ``vision``, seconds per image,
forward and backward. The pool is the ``dp`` data-parallel ranks (a sample runs whole on one).

**Comparison** (:func:`compare_multimodal`): per sampled batch, the busiest rank's seconds
after ``planner.batch_multimodal.assign_samples`` and on the fixed split, and the ideal (the
mean), each plus the per-step work both share (``fixed_s``: gradient reduction, optimizer); the
spread (busiest over mean) before and after.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from cost_models.batch_pricing import stage_seconds, work_cost
from cost_models.cluster import Cluster
from planner.batch_assign import WorkCost
from planner.batch_multimodal import MultimodalBatchShape, balance
from planner.graph import ModelGraph
from planner.plan import ParallelConfig

VISION_UNITS = ("vision", "projector")  # the top-level units of the image path (planner.zoo.mllm)


def is_vision_layer(name: str) -> bool:
    """Whether a graph layer belongs to the image path (runs once per image)."""
    return name.split(".")[0] in VISION_UNITS


def multimodal_work_cost(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, profile=None) -> WorkCost:
    """The rates of one data-parallel rank of ``cfg`` for a vision + language ``graph`` (module
    docstring); ``cfg``'s dp ranks are the pool (cp, tp and pp 1)."""
    vision = [l for l in graph.layers if is_vision_layer(l.name)]
    if not vision:
        raise ValueError(f"{graph.name} has no vision layers ({', '.join(VISION_UNITS)}): price it as text")
    text = replace(graph, layers=[l for l in graph.layers if not is_vision_layer(l.name)])
    base = work_cost(text, cluster, cfg, profile, method="ring")
    worker = replace(cfg, dp=cfg.dp * cfg.cp, cp=1, ulysses=1, mbs=1)
    per_image = stage_seconds(replace(graph, layers=vision, documents=None), cluster, worker, profile)
    return WorkCost(linear=base.linear, attention=base.attention, vision=per_image)


def sample_image_counts(distribution: Mapping[int, float], samples: int, batches: int,
                        seed: int = 0) -> list[list[int]]:
    """``batches`` lists of ``samples`` image counts drawn from ``distribution`` (images ->
    probability, normalised here), seeded."""
    if not distribution or min(distribution) < 0 or min(distribution.values()) < 0:
        raise ValueError("an images-per-sample distribution maps counts >= 0 to probabilities >= 0")
    counts = np.array(sorted(distribution))
    p = np.array([distribution[c] for c in counts], dtype=np.float64)
    rng = np.random.default_rng(seed)
    return [rng.choice(counts, size=samples, p=p / p.sum()).tolist() for _ in range(batches)]


@dataclass(frozen=True)
class MultimodalComparison:
    """Seconds per step over the sampled batches: assigned, fixed split and ideal (each with
    ``fixed_s``); the spread of per-rank work before (fixed) and after, per batch."""
    assigned: tuple[float, ...]
    fixed: tuple[float, ...]
    ideal: tuple[float, ...]
    spread_before: tuple[float, ...]
    spread_after: tuple[float, ...]
    fixed_s: float

    @property
    def speedup(self) -> float:
        """Mean fixed-split step over the mean step with assignment."""
        return float(np.mean(self.fixed) / np.mean(self.assigned))

    @property
    def ideal_gap(self) -> float:
        """Mean step with assignment over the ideal's (1.0: no gap)."""
        return float(np.mean(self.assigned) / np.mean(self.ideal))

    def summary(self) -> dict:
        m = lambda xs: float(np.mean(xs))  # noqa: E731
        return {"assigned_s": m(self.assigned), "fixed_split_s": m(self.fixed), "ideal_s": m(self.ideal),
                "speedup": self.speedup, "ideal_gap": self.ideal_gap, "spread_before": m(self.spread_before),
                "spread_after": m(self.spread_after), "fixed_s": self.fixed_s, "batches": len(self.assigned)}


def compare_multimodal(batches: Sequence[MultimodalBatchShape], dp: int, cost: WorkCost, capacity: int,
                       fixed_s: float = 0.0) -> MultimodalComparison:
    """Price every batch with assignment and on the fixed split (module docstring)."""
    if not batches:
        raise ValueError("compare_multimodal needs at least one batch")
    got = [balance(b, dp, cost, capacity) for b in batches]
    return MultimodalComparison(tuple(max(b.assigned) + fixed_s for b in got), tuple(max(b.fixed) + fixed_s for b in got),
                                tuple(b.ideal + fixed_s for b in got), tuple(b.spread_fixed for b in got),
                                tuple(b.spread_assigned for b in got), fixed_s)
