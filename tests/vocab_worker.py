"""torchrun worker: vocabulary passes (planner/vocab_passes.py) against one process.

Each case runs the model with its head split over the pp ranks as vocabulary passes (the blocks
split evenly over the pp ranks, pass j the last virtual stage of rank j) under the interleaved 1F1B
order and a schedule generated for the passes (planner/search/schedule_gen.py on looped(pp, 2)),
3 SGD steps, and reports the worst relative error of the first step's gradients (the head's rows
gathered from the pp ranks) and of the losses (tests/dist_worker.compare), and each rank's local
head rows.

    torchrun --nproc-per-node N tests/vocab_worker.py OUT.json    (or tests/dist_worker.py vocab OUT.json)
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from codegen.runtime.mesh import init_distributed  # noqa: E402
from codegen.runtime.torch_compat import local_tensor  # noqa: E402
from codegen.runtime.train import parallelize  # noqa: E402
from codegen.runtime.vocab_passes import VocabPassStage  # noqa: E402
from planner import vocab_passes as vp  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402
from planner.schedule_ir import builtin, looped  # noqa: E402
from planner.search.schedule_gen import generate  # noqa: E402
from planner.search.stage_split import passes_body  # noqa: E402
from planner.search.vocab_schedule import passes_partition  # noqa: E402

from dist_worker import LR, NORM, compare  # noqa: E402
from model_cases import GB, SEED, SEQ, case, planner_view  # noqa: E402
from worker_io import failure, finish  # noqa: E402

MODELS = ("gpt-tiny", "llama-tiny", "hf-llama")
LAYOUTS = {2: [("pp2", dict(pp=2))], 4: [("pp4", dict(pp=4)), ("dp2xpp2", dict(dp=2, pp=2))]}


def stages_and_schedules(name: str, pp: int, m: int):
    """The passes' stage lists and the two schedules (interleaved order, generated) for case ``name``."""
    g, _, _ = planner_view(name)
    g2 = vp.with_vocab_passes(g, pp)
    part = passes_partition(g, passes_body(g, ParallelConfig(pp=pp)))
    names = [layer.name for layer in g2.layers]
    stages = [names[a:b] for a, b in part.bounds]
    f = [sum(g2.layers[i].fwd_flops for i in range(a, b)) * 1e-9 for a, b in part.bounds]
    gen = generate(f, [2 * x for x in f], m, stage_rank=looped(pp, 2), name="generated+vocab")
    return stages, {"interleaved": builtin("interleaved-1f1b", pp, m, 2), "generated": gen}


def run(name: str, kw: dict, stages, schedule, data):
    c = case(name)
    pc = ParallelConfig(**{"dtype": "fp32", "mbs": 1, "vpp": 2, "schedule": "custom", "vocab_passes": True,
                           **kw}).validate()
    _, layout, facts = planner_view(name)
    pm = parallelize(c.build(c.parallel_device), pc, stages, ["none"] * len(stages), layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED, facts=facts,
                     schedule=schedule)
    rows = [list(local_tensor(sm.weight).shape) for sm in pm.stage_modules if isinstance(sm, VocabPassStage)]
    losses, grads = [], None
    for s, b in enumerate(data):
        losses.append(pm.step(b))
        if s == 0:
            grads = pm.gradients_for_check()
            grads[NORM] = torch.tensor(pm.clip_grad_norm_(None), dtype=torch.float64)
    pm.close()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    return losses, grads, every


def checkpoint_case(ckpt_dir: str) -> dict:
    """llama-tiny pp2 with passes (zero1, AdamW, the generated schedule): 4 steps uninterrupted; 2
    steps, a checkpoint; a fresh build resumed from it for the last 2 (the head's rows saved and
    loaded per pp rank)."""
    from codegen.runtime import checkpoint as ck
    name, c = "llama-tiny", case("llama-tiny")
    data = c.batches(4)
    stages, schedules = stages_and_schedules(name, 2, GB)
    _, layout, facts = planner_view(name)

    def build():
        pc = ParallelConfig(dtype="fp32", mbs=1, pp=2, vpp=2, schedule="custom", vocab_passes=True,
                            zero="zero1").validate()
        return parallelize(c.build(c.parallel_device), pc, stages, ["none"] * 4, layout, GB, SEQ, "cpu",
                           optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=1e-3), seed=SEED, facts=facts,
                           schedule=schedules["generated"])
    pm = build()
    full = [float(pm.step(b)) for b in data]
    pm.close()
    pm = build()
    [pm.step(b) for b in data[:2]]
    ck.save(pm, ckpt_dir)
    pm.close()
    pm = build()
    step = ck.load_latest(pm, ckpt_dir)
    resumed = [float(pm.step(b)) for b in data[step:]]
    pm.close()
    return {"uninterrupted": full, "resumed_from": step, "resumed": resumed}


def vocab_group(world: int, work_dir: str | None = None) -> dict:
    """Every model under every layout of ``world`` ranks and both schedules (module docstring); with
    ``work_dir`` on 2 ranks, also :func:`checkpoint_case` under it."""
    results: dict = {}
    if work_dir is not None and world == 2:
        try:
            results["ckpt"] = checkpoint_case(os.path.join(work_dir, "vocab_ckpt"))
        except Exception as exc:  # noqa: BLE001 - reported
            results["ckpt"] = failure(exc)
    for name in MODELS:
        c = case(name)
        data = c.batches(3)
        ref_losses, ref_grads = c.reference(data, LR)
        for label, kw in LAYOUTS[world]:
            stages, schedules = stages_and_schedules(name, kw["pp"], GB // kw.get("dp", 1))
            for sname, sched in schedules.items():
                key = f"{name}/{label}-{sname}"
                try:
                    losses, grads, rows = run(name, kw, stages, sched, data)
                    results[key] = {**compare(grads, ref_grads, losses, ref_losses), "rows": rows}
                except Exception as exc:  # noqa: BLE001 - reported per case
                    results[key] = failure(exc)
    return results


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    finish(vocab_group(dist.get_world_size(), os.path.dirname(os.path.abspath(out))), out)


if __name__ == "__main__":
    main()
