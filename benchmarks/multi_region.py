"""Two regions joined by a WAN: the planned step against an ideal link and against naive pipelines.

Llama-3 70B (seq 8192) on 2 x 64 H100 (``two-region-h100``: 8 DGX H100 per region, 100 Gb/s =
12.5 GB/s between the regions, 20 ms round trip). Rows, all priced by the same cost model
(roofline, uncalibrated; the final figures simulated on their ILP stage split):

- ``ideal link``: the same 128 H100 with the WAN replaced by the regions' own InfiniBand
  (the plan autopar makes for one datacenter);
- ``planned (WAN-aware)``: autopar's plan for the two regions, and its search time;
- ``1F1B, WAN-aware placement``: the best plan with the schedule pinned to 1F1B (the pipeline
  cut on the WAN, TP/CP/DP inside a region);
- ``1F1B laid naively across the WAN``: the planned degrees under 1F1B with the pipeline's
  stages dealt round-robin to the regions (stage i in region i mod 2: what a placement that
  ignores the regions gives), so every boundary crosses the WAN and the boundaries share
  the one circuit;
- ``WAN-unaware plan``: the ideal-link plan run on the two regions.

    python -m benchmarks.multi_region [--global-batch 256] [--repeat 3] [--out benchmarks/results/multi_region.json]

``--repeat N``: the WAN-aware search timed N times, the median reported (a shared machine is noisy),
and the first: the process's first search (run before the ideal-link one), which also pays the
solver's import and the schedule caches' filling, as ``autopar plan`` does.
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.results import write_json
from cost_models.cluster import Cluster, parse_cluster
from planner.frontend.load import load_graph
from planner.search.planning import plan_model
from planner.search.stage_split import split_and_estimate

MODEL, CLUSTER = "llama3-70b", "two-region-h100"


def ideal(wan: Cluster) -> Cluster:
    """The same nodes as one datacenter: no groups, the regions' InfiniBand everywhere."""
    d = wan.to_dict()
    del d["groups"], d["links"]
    d["name"] = f"{wan.name}-ideal-link"
    return Cluster.from_dict(d)


def round_robin(wan: Cluster, pp: int) -> Cluster:
    """The regions' nodes dealt to ``pp`` stage-sized groups alternating between the regions: every
    pipeline boundary crosses the WAN, and the ``pp - 1`` boundaries share its bandwidth."""
    d = wan.to_dict()
    per = wan.nodes // pp
    link = d["links"][0]
    d["groups"] = [{"name": f"{'ab'[i % 2]}{i // 2}", "nodes": per} for i in range(pp)]
    fabric = wan.inter.bandwidth_gbs * per * wan.devices_per_node  # in-region: the nodes' InfiniBand
    d["links"] = [{"from": a["name"], "to": b["name"],
                   "bandwidth_gbs": (link["bandwidth_gbs"] / (pp - 1) if a["name"][0] != b["name"][0] else fabric),
                   "latency_us": link["latency_us"] if a["name"][0] != b["name"][0] else wan.inter.latency_us}
                  for i, a in enumerate(d["groups"]) for b in d["groups"][i + 1:]]
    d["name"] = f"{wan.name}-round-robin"
    return Cluster.from_dict(d)


def row(name: str, e, search: tuple[float, float, float] | None = None) -> dict:
    """One case; ``search``: the search's (median wall, median CPU, first wall) seconds (CPU: this
    process alone, the figure that holds on a shared machine; the stage ILP runs in-process under
    HiGHS; first: the process's first search, which also pays the solver's import and fills the
    schedule caches)."""
    return {"case": name, "config": e.config.label(), "step_s": e.step_s, "mfu": e.mfu,
            "search_s": search[0] if search else None, "search_cpu_s": search[1] if search else None,
            "search_first_s": search[2] if search else None, "wan": e.wan}


def timed_plan(g, cluster: Cluster, gb: int, repeat: int = 1, **kw):
    """plan_model's search result, the median of ``repeat`` runs' (wall, CPU) seconds and the
    first run's wall seconds."""
    walls, cpus = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        _, res = plan_model(g, cluster, gb, spec=MODEL, cluster_spec=CLUSTER, **kw)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return res, (statistics.median(walls), statistics.median(cpus), walls[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="time the WAN-aware search this many times (median)")
    ap.add_argument("--out", default="benchmarks/results/multi_region.json")
    args = ap.parse_args()
    gb = args.global_batch
    g = load_graph(MODEL, batch=1, seq_len=8192)
    wan = parse_cluster(CLUSTER)
    res, took = timed_plan(g, wan, gb, args.repeat)  # first: its first run is a fresh process's search
    res_ideal, took_ideal = timed_plan(g, ideal(wan), gb)
    rows = [row("ideal link", res_ideal.best, took_ideal), row("planned (WAN-aware)", res.best, took)]
    _, res_1f1b = plan_model(g, wan, gb, spec=MODEL, cluster_spec=CLUSTER, fix="schedule=1f1b")
    rows.append(row("1F1B, WAN-aware placement", res_1f1b.best))
    naive_cfg = res.best.config.replace(schedule="1f1b", vpp=1)
    naive, _ = split_and_estimate(g, round_robin(wan, naive_cfg.pp), naive_cfg, gb)
    rows.append(row("1F1B laid naively across the WAN", naive))
    unaware, _ = split_and_estimate(g, wan, res_ideal.best.config, gb)
    rows.append(row("WAN-unaware plan on the WAN", unaware))
    planned = rows[1]["step_s"]
    print(f"{MODEL}, global batch {gb} x 8192 tokens, {wan.world} H100 in 2 regions (12.5 GB/s, 20 ms RTT)")
    print(f"{'case':<36}{'step s':>9}{'vs planned':>11}{'MFU':>7}{'search s first / median (CPU)':>31}  configuration")
    for r in rows:
        srch = (f"{r['search_first_s']:.2f} / {r['search_s']:.2f} ({r['search_cpu_s']:.2f})"
                if r["search_s"] is not None else "-")
        print(f"{r['case']:<36}{r['step_s']:>9.2f}{r['step_s'] / planned:>10.3f}x{r['mfu'] * 100:>6.1f}%"
              f"{srch:>31}  {r['config']}")
    summary = {"planned_over_ideal": planned / rows[0]["step_s"],
               "naive_1f1b_over_planned": rows[3]["step_s"] / planned,
               "wan_aware_1f1b_over_planned": rows[2]["step_s"] / planned,
               "search_s": rows[1]["search_s"], "search_cpu_s": rows[1]["search_cpu_s"],
               "search_first_s": rows[1]["search_first_s"]}
    print("  ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    write_json(args.out, {"model": MODEL, "cluster": CLUSTER, "global_batch": gb, "rows": rows, **summary})


if __name__ == "__main__":
    main()
