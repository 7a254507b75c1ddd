"""A CPU ring's own work outside the fallback's attention calls: its log-sum-exp merges, its
concatenations and its calls' wrappers, in the fallback's units (score elements per head).

On a CPU every ring block runs through the flash kernels' plain-torch fallback, whose work
``cost_models.fallback_attention`` prices call by call. Around those calls the ring
(``codegen/runtime/context_parallel.py``, ``RingCompute`` with the flash path, and
``codegen/runtime/kernels.ring_block_attention``) does work of its own, forward and backward,
that does not shrink with the documents: per ring rank, micro-batch and layer,

- each ring step computed (the rank's own block, then the ``r - 1`` visiting blocks no query
  skips) cuts the rank's held positions into runs (:func:`ring_runs`); each query run makes
  one ``flash_attention`` call per key run it reaches (a custom op: its wrapper, the run's
  slices and their gradients' copies back into the whole tensors) and merges the partials of
  two or more key runs by log-sum-exp (``attn_merge``: ``keys runs - 1`` merges of the run's
  query rows); a step with two or more query runs concatenates their outputs (all the rank's
  query rows);
- each visiting step computed is merged into the running output (one ``attn_merge`` of all
  the rank's query rows); a step no query may see (``RingCompute``'s skip: every key after
  every query, or no query's document reaching the block) does none of this.

:func:`ring_steps` counts these per (ring rank, step) from the runtime's own layout
(``RingCompute.held_positions`` in ``RingCompute.attention_order``: its runs; ``ring_block_attention``'s rule for a key run a query
run reaches); :func:`own_work` prices them: ``MERGE_ROW_ELEMENTS`` per query row (a batch row's
query, all heads) merged, ``CALL_ROW_ELEMENTS`` per call and query row the rank holds (the
call's slices: their gradients are copied back into the whole q, k, v), ``RING_CALL_ELEMENTS``
per call (the op's wrapper and dispatch). The concatenations and the merges' own dispatch
fitted to nothing beside those (``benchmarks.ring_merge``). The per-batch runtime's groups run
the plain path (``partial_attention`` and ``merge_partials``: one merge of the worker's queries
per visiting step, no runs): ``PLAIN_ROW_ELEMENTS`` per query row merged and
``PLAIN_RING_ELEMENTS`` per ring call (:func:`plain_ring_elements`). Both scale with heads x
head dim as the score elements do (assumed: the fit is on llama-mini's 4 heads of 64 only).
A skipped step's ``_zero_use`` (one add of the output) is not priced. Only a CPU ring runs
these: on GPUs the fused kernels carry their own merge (``cost_models.compute``).
"""
from __future__ import annotations

import numpy as np

# Fitted 2026-12-03 22:52 UTC by benchmarks.ring_merge (quiet.sh, load 1.9 -> 1.7; torch 2.13, one
# thread of this 2-core box): one ring rank's attention, forward + backward, with the kernel bodies
# stubbed (their outputs allocated), in the same process's real one-document row of 2,048 at cp 1
# (180 ms = 2.38M modelled elements: 75.6 ns each), least squares of the relative error on 36 flash
# cases (cp 2 and 4, every rank, 256 / 512 / 1,024 tokens per rank, 1 / 2 / 4 rows; llama-mini's 4
# heads of 64, 2 kv heads) and 18 plain ones (g 2 and 4, every rank, the same tokens, one row).
# Flash: 22.8 per query row merged, 9.13 per call and query row held (the run slices' gradients
# copied back whole), 2,673 per call; rms 12%, 0.64-1.16x (under: rank 0 at 256 tokens and one
# row, 0.64 / 0.70 at cp 2 / 4; 4 rows of 1,024, 0.68-0.80: out of cache), batch_assign_run's
# shapes (cp 4 x 512 x 4 rows, cp 2 x 1,024 x 2) 0.95-1.04x. Plain: 19.2 per query row merged,
# 6,510 per ring call; rms 15%, 0.66-1.21x. An earlier quiet run (22:50, load 2.3) fitted 24.2 /
# 8.8 / 2,593 and 19.3 / 7,096.
MERGE_ROW_ELEMENTS = 22.8
CALL_ROW_ELEMENTS = 9.13
RING_CALL_ELEMENTS = 2673.0
PLAIN_ROW_ELEMENTS = 19.2
PLAIN_RING_ELEMENTS = 6510.0

