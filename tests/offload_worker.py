"""Distributed worker for tests/test_offload.py (torchrun, gloo on CPU): every layout of
``LAYOUTS[world]`` with activation offload on some stages trains llama-tiny (the zoo) and
transformers' Llama for 3 SGD steps in one launch; rank 0 writes, per (model, layout), the
worst relative loss and first-step gradient errors against one process (fp32).

``python -m torch.distributed.run --nproc-per-node N tests/offload_worker.py OUT.json``
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from codegen.runtime.mesh import init_distributed  # noqa: E402
from dist_worker import layout_parity, run_layout  # noqa: E402
from worker_io import finish  # noqa: E402

MODELS = ("llama-tiny", "hf-llama")
# (name, ParallelConfig kwargs, recompute policy per virtual stage)
LAYOUTS = {
    2: [("dp2-ddp-offload", dict(dp=2, zero="ddp", recompute="offload"), ["offload"]),
        ("dp2-fsdp-offload", dict(dp=2, zero="fsdp", recompute="offload"), ["offload"]),
        ("tp2-sp-offload", dict(tp=2, sp=True, recompute="offload"), ["offload"]),
        # keep / offload per stage, and a split backward (a second read of each saved tensor)
        ("pp2-1f1b-offload-keep", dict(pp=2, schedule="1f1b"), ["offload", "none"]),
        ("pp2-zb-h1-offload", dict(pp=2, schedule="zb-h1"), ["offload", "offload"])],
    4: [("pp4-1f1b-mixed", dict(pp=4, schedule="1f1b"), ["offload", "full", "none", "offload"]),
        ("pp2xdp2-fsdp-offload", dict(pp=2, dp=2, zero="fsdp", schedule="1f1b"), ["none", "offload"]),
        ("pp2-interleaved-offload", dict(pp=2, dp=2, schedule="interleaved-1f1b", vpp=2),
         ["offload", "selective", "offload", "none"])],
}


def _moved(pm) -> list[int]:
    """Per rank: bytes of saved activations its offloaded blocks copied to host, and how many
    tensors they copied back."""
    mine = torch.tensor([sum(o.moved_bytes for o in pm.offloaders), sum(o.reloads for o in pm.offloaders)])
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _run(model_name: str, layout: list, data) -> tuple:
    kw, policies = layout
    moved: list = []
    losses, grads, dt = run_layout(model_name, kw, len(policies), data, policies=policies,
                                   before_close=lambda pm: moved.append(_moved(pm)))
    return losses, grads, dt, {"offloaded_bytes": moved[0]}


def main() -> None:
    init_distributed()
    finish(layout_parity(MODELS, LAYOUTS[dist.get_world_size()], _run), sys.argv[1])


if __name__ == "__main__":
    main()
