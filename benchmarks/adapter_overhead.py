"""Adapter overhead: step time of a transformers Llama and the zoo Llama of the same size, same plan.

``python -m benchmarks.adapter_overhead`` launches ``--nproc`` gloo processes once; in it,
for each layout (dp2 ddp, pp2 1F1B, tp2 + SP) and each of ``--repeats`` rounds, both models
(built on meta, initialised by their adapters) are parallelised with the same
configuration and the planner's even stage split, run ``--warmup`` steps, then
``--steps`` timed steps; a round's figure is the median step. The table gives, per
layout, the median over rounds for each model, the HF / zoo ratio, and the run-to-run
noise: the largest relative spread of one model's round medians. Writes JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {"dp2-ddp": dict(dp=2, zero="ddp"), "pp2-1f1b": dict(pp=2, schedule="1f1b"), "tp2-sp": dict(tp=2, sp=True)}


def _models(size: dict):
    """(name, build on meta, graph, batch maker) for the zoo Llama and its transformers twin."""
    import torch

    from planner import zoo
    from planner.frontend.load import example_for_module, graph_of

    cfg = zoo.preset("llama-tiny").replace(name="llama-bench", **size)
    seq = cfg.seq_len
    zoo_g = graph_of(zoo.build_model(cfg, "meta"), zoo.example_batch(cfg, 1, seq, device="meta"), name="zoo",
                     seq_len=seq, hidden=cfg.hidden, vocab=cfg.vocab)

    def hf_build():
        with torch.device("meta"):
            return zoo.build_hf_model(cfg)

    hf_model = hf_build()
    hf_g = graph_of(hf_model, example_for_module(hf_model, 1, seq), name="hf", seq_len=seq)
    return cfg, [("zoo", lambda: zoo.build_model(cfg, "meta"), zoo_g, False), ("hf", hf_build, hf_g, True)]


def _round(build, graph, shifts, cfg, pc, gb: int, steps: int, warmup: int) -> float:
    import torch

    from codegen.runtime.train import parallelize
    from planner.search.candidates import facts_of
    from planner.search.stage_split import even_split
    from planner.frontend.tp_layout import tp_layout

    names = [l.name for l in graph.layers]
    stages = [names[a:b] for a, b in even_split(graph, pc.pp * pc.vpp).bounds]
    pm = parallelize(build(), pc, stages, ["none"] * len(stages), tp_layout(graph), gb, cfg.seq_len, "cpu", seed=0,
                     facts=facts_of(graph), optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (gb, cfg.seq_len + 1), generator=g)
    batch = ({"input_ids": ids[:, :-1], "labels": ids[:, :-1]} if shifts
             else {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pm.step(batch)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    pm.close()
    return statistics.median(times)


def worker(args) -> None:
    import torch.distributed as dist

    from codegen.runtime.mesh import exit_process, init_distributed, teardown
    from planner.plan import ParallelConfig

    init_distributed()
    size = dict(hidden=args.hidden, ffn_hidden=args.hidden * 8 // 3 // 8 * 8, heads=args.heads, kv_heads=args.heads // 2,
                layers=args.layers, vocab=args.vocab, seq_len=args.seq_len, max_seq_len=args.seq_len)
    cfg, models = _models(size)
    rows = {}
    for lname, kw in LAYOUTS.items():
        pc = ParallelConfig(dtype="fp32", mbs=1, **kw).validate()
        per = {name: [] for name, *_ in models}
        for r in range(args.repeats):
            order = models if r % 2 == 0 else models[::-1]  # alternate which model runs first
            for name, build, graph, shifts in order:
                per[name].append(_round(build, graph, shifts, cfg, pc, args.global_batch, args.steps, args.warmup))
        med = {n: statistics.median(v) for n, v in per.items()}
        noise = max((max(v) - min(v)) / statistics.median(v) for v in per.values())
        rows[lname] = {"zoo_s": med["zoo"], "hf_s": med["hf"], "ratio": med["hf"] / med["zoo"], "noise": noise,
                       "rounds": per}
    if dist.get_rank() == 0:
        from benchmarks.results import write_json
        print(f"llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, seq {args.seq_len}, global batch "
              f"{args.global_batch}, local-cpu:{dist.get_world_size()}, fp32; median step over {args.repeats} rounds "
              f"of {args.steps} steps")
        print(f"{'layout':<10} {'zoo s':>8} {'hf s':>8} {'hf/zoo':>7} {'noise':>7}")
        for lname, r in rows.items():
            print(f"{lname:<10} {r['zoo_s']:8.4f} {r['hf_s']:8.4f} {r['ratio']:7.3f} {r['noise'] * 100:6.1f}%")
        write_json(args.out, {"args": vars(args), "rows": rows})
    teardown()
    exit_process(0)  # the gloo exit abort (codegen/runtime/mesh.py)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.adapter_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/adapter_overhead.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import subprocess

    from planner.entry.launch import torchrun_cmd, worker_env
    cmd = torchrun_cmd(args.nproc, ["-m", "benchmarks.adapter_overhead", "--worker",
                                    *[a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]])
    env = dict(worker_env(1), PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
