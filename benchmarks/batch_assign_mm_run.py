"""Multimodal per-batch assignment measured on local-cpu:4: the fixed data-parallel split against
the per-batch planner's assignment of the same batches (codegen/runtime/multimodal.py).

A small vision + language model (mllm-tiny widened: 4 ViT blocks of 128 on 32 px images of 64
patches, 4 decoder blocks of 128), fp32, 4 gloo ranks (dp4), ``SAMPLES`` samples per step with
images per sample drawn from ``IMAGES`` and ``TEXT`` text tokens each. Rates: measured first on
rank 0 alone (a text-only sample and one with 4 images: seconds per decoder token and per image)
and given to the planner; its predicted busiest-rank seconds per step are compared with the
measured ones. Per mode: the median step (wall, the slowest rank, after a barrier), the mean over
steps of the busiest rank's CPU seconds (its forward and backward and the all-reduce; less
sensitive than wall time to other processes on the machine), and the predicted busiest rank.

``python -m benchmarks.batch_assign_mm_run [--steps 8]`` launches the 4 ranks (torchrun),
prints a table and writes ``benchmarks/results/batch_assign_mm_run.json``. The machine may be
shared: the load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.results import write_json
from planner.entry.launch import worker_env

SAMPLES, TEXT, SEED = 16, 64, 0
IMAGES = {0: 0.45, 1: 0.3, 4: 0.15, 8: 0.1}
WIDER = dict(vision_hidden=128, vision_layers=4, vision_heads=4, vision_ffn_hidden=512, image_size=32, hidden=128,
             layers=4, ffn_hidden=352, seq_len=1024)  # seq_len: the longest sample (8 images) fits the RoPE table


def model_config():
    from planner import zoo
    return zoo.preset("mllm-tiny").replace(**WIDER)


def make_batch(cfg, counts: list[int], step: int) -> dict:
    import torch
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    ids = torch.randint(0, cfg.vocab, (len(counts), TEXT + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "image_counts": torch.tensor(counts),
            "pixel_values": torch.randn(sum(counts), cfg.channels, cfg.image_size, cfg.image_size, generator=g)}


def calibrate(model, cfg) -> tuple[float, float]:
    """(seconds per decoder token, seconds per image) of one sample's forward and backward."""
    def timed(n: int) -> float:
        b = make_batch(cfg, [n], 10_000 + n)
        out = []
        for _ in range(4):
            t = time.perf_counter()
            model(b["input_ids"], b["pixel_values"], labels=b["labels"], image_counts=b["image_counts"]).backward()
            out.append(time.perf_counter() - t)
        model.zero_grad()
        return statistics.median(out[1:])
    t0, t4 = timed(0), timed(4)
    linear = t0 / TEXT
    return linear, max(t4 - t0 - linear * 4 * cfg.num_patches, 0.0) / 4


def worker(out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from codegen.runtime.mesh import init_distributed
    from codegen.runtime.multimodal import SampleBalancer, train_step
    from cost_models.multimodal_pricing import sample_image_counts
    from planner import zoo
    from planner.batch_assign import WorkCost

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config()
    model = zoo.build_model(cfg, device="cpu", seed=SEED)
    rates = [calibrate(model, cfg) if rank == 0 else None]
    dist.broadcast_object_list(rates, src=0)
    cost = WorkCost(linear=rates[0][0], attention=0.0, vision=rates[0][1])
    counts = sample_image_counts(IMAGES, SAMPLES, steps, SEED)
    batches = [make_batch(cfg, c, s) for s, c in enumerate(counts)]
    result: dict = {"rates": {"linear": cost.linear, "vision": cost.vision}}
    for mode in ("fixed", "assigned"):
        bal = SampleBalancer(world, rank, cost, 10 ** 9, cfg.num_patches, assign=mode == "assigned")
        walls, cpus, predicted, spreads = [], [], [], []
        for b in batches:
            dist.barrier()
            w, c = time.perf_counter(), time.process_time()
            train_step(model, b, bal)
            model.zero_grad()
            cpu = torch.tensor([time.process_time() - c])
            dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
            wall = torch.tensor([time.perf_counter() - w])
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            walls.append(float(wall))
            cpus.append(float(cpu))
            predicted.append(max(bal.last.assigned))
            spreads.append(bal.last.spread_assigned)
        result[mode] = {"median_step_s": statistics.median(walls[1:]), "busiest_cpu_s": statistics.mean(cpus[1:]),
                        "predicted_busiest_s": statistics.mean(predicted[1:]),
                        "spread": statistics.mean(spreads[1:])}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_assign_mm_run.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    tmp = os.path.join(tempfile.mkdtemp(), "mm.json")
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "-m", "benchmarks.batch_assign_mm_run",
           "--worker", tmp, "--steps", str(args.steps)]
    subprocess.run(cmd, check=True, env=dict(worker_env(1), PYTHONWARNINGS="ignore"))
    with open(tmp) as fh:
        r = json.load(fh)
    r["load_avg"] = [load, os.getloadavg()[0]]
    print(f"mllm-tiny widened, dp4 on local-cpu (gloo), {SAMPLES} samples per step, images {IMAGES}, text {TEXT}; "
          f"{args.steps - 1} timed steps; load average {load:.1f} -> {r['load_avg'][1]:.1f}\n")
    print("| mode | median step (wall) | busiest rank CPU s | predicted busiest s | measured / predicted | spread |\n"
          "|---|---|---|---|---|---|")
    for mode in ("fixed", "assigned"):
        m = r[mode]
        print(f"| {mode} | {m['median_step_s']:.3f} s | {m['busiest_cpu_s']:.3f} | {m['predicted_busiest_s']:.3f} | "
              f"{m['busiest_cpu_s'] / m['predicted_busiest_s']:.2f} | {m['spread']:.2f} |")
    f, a = r["fixed"], r["assigned"]
    print(f"\nassigned vs fixed: wall {f['median_step_s'] / a['median_step_s']:.2f}x, busiest CPU "
          f"{f['busiest_cpu_s'] / a['busiest_cpu_s']:.2f}x, predicted {f['predicted_busiest_s'] / a['predicted_busiest_s']:.2f}x")
    write_json(args.out, dict(r, samples=SAMPLES, text=TEXT, images={str(k): v for k, v in IMAGES.items()},
                              steps=args.steps))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
