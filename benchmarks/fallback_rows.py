"""The CPU attention fallback alone on ``benchmarks.batch_assign_run``'s rows, timed against its model.

llama-mini's attention (4 query heads, 2 kv heads, head dim 64) over rows of 2,048 tokens packed
with documents of 32-2,048 tokens (the runtime's synthetic rows: ``codegen.runtime.data.
packed_documents`` with the benchmark's ``LENGTHS``; steps 0 and 1 give rows 0-3 and 4-7), one
causal call of the flash kernels' plain-torch fallback (``impl="torch"``) with the rows'
``doc_start``, forward + backward, one thread, one process, cases interleaved rep by rep.

For each case it prints the median seconds and two predictions from
``cost_models.fallback_attention``: ``work x FALLBACK_ELEMENT_S`` (the fitted seconds per score
element per head, for these heads), and the one the CPU estimate makes: this process's own one-document row
(``doc_start`` all 0) times the case's work over that row's (``rank_elements`` at cp 1, mbs the
case's rows). ``--cp N`` runs each case but that reference over a ring of N ranks (the ranks'
blocks one after another, their modelled work summed). ``python -m benchmarks.fallback_rows
[--reps N] [--cp N]``; report the machine's load.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

import torch

from benchmarks.batch_assign_run import LENGTHS, SEQ
from codegen.kernels.attention import flash_attention
from codegen.runtime.data import packed_documents
from cost_models.documents import pack_mix
from cost_models.fallback_attention import FALLBACK_ELEMENT_S, rank_elements

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 64, 768  # llama-mini's attention (planner/zoo/config.py)


def benchmark_rows(rows: int = 8) -> tuple[torch.Tensor, list[list[int]]]:
    """(doc_start [rows, SEQ] int64, each row's document lengths) of the benchmark's first rows."""
    data = packed_documents(VOCAB, 4, SEQ, LENGTHS)
    lens: list[list[int]] = []
    for step in range((rows + 3) // 4):
        cu = data(step)["cu_seqlens"].tolist()
        pieces, row = [b - a for a, b in itertools.pairwise(cu)], []
        for n in pieces:
            row.append(n)
            if sum(row) == SEQ:
                lens.append(row)
                row = []
    starts = torch.zeros(rows, SEQ, dtype=torch.int64)
    for r, row in enumerate(lens[:rows]):
        first = 0
        for n in row:
            starts[r, first:first + n] = first
            first += n
    return starts, lens[:rows]


def time_call(doc_start: torch.Tensor, cp: int = 1) -> float:
    """Seconds of one forward + backward of the fallback over ``doc_start``'s rows: one call at
    ``cp`` 1, else every ring rank's blocks one after another (``RingCompute`` without the
    exchange: each rank's own work, as the profiler times it)."""
    from codegen.runtime.context_parallel import RingCompute
    from codegen.runtime.documents import Documents

    b, total = doc_start.shape[0], 0.0
    docs = Documents()
    docs.set(doc_start)
    for rank in range(cp):
        q = torch.randn(b, HEADS, SEQ // cp, HEAD_DIM, requires_grad=True)
        k, v = (torch.randn(b, KV_HEADS, SEQ // cp, HEAD_DIM, requires_grad=True) for _ in range(2))
        t0 = time.perf_counter()
        if cp == 1:
            out, lse = flash_attention(q, k, v, causal=True, impl="torch", doc_start=doc_start)
            (out.sum() + lse.sum()).backward()
        else:
            RingCompute(cp, rank, flash=True, documents=docs)(q, k, v, causal=True).sum().backward()
        total += time.perf_counter() - t0
    return total


def modelled(lens: list[list[int]], cp: int = 1) -> float:
    """The model's work (score elements per head, summed over the ``cp`` ring ranks) of these
    rows in one micro-batch."""
    mix = pack_mix([n for row in lens for n in row], SEQ)
    return float(rank_elements(mix, 1, cp, mbs=len(lens))[0][0].sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cp", type=int, default=1, help="time every case but the one-document row over a ring")
    args = ap.parse_args()
    os.environ.pop("AUTOPAR_KERNEL_IMPL", None)  # "auto": the fallback on CPU
    torch.set_num_threads(1)
    starts, lens = benchmark_rows(8)
    cases = {"one document": (torch.zeros(1, SEQ, dtype=torch.int64), [[SEQ]]),
             "rows 0-3": (starts[0:4], lens[0:4]), "rows 4-7": (starts[4:8], lens[4:8])}
    cases.update({f"row {r}": (starts[r:r + 1], lens[r:r + 1]) for r in range(8)})
    if args.cp > 1:
        cases["4 x one doc"] = (torch.zeros(4, SEQ, dtype=torch.int64), [[SEQ]] * 4)
    cps = {name: 1 if name == "one document" else args.cp for name in cases}
    times: dict[str, list[float]] = {name: [] for name in cases}
    time_call(starts[0:4], args.cp)  # warm-up
    for _ in range(args.reps):
        for name, (ds, _) in cases.items():
            times[name].append(time_call(ds, cps[name]))
    one = statistics.median(times["one document"])
    one_work = modelled([[SEQ]])
    print(f"load {os.getloadavg()}  torch {torch.__version__}  {args.reps} reps, median s (fwd + bwd), cp {args.cp}")
    print(f"{'case':14s} {'measured':>9s} {'alpha model':>12s} {'ratio':>6s} {'1-doc model':>12s} {'ratio':>6s}")
    for name, (_, rows) in cases.items():
        t, work = statistics.median(times[name]), modelled(rows, cps[name])
        alpha = work * FALLBACK_ELEMENT_S
        rel = one * work / one_work
        print(f"{name:14s} {t:9.3f} {alpha:12.3f} {t / alpha:6.2f} {rel:12.3f} {t / rel:6.2f}")


if __name__ == "__main__":
    main()
