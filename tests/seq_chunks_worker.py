"""Distributed worker for tests/test_seq_chunks.py (torchrun, gloo on CPU): every layout of
``LAYOUTS[world]`` runs each micro-batch's sequence as k chunks (Seq1F1B) and trains the zoo's
llama-tiny (RoPE) and gpt-tiny (learned positions) and transformers' Llama for 3 SGD steps in one
launch (the ``custom`` layouts run 1F1B with a deeper warm-up: ``planner.schedule_ir.deep_warmup``); rank 0 writes, per (model, layout), the worst relative loss and first-step gradient
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
from dist_worker import layout_parity, run_layout  # noqa: E402
from model_cases import GB  # noqa: E402
from planner import schedule_ir as ir  # noqa: E402
from worker_io import finish  # noqa: E402

MODELS = ("llama-tiny", "gpt-tiny", "hf-llama")
# (name, ParallelConfig kwargs, virtual stages)
LAYOUTS = {
    2: [("pp2-1f1b-k2", dict(pp=2, schedule="1f1b", seq_chunks=2), 2),
        ("pp2-1f1b-k4", dict(pp=2, schedule="1f1b", seq_chunks=4), 2),
        ("pp2-1f1b-deep-k2", dict(pp=2, schedule="custom", seq_chunks=2), 2)],
    4: [("pp4-1f1b-k2", dict(pp=4, schedule="1f1b", seq_chunks=2), 4),
        ("pp4-gpipe-k4", dict(pp=4, schedule="gpipe", seq_chunks=4), 4),
        ("pp2xdp2-fsdp-k4", dict(pp=2, dp=2, zero="fsdp", schedule="1f1b", seq_chunks=4), 2),
        ("pp4-1f1b-deep-k2", dict(pp=4, schedule="custom", seq_chunks=2), 4)],
}
DEEP_CUT = {2: 0, 4: 1}  # custom layouts: 1F1B with two more units in flight up to this pp rank (a WAN cut's)


def _run(model_name: str, layout: list, data) -> tuple:
    kw, n_virtual = layout
    schedule = None
    if kw["schedule"] == "custom":  # the search's deeper warm-up before a WAN cut (planner/search/wan_warmup.py)
        m = GB // kw.get("dp", 1)
        schedule = ir.one_f_one_b(kw["pp"], m, kw["seq_chunks"], ir.deep_warmup(kw["pp"], DEEP_CUT[kw["pp"]], 2))
    return (*run_layout(model_name, kw, n_virtual, data, schedule), {})


def main() -> None:
    init_distributed()
    finish(layout_parity(MODELS, LAYOUTS[dist.get_world_size()], _run), sys.argv[1])


if __name__ == "__main__":
    main()
