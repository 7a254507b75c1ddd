"""Planning speed over the whole space, each case in a fresh process (no cached state).

Times: import (torch, autopar, and torch's dynamo package, which torch otherwise imports lazily
during the first model build), capture (build on meta + fake-tensor trace), search (enumerate, bound, estimate, ILP on the best few)
and the whole `plan` call; counts: configurations considered, pruned by bounds, estimated
with the closed form, fully solved (ILP split + simulated schedule).

    python -m benchmarks.plan_speed [--out benchmarks/results/plan_speed.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.results import write_json

CASES = [
    ("llama3-8b", "dgx-h100:8", 512, 8192),      # 64 H100, 8 per node
    ("llama3-70b", "dgx-h100:64", 1024, 8192),   # 512 H100
    ("llama3-405b", "dgx-h100:2048", 2048, 8192),  # 16,384 H100
    ("gpt3-175b", "dgx-a100-80g:128", 1536, 2048),
    ("mllm-small", "h200-8x:1", 64, None),
    ("mixtral-8x22b", "dgx-h100:16", 1024, 4096),       # 128 H100: 8 experts, top-2
    ("deepseek-v3-like", "dgx-h100:256", 4096, 4096),   # 2,048 H100: 256 fine-grained experts, top-8
]

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from cost_models.cluster import parse_cluster
from planner.frontend.load import load_graph
from planner.search.planning import plan_model
from codegen.runtime.torch_compat import preload_dynamo
preload_dynamo()  # torch loads its dynamo package lazily on the first nn.Module built under a device context (~0.9 s)
t1 = time.perf_counter()
model, cluster, gb, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), (int(sys.argv[4]) if sys.argv[4] != "None" else None)
g = load_graph(model, batch=1, seq_len=seq)
t2 = time.perf_counter()
c = parse_cluster(cluster)
plan, res = plan_model(g, c, gb, spec=model, cluster_spec=cluster)
t3 = time.perf_counter()
b = res.best
print(json.dumps({"model": model, "cluster": cluster, "devices": c.world, "global_batch": gb, "seq_len": g.seq_len,
                  "import_s": t1 - t0, "capture_s": t2 - t1, "search_s": t3 - t2, "plan_s": t3 - t1,
                  "considered": res.considered, "pruned": res.pruned, "estimated": res.estimated,
                  "fully_solved": res.fully_solved, "best": b.config.label(), "step_s": b.step_s, "mfu": b.mfu,
                  "tflops_per_device": b.tflops_per_device,
                  "partition": res.partition_info.get(b.config.to_str(), {})}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/plan_speed.json")
    args = ap.parse_args()
    rows = []
    for model, cluster, gb, seq in CASES:
        r = subprocess.run([sys.executable, "-c", _CHILD, model, cluster, str(gb), str(seq)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{model} on {cluster}: failed: {r.stderr.strip().splitlines()[-1]}")
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{'model':<17}{'devices':>8}{'import s':>9}{'capture s':>10}{'search s':>9}{'plan s':>8}{'considered':>11}"
          f"{'pruned':>8}{'estimated':>10}{'solved':>7}  best (step s, MFU, model TFLOP/s per device)")
    for r in rows:
        print(f"{r['model']:<17}{r['devices']:>8}{r['import_s']:>9.2f}{r['capture_s']:>10.2f}{r['search_s']:>9.2f}"
              f"{r['plan_s']:>8.2f}{r['considered']:>11}{r['pruned']:>8}{r['estimated']:>10}{r['fully_solved']:>7}  "
              f"{r['best']} ({r['step_s']:.3g} s, {r['mfu'] * 100:.1f}%, {r['tflops_per_device']:.0f})")
    write_json(args.out, {"rows": rows, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
