"""Simulated step times of the built-in schedules, to compare two versions of the simulator.

The schedule IR (planner/schedule_ir.py) replaced the simulator's hand-written orders; this
prints, for every built-in schedule on a grid of (p, m, v) with uneven stage times, and for the
best plan of each planning preset (benchmarks/plan_speed.py's cases, a two-region WAN cluster and
a mixed A100 + H100 pool), the simulated step seconds; the grid runs once with one p2p hop and
once with a hop per rank boundary (a slow one where a WAN cut would be). Run it on two trees and
compare::

    PYTHONPATH=/old/tree python -m benchmarks.schedule_ir_parity --out old.json
    python -m benchmarks.schedule_ir_parity --out new.json --compare old.json
"""
from __future__ import annotations

import argparse
import json
import random

from benchmarks.plan_speed import CASES
from benchmarks.results import write_json
from cost_models.pipeline import simulate

WAN_CASES = [("llama3-70b", "two-region-h100", 1024, 8192), ("llama3-8b", "mixed-a100-h100", 256, None)]
GRID = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4),
        ("zb-h1", 1)]


def grid_rows() -> dict[str, float]:
    rnd = random.Random(0)
    out = {}
    for name, v in GRID:
        for p in (2, 4, 8):
            for m in (p // 2 or 1, p, 2 * p, 4 * p, 16 * p):
                if v > 1 and m % p:
                    continue
                f = [rnd.uniform(0.5, 2.0) for _ in range(p * v)]
                b = [2 * x * rnd.uniform(0.8, 1.2) for x in f]
                out[f"{name}/v{v}/p{p}/m{m}"] = simulate(name, p, m, f, b, p2p=0.01, v=v).step_s
                hops = [0.01 * (1 + r) for r in range(p)]
                hops[p // 2 - 1] = 0.5  # a slow boundary in the middle
                out[f"{name}/v{v}/p{p}/m{m}/hops"] = simulate(name, p, m, f, b, p2p=hops, v=v).step_s
    return out


def preset_rows(skip: set[str]) -> dict[str, dict]:
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model
    out = {}
    for model, cluster, gb, seq in CASES + WAN_CASES:
        if model in skip:
            continue
        g = load_graph(model, batch=1, seq_len=seq)
        _, res = plan_model(g, parse_cluster(cluster), gb, spec=model, cluster_spec=cluster)
        out[f"{model}@{cluster}"] = {"best": res.best.config.label(), "step_s": res.best.step_s}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/schedule_ir_parity.json")
    ap.add_argument("--compare", help="an earlier run's JSON to compare with")
    ap.add_argument("--skip", default="", help="comma-separated preset models to leave out")
    args = ap.parse_args()
    res = {"grid": grid_rows(), "presets": preset_rows(set(filter(None, args.skip.split(","))))}
    write_json(args.out, res)
    old = json.load(open(args.compare)) if args.compare else None
    print(f"{'case':44s} {'step_s':>12s} {'earlier':>12s} {'rel diff':>9s}")
    for key, val in list(res["grid"].items()) + [(k, v["step_s"]) for k, v in res["presets"].items()]:
        ref = None
        if old:
            ref = old["grid"].get(key) if key in old["grid"] else old["presets"].get(key, {}).get("step_s")
        diff = f"{abs(val - ref) / ref:9.2e}" if ref else ""
        print(f"{key:44s} {val:12.6g} {ref if ref is not None else '':>12} {diff}")
    for k, v in res["presets"].items():
        print(f"{k}: {v['best']}" + (f"  (earlier: {old['presets'][k]['best']})" if old and k in old["presets"] else ""))


if __name__ == "__main__":
    main()
