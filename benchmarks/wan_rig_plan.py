"""A plan with its pipeline across the rig's limited link, run by autopar's own runtime and priced by
the schedule simulator (benchmarks/wan_rig.py's rig: 2 + 2 gloo ranks in two network namespaces,
the veth between them limited with ``tc qdisc tbf``).

The plan is searched for the rig as the cost model sees it (``wan_rig.rig_cluster``: two groups of
2 ranks joined by the limited link) with the layout pinned (``--fix``, by default a 2-stage
pipeline whose boundary crosses the link, dp = 2 inside each region), then built on every rank by
``codegen.runtime.train.parallelize_plan`` (benchmarks/rig_plan_worker.py) and trained through the
limited link and without the limit. ``predicted`` = measured without the limit + what the cost
model (``cost_models.estimate.estimate``: the pipeline schedule simulated with the WAN hops) adds
for the limit, the same split and schedule priced on both clusters; ``simulated`` is the
estimate's own step on the limited rig (compute priced from the cluster file, uncalibrated).
Timings on a shared 2-core box are noisy: quote the load.

    python -m benchmarks.wan_rig_plan [--mbit 200] [--model llama-mini] [--batch 16] [--fix dp=2,pp=2,tp=1,cp=1]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.results import write_json
from benchmarks.wan_rig import ROOT, rig, rig_cluster
from planner.entry.netns_rig import launch_across, rig_problem

WORKER = os.path.join(ROOT, "benchmarks", "rig_plan_worker.py")


def make_plan(model: str, batch: int, fix: str, mbit: float, seq_len: int | None = None):
    """(graph, plan) for ``model`` on the rig limited to ``mbit`` with ``fix`` pinned."""
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    g = load_graph(model, batch=1, seq_len=seq_len)
    plan, _ = plan_model(g, rig_cluster(mbit), batch, spec=model, cluster_spec="wan-rig", fix=fix)
    return g, plan


def priced_s(graph, plan, mbit: float | None) -> float:
    """The simulator's step for ``plan``'s configuration, split and schedule on the rig at ``mbit``."""
    from cost_models.estimate import estimate

    return estimate(graph, rig_cluster(mbit), plan.config, plan.partition(), int(plan.batch["global"]),
                    schedule=plan.schedule_ir).step_s


def run(mbit: float | None, path: str, steps: int, port: int, timeout: float = 600) -> dict:
    """The worker's 4 ranks on the rig at ``mbit`` (None: no limit); its RESULT record."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with rig(mbit) as r:
        out = launch_across(r, [WORKER, path, str(steps)], env, timeout, port=port, capture=True)
    if out.rc != 0:
        raise RuntimeError(f"rig plan worker failed (rc {out.rc}): {out.stderr[0].strip().splitlines()[-3:]}")
    line = next(ln for ln in out.stdout[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--model", default="llama-mini")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--fix", default="dp=2,pp=2,tp=1,cp=1")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/wan_rig_plan.json")
    args = ap.parse_args()
    if why := rig_problem():
        print(f"skipped: {why}")
        return
    graph, plan = make_plan(args.model, args.batch, args.fix, args.mbit, args.seq_len)
    port = 29900 + os.getpid() % 60
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as fh:
            fh.write(plan.to_json())
        free = run(None, path, args.steps, port)
        slow = run(args.mbit, path, args.steps, port + 1)
    link = priced_s(graph, plan, args.mbit) - priced_s(graph, plan, None)
    pred = free["mean_s"] + link
    row = {"plan": plan.config.label(), "schedule": plan.config.schedule, "microbatches": plan.estimate.get("microbatches"),
           "unlimited_s": free["mean_s"], "limited_s": slow["mean_s"], "modelled_link_s": link, "predicted_s": pred,
           "error": pred / slow["mean_s"] - 1, "simulated_s": priced_s(graph, plan, args.mbit),
           "losses": slow["losses"], "losses_unlimited": free["losses"]}
    print(f"rig plan: {row['plan']} ({row['schedule']}), {args.model}, batch {args.batch}, link {args.mbit:g} Mbit/s")
    print(f"{'unlimited s':>12}{'limited s':>11}{'model link s':>14}{'predicted s':>13}{'error':>8}{'simulated s':>13}")
    print(f"{row['unlimited_s']:>12.4f}{row['limited_s']:>11.4f}{row['modelled_link_s']:>14.4f}{row['predicted_s']:>13.4f}"
          f"{row['error'] * 100:>7.1f}%{row['simulated_s']:>13.4f}")
    write_json(args.out, {"mbit": args.mbit, "model": args.model, "rows": [row]})


if __name__ == "__main__":
    main()
