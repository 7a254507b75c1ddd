"""Packed short documents on local-cpu: measured step time with document masks against without,
and predicted against measured for both.

One sequence length (``SEQ`` tokens per row) of llama-mini, each row packing whole documents
drawn uniformly from ``LENGTHS`` (the synthetic source of ``codegen.runtime.data.
packed_documents``). Per layout (``LAYOUTS``, pinned with ``--fix``):

- **masked**: planned with ``--seq-lens`` (the cost model prices the documents' attention),
  run on batches that carry ``cu_seqlens`` (attention within each document, positions per
  document, the ring skipping blocks no local query sees);
- **unmasked**: planned as one sequence per row, run on the same tokens without
  ``cu_seqlens`` (causal attention over the whole row).

``python -m benchmarks.packed_documents [--steps N]`` plans and runs each (``autopar plan``,
``autopar run --data benchmarks.packed_documents:masked|unmasked``) and writes
``benchmarks/results/packed_documents.json`` and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.results import autopar

MODEL, CLUSTER, GLOBAL_BATCH, SEQ = "llama-mini", "local-cpu:4", 4, 2048
LENGTHS = list(range(32, 257, 16))          # tokens; a document's length is drawn uniformly from these
LAYOUTS = {"dp4": "dp=4,pp=1,cp=1,tp=1,recompute=none", "cp4": "dp=1,pp=1,cp=4,ulysses=1,tp=1,recompute=none"}
VOCAB = 768                                 # llama-mini's


def masked(step: int, global_batch: int, seq_len: int) -> dict:
    """The ``--data`` hook of the masked runs: packed documents with their ``cu_seqlens``."""
    from codegen.runtime.data import packed_documents
    return packed_documents(VOCAB, global_batch, seq_len, LENGTHS)(step)


def unmasked(step: int, global_batch: int, seq_len: int) -> dict:
    """The same tokens without ``cu_seqlens``: one causal sequence per row."""
    b = masked(step, global_batch, seq_len)
    del b["cu_seqlens"]
    return b


def run_case(layout: str, pins: str, docs: bool, steps: int, work: str) -> dict:
    """Plan and run one case; returns its predicted and measured figures."""
    from planner.entry.launch import compare_run

    name = f"{layout}-{'masked' if docs else 'unmasked'}"
    plan = os.path.join(work, f"{name}.json")
    lens = os.path.join(work, "lengths.txt")
    with open(lens, "w") as fh:
        fh.write("\n".join(map(str, LENGTHS)) + "\n")
    autopar("plan", "--model", MODEL, "--cluster", CLUSTER, "--global-batch", str(GLOBAL_BATCH),
             "--seq-len", str(SEQ), "--fix", pins, *(["--seq-lens", lens] if docs else []), "-o", plan)
    run_dir = os.path.join(work, name)
    autopar("run", plan, "--steps", str(steps), "--dir", run_dir,
             "--data", f"benchmarks.packed_documents:{'masked' if docs else 'unmasked'}")
    c = compare_run(plan, os.path.join(run_dir, "train_log.jsonl"))
    return {"case": name, "layout": layout, "documents": docs, "predicted_s": c["predicted_step_s"],
            "measured_s": c["measured_step_s"], "ratio": c["ratio"], "first_loss": c["first_loss"],
            "last_loss": c["last_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "packed_documents.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for layout, pins in LAYOUTS.items():
            for docs in (True, False):
                rows.append(run_case(layout, pins, docs, args.steps, work))
                r = rows[-1]
                print(f"{r['case']:16s} predicted {r['predicted_s']:7.3f} s  measured {r['measured_s']:7.3f} s  "
                      f"({r['ratio']:.2f}x)  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}", flush=True)
    by = {(r["layout"], r["documents"]): r for r in rows}
    print("\n| layout | masked predicted | masked measured | unmasked predicted | unmasked measured | "
          "measured speed-up | predicted speed-up |\n|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        m, u = by[(layout, True)], by[(layout, False)]
        print(f"| {layout} | {m['predicted_s']:.3f} s | {m['measured_s']:.3f} s | {u['predicted_s']:.3f} s | "
              f"{u['measured_s']:.3f} s | {u['measured_s'] / m['measured_s']:.2f}x | "
              f"{u['predicted_s'] / m['predicted_s']:.2f}x |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"model": MODEL, "cluster": CLUSTER, "global_batch": GLOBAL_BATCH, "seq_len": SEQ,
                   "lengths": LENGTHS, "steps": args.steps, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
