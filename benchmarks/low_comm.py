"""Low-communication DP priced against synchronous layouts across two regions.

For each ``H`` and wire dtype, ``autopar plan --low-comm 2xH:dtype`` on ``two-region-h100`` (2 x 64
H100, 12.5 GB/s and 20 ms RTT between the regions): the plan it chooses (low-communication DP
only where it wins), its predicted step, and for the best low-communication layout the bytes
each rank sends across the WAN per exchange and per inner step. The first row is the plan
without the option (synchronous training: pipeline cuts on the WAN). Roofline, uncalibrated.
Low-communication DP changes the optimisation: the step times compare throughput only.

    python -m benchmarks.low_comm [--model llama3-8b] [--global-batch 256] [--out benchmarks/results/low_comm.json]
"""
from __future__ import annotations

import argparse
import time

from benchmarks.results import write_json
from cost_models.cluster import parse_cluster
from cost_models.wan_cost import outer_bytes
from planner.frontend.load import load_graph
from planner.low_comm import inner_dp, parse_low_comm
from planner.search.planning import plan_model

CLUSTER = "two-region-h100"
CHOICES = [(4, "bf16"), (16, "bf16"), (64, "bf16"), (16, "int8")]


def _bytes(graph, e) -> tuple[float, float]:
    """(bytes per rank per exchange, per inner step) of a low-communication estimate."""
    cfg = e.config
    low = parse_low_comm(cfg.low_comm)
    if low is None:
        return 0.0, 0.0
    params = graph.params / (cfg.pp * cfg.tp) / (inner_dp(cfg.dp, cfg.low_comm) * cfg.cp if cfg.zero == "fsdp" else 1)
    b = outer_bytes(cfg, params)
    return b, b / low.every


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/low_comm.json")
    args = ap.parse_args()
    g = load_graph(args.model, batch=1, seq_len=None)
    cl = parse_cluster(CLUSTER)
    rows = []
    for h, dtype in [(0, "")] + CHOICES:
        low = f"2x{h}:{dtype}" if h else ""
        t0 = time.perf_counter()
        _, res = plan_model(g, cl, args.global_batch, spec=args.model, cluster_spec=CLUSTER, low_comm=low)
        best_low = next((e for e in [res.best, *res.alternatives] if e.config.low_comm), None)
        per_exchange, per_step = _bytes(g, best_low) if best_low is not None else (0.0, 0.0)
        rows.append({"low_comm": low or "off (synchronous)", "chosen": res.best.config.label(),
                     "step_s": res.best.step_s, "search_s": time.perf_counter() - t0,
                     "best_low_comm": best_low.config.label() if best_low else None,
                     "best_low_comm_step_s": best_low.step_s if best_low else None,
                     "wan_bytes_per_exchange": per_exchange, "wan_bytes_per_inner_step": per_step})
    print(f"{args.model}, global batch {args.global_batch}, {cl.world} H100 in 2 regions (12.5 GB/s, 20 ms RTT)")
    print(f"{'--low-comm':<20}{'step s':>8}{'low-comm step s':>16}{'GB/rank/exchange':>17}{'MB/rank/step':>13}  chosen")
    for r in rows:
        lc = f"{r['best_low_comm_step_s']:.3f}" if r["best_low_comm_step_s"] else "-"
        print(f"{r['low_comm']:<20}{r['step_s']:>8.3f}{lc:>16}{r['wan_bytes_per_exchange'] / 1e9:>17.3f}"
              f"{r['wan_bytes_per_inner_step'] / 1e6:>13.1f}  {r['chosen']}")
    write_json(args.out, {"model": args.model, "cluster": CLUSTER, "global_batch": args.global_batch, "rows": rows})


if __name__ == "__main__":
    main()
