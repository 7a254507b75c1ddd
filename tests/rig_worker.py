"""Measured by tests/test_netns_rig.py on the two-region rig: one-way throughput of a send
within region 0 (rank 0 -> 1) and across the cut (rank 0 -> the first rank of region 1).
Rank 0 writes {"within_mbit": ..., "across_mbit": ...} as JSON to argv[1]."""
import json
import sys
import time

import torch
import torch.distributed as dist

MB = 4


def one_way(src: int, dst: int, x: torch.Tensor, repeats: int = 3) -> float:
    """Best Mbit/s of ``repeats`` sends of ``x`` from ``src`` to ``dst``, barriers around each."""
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if dist.get_rank() == src:
            dist.send(x, dst)
        elif dist.get_rank() == dst:
            dist.recv(x, src)
        dist.barrier()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() * 8 / 1e6 / best


def main() -> None:
    dist.init_process_group("gloo")
    x = torch.zeros(MB * 2**20 // 4)
    half = dist.get_world_size() // 2
    within = one_way(0, 1, x)
    across = one_way(0, half, x)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"within_mbit": within, "across_mbit": across}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
