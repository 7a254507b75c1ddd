"""Distributed worker for tests/test_seq_chunks.py (torchrun, gloo on CPU): every layout of
``LAYOUTS[world]`` runs each micro-batch's sequence as k chunks (Seq1F1B) and trains the zoo's
llama-tiny (RoPE) and gpt-tiny (learned positions) and transformers' Llama for 3 SGD steps in one
launch; rank 0 writes, per (model, layout), the worst relative loss and first-step gradient
errors against one process (fp32).

``python -m torch.distributed.run --nproc-per-node N tests/seq_chunks_worker.py OUT.json``
"""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from codegen.runtime.mesh import init_distributed  # noqa: E402
from dist_worker import LR, STEPS, compare, run_layout  # noqa: E402
from model_cases import case  # noqa: E402
from worker_io import failure, finish, report  # noqa: E402

MODELS = ("llama-tiny", "gpt-tiny", "hf-llama")
# (name, ParallelConfig kwargs, virtual stages)
LAYOUTS = {
    2: [("pp2-1f1b-k2", dict(pp=2, schedule="1f1b", seq_chunks=2), 2),
        ("pp2-1f1b-k4", dict(pp=2, schedule="1f1b", seq_chunks=4), 2)],
    4: [("pp4-1f1b-k2", dict(pp=4, schedule="1f1b", seq_chunks=2), 4),
        ("pp4-gpipe-k4", dict(pp=4, schedule="gpipe", seq_chunks=4), 4),
        ("pp2xdp2-fsdp-k4", dict(pp=2, dp=2, zero="fsdp", schedule="1f1b", seq_chunks=4), 2)],
}


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    world = dist.get_world_size()
    results = {}
    for model_name in MODELS:
        c = case(model_name)
        data = c.batches(STEPS)
        ref_losses, ref_grads = c.reference(data, LR)
        for name, kw, n_virtual in LAYOUTS[world]:
            key = f"{model_name}/{name}"
            try:
                losses, grads, dt = run_layout(model_name, kw, n_virtual, data)
                results[key] = {"losses": losses, "ref_losses": ref_losses, "seconds": dt,
                                **compare(grads, ref_grads, losses, ref_losses)}
            except Exception as exc:  # report, keep going with the other layouts
                results[key] = failure(exc)
            report(key, results[key])
    finish(results, out)


if __name__ == "__main__":
    main()
