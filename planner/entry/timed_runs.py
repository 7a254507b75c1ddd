"""Time a few training steps of several plans in one torchrun launch (the first-run calibration).

``python -m torch.distributed.run --nproc-per-node N -m planner.entry.timed_runs OUT.json
PLAN.json [PLAN.json ...] --steps K``: every plan (all of world size N and one thread count per
rank, zoo models) is built,
parallelised exactly as its emitted program does (``parallelize_plan``) and trained for ``warmup + K`` steps on the synthetic data;
then it is torn down and the next one built, so N processes start once for all of them.
Rank 0 writes ``{"runs": [{"plan", "step_s": [K floats], "memory_gib": [per rank]}]}``; with
``--runtime`` (gloo, two ranks or more) also ``"runtime"``: a ``ProfileDB`` layout holding the CPU
runtime's own per-call work and FSDP2 units by size, measured after the plans on the same ranks as
``autopar profile`` measures them (``cost_models.profile_runtime.measure_runtime``, its default
sizes and repeats).

Step time is wall seconds per optimizer step on rank 0 after a barrier (the ranks start each
step together, as the emitted program's steps do after the first); memory is every rank's peak
(``metrics.peak_memory_per_rank``: RSS on CPUs, allocated memory on GPUs) at the end of the
plan's steps (GiB; a peak only grows, so later plans report the maximum so far - the first
plan's figure is the one to compare).
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from codegen.runtime.data import synthetic
from codegen.runtime.mesh import exit_process, init_distributed, teardown
from codegen.runtime.metrics import peak_memory_per_rank
from codegen.runtime.train import parallelize_plan
from planner import zoo
from planner.plan import Plan


def time_plan(plan: Plan, device: torch.device, steps: int, warmup: int, lr: float) -> dict:
    """Build ``plan``'s parallel model on this rank, train ``warmup + steps`` steps, tear it down."""
    spec = zoo.load_model_spec(plan.model["spec"])
    model = spec.build("meta")
    gb, seq = int(plan.batch["global"]), int(plan.batch["seq_len"])
    pm = parallelize_plan(model, plan, device, seed=0,
                          optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1))
    data = synthetic(int(plan.model["vocab"]), gb, seq, 0)
    times = []
    for step in range(warmup + steps):
        batch = data(step)
        dist.barrier()
        t0 = time.perf_counter()
        pm.step(batch)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    mem = peak_memory_per_rank(device)
    pm.close()
    return {"plan": plan.config.label(), "step_s": times, "memory_gib": mem}


def measure_runtime_profile(world: int) -> dict:
    """The CPU runtime's per-call figures and FSDP2 unit samples on these ranks, as a ``ProfileDB``
    layout (module docstring; its fingerprint left for the caller to name); ``{}`` where
    ``measure_runtime`` measures nothing (one rank, not gloo)."""
    from cost_models.profile_db import ProfileDB
    from cost_models.profile_runtime import measure_runtime
    from cost_models.profiler import DEFAULT_REPEATS, DEFAULT_SIZES

    db = ProfileDB(cluster_fingerprint="", backend=dist.get_backend(), world=world)
    measure_runtime(db, world, DEFAULT_REPEATS, DEFAULT_SIZES)
    return db.to_dict() if db.runtime else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("plans", nargs="+")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--runtime", action="store_true", help="also measure the CPU runtime's own work (docstring)")
    args = ap.parse_args(argv)
    plans = [Plan.load(p) for p in args.plans]
    threads = {p.config.threads for p in plans}
    if len(threads) != 1:
        raise SystemExit(f"timed_runs: the plans of one launch run different threads per rank ({sorted(threads)}): "
                         "launch each thread count on its own")
    device = init_distributed(threads=threads.pop())
    out = {"runs": [time_plan(p, device, args.steps, args.warmup, args.lr) for p in plans]}
    if args.runtime:
        out["runtime"] = measure_runtime_profile(dist.get_world_size())
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f)
    teardown()
    exit_process(0)
    return 0


if __name__ == "__main__":
    main()
