"""Per-batch assignment's fixed-layout side (contract: numpy and the standard library, beside
:mod:`planner.batch_assign`, whose cost terms it reuses): :func:`static_work` prices a batch on
the fixed layout (rows of ``row_len`` tokens, one block of rows per dp rank, each row split
zigzag over ``cp`` ranks), the "before" of an :class:`planner.batch_assign.Assignment`;
:func:`pipeline_step` a step of a pipeline over its micro-batches' times; :func:`row_rank_pairs`
the fixed layout's per-rank attention pairs.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from planner.batch_assign import PAD_CHUNKS, AssignError, WorkCost, ring_exposed


def row_rank_pairs(lengths: Sequence[int], row_len: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """(all, visiting) causal query-key pairs, diagonal included, per row and ring rank
    (``[rows, cp]`` arrays) of pieces packed in order into rows of ``row_len`` tokens (row ends
    fall on multiples of ``row_len``; a partial last row is left out), each row split zigzag
    into ``2 cp`` chunks: rank r holds chunks r and 2cp-1-r; a pair is visiting when its key
    lies on another rank's chunks. The one count of a fixed layout's per-rank attention work
    (:func:`static_work`, ``cost_models.documents.busiest_share``)."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    ends = np.cumsum(lens)
    rows = int(ends[-1]) // row_len if lens.size else 0
    row = (ends - lens) // row_len
    keep = row < rows
    row, a, e = row[keep], (ends - lens)[keep] - row[keep] * row_len, ends[keep] - row[keep] * row_len
    total, visiting = np.zeros((rows, cp)), np.zeros((rows, cp))
    if cp == 1:
        np.add.at(total[:, 0], row, ((e - a) * (e - a + 1) / 2).astype(np.float64))
        return total, visiting
    c = row_len // (PAD_CHUNKS * cp)
    ranks = np.arange(cp)
    lo = np.stack([ranks, PAD_CHUNKS * cp - 1 - ranks]) * c             # [2, cp] chunk starts (earlier, later)
    for b in range(0, row.size, 4096):                                   # blocks of pieces: bounded memory
        s_, e_ = a[b:b + 4096, None, None], e[b:b + 4096, None, None]
        x, y = np.maximum(s_, lo[None]), np.minimum(e_, lo[None] + c)   # [pieces, 2, cp] queries in each chunk
        n = np.maximum(y - x, 0).astype(np.float64)
        tot = (n * (x + y + 1 - 2 * s_) / 2).sum(axis=1)
        local = (n * (n + 1) / 2).sum(axis=1) + n[:, 0] * n[:, 1]
        np.add.at(total, row[b:b + 4096], tot)
        np.add.at(visiting, row[b:b + 4096], tot - local)
    return total, visiting


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