# Columns of :func:`ring_steps`: merges, query rows they merge, flash calls, calls x the rank's query
# rows (each call's run slices: their gradients are copied back into whole tensors).
MERGES, MERGED_ROWS, CALLS, CALL_ROWS = range(4)


def ring_runs(seq_len: int, cp: int, ulysses: int = 1) -> list[tuple[int, int, int]]:
    """(first position, end, ring rank) of each maximal run of consecutive positions a ring rank
    holds, in position order: of the ``2cp`` zigzag chunks of the row, cp rank ``r`` holds ``r``
    and ``2cp - 1 - r``, a ring rank its Ulysses group's (``ulysses`` consecutive cp ranks), and
    it attends them in position order (``RingCompute.attention_order``), so its adjacent chunks
    make one run (pure Ulysses: the whole row); the whole row at ``cp`` 1."""
    if cp == 1:
        return [(0, seq_len, 0)]
    c = seq_len // (2 * cp)
    owner = [0] * (2 * cp)
    for r in range(cp):
        owner[r] = owner[2 * cp - 1 - r] = r // ulysses
    runs: list[tuple[int, int, int]] = []
    for k, ring in enumerate(owner):
        if runs and runs[-1][2] == ring:
            runs[-1] = (runs[-1][0], (k + 1) * c, ring)
        else:
            runs.append((k * c, (k + 1) * c, ring))
    return runs


def ring_steps(seq_len: int, cp: int, ulysses: int = 1) -> np.ndarray:
    """[ring ranks, steps, 4]: what ring rank ``k``'s step ``s`` (the block of ring rank
    ``k - s``) does outside the fallback's calls when computed, one layer's forward of one
    micro-batch (its backward undoes each): the columns ``MERGES``, ``MERGED_ROWS`` (query
    positions merged, per batch row), ``CALLS`` and ``CALL_ROWS`` (calls x the rank's query
    positions, per batch row; module docstring). Zero for a step whose every key follows every
    query (``RingCompute`` skips it); all zero at ``cp`` 1."""
    r = max(cp // ulysses, 1)
    out = np.zeros((r, r, 4))
    if cp == 1:
        return out
    held = [[(a, e) for a, e, o in ring_runs(seq_len, cp, ulysses) if o == j] for j in range(r)]
    for k in range(r):
        rows = sum(e - a for a, e in held[k])
        last = max(e for _, e in held[k]) - 1
        for s in range(r):
            kv = held[(k - s) % r]
            if s > 0 and min(a for a, _ in kv) > last:
                continue
            reach = [sum(ka <= qe - 1 for ka, _ in kv) for _, qe in held[k]]   # key runs each query run reaches
            merges = [max(n - 1, 0) for n in reach]
            out[k, s] = (sum(merges) + (s > 0), sum(m * (qe - qa) for m, (qa, qe) in zip(merges, held[k]))
                         + (s > 0) * rows, sum(reach), sum(reach) * rows)
    return out


def own_work(counts: np.ndarray, mbs: int, ulysses: int = 1) -> np.ndarray:
    """The fallback elements (score elements per head, forward + backward) of ``counts``
    ``[..., 4]`` (:func:`ring_steps` columns, summed over the steps computed) for a micro-batch
    of ``mbs`` rows, the rows' query positions at ``1 / ulysses`` of the heads: the flash path."""
    rows = mbs / ulysses
    return (MERGE_ROW_ELEMENTS * counts[..., MERGED_ROWS] * rows + CALL_ROW_ELEMENTS * counts[..., CALL_ROWS] * rows
            + RING_CALL_ELEMENTS * counts[..., CALLS])


def plain_ring_elements(g: int) -> tuple[float, float]:
    """(fallback elements per query row and visiting step, fixed elements per call) of the plain
    ring path over ``g`` workers, one row per micro-batch, forward + backward: a worker holding
    ``tokens`` of a piece does ``first x tokens x (g - 1) + second`` (nothing at ``g`` 1)."""
    return (PLAIN_ROW_ELEMENTS, PLAIN_RING_ELEMENTS) if g > 1 else (0.0, 0.0)
