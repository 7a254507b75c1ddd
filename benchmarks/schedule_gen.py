"""Generated pipeline schedules against the best built-in, in simulation.

For each case (per-stage forward / backward seconds, micro-batches, p2p hop) the table gives the
simulated step of 1f1b, zb-h1 and the generated schedule (planner/search/schedule_gen.py, at
1F1B's activation memory per rank) and the speed-up of what ``best_schedule`` keeps over the best
built-in (>= 1 by construction: the generated one is kept only when faster). Cases: uniform
stages; a heavy last stage (a 256K-vocabulary head: 2.5x a block stage); a heavy first stage (a
MoE's dense first blocks or a vision encoder: 2x); random uneven stages; and the stage times of
the planned pipelines of the presets (benchmarks/plan_speed.py's cases that plan pp > 1).

    python -m benchmarks.schedule_gen [--out benchmarks/results/schedule_gen.json]
"""
from __future__ import annotations

import argparse
import random

from benchmarks.plan_speed import CASES
from benchmarks.results import write_json
from cost_models.pipeline import simulate
from planner.search.schedule_gen import best_schedule


def synthetic() -> list[tuple[str, list[float], list[float], int, float]]:
    out = []
    for p, m in ((4, 8), (8, 8), (8, 32)):
        out.append((f"uniform p{p} m{m}", [1.0] * p, [2.0] * p, m, 0.02))
        out.append((f"heavy head p{p} m{m}", [1.0] * (p - 1) + [2.5], [2.0] * (p - 1) + [5.0], m, 0.02))
        out.append((f"heavy first p{p} m{m}", [2.0] + [1.0] * (p - 1), [4.0] + [2.0] * (p - 1), m, 0.02))
    rnd = random.Random(0)
    for k in range(6):
        p = rnd.choice((4, 8))
        f = [rnd.uniform(0.5, 2.0) for _ in range(p)]
        out.append((f"random {k} p{p} m{p}", f, [x * rnd.uniform(1.6, 2.4) for x in f], p, 0.05))
    return out


def presets() -> list[tuple[str, list[float], list[float], int, float]]:
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model
    out = []
    for model, cluster, gb, seq in CASES:
        g = load_graph(model, batch=1, seq_len=seq)
        _, res = plan_model(g, parse_cluster(cluster), gb, spec=model, cluster_spec=cluster)
        for e in [res.best] + list(res.alternatives):
            if e.config.pp > 1 and e.config.vpp == 1:
                out.append((f"{model} {e.config.label()}", e.stage_fwd_s, e.stage_bwd_s, e.microbatches, e.p2p_hop_s))
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/schedule_gen.json")
    args = ap.parse_args()
    rows = []
    print(f"{'case':62s} {'1f1b':>9s} {'zb-h1':>9s} {'kept':>9s} {'speed-up':>8s}")
    for name, f, b, m, p2p in synthetic() + presets():
        p = len(f)
        one, zb = (simulate(s, p, m, f, b, p2p=p2p).step_s for s in ("1f1b", "zb-h1"))
        c = best_schedule(f, b, m, p2p=p2p)
        row = {"case": name, "p": p, "m": m, "1f1b_s": one, "zb-h1_s": zb, "kept": c.name,
               "kept_s": c.result.step_s, "speedup_vs_best_builtin": min(one, zb) / c.result.step_s}
        rows.append(row)
        print(f"{name[:62]:62s} {one:9.4g} {zb:9.4g} {c.name:>9s} {row['speedup_vs_best_builtin']:8.3f}")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
