"""A mixed pool: 32 A100 + 32 H100 (``mixed-a100-h100``) planned with stages sized to each device.

Rows (roofline, uncalibrated, simulated on their stage split): autopar's plan for the mixed
pool (the ILP sizes the stages to each group's speed; the report says which stage sits on which
device); the same configuration with an even split (as Megatron-LM / torchtitan split); the best
layout without a pipeline, whose dp ranks take rows in proportion to their device's speed
(``dp_shares``: cost_models/speed_shares.py), and that layout with equal shares; and the plans
for either type alone (``dgx-h100:4``, ``dgx-a100-80g:4``: 32 GPUs each).

    python -m benchmarks.mixed_devices [--model llama3-8b] [--global-batch 256] [--seq-len N]
                                       [--out benchmarks/results/mixed_devices.json]
"""
from __future__ import annotations

import argparse
import time

from benchmarks.results import write_json
from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from planner.describe import devices_text
from planner.frontend.load import load_graph
from planner.search.planning import plan_model
from planner.search.stage_split import even_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    ap.add_argument("--out", default="benchmarks/results/mixed_devices.json")
    args = ap.parse_args()
    g, gb = load_graph(args.model, batch=1, seq_len=args.seq_len), args.global_batch
    rows = []
    for spec in ("mixed-a100-h100", "dgx-h100:4", "dgx-a100-80g:4"):
        cl = parse_cluster(spec)
        t0 = time.perf_counter()
        plan, res = plan_model(g, cl, gb, spec=args.model, cluster_spec=spec)
        e = res.best
        rows.append({"case": f"{spec} ({cl.world} GPUs): planned", "config": e.config.label(), "step_s": e.step_s,
                     "search_s": time.perf_counter() - t0, "layers_per_stage": [hi - lo for lo, hi in e.partition.bounds],
                     "stages_on": devices_text(e.config, plan.stages, e.devices)[1] if e.devices else ""})
        if spec.startswith("mixed") and e.config.pp > 1:
            ev = estimate(g, cl, e.config, even_split(g, e.config.pp * e.config.vpp, e.config.recompute), gb,
                          schedule=e.schedule_ir)
            rows.append({"case": f"{spec}: same layout, even split", "config": e.config.label(), "step_s": ev.step_s,
                         "fits": ev.fits, "search_s": None, "layers_per_stage": [hi - lo for lo, hi in ev.partition.bounds],
                         "stages_on": ""})
        if spec.startswith("mixed"):
            rows += _shares_rows(g, cl, spec, gb, e if e.config.pp == 1 else None)
    print(f"{args.model}, global batch {gb} x {g.seq_len} tokens")
    print(f"{'case':<42}{'step s':>8}{'vs mixed':>10}  layers per stage, configuration")
    for r in rows:
        print(f"{r['case']:<42}{r['step_s']:>8.3f}{r['step_s'] / rows[0]['step_s']:>9.2f}x  {r['layers_per_stage']} "
              f"{r['config']}")
    print("\n".join(r["stages_on"] for r in rows if r["stages_on"]))
    write_json(args.out, {"model": args.model, "global_batch": gb, "rows": rows})


def _shares_rows(g, cl, spec: str, gb: int, best) -> list[dict]:
    """The best layout without a pipeline (dp shares by speed where they win) and the same with equal shares."""
    t0 = time.perf_counter()
    e = best or plan_model(g, cl, gb, spec="", cluster_spec=spec, fix="pp=1")[1].best
    dt = time.perf_counter() - t0
    eq = estimate(g, cl, e.config.replace(dp_shares=""), e.partition, gb)
    return [{"case": f"{spec}: best with pp=1", "config": e.config.label(), "step_s": e.step_s, "search_s": dt,
             "layers_per_stage": [len(g.layers)], "stages_on": e.devices[0] if e.devices else ""},
            {"case": f"{spec}: that layout, equal shares", "config": eq.config.label(), "step_s": eq.step_s,
             "fits": eq.fits, "search_s": None, "layers_per_stage": [len(g.layers)], "stages_on": ""}]


if __name__ == "__main__":
    main()
