"""One rank of the rig's ``plan`` mode (benchmarks/wan_rig_plan.py): a plan file made for the rig's
cluster (two groups joined by the limited link), built with autopar's runtime
(``codegen.runtime.train.parallelize_plan``: mesh, stages, pipeline schedule, DP) on a zoo model
and trained on synthetic text for ``STEPS`` steps. Prints one ``RESULT`` JSON line on rank 0:
the mean and median step after ``WARMUP`` steps, every step's seconds and loss.

    python benchmarks/rig_plan_worker.py PLAN.json STEPS   (under torchrun, one per region)
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from codegen.runtime.data import synthetic
from codegen.runtime.mesh import exit_process, init_distributed, teardown
from codegen.runtime.train import parallelize_plan
from planner import zoo
from planner.plan import Plan

WARMUP = 2


def main() -> None:
    path, steps = sys.argv[1], int(sys.argv[2])
    plan = Plan.load(path)
    device = init_distributed(threads=plan.config.threads)
    spec = zoo.load_model_spec(plan.model["spec"])
    pm = parallelize_plan(spec.build("meta"), plan, device, seed=0,
                          optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1))
    data = synthetic(int(plan.model["vocab"]), int(plan.batch["global"]), int(plan.batch["seq_len"]), seed=0)
    times, losses = [], []
    for step in range(steps):
        batch = data(step)
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(pm.step(batch))
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        steady = times[WARMUP:]
        print("RESULT " + json.dumps({"mean_s": statistics.mean(steady), "step_s": statistics.median(steady),
                                      "times": times, "losses": losses}), flush=True)
    pm.close()
    teardown()
    exit_process(0)


if __name__ == "__main__":
    main()
