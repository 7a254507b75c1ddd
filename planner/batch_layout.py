"""Per-batch assignment's fixed-layout side (contract: numpy and the standard library, beside
:mod:`planner.batch_assign`, whose cost terms it reuses): :func:`static_work` prices a batch on
the fixed layout (rows of ``row_len`` tokens, one block of rows per dp rank, each row split
zigzag over ``cp`` ranks), the "before" of an :class:`planner.batch_assign.Assignment`;
:func:`pipeline_step` a step of a pipeline over its micro-batches' times.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from planner.batch_assign import PAD_CHUNKS, AssignError, WorkCost, ring_exposed, row_rank_pairs


def static_work(lengths: Sequence[int], row_len: int, dp: int, cp: int, cost: WorkCost) -> tuple[float, ...]:
    """Per worker (``d * cp + c``) seconds of the batch on the fixed layout: the pieces fill rows
    of ``row_len`` tokens in order (row ends fall on multiples of ``row_len`` of their running
    sum), dp rank ``d`` takes the ``d``-th block of consecutive rows (as
    ``ParallelModel.local_batch`` cuts them), each row split zigzag over ``cp`` ranks (ring:
    exact per-rank pairs, :func:`row_rank_pairs`, the ring's transfers hidden behind each
    rank's visiting pairs; Ulysses: every rank ``1 / cp`` of each document's heads, the
    all-to-alls exposed)."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    total = int(lens.sum())
    if total == 0 or total % (row_len * dp) or (cp > 1 and row_len % (PAD_CHUNKS * cp)):
        raise AssignError(f"{total} tokens do not make whole rows of {row_len} for {dp} dp ranks split over "
                          f"cp = {cp} (rows must split into {PAD_CHUNKS * cp} chunks)")
    ring = 1 if cost.method == "ulysses" else cp
    tot, vis = row_rank_pairs(lens, row_len, ring)
    tot, vis = tot * ring / cp, vis * ring / cp                           # Ulysses: 1 / cp of every row's heads
    per_row = (cost.linear * row_len / cp + 2 * cost.attention * tot
               + ring_exposed(row_len / cp, cp, 2 * cost.attention * vis, cost))   # [rows, cp] (or [rows, 1])
    work = np.broadcast_to(per_row, (per_row.shape[0], cp)).reshape(dp, -1, cp).sum(axis=1)
    return tuple(float(x) for x in work.reshape(-1))


def pipeline_step(times: Sequence[float], pp: int) -> float:
    """Seconds of a gpipe / 1f1b step whose micro-batches take ``times`` per stage: all of them,
    plus ``pp - 1`` of the slowest filling and draining the pipeline (exact for equal times)."""
    return float(sum(times) + (pp - 1) * max(times))
