"""Per-batch assignment predicted: Llama-3 8B on 2 and 8 DGX H100, batches of long-tail documents.

Each global batch is rows of ``ROW`` = 131,072 tokens (the longest document), ``TOKENS_PER_GPU``
tokens per GPU in all, filled with documents whose lengths are log-normal (median ``MEDIAN``,
sigma ``SIGMA``, cut to 32 .. 131,072 tokens) packed in order, the last one cut at the batch's
end (each row end cuts a document into pieces, as packed batches do). TP 1, FSDP, full
recompute, bf16, flash attention: every GPU is a worker of the ``dp x cp`` pool.

- **fixed layouts**: every ``dp x cp`` with ``dp`` dividing the rows, each row over a ring of
  ``cp`` GPUs (zigzag) or, where ``cp`` divides the 8 kv heads, over Ulysses' all-to-alls,
  priced per batch by ``planner.batch_layout.static_work``; the best is the one with the
  least mean step (the 2-D hybrid is not among them);
- **per-batch**: ``planner.batch_assign.assign`` on each batch (groups up to the whole pool,
  memory per GPU from the fixed cp-8 layout's estimate);
- **ideal**: every GPU the same work, no communication: a floor for any assignment, so the
  best fixed layout's step over the ideal's (``bound``) is the most any per-batch planner
  could gain on these batches.

Rates from the cost model (``cost_models.batch_pricing.work_cost``); the data-parallel
reduction and optimizer (``fixed_s``) from the cp-8 layout's estimate, the same for all.
``python -m benchmarks.batch_assign [--batches 1000]`` prints a table, the planner's time per
batch, and writes ``benchmarks/results/batch_assign.json``.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.results import write_json

MODEL, ROW, TOKENS_PER_GPU = "llama3-8b", 131072, 16384
MEDIAN, SIGMA, SHORTEST = 2048, 2.0, 32
CLUSTERS = ("dgx-h100:2", "dgx-h100:8")


def sample_batches(n: int, tokens: int, seed: int = 0, median: int = MEDIAN, sigma: float = SIGMA) -> list[list[int]]:
    """``n`` batches of ``tokens`` tokens each: log-normal documents (module docstring) cut at
    every multiple of ``ROW`` (the rows' ends)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pieces, used = [], 0
        while used < tokens:
            doc = int(min(max(rng.lognormal(np.log(median), sigma), SHORTEST), ROW, tokens - used))
            while doc > 0:  # cut at the row end
                take = min(doc, ROW - used % ROW)
                pieces.append(take)
                used += take
                doc -= take
        out.append(pieces)
    return out


def price_cluster(spec: str, batches: int, seed: int) -> dict:
    from cost_models.batch_pricing import Layout, capacity_tokens, compare, work_cost
    from cost_models.cluster import parse_cluster
    from planner.batch_assign import Pool, assign
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config

    cluster = parse_cluster(spec)
    gpus = cluster.world
    rows = gpus * TOKENS_PER_GPU // ROW
    graph = load_graph(MODEL, batch=1, seq_len=ROW)
    base = dict(pp=1, tp=1, zero="fsdp", recompute="full", dtype="bf16", attention="flash", mbs=1)
    ref = ParallelConfig(dp=gpus // 8, cp=8, **base)
    est, problems = evaluate_config(graph, cluster, ref, rows)
    worst = max(est.memory, key=lambda m: m.total)
    capacity = capacity_tokens(TOKENS_PER_GPU, worst.activations, worst.total - worst.activations, est.capacity)
    fixed_s = est.breakdown.get("dp_comm", 0.0) + est.breakdown.get("optimizer", 0.0)
    cost = work_cost(graph, cluster, ParallelConfig(dp=1, cp=gpus, **base))
    pool = Pool(gpus, gpus, capacity)
    dps = [dp for dp in range(1, rows + 1) if rows % dp == 0]
    kv = next(l.attention.kv_heads for l in graph.layers if l.attention is not None)
    layouts = ([Layout(dp, gpus // dp, ROW, "ring") for dp in dps]  # Ulysses where its groups divide the kv heads
               + [Layout(dp, gpus // dp, ROW, "ulysses") for dp in dps if kv % (gpus // dp) == 0])
    sampled = sample_batches(batches, gpus * TOKENS_PER_GPU, seed)
    c = compare(sampled, pool, cost, layouts, fixed_s)
    times = []
    for lengths in sampled[:50]:  # CPU time of this process (the machine may be shared)
        t = time.process_time()
        assign(lengths, pool, cost)
        times.append(time.process_time() - t)
    docs = [len(b) for b in sampled]
    return {"cluster": spec, "gpus": gpus, "rows": rows, "capacity_tokens": capacity, "problems": problems,
            "cost": cost.__dict__, "pieces_per_batch": float(np.mean(docs)),
            "assign_ms_median": 1e3 * float(np.median(times)), "assign_ms_max": 1e3 * max(times), **c.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_assign.json"))
    args = ap.parse_args()
    rows = [price_cluster(spec, args.batches, args.seed) for spec in CLUSTERS]
    print(f"{MODEL}, {args.batches} batches of {TOKENS_PER_GPU} tokens per GPU, rows of {ROW}, log-normal "
          f"documents (median {MEDIAN}, sigma {SIGMA}, {SHORTEST}..{ROW} tokens)\n")
    print("| cluster | GPUs | pieces/batch | best fixed layout | its step | per-batch step | speed-up | ideal step "
          "| gap to ideal | bound (fixed / ideal) | spread before -> after | assign ms (median / max) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cluster']} | {r['gpus']} | {r['pieces_per_batch']:.1f} | {r['best_static']} | "
              f"{r['static_s'][r['best_static']]:.3f} s | {r['per_batch_s']:.3f} s | {r['speedup']:.2f}x | "
              f"{r['ideal_s']:.3f} s | {r['ideal_gap']:.3f}x | {r['bound']:.2f}x | {r['spread_before']:.2f} -> {r['spread_after']:.2f} | "
              f"{r['assign_ms_median']:.2f} / {r['assign_ms_max']:.2f} |")
    for r in rows:
        print(f"{r['cluster']}: fixed layouts " + ", ".join(f"{k} {v:.3f} s" for k, v in r["static_s"].items()))
    write_json(args.out, {"model": MODEL, "row": ROW, "tokens_per_gpu": TOKENS_PER_GPU, "median": MEDIAN,
                          "sigma": SIGMA, "batches": args.batches, "seed": args.seed, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
