"""Per-step metrics of emitted programs, gathered with tensors (no pickled objects)."""
from __future__ import annotations

import resource

import torch
import torch.distributed as dist


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory, GiB: allocated device memory on CUDA, peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def peak_memory_per_rank(device: torch.device) -> list[float]:
    """Every rank's :func:`peak_memory_gib`, indexed by global rank, on every rank: one
    ``all_reduce`` (MAX) of a world-sized float64 tensor on ``device`` (nccl reduces device
    tensors only). Collective."""
    mem = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    mem[dist.get_rank()] = peak_memory_gib(device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    return mem.tolist()
