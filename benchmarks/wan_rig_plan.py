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

``--variants``: the same layout also under plain 1F1B (pinned) and under 1F1B with its warm-up deepened
before the cut (``planner/search/wan_warmup.py``), each measured and priced the same way.

    python -m benchmarks.wan_rig_plan [--mbit 200] [--model llama-mini] [--batch 16] [--fix dp=2,pp=2,tp=1,cp=1] [--variants]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.results import write_json
from benchmarks.wan_rig import ROOT, rig, rig_cluster
from planner.describe import schedule_name
from planner.entry.launch import worker_env
from planner.entry.netns_rig import launch_across, rig_problem

WORKER = os.path.join(ROOT, "benchmarks", "rig_plan_worker.py")


def make_plan(model: str, batch: int, fix: str, mbit: float, seq_len: int | None = None):
    """(graph, plan) for ``model`` on the rig limited to ``mbit`` with ``fix`` pinned."""
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    g = load_graph(model, batch=1, seq_len=seq_len)
    plan, _ = plan_model(g, rig_cluster(mbit), batch, spec=model, cluster_spec="wan-rig", fix=fix)
    return g, plan


def variant_plans(model: str, batch: int, fix: str, mbit: float, seq_len: int | None = None) -> list:
    """(name, graph, plan) of the search's plan and, for comparison, its layout under plain 1F1B
    (pinned) and under 1F1B with the warm-up deepened before the cut (``planner.search.wan_warmup``)."""
    from planner.search.planning import build_plan
    from planner.search.stage_split import split_and_estimate
    from planner.search.wan_warmup import deepen

    graph, plan = make_plan(model, batch, fix, mbit, seq_len)
    pinned = ",".join([fix, "schedule=1f1b"] + (["seq_chunks=1"] if "seq_chunks" not in fix else []))
    _, plain = make_plan(model, batch, pinned, mbit, seq_len)
    e, _ = split_and_estimate(graph, rig_cluster(mbit), plain.config, batch)
    deep = deepen(graph, rig_cluster(mbit), e, batch)
    out = [("plan", graph, plan), ("1f1b", graph, plain)]
    if deep.depth:
        out.append((f"1f1b-deep (+{deep.depth})", graph, build_plan(graph, rig_cluster(mbit), deep.estimate,
                                                                    spec=model, cluster_spec="wan-rig")))
    return out


def priced_s(graph, plan, mbit: float | None) -> float:
    """The simulator's step for ``plan``'s configuration, split and schedule on the rig at ``mbit``."""
    from cost_models.estimate import estimate

    return estimate(graph, rig_cluster(mbit), plan.config, plan.partition(), int(plan.batch["global"]),
                    schedule=plan.schedule_ir).step_s


def run(mbit: float | None, path: str, steps: int, port: int, timeout: float = 600) -> dict:
    """The worker's 4 ranks on the rig at ``mbit`` (None: no limit); its RESULT record."""
    env = dict(worker_env(1), PYTHONPATH=ROOT)
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
    ap.add_argument("--variants", action="store_true",
                    help="also the layout under plain 1F1B and under 1F1B with the warm-up deepened before the cut")
    ap.add_argument("--out", default="benchmarks/results/wan_rig_plan.json")
    args = ap.parse_args()
    if why := rig_problem():
        print(f"skipped: {why}")
        return
    plans = variant_plans(args.model, args.batch, args.fix, args.mbit, args.seq_len) if args.variants else \
        [("plan",) + make_plan(args.model, args.batch, args.fix, args.mbit, args.seq_len)]
    port = 29900 + os.getpid() % 60
    rows = []
    print(f"{args.model}, batch {args.batch}, link {args.mbit:g} Mbit/s")
    print(f"{'variant':<18}{'unlimited s':>12}{'limited s':>11}{'model link s':>14}{'predicted s':>13}{'error':>8}"
          f"{'simulated s':>13}  plan")
    for name, graph, plan in plans:
        rows.append(measure(name, graph, plan, args.mbit, args.steps, port))
        port += 2
        r = rows[-1]
        print(f"{name:<18}{r['unlimited_s']:>12.4f}{r['limited_s']:>11.4f}{r['modelled_link_s']:>14.4f}"
              f"{r['predicted_s']:>13.4f}{r['error'] * 100:>7.1f}%{r['simulated_s']:>13.4f}  {r['plan']} ({r['schedule']})")
    write_json(args.out, {"mbit": args.mbit, "model": args.model, "rows": rows})


def measure(name: str, graph, plan, mbit: float, steps: int, port: int) -> dict:
    """One plan trained without the limit and through the limited link (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as fh:
            fh.write(plan.to_json())
        free = run(None, path, steps, port)
        slow = run(mbit, path, steps, port + 1)
    link = priced_s(graph, plan, mbit) - priced_s(graph, plan, None)
    pred = free["mean_s"] + link
    return {"variant": name, "plan": plan.config.label(), "schedule": schedule_name(plan.config, plan.schedule_ir),
            "microbatches": plan.estimate.get("microbatches"), "unlimited_s": free["mean_s"],
            "limited_s": slow["mean_s"], "modelled_link_s": link, "predicted_s": pred,
            "error": pred / slow["mean_s"] - 1, "simulated_s": priced_s(graph, plan, mbit),
            "losses": slow["losses"], "losses_unlimited": free["losses"]}


if __name__ == "__main__":
    main()
