"""Capture speed: wall time and peak RSS of capturing a large preset on fake tensors.

Each model runs in a fresh process (no warm caches), timing the whole job (imports,
building the model on meta, capture) and the capture alone.

    python -m benchmarks.capture_speed [--models llama3-405b gpt3-175b] [--out benchmarks/results/capture_speed.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.results import write_json

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from planner.frontend.load import load_graph
t1 = time.perf_counter()
g = load_graph(sys.argv[1], batch=1)
t2 = time.perf_counter()
print(json.dumps({"model": sys.argv[1], "import_s": t1 - t0, "build_and_capture_s": t2 - t1,
                  "capture_s": g.capture_s, "layers": len(g.layers), "classes": len(g.classes()),
                  "params": g.params, "seq_len": g.seq_len,
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama3-405b", "gpt3-175b", "llama3-8b"])
    ap.add_argument("--out", default="benchmarks/results/capture_speed.json")
    args = ap.parse_args()
    rows = []
    for m in args.models:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _CHILD, m], capture_output=True, text=True, check=True)
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["process_wall_s"] = time.perf_counter() - t0
        rows.append(row)
    print(f"{'model':<14}{'layers':>7}{'classes':>8}{'params':>10}{'seq':>7}{'capture s':>11}"
          f"{'build+capture s':>17}{'process s':>11}{'peak RSS GiB':>14}")
    for r in rows:
        print(f"{r['model']:<14}{r['layers']:>7}{r['classes']:>8}{r['params'] / 1e9:>9.1f}B{r['seq_len']:>7}"
              f"{r['capture_s']:>11.2f}{r['build_and_capture_s']:>17.2f}{r['process_wall_s']:>11.2f}"
              f"{r['peak_rss_gib']:>14.2f}")
    write_json(args.out, {"rows": rows, "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
