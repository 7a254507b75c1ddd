"""Plan -> a standalone, readable training program (``autopar codegen plan.json -o train.py``).

The program is the plan's constants followed by a short torchtitan-style train loop on
codegen/runtime: build the model (on meta for the zoo and transformers models, whose
adapters initialise only this rank's units; a plain module as its own function builds it,
its weights then broadcast from rank 0), apply the plan (mesh, TP, CP, recompute, PP, DP),
resume from the newest complete distributed checkpoint, train with AdamW on synthetic
data (or a ``--data package.module:function`` hook), log every step as a JSON line,
checkpoint every K steps. Run it with torchrun.

Only validated values reach the program: the model spec (preset name, .toml path or a
dotted ``package.module:function``), layer names and TP roles (identifiers, checked by
Plan.from_dict) and numbers, all written with ``repr`` - nothing from a plan file is
pasted as code.
"""
from __future__ import annotations

import re

from planner.plan import Plan, PlanError, write_atomic

_SPEC = re.compile(r"^([A-Za-z0-9_][\w.-]*|[\w./-]+\.toml|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*|hf:[\w./-]+)$")

TEMPLATE = '''#!/usr/bin/env python
"""Train {model_name} with {label} on {world} {device}s ({cluster}).

Emitted by autopar from a plan; predicted step {step_s:.4g} s, {tokens:,.0f} tokens/s, MFU {mfu:.1%}.
Run: torchrun --nproc-per-node {world} {{this file}} --steps 20
"""
import argparse
import json
import resource
import time

import torch
import torch.distributed as dist

from codegen.runtime import checkpoint
from codegen.runtime.data import synthetic, user_hook
from codegen.runtime.mesh import exit_process, init_distributed, teardown
from codegen.runtime.train import parallelize
from planner import zoo
from planner.plan import ModelFacts, ParallelConfig

# ---- the plan --------------------------------------------------------------------------
MODEL, ADAPTER, VOCAB = {model!r}, {adapter!r}, {vocab!r}
FACTS = ModelFacts.from_dict({facts!r})  # what the runtime checks before building anything
CONFIG = ParallelConfig.parse({config!r})
STAGES = {stages!r}  # layer units per virtual stage
RECOMPUTE = {recompute!r}  # per virtual stage
TP_LAYOUT = {tp_layout!r}
GLOBAL_BATCH, SEQ_LEN = {global_batch!r}, {seq_len!r}
PREDICTED = {{"step_s": {step_s!r}, "memory_gib": {memory!r}}}


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB -> GiB)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ckpt-dir", default="checkpoints")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (0: never)")
    ap.add_argument("--metrics", default="train_log.jsonl", help="JSON-lines log of every step")
    ap.add_argument("--data", default=None, help="package.module:function(step, global_batch, seq_len) -> batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()

    device = init_distributed()
    spec = zoo.load_model_spec(MODEL)
    model = spec.build(None if ADAPTER == "module" else "meta")
    pm = parallelize(model, CONFIG, STAGES, RECOMPUTE, TP_LAYOUT, GLOBAL_BATCH, SEQ_LEN, device, seed=args.seed,
                     facts=FACTS, optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.1))
    mllm = spec.cfg if spec.cfg is not None and spec.cfg.arch == "mllm" else None
    data = user_hook(args.data, GLOBAL_BATCH, SEQ_LEN) if args.data else synthetic(
        VOCAB, GLOBAL_BATCH, SEQ_LEN, args.seed, mllm=mllm, model_shifts_labels=ADAPTER == "hf")
    start = checkpoint.load_latest(pm, args.ckpt_dir) or 0
    rank = dist.get_rank()
    if rank == 0:  # drop steps logged after the checkpoint we resume from (they are run again)
        checkpoint.trim_log(args.metrics, start)
    log = open(args.metrics, "a") if rank == 0 else None
    for step in range(start, args.steps):
        batch = data(step)
        t0 = time.perf_counter()
        loss = pm.step(batch)
        step_s = time.perf_counter() - t0
        mem = [None] * dist.get_world_size()
        dist.all_gather_object(mem, peak_memory_gib(device))
        if log:  # logged before the checkpoint, so a checkpointed step is always in the log
            rec = {{"step": step + 1, "loss": loss, "step_s": step_s,
                   "tokens_per_s": GLOBAL_BATCH * SEQ_LEN / step_s, "memory_gib": mem}}
            log.write(json.dumps(rec) + "\\n")
            log.flush()
            print(f"step {{step + 1:4d}}  loss {{loss:.4f}}  {{step_s * 1e3:8.1f}} ms  "
                  f"{{rec['tokens_per_s']:,.0f}} tok/s  peak {{max(mem):.2f}} GiB", flush=True)
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            checkpoint.save(pm, args.ckpt_dir)
    if log:
        log.close()
    pm.close()
    teardown()
    exit_process(0)


if __name__ == "__main__":
    main()
'''


def emit(plan: Plan) -> str:
    """The program text for ``plan``."""
    spec = plan.model.get("spec") or plan.model["name"]
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise PlanError(f"model spec {spec!r} in the plan is not a preset, .toml path or package.module:function")
    names = plan.model["layers"]
    stages = [list(s["layers"]) for s in plan.stages]
    for s in stages:
        for n in s:
            if n not in names or not re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)*", n):
                raise PlanError(f"layer name {n!r} in the plan is not a module path")
    est = plan.estimate
    return TEMPLATE.format(
        model_name=plan.model["name"], label=plan.config.label(), world=plan.config.world,
        device="GPU" if plan.cluster.get("backend") == "nccl" else "CPU process", cluster=plan.cluster["name"],
        step_s=float(est["step_s"]), tokens=float(est["tokens_per_s"]), mfu=float(est["mfu"]),
        model=spec, adapter=str(plan.model.get("adapter", "zoo")), vocab=int(plan.model.get("vocab") or 0),
        facts=plan.facts.to_dict(), config=plan.config.to_str(), stages=stages,
        recompute=[s["recompute"] for s in plan.stages],
        tp_layout=dict(plan.tp_layout), global_batch=int(plan.batch["global"]), seq_len=int(plan.batch["seq_len"]),
        memory=[float(x) for x in est.get("memory_gib", [])])


def write_program(plan: Plan, path: str, force: bool = False) -> None:
    write_atomic(path, emit(plan), force=force)
