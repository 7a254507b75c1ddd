"""Multimodal batches: the per-batch planner's assignment of samples with varying images against
the fixed data-parallel split, predicted, and the planner's time per batch.

mllm-small (ViT-B/16-sized encoder, 196 patches per 224 px image, 12-layer 1024-wide decoder)
in bf16 on one and eight DGX H100 nodes (dp 8 and 64), global batches of ``SAMPLES`` samples:
images per sample drawn from ``IMAGES`` (mostly none or one, a tail of 4 and 16), text tokens
per sample log-normal (median ``TEXT_MEDIAN``, sigma ``TEXT_SIGMA``, ``TEXT_MIN``..``TEXT_MAX``).
Rates from the cost model (``cost_models.multimodal_pricing.multimodal_work_cost``: the
decoder's per token, the vision layers' per image); the shared per-step work (gradient
reduction, optimizer) from the plan's estimate is added to both sides. Columns: the mean step
(busiest rank) on the fixed split and with assignment, the speed-up, the ideal (every rank the
mean) and the gap to it, the spread (busiest over mean rank) before -> after, and the
planner's CPU time per batch (median / max over 50 batches; the machine may be shared).

``python -m benchmarks.batch_assign_mm [--batches 200]`` prints a table and writes
``benchmarks/results/batch_assign_mm.json``.
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np

from benchmarks.results import write_json

MODEL, SAMPLES = "mllm-small", 1024
IMAGES = {0: 0.35, 1: 0.4, 2: 0.1, 4: 0.1, 16: 0.05}
TEXT_MEDIAN, TEXT_SIGMA, TEXT_MIN, TEXT_MAX = 256, 1.0, 16, 2048
CLUSTERS = ("dgx-h100:1", "dgx-h100:8")
CAPACITY = 10 ** 9  # a rank's samples run one at a time: memory bounds one sample, not their sum


def sample_shapes(batches: int, seed: int, patches: int) -> list:
    from cost_models.multimodal_pricing import sample_image_counts
    from planner.batch_multimodal import MultimodalBatchShape

    rng = np.random.default_rng(seed + 1)
    counts = sample_image_counts(IMAGES, SAMPLES, batches, seed)
    return [MultimodalBatchShape.of(c, np.clip(rng.lognormal(np.log(TEXT_MEDIAN), TEXT_SIGMA, SAMPLES), TEXT_MIN,
                                               TEXT_MAX).astype(int).tolist(), patches) for c in counts]


def price_cluster(spec: str, batches: int, seed: int) -> dict:
    from cost_models.cluster import parse_cluster
    from cost_models.multimodal_pricing import compare_multimodal, multimodal_work_cost
    from planner.batch_multimodal import assign_samples
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config

    cluster = parse_cluster(spec)
    dp = cluster.world
    graph = load_graph(MODEL, batch=1)
    cfg = ParallelConfig(dp=dp, mbs=1, zero="fsdp", dtype="bf16", attention="flash")
    est, _ = evaluate_config(graph, cluster, cfg, dp)
    fixed_s = est.breakdown.get("dp_comm", 0.0) + est.breakdown.get("optimizer", 0.0)
    cost = multimodal_work_cost(graph, cluster, cfg)
    patches = (graph.config.get("image_size", 224) // graph.config.get("patch_size", 16)) ** 2
    shapes = sample_shapes(batches, seed, patches)
    c = compare_multimodal(shapes, dp, cost, CAPACITY, fixed_s)
    assign_samples(shapes[0], dp, cost, CAPACITY)  # warm-up (first calls into numpy)
    gc.collect()  # the cost model's garbage is not the planner's time
    times = []
    for shape in shapes[:50]:  # CPU time of this process (the machine may be shared)
        t = time.process_time()
        a = assign_samples(shape, dp, cost, CAPACITY)
        times.append(time.process_time() - t)
    deterministic = a == assign_samples(shapes[49 if len(shapes) >= 50 else -1], dp, cost, CAPACITY)
    images = [sum(s.image_counts) for s in shapes]
    return {"cluster": spec, "dp": dp, "patches": patches, "cost": cost.__dict__, "images_per_batch": float(np.mean(images)),
            "assign_ms_median": 1e3 * float(np.median(times)), "assign_ms_max": 1e3 * max(times),
            "deterministic": deterministic, **c.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_assign_mm.json"))
    args = ap.parse_args()
    rows = [price_cluster(spec, args.batches, args.seed) for spec in CLUSTERS]
    print(f"{MODEL}, {args.batches} batches of {SAMPLES} samples, images per sample {IMAGES}, text log-normal "
          f"(median {TEXT_MEDIAN}, sigma {TEXT_SIGMA}, {TEXT_MIN}..{TEXT_MAX} tokens)\n")
    print("| cluster | dp | images/batch | fixed split step | assigned step | speed-up | ideal step | gap to ideal "
          "| spread before -> after | assign ms (median / max) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cluster']} | {r['dp']} | {r['images_per_batch']:.0f} | {r['fixed_split_s']:.3f} s | "
              f"{r['assigned_s']:.3f} s | {r['speedup']:.2f}x | {r['ideal_s']:.3f} s | {r['ideal_gap']:.3f}x | "
              f"{r['spread_before']:.2f} -> {r['spread_after']:.3f} | {r['assign_ms_median']:.2f} / "
              f"{r['assign_ms_max']:.2f} |")
    write_json(args.out, {"model": MODEL, "samples": SAMPLES, "images": {str(k): v for k, v in IMAGES.items()},
                          "text": [TEXT_MEDIAN, TEXT_SIGMA, TEXT_MIN, TEXT_MAX], "batches": args.batches,
                          "seed": args.seed, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
