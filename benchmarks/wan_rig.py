"""A local rig with a real slow link: 2 + 2 gloo ranks in two network namespaces joined by a veth
pair rate-limited with ``tc qdisc tbf`` (this kernel has tbf and htb, not netem: latency stays a
modelled term), and the cost model's WAN terms against what the link does to the steps.

Each mode of ``benchmarks/rig_worker.py`` (a 2-stage pipeline across the cut, hand-written; synchronous
DP over all 4 ranks as the runtime runs it across regions, hierarchically; low-communication DP with
H = 4 and 16 in bf16) runs twice: through the limited
link and without the limit. The cost model prices the rig as a cluster of two groups (one node
of 2 ranks each) joined by the limited link (``rig_cluster``): its WAN terms
(``comm.p2p_hops`` for the pipeline's hops, ``comm.collective_time`` for the all-reduce across,
``wan_cost.outer_step_s`` for the pseudo-gradient exchange) minus the same terms on an unlimited
link (the gloo defaults) are added to the measured unlimited step: ``predicted`` = measured
without the limit + the modelled cost of the limit. So the comparison holds the compute and
the local communication to measurement and tests the WAN pricing this module's issue adds.

A plan with its pipeline across the cut, built by autopar's runtime and priced by the schedule
simulator: ``benchmarks/wan_rig_plan.py``.

The rig is ``planner/entry/netns_rig.py``'s (``autopar run --rig-mbit`` runs plans on it): it needs
root and ``ip netns`` (``rig_problem`` says why not, in one line) and deletes every namespace it
makes on the way out, whatever happens. Timings on a shared 2-core box are noisy.

    python -m benchmarks.wan_rig [--mbit 200] [--modes pp,sync,low4,low16] [--out benchmarks/results/wan_rig.json]
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks.results import write_json
from planner.entry.launch import worker_env
from planner.entry.netns_rig import Rig, RigSpec, launch_across, rig_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "rig_worker.py")


def rig(mbit: float | None) -> Rig:
    """The two-region rig (planner/entry/netns_rig.py): 2 ranks per region, each direction of the
    link limited to ``mbit`` Mbit/s (None: no limit). A context manager."""
    return Rig(RigSpec(nproc=2, rate_mbit=mbit))


def launch(r: Rig, mode: str, port: int, timeout: float = 300) -> dict:
    """The worker's 4 ranks on ``r`` (one torchrun per region); its RESULT record."""
    env = dict(worker_env(1), PYTHONPATH=ROOT)
    run = launch_across(r, [WORKER, mode], env, timeout, port=port, capture=True)
    if run.rc != 0:
        raise RuntimeError(f"rig worker {mode} failed (rc {run.rc}): {run.stderr[0].strip().splitlines()[-1:]}")
    line = next(ln for ln in run.stdout[0].splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def rig_cluster(mbit: float | None):
    """The rig as the cost model sees it: two groups of one node (2 gloo ranks) joined by the link."""
    from cost_models.cluster import GLOO_LATENCY_US, GLOO_LINK_GBS, Cluster

    link = GLOO_LINK_GBS if mbit is None else mbit / 8 / 1000
    gloo = {"bandwidth_gbs": GLOO_LINK_GBS, "latency_us": GLOO_LATENCY_US}
    return Cluster.from_dict({
        "name": "wan-rig", "nodes": 2, "devices_per_node": 2, "backend": "gloo",
        "device": {"name": "cpu", "memory_gib": 4, "mem_bw_gbs": 10, "peak_tflops": {"fp32": 0.05}},
        "intra": gloo, "inter": gloo, "groups": [{"name": "a", "nodes": 1}, {"name": "b", "nodes": 1}],
        "links": [{"from": "a", "to": "b", "bandwidth_gbs": link, "latency_us": GLOO_LATENCY_US}]})


def modelled_wan_s(mode: str, mbit: float | None) -> float:
    """The cost model's seconds per step for the traffic of ``mode`` on the rig's link."""
    from benchmarks import rig_worker as W
    from cost_models import comm
    from cost_models.wan_cost import outer_step_s
    from planner.plan import ParallelConfig

    cl = rig_cluster(mbit)
    params = W.DEPTH * (W.WIDTH * W.WIDTH + W.WIDTH)
    if mode == "pp":
        act = (W.ROWS // W.M) * W.WIDTH * 4
        hop = comm.p2p_hops(act, cl, comm.Mesh(pp=2, dp=2))[0].seconds
        return 2 * W.M * hop  # each micro-batch's activation across and its gradient back, one at a time
    if mode == "sync":  # the runtime's DDP reducer, one bucket, hierarchical across the groups
        return comm.collective_time("all_reduce", params * 4, cl, comm.Mesh(dp=4), "dp").seconds
    h = int(mode[3:])
    return outer_step_s(cl, ParallelConfig(dp=4, low_comm=f"2x{h}:bf16"), params) / h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbit", type=float, default=200.0)
    ap.add_argument("--modes", default="pp,sync,low4,low16")
    ap.add_argument("--out", default="benchmarks/results/wan_rig.json")
    args = ap.parse_args()
    if why := rig_problem():
        print(f"skipped: {why}")
        return
    rows = []
    port = 29600 + os.getpid() % 300
    for mode in args.modes.split(","):
        measured = {}
        for limit in (None, args.mbit):
            with rig(limit) as r:
                measured[limit] = launch(r, mode, port)
            port += 1
        free, slow = measured[None]["mean_s"], measured[args.mbit]["mean_s"]
        delta = modelled_wan_s(mode, args.mbit) - modelled_wan_s(mode, None)
        pred = free + delta
        rows.append({"mode": mode, "unlimited_s": free, "limited_s": slow, "modelled_link_s": delta,
                     "predicted_s": pred, "error": pred / slow - 1, "losses": measured[args.mbit]["losses"],
                     "losses_unlimited": measured[None]["losses"]})
    print(f"rig: 2 + 2 gloo ranks, veth limited to {args.mbit:g} Mbit/s each way (tc tbf); mean step after warm-up")
    print(f"{'mode':<8}{'unlimited s':>12}{'limited s':>11}{'model link s':>14}{'predicted s':>13}{'error':>8}  "
          f"final loss")
    for r in rows:
        print(f"{r['mode']:<8}{r['unlimited_s']:>12.4f}{r['limited_s']:>11.4f}{r['modelled_link_s']:>14.4f}"
              f"{r['predicted_s']:>13.4f}{r['error'] * 100:>7.1f}%  {r['losses'][-1]:.5f}")
    write_json(args.out, {"mbit": args.mbit, "rows": rows})


if __name__ == "__main__":
    main()
