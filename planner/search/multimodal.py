"""The plan's record of multimodal per-batch assignment (``batch.multimodal``): for a vision +
language model and an images-per-sample distribution (``autopar plan --images-per-sample
0:0.4,1:0.4,4:0.15,16:0.05``), the chosen layout's expected step with each batch's samples
assigned to the data-parallel ranks by the per-batch planner (``planner.batch_multimodal``)
against the fixed split, on ``SAMPLED`` batches drawn from the distribution (seeded), priced by
``cost_models.multimodal_pricing``; the spread of per-rank work before and after.

Each sample has the graph's text tokens (its ``seq_len`` less one image's patches) and its
images' patches; its images and text run whole on one rank, one sample per forward and
backward (codegen/runtime/multimodal.py: a rank's memory holds one sample, so the pool's
capacity does not bound its samples' sum). ``chosen`` when assignment saves at least
``MIN_GAIN`` of the step on a layout that can run it (``planner.batch_multimodal.layout_problem``:
data-parallel, replicated fp32 parameters): the emitted program then runs every step with
``codegen.runtime.multimodal.train_step`` over the record's rates; other layouts are recorded
with why.
"""
from __future__ import annotations

from typing import Any, Mapping

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate
from cost_models.multimodal_pricing import compare_multimodal, multimodal_work_cost, sample_image_counts
from planner.batch_multimodal import MultimodalBatchShape, layout_problem
from planner.errors import AutoparError
from planner.graph import ModelGraph

SAMPLED = 200       # batches drawn from the distribution
MIN_GAIN = 0.02     # the least share of the step assignment must save to be chosen
CAPACITY = 10 ** 12  # samples run one at a time (module docstring)


def parse_images(text: str) -> dict[int, float]:
    """``"0:0.4,1:0.4,16:0.2"`` -> {images: weight}; one line naming the problem otherwise."""
    out: dict[int, float] = {}
    try:
        for part in text.split(","):
            k, v = part.split(":")
            out[int(k)] = out.get(int(k), 0.0) + float(v)
    except ValueError:
        raise AutoparError(f"--images-per-sample {text!r}: write IMAGES:WEIGHT pairs, e.g. 0:0.4,1:0.4,16:0.2") from None
    if min(out) < 0 or min(out.values()) < 0 or sum(out.values()) <= 0:
        raise AutoparError(f"--images-per-sample {text!r}: image counts and weights must be >= 0, some weight > 0")
    return out


def image_patches(graph: ModelGraph) -> int:
    """Image tokens per image of a vision + language graph; one line when it is not one."""
    cfg = graph.config
    if not cfg.get("image_size") or not cfg.get("patch_size"):
        raise AutoparError(f"--images-per-sample needs a vision + language model (the zoo's mllm-*); {graph.name} "
                           "has no image size")
    return (int(cfg["image_size"]) // int(cfg["patch_size"])) ** 2


def multimodal_record(graph: ModelGraph, cluster: Cluster, est: Estimate, global_batch: int, images: Mapping[int, float],
                      profile=None) -> dict[str, Any]:
    """What ``batch.multimodal`` records (module docstring)."""
    patches = image_patches(graph)
    cfg = est.config
    out: dict[str, Any] = {"images": {str(k): v for k, v in sorted(images.items())}, "dp": cfg.dp,
                           "chosen": False, "capacity": CAPACITY}
    if why := layout_problem(cfg):
        return dict(out, why=why)
    if global_batch % cfg.dp:
        return dict(out, why=f"the global batch of {global_batch} samples does not split over dp {cfg.dp}")
    cost = multimodal_work_cost(graph, cluster, cfg, profile)
    text = max(graph.seq_len - patches, 1)
    shapes = [MultimodalBatchShape.of(c, text, patches) for c in sample_image_counts(images, global_batch, SAMPLED)]
    fixed = est.breakdown.get("dp_comm", 0.0) + est.breakdown.get("optimizer", 0.0)
    c = compare_multimodal(shapes, cfg.dp, cost, CAPACITY, fixed)
    s = c.summary()
    out.update(s, cost=dict(cost.__dict__), text_tokens=text, patches=patches)
    words = (f"{s['assigned_s']:.4g} s per step expected against the fixed split's {s['fixed_split_s']:.4g} s "
             f"({s['speedup']:.2f}x; busiest over mean rank {s['spread_before']:.2f} -> {s['spread_after']:.3f})")
    if s["speedup"] < 1 / (1 - MIN_GAIN):
        return dict(out, why=f"assigning samples saves under {MIN_GAIN:.0%}: {words}")
    return dict(out, chosen=True, why=f"the program assigns each batch's samples to the dp ranks: {words}")
