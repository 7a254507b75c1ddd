"""What a gloo collective adds to a step when it follows compute, against the profiler's back-to-back time.

``torchrun --nproc-per-node 4 -m benchmarks.collective_in_step`` (the ranks pinned as the runtime pins
them, ``codegen.runtime.mesh.init_distributed``); the table also lands in
``benchmarks/results/collective_in_step.json`` (ms per group size). For groups of 4 and of 2 consecutive ranks, all
groups at once, each all-to-all (64 B, as the EP count exchange; 128 KiB, as moe-fid's dispatch at
mbs 2 x 64 tokens) is timed four ways, each the median of 5 loops of 60 iterations, the slowest rank:

- back-to-back (what ``cost_models.profile_comm.measure_collectives`` stores, from batches of back-to-back calls);
- after a compute chunk (8 x a 256 x 256 GEMM + tanh), less the chunk alone;
- the 128 KiB call right after the 64 B one (the dispatch after the count exchange), less both before it.

The difference between "after compute" and back-to-back is what ``cost_models.shared_cores.sync_wait_s``
prices (1.5 ms per call on 2 cores shared by 4 ranks). Measured 2026-12-04 10:19 UTC, local 2-core
VM, load 2-3.7 (ms): group of 4: 64 B 2.25 b2b / +3.18 after compute, 128 KiB 2.26 / +3.14, 128 KiB
after the 64 B call +2.67; group of 2 (its members on different cores): 64 B 0.60 / +0.72, 128 KiB
0.91 / +0.77, after the 64 B call +0.89; again at 10:20 (load 1.6-2.7): group of 4: 2.32 / +3.50, 2.54 /
+3.46, +2.49; group of 2: 0.50 / +0.70, 0.93 / +0.72, +0.81. So a group holding two ranks of a core
pays about 0.4-1.2 ms per call beyond its back-to-back time after compute and about nothing right
after another call of the group, and a group with one rank per core about nothing either way; the
estimate charges both 1.5 ms (not changed: dropping it for one-rank-per-core groups moved moe-fid
dp4 ep2 fsdp from +18.5% to +6.5% but the TP layouts, already under-predicted, by 8-21 points the
wrong way: their missing time lies elsewhere).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

from benchmarks.results import write_json

OUT = "benchmarks/results/collective_in_step.json"


def _loop(body: Callable[[], object], iters: int) -> float:
    import torch.distributed as dist

    body()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        body()
    dist.barrier()
    return (time.perf_counter() - t0) / iters


def timed_ms(body: Callable[[], object], iters: int = 60, loops: int = 5) -> float:
    """Milliseconds per iteration of ``body``: the median of ``loops`` loops, the slowest rank's."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([statistics.median(_loop(body, iters) for _ in range(loops))], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() * 1e3


def main() -> int:
    import torch
    import torch.distributed as dist

    from codegen.runtime.mesh import init_distributed

    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    table: dict[str, dict[str, float]] = {}  # group size -> ms per timing

    def compute() -> torch.Tensor:
        y = a
        for _ in range(8):
            y = torch.tanh(y @ b)
        return y

    for n in sorted({k for k in (world, 2) if k > 1 and world % k == 0}, reverse=True):  # once each
        group = [dist.new_group(list(range(i, i + n))) for i in range(0, world, n)][rank // n]

        def a2a(nbytes: int) -> Callable[[], object]:
            x = torch.ones(max(n, nbytes // 4 // n * n))
            out = torch.empty_like(x)
            return lambda: dist.all_to_all_single(out, x, group=group)

        counts, rows = a2a(64), a2a(128 * 1024)
        t = {name: timed_ms(body) for name, body in (
            ("C", compute), ("C+c", lambda: (compute(), counts())), ("C+c+r", lambda: (compute(), counts(), rows())),
            ("C+r", lambda: (compute(), rows())), ("r", rows), ("c", counts))}
        table[str(n)] = t
        if rank == 0:
            print(f"group of {n}: 64 B {t['c']:.2f} back-to-back / +{t['C+c'] - t['C']:.2f} after compute; "
                  f"128 KiB {t['r']:.2f} / +{t['C+r'] - t['C']:.2f}, after the 64 B call "
                  f"+{t['C+c+r'] - t['C+c']:.2f} ms (compute chunk {t['C']:.2f} ms)", flush=True)
    if rank == 0:
        write_json(OUT, {"world": world, "ms": table})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
