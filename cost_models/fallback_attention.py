"""Packed documents through the flash kernels' plain-torch fallback (CPU): the work it really does.

On a CPU, causal attention over packed documents, and every ring block, runs through
``codegen/kernels/attention_torch.py``: the queries go in blocks of ``CHUNK`` rows (at most a
contiguous run of the rank's positions: a zigzag chunk of ``S / 2cp`` tokens), and each block
computes, masks and multiplies a full rectangle of scores: every row of the micro-batch (``mbs``
rows at once), its ``b`` queries, against the keys from the earliest document start of the block
**over all the micro-batch's rows** to the block's last query. So per block of query positions
``[x, x + b)``::

    elements = mbs x b x (x + b - min over the micro-batch's rows of doc_start[x : x + b])

per head, whatever the documents' own causal pairs are. The pairs (``sum l (l+1) / 2``,
``cost_models.documents.busiest_share``) miss two things: a block holding the end of one
document and the start of the next computes the rectangle back to the first one's start (short
documents: about ``b^2`` per block, not ``sum l^2``), and rows of one micro-batch whose
documents start at different places share the earliest start (two rows of 2,048 tokens with
log-uniform documents of 32-2,048 tokens: about 1.7x the elements of the rows one by one,
measured 2.0-2.4x the time, 2026-12-03, torch 2.13, one thread of a 2-core Xeon).

:func:`fallback_share` is the busiest rank's elements in a fixed layout (``dp`` ranks of ``mbs``
consecutive rows each, rows split zigzag over ``cp`` ranks, a ring rank's work over its
``ulysses`` ranks' heads; every rank waits for the busiest, micro-batch by micro-batch, as in
``busiest_share``), over the mean rank's elements with one document filling every row: 1.0
exactly for rows of one document, so the fallback's measured speed against the fused kernel on
one document (``cost_models.compute.CPU_TORCH_ATTENTION_SLOWDOWN``) prices every other mix.
Cost: one pass over the simulated rows' tokens per (mix, dp, cp, ulysses, mbs), cached.
"""
from __future__ import annotations

import numpy as np

from planner.feasibility import sequence_problem
from planner.graph import DocumentMix


def fallback_chunk() -> int:
    """Query rows per block of the plain-torch fallback (``attention_torch.CHUNK``)."""
    from codegen.kernels.attention_torch import CHUNK
    return CHUNK


def row_doc_starts(mix: DocumentMix) -> np.ndarray:
    """[rows, S] (int64): per token of the mix's simulated rows, its document's first position in
    the row (the runtime's ``doc_start``; pieces never cross a row end)."""
    s = mix.seq_len
    pieces = np.asarray(mix.pieces, dtype=np.int64)
    starts = np.cumsum(pieces) - pieces
    out = np.repeat(starts % s, pieces)
    return out[: mix.rows * s].reshape(mix.rows, s)


def block_bounds(seq_len: int, cp: int, chunk: int) -> np.ndarray:
    """First positions of the fallback's query blocks of a row: each contiguous run of a rank's
    positions (``seq_len / 2cp`` tokens zigzag, the whole row at ``cp`` 1) cut every ``chunk``."""
    run = seq_len // (2 * cp) if cp > 1 else seq_len
    return np.concatenate([np.arange(r, r + run, chunk) for r in range(0, seq_len, run)])


def rank_elements(mix: DocumentMix, dp: int, cp: int, ulysses: int = 1, mbs: int = 1,
                  chunk: int | None = None) -> tuple[np.ndarray, float]:
    """(score elements per head the fallback computes per micro-batch and rank, ``[groups, dp x cp]``
    in mesh order (dp outer, cp inner); the mean rank's with one document filling every row).
    Micro-batches as in ``busiest_share`` (wrapping around fewer rows than one)."""
    s = mix.seq_len
    chunk = chunk or fallback_chunk()
    bounds = block_bounds(s, cp, chunk)
    ends = np.append(bounds[1:], s)
    lo = np.minimum.reduceat(row_doc_starts(mix), bounds, axis=1)           # [rows, blocks]
    k = dp * mbs
    groups = max(mix.rows // k, 1)
    take = np.resize(np.arange(mix.rows), groups * k)
    lo = lo[take].reshape(groups, dp, mbs, -1).min(axis=2)                  # [groups, dp, blocks]
    el = mbs * (ends - bounds) * (ends[None, None] - lo)
    full = mbs * float(((ends - bounds) * ends).sum()) / cp
    if cp == 1:
        return el.sum(axis=2).reshape(groups, dp), full
    run = s // (2 * cp)
    chunk_of = bounds // run
    owner = np.where(chunk_of < cp, chunk_of, 2 * cp - 1 - chunk_of) // ulysses   # the ring rank
    ring = np.stack([el[:, :, owner == r].sum(axis=2) for r in range(cp // ulysses)], axis=2)
    per_cp = np.repeat(ring, ulysses, axis=2) / ulysses                      # [groups, dp, cp]
    return per_cp.reshape(groups, dp * cp), full


_CACHE: dict[tuple, tuple[DocumentMix, float]] = {}


def fallback_share(mix: DocumentMix, dp: int, cp: int, ulysses: int = 1, mbs: int = 1) -> float:
    """The busiest rank's fallback work over the mean rank's with one document per row, averaged
    over the micro-batches (module docstring); cached per (mix, layout). A ring the runtime cannot
    split is priced as ``cp`` 1 (the feasibility rule refuses it anyway)."""
    ulysses = max(ulysses, 1)
    if not mix.pieces or mix.rows < 1:  # a mix of figures only (no simulated rows): its own share
        return mix.attention_share
    if cp > 1 and sequence_problem(mix.seq_len, cp):
        cp = ulysses = 1
    key = (id(mix), dp, cp, ulysses, mbs)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not mix:
        work, full = rank_elements(mix, dp, cp, ulysses, mbs)
        if len(_CACHE) > 256:
            _CACHE.clear()
        hit = _CACHE[key] = (mix, float(work.max(axis=1).mean()) / full if full > 0 else 1.0)
    return hit[1]
