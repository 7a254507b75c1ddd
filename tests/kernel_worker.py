"""Distributed worker for tests/test_kernel_wiring.py (gloo on CPU).

``python -m torch.distributed.run --nproc-per-node N tests/kernel_worker.py OUT.json`` (or plain
``python`` with RANK/WORLD_SIZE/MASTER_* set for one process) trains the layouts of
:data:`LAYOUTS` for this world size with the plan's kernels on (``loss="fused"``,
``attention="flash"``) and with the eager kernels (``loss="eager"``, ``attention="eager"``),
3 SGD steps on the same seed and data, and compares both with the single-process model
(SDPA + logits cross-entropy). Rank 0 writes JSON: per layout and kernel set, the losses,
the max relative loss error and first-step gradient error against the reference, and the
fused-vs-eager runtime differences.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_worker import (GB, LR, SEED, STEPS, batches, compare, even_stages, reference, tp_layout_for,  # noqa: E402
                         units_of)
from codegen.runtime.mesh import init_distributed  # noqa: E402
from codegen.runtime.train import parallelize  # noqa: E402
from planner import zoo  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402
from worker_io import failure, finish, report  # noqa: E402

SEQ = 32
# (name, ParallelConfig kwargs, number of virtual stages)
LAYOUTS = {
    1: [("pp1", dict(), 1)],
    2: [("tp2-sp", dict(tp=2, sp=True), 1),
        ("pp2-1f1b", dict(pp=2, schedule="1f1b"), 2),
        ("cp2-zigzag", dict(cp=2), 1),
        ("cp2-ulysses", dict(cp=2, ulysses=2), 1)],
}
KERNELS = {"kernels": dict(loss="fused", attention="flash"), "eager": dict(loss="eager", attention="eager")}
MODELS = ("llama-tiny", "gpt-tiny")


CALLS = {"linear_loss": 0, "flash_attention": 0}


def _count(name: str):
    """Wrap ``codegen.runtime.kernels.<name>`` to count its calls (proves the kernel path ran)."""
    from codegen.runtime import kernels as kern
    fn = getattr(kern, name)

    def wrapped(*a, **k):
        CALLS[name] += 1
        return fn(*a, **k)
    setattr(kern, name, wrapped)


def run(model_name: str, cfg_kw: dict, n_virtual: int, data, layout: dict):
    for k in CALLS:
        CALLS[k] = 0
    cfg = zoo.preset(model_name)
    pc = ParallelConfig(dtype="fp32", mbs=1, **cfg_kw).validate()
    model = zoo.build_model(cfg, device="meta")
    stages = even_stages(units_of(model), n_virtual)
    pm = parallelize(model, pc, stages, ["none"] * n_virtual, layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED)
    block = next(sm.get_submodule(u) for sm in pm.stage_modules for u in sm.units if u in pm.adapter.blocks)
    impl = type(pm.adapter.attention_modules(block)[0].attn_impl).__name__
    losses, grads = [], None
    t0 = time.perf_counter()
    try:
        for s, b in enumerate(data):
            losses.append(pm.step(b))
            if s == 0:
                grads = pm.gradients_for_check()
    finally:
        pm.close()
    calls = torch.tensor([CALLS[k] for k in CALLS], dtype=torch.int64)
    dist.all_reduce(calls)  # summed over ranks (the last pipeline stage is not rank 0)
    return losses, grads, time.perf_counter() - t0, {"attention_impl": impl,
                                                    "calls": dict(zip(CALLS, calls.tolist()))}


def main() -> None:
    out = sys.argv[1]
    init_distributed("gloo")
    _count("linear_loss")
    _count("flash_attention")
    world = dist.get_world_size()
    results: dict = {}
    for model_name in MODELS:
        cfg = zoo.preset(model_name)
        data = [{k: v[:, :SEQ] for k, v in b.items()} for b in batches(cfg, STEPS)]
        ref_losses, ref_grads = reference(cfg, data)
        layout = tp_layout_for(model_name)
        for name, kw, nv in LAYOUTS[world]:
            only = os.environ.get("AUTOPAR_ONLY")
            if only and name not in only.split(","):
                continue
            runs = {}
            for kname, kkw in KERNELS.items():
                key = f"{model_name}/{name}/{kname}"
                try:
                    losses, grads, dt, info = run(model_name, {**kw, **kkw}, nv, data, layout)
                    runs[kname] = (losses, grads)
                    results[key] = {"losses": losses, "ref_losses": ref_losses, "seconds": dt,
                                    **info, **compare(grads, ref_grads, losses, ref_losses)}
                except Exception as exc:  # report, keep going
                    results[key] = failure(exc)
                report(key, results[key])
            if len(runs) == 2:  # the kernels against the eager runtime
                (lk, gk), (le, ge) = runs["kernels"], runs["eager"]
                results[f"{model_name}/{name}/vs-eager"] = compare(gk, ge, lk, le)
    finish(results, out)


if __name__ == "__main__":
    main()
