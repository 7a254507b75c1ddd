"""Per-step metrics of emitted programs, gathered with tensors (no pickled objects), and their
TensorBoard scalars (:class:`ScalarLog`)."""
from __future__ import annotations

import os
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


TB_DIR = "tensorboard"  # beside the JSON-lines log
TB_SCALARS = ("loss", "lr", "grad_norm", "step_s", "tokens_per_s")


class ScalarLog:
    """TensorBoard scalars of every step (``train/<key>`` of :data:`TB_SCALARS` and
    ``memory/peak_gib``, the largest rank's) in ``<folder of the JSON-lines log>/tensorboard``,
    when the ``tensorboard`` package is installed (torch's ``SummaryWriter`` needs it); without
    it nothing is written and the JSON lines are the only log. A run resumed from step
    ``start`` hides the events after it, as the JSON-lines log drops those steps (they run
    again). Rank 0 keeps one; a context manager (closing flushes the events file)."""

    def __init__(self, metrics_path: str, start: int = 0):
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        folder = os.path.join(os.path.dirname(os.path.abspath(metrics_path)), TB_DIR)
        self.writer = SummaryWriter(log_dir=folder, purge_step=start + 1 if start else None)

    def write(self, rec: dict) -> None:
        """One step's record, as written to the JSON-lines log (``step``, ``loss``, ...)."""
        if self.writer is None:
            return
        for key in TB_SCALARS:
            if isinstance(rec.get(key), (int, float)):
                self.writer.add_scalar(f"train/{key}", rec[key], rec["step"])
        if rec.get("memory_gib"):
            self.writer.add_scalar("memory/peak_gib", max(rec["memory_gib"]), rec["step"])

    def __enter__(self) -> "ScalarLog":
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
