"""Per-batch assignment measured on local-cpu:4: llama-mini on packed batches of documents of 32 to
2,048 tokens, the fixed layouts against the same dp x cp ranks assigning each batch.

Rows of ``SEQ`` = 2,048 tokens, ``GLOBAL_BATCH`` rows per step, documents drawn uniformly from
``LENGTHS`` (log-uniform from 32 to 2,048: many short documents, a few long ones; the emitted
program's synthetic packed rows, the same batches for every plan). Per
layout (``LAYOUTS``, pinned with ``--fix``; one micro-batch per step, no recompute):

- **fixed**: ``autopar plan --seq-lens`` then ``autopar run`` (the rows as they come, each dp
  rank its rows, each row over cp ranks);
- **per-batch**: the same plan with ``--per-batch`` (recorded and run when the planner expects
  it to be faster), each batch's documents assigned to groups of the 4 ranks.

``python -m benchmarks.batch_assign_run [--steps N]`` prints predicted and measured median step
times (the per-batch plan's predicted step is its expected step, ``batch.per_batch``), the
machine's load average around each run (it is shared: a loaded machine stretches the measured
steps and the planner's own speed probe alike) and writes
``benchmarks/results/batch_assign_run.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.results import autopar, write_json

MODEL, CLUSTER, GLOBAL_BATCH, SEQ = "llama-mini", "local-cpu:4", 4, 2048
LENGTHS = [round(32 * 2 ** (k / 8)) for k in range(49)]  # 32 .. 2048 tokens, log-uniform
LAYOUTS = {"dp4": "dp=4,pp=1,cp=1,tp=1,mbs=1,recompute=none,world=4",
           "dp2xcp2": "dp=2,pp=1,cp=2,ulysses=1,tp=1,mbs=2,recompute=none,world=4",
           "cp4": "dp=1,pp=1,cp=4,ulysses=1,tp=1,mbs=4,recompute=none,world=4"}


def run_case(layout: str, pins: str, per_batch: bool, steps: int, work: str) -> dict:
    """Plan and run one case; returns its predicted and measured figures."""
    from planner.entry.launch import compare_run

    name = f"{layout}-{'per-batch' if per_batch else 'fixed'}"
    plan = os.path.join(work, f"{name}.json")
    lens = os.path.join(work, "lengths.txt")
    with open(lens, "w") as fh:
        fh.write("\n".join(map(str, LENGTHS)) + "\n")
    autopar("plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", str(GLOBAL_BATCH), "--seq-len",
             str(SEQ), "--fix", pins, "--seq-lens", lens, *(["--per-batch"] if per_batch else []), "-o", plan)
    with open(plan) as fh:
        record = json.load(fh)["batch"].get("per_batch") or {}
    if per_batch and not record.get("chosen"):
        return {"case": name, "layout": layout, "per_batch": True, "chosen": False, "why": record.get("why")}
    run_dir = os.path.join(work, name)
    load = os.getloadavg()[0]  # the machine is shared: its load says how far to trust the timing
    autopar("run", plan, "--steps", str(steps), "--dir", run_dir)
    c = compare_run(plan, os.path.join(run_dir, "train_log.jsonl"))
    predicted = record["expected_step_s"] if per_batch else c["predicted_step_s"]
    return {"case": name, "layout": layout, "per_batch": per_batch, "chosen": bool(record.get("chosen")),
            "predicted_s": predicted, "measured_s": c["measured_step_s"], "ratio": c["measured_step_s"] / predicted,
            "first_loss": c["first_loss"], "last_loss": c["last_loss"], "record": record,
            "load": [load, os.getloadavg()[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_assign_run.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for layout in args.layouts.split(","):
            for per_batch in (False, True):
                rows.append(run_case(layout, LAYOUTS[layout], per_batch, args.steps, work))
                r = rows[-1]
                if "measured_s" in r:
                    print(f"{r['case']:20s} predicted {r['predicted_s']:7.3f} s  measured {r['measured_s']:7.3f} s  "
                          f"(measured/predicted {r['ratio']:.2f})  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}  "
                          f"load {r['load'][0]:.1f} -> {r['load'][1]:.1f}",
                          flush=True)
                else:
                    print(f"{r['case']:20s} not chosen: {r['why']}", flush=True)
    print("\n| case | predicted | measured | measured / predicted | loss | load (1 min, before -> after) |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        if "measured_s" in r:
            print(f"| {r['case']} | {r['predicted_s']:.3f} s | {r['measured_s']:.3f} s | {r['ratio']:.2f} | "
                  f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['load'][0]:.1f} -> {r['load'][1]:.1f} |")
    write_json(args.out, {"model": MODEL, "cluster": CLUSTER, "global_batch": GLOBAL_BATCH, "seq_len": SEQ,
                          "lengths": LENGTHS, "steps": args.steps, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
