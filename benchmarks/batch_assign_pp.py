"""Per-batch assignment under a pipeline, predicted: what padding every worker's row costs.

Llama-1B on one DGX H100 (8 GPUs) as pp2 x dp4 (1f1b, mbs 1, global batch 8: two
micro-batches of 4 rows of 16,384 tokens), documents drawn log-normal (median 1,024, sigma
1.5, 32 .. 16,384 tokens, 400 of them, seed 0) and packed as ``autopar plan --seq-lens``
packs them (``planner.search.per_batch.sampled_batches``). Under a pipeline every worker's
micro-batch row is padded to one length (``planner.batch_assign.row_tokens``: the stages'
buffers keep the first step's shape); each row length is priced with per-batch assignment
(``cost_models.batch_pricing.compare``: pad tokens cost linear work, a step is the pipeline's
over its micro-batches) beside the fixed dp4 layout and the ideal balance, with the row the
planner picks (``planner.search.per_batch``: the least expected step among ``ROW_SLACK``).
``python -m benchmarks.batch_assign_pp`` prints a table and writes
``benchmarks/results/batch_assign_pp.json``.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from benchmarks.results import write_json

MODEL, CLUSTER, SEQ, GLOBAL_BATCH = "llama-1b", "dgx-h100:1", 16384, 8
ROWS = (16384, 17408, 18432, 20480, 24576, 32768)


def main() -> None:
    from cost_models.batch_pricing import Layout, compare, work_cost
    from cost_models.cluster import parse_cluster
    from planner.batch_assign import AssignError, Pool
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.per_batch import sampled_batches
    from planner.search.seq_lens import as_histogram, with_documents

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_assign_pp.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = [int(min(max(x, 32), SEQ)) for x in rng.lognormal(np.log(1024), 1.5, 400)]
    hist, source = as_histogram(lengths)
    graph = with_documents(load_graph(MODEL, batch=1, seq_len=SEQ), hist, source)
    cfg = ParallelConfig(dp=4, pp=2, mbs=1, schedule="1f1b", zero="fsdp")
    cost = work_cost(graph, parse_cluster(CLUSTER), cfg)
    batches = sampled_batches(graph, GLOBAL_BATCH)
    rows = []
    print(f"{MODEL} on {CLUSTER}, {cfg.label()}, {len(batches)} sampled batches of {GLOBAL_BATCH} rows of {SEQ}\n")
    print("| padded row (tokens) | padding over the mean | per-batch step | fixed dp4 step | ideal step |\n"
          "|---|---|---|---|---|")
    for row in ROWS:
        try:
            c = compare(batches, Pool(4, 4, row), cost, [Layout(4, 1, SEQ)], 0.0, cfg.pp, 2)
        except AssignError as e:
            print(f"| {row:,} | {row / SEQ - 1:.1%} | does not fit: {e} | | |")
            rows.append({"row": row, "error": str(e)})
            continue
        r = {"row": row, "per_batch_s": c.mean(c.per_batch), "fixed_s": c.mean(c.static["dp4 cp1"]),
             "ideal_s": c.mean(c.ideal)}
        rows.append(r)
        print(f"| {row:,} | {row / SEQ - 1:.1%} | {r['per_batch_s']:.4f} s | {r['fixed_s']:.4f} s | {r['ideal_s']:.4f} s |")
    write_json(args.out, {"model": MODEL, "cluster": CLUSTER, "config": cfg.label(), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
