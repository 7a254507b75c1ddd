"""Packed documents through the flash kernels' plain-torch fallback (CPU): the work it really does.

On a CPU, causal attention over packed documents, and every ring block, runs through
``codegen/kernels/attention_torch.py``: the queries go in blocks of ``CHUNK`` rows (at most a
contiguous run of the rank's positions: a zigzag chunk of ``S / 2cp`` tokens), and each block
computes, masks and multiplies, for each row of the micro-batch, a full rectangle of scores: its
``b`` queries against the keys from **that row's** earliest document start in the block to the
block's last query. So per block of query positions ``[x, x + b)``::

    elements = sum over the micro-batch's rows r of b x (x + b - min doc_start[r, x : x + b])

per head, whatever the documents' own causal pairs are. Each row of a block is one call per key
run it reaches (a ring block's keys come in runs, the zigzag chunks; ``attention_torch.row_calls``:
one row at a time, so the score buffer stays in cache); each call does a fixed work of its own
(``BLOCK_ELEMENTS``) and one per ``CHUNK`` queries (``BLOCK_ROW_ELEMENTS``; both in elements at
the fallback's speed). The pairs (``sum l (l+1) / 2``, ``cost_models.documents.busiest_share``)
miss that a block holding the end of one document and the start of the next computes the
rectangle back to the first one's start (short documents: about ``b^2`` per block, not
``sum l^2``), and the calls. (Before 2026-12-03 the rows of a micro-batch went in one call from
their earliest start: on ``benchmarks.fallback_rows``' rows 1.5-1.6x the time of the rows one by
one, and four one-document rows of 2,048 1.25x.)

:func:`fallback_share` is the busiest rank's work in a fixed layout (``dp`` ranks of ``mbs``
consecutive rows each, rows split zigzag over ``cp`` ranks, a ring rank's work over its
``ulysses`` ranks' heads; every rank waits for the busiest, micro-batch by micro-batch, as in
``busiest_share``; on shared CPU cores the busiest core, :func:`busiest`), over the same layout's
with one document filling every row: 1.0 exactly for rows of one document, so documents filling
the row price as none, and the fallback's measured speed against the fused kernel there
(``cost_models.compute.CPU_TORCH_ATTENTION_SLOWDOWN``; CP's blocks, ring or Ulysses, with or
without documents, from the layer's profile or that factor) prices every other mix.

:func:`ring_factor` prices what that factor, measured at ``cp`` 1, leaves out: a ring's calls
beyond cp 1's, with or without documents (a block reaching ``k`` key runs makes ``k`` calls,
:func:`ring_calls`; one row of 2,048 over cp 4: 16 calls per rank and row against cp 1's 4, +19%
of the rank's work, whatever the rows per micro-batch: each row its own calls), and the ring's
own work outside the calls (``cost_models.ring_merges``: its log-sum-exp merges and the calls'
wrappers and slices, per rank over the steps it computes, :func:`ring_own`; in both
:func:`rank_elements`' work and its one-document reference, so it does not shrink with the
documents). :func:`fallback_work`, the product of the
two, is what the CPU estimate charges (``cost_models.layer_work.attention_share``), on the roofline
only: a layer profiled at its ``cp`` is the profiler's own timing of the ring (``RingCompute``),
charged nothing more; the roofline's ratio with and without documents that scales it has the
ring's calls and own work on both sides.

Cost: one pass over the simulated rows' tokens per (mix, dp, cp, ulysses, mbs), cached.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from cost_models.cluster import Cluster
from cost_models.documents import per_mix
from cost_models.ring_merges import own_work, ring_runs, ring_steps
from cost_models.shared_cores import local_cpu, shares_cores
from planner.feasibility import sequence_problem
from planner.graph import DocumentMix
from planner.plan import ParallelConfig

# The fallback's fixed work per block, in score elements per head at its own speed (fitted
# 2026-12-03 on 13 shapes, forward + backward, llama-mini's heads (4 of 64, 2 kv heads), torch
# 2.13, one thread of a 2-core Xeon, load 2.3-3.0: t = alpha E + beta0 N + beta1 R over rows
# of one document of 256-2,048 tokens and rows of 32-, 128- and 512-token documents, 1, 2 and
# 4 rows at once, within 15%: alpha 95.7 ns per element, beta0 0.417 ms per (query block, key
# run) call: its ~35 dispatched ops; beta1 0.497 ms per call and row of 128 queries: the block's
# casts, exponentials and gradient sums over its queries). Their ratios to alpha; not re-fitted for
# one row per call (row_calls). benchmarks.fallback_rows, 2026-12-03 19:20 UTC, quiet.sh, load 3.2:
# batch_assign_run's rows 0-3 and 4-7 in one micro-batch 1.04 / 1.06x this model's share of the
# same process's one-document row, each row alone 0.96-1.13x (before row_calls 1.64 / 1.52x,
# 1.06-1.17x). Over a cp 4 ring (--cp 4, load 2.5) four one-document rows 1.07x, the rows with
# documents 1.17-1.62x before the ring's own work outside these calls (RingCompute's merges, the
# calls' wrappers and slices) was priced: cost_models.ring_merges, fitted by benchmarks.ring_merge.
# Priced (--cp 4 --reps 3, quiet.sh, 2026-12-03 23:28 UTC, load 5.0 falling: the run before it),
# the rows with documents 0.90-1.10x (the same run without it 1.04-1.47x), rows 0-3 / 4-7 in one
# micro-batch 0.93 / 1.02x (1.11 / 1.24x), four one-document rows 0.86x (0.96x).
BLOCK_ELEMENTS = 4361.0
BLOCK_ROW_ELEMENTS = 5197.0
# The fit's alpha: seconds per score element per head (llama-mini's call: 4 heads of 64, forward +
# backward); the estimate prices by ratios of work (fallback_share): this only turns work into
# seconds for benchmarks.fallback_rows.
FALLBACK_ELEMENT_S = 95.7e-9
# Query rows per block of the fallback: codegen/kernels/attention_torch.py's ``CHUNK`` (the cost
# models may not import the kernels; tests/test_fallback_attention.py checks the two agree).
FALLBACK_CHUNK = 128


def row_doc_starts(mix: DocumentMix) -> np.ndarray:
    """[rows, S] (int32: up to ``MAX_TOKENS`` of them): per token of the mix's simulated rows, its
    document's first position in the row (the runtime's ``doc_start``; pieces never cross a row end)."""
    s = mix.seq_len
    pieces = np.asarray(mix.pieces, dtype=np.int64)
    starts = np.cumsum(pieces) - pieces
    out = np.repeat((starts % s).astype(np.int32), pieces)
    return out[: mix.rows * s].reshape(mix.rows, s)


def _blocks(seq_len: int, cp: int, ulysses: int, chunk: int) -> tuple[np.ndarray, ...]:
    """(first position, end, ring rank of each query block; first position, end of each key run):
    each run of :func:`ring_runs` cut every ``chunk`` queries, the fallback's blocks."""
    runs = ring_runs(seq_len, cp, ulysses)
    bounds = np.concatenate([np.arange(a, e, chunk) for a, e, _ in runs])
    owner = np.concatenate([np.full(len(range(a, e, chunk)), r) for a, e, r in runs])
    return (bounds, np.append(bounds[1:], seq_len), owner, np.array([a for a, _, _ in runs]),
            np.array([e for _, e, _ in runs]))


def _calls(ends: np.ndarray, firsts: np.ndarray, lasts: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Calls ``[..., blocks]`` of the query blocks ending at ``ends`` over the micro-batch rows whose
    keys start at ``lo`` ``[..., mbs, blocks]`` (each row's earliest document start in the block),
    key runs ``[firsts, lasts)``: one per row and key run it reaches, the keys from
    ``max(lo, first)`` to ``min(last, block end)`` when that is not empty
    (``attention_torch.row_calls``: one row at a time)."""
    calls = np.zeros(lo.shape[:-2] + lo.shape[-1:], dtype=np.int64)
    for first, last in zip(firsts, lasts):
        calls += (np.maximum(lo, first) < np.minimum(last, ends)).sum(axis=-2)
    return calls


def ring_calls(seq_len: int, cp: int, ulysses: int = 1, chunk: int | None = None) -> np.ndarray:
    """[cp / ulysses]: the fallback's (query block, key run) calls per ring rank and row for one
    layer's forward with one document per row (its backward makes as many, the same blocks): what
    :func:`ring_factor` prices. ``seq_len / chunk`` at ``cp`` 1 (the whole row, one rank)."""
    bounds, ends, owner, firsts, lasts = _blocks(seq_len, cp, ulysses, chunk or FALLBACK_CHUNK)
    calls = _calls(ends, firsts, lasts, np.zeros((1, bounds.size), dtype=np.int64))
    return np.array([calls[owner == r].sum() for r in range(max(cp // ulysses, 1))])


def _layout_work(seq_len: int, dp: int, cp: int, ulysses: int, mbs: int, chunk: int,
                 lo: np.ndarray | None) -> np.ndarray:
    """[groups, dp x cp] fallback work per micro-batch and rank (:func:`rank_elements`) of blocks whose
    keys start at ``lo`` ``[groups, dp, mbs, blocks]`` (each row's earliest document start per
    block), or at 0 (one document per row: ``[1, dp x cp]``) when ``lo`` is None."""
    bounds, ends, owner, firsts, lasts = _blocks(seq_len, cp, ulysses, chunk)
    if lo is None:
        lo = np.zeros((1, dp, mbs, bounds.size), dtype=np.int64)
    calls = _calls(ends, firsts, lasts, lo)
    size = ends - bounds
    heads = size * (ends - lo).sum(axis=-2) + calls * BLOCK_ROW_ELEMENTS * size / chunk
    ring = [heads[..., owner == r].sum(axis=-1) / ulysses + calls[..., owner == r].sum(axis=-1) * BLOCK_ELEMENTS
            for r in range(max(cp // ulysses, 1))]                      # Ulysses: 1 / u of the heads
    work = np.stack(ring, axis=-1) + ring_own(seq_len, cp, ulysses, mbs, lo, ends, owner)
    return np.repeat(work, ulysses if cp > 1 else 1, axis=-1).reshape(lo.shape[0], dp * cp)


def steps_seen(lo: np.ndarray, ends: np.ndarray, owner: np.ndarray, seq_len: int, cp: int,
               ulysses: int) -> np.ndarray:
    """[..., ring ranks, steps] bool: whether ring rank ``k``'s step ``s`` (the block of ring rank
    ``k - s``) is computed for micro-batches whose rows' blocks (ending at ``ends``, held by ring
    rank ``owner``) reach back to ``lo`` ``[..., mbs, blocks]``: its own block always; a visiting
    one when some row's query sees one of its keys (``RingCompute``'s ``any_visible``: a key in
    ``[doc_start, position]``; a row's document starts never fall, so a block's first query's
    start, its least, decides)."""
    r = max(cp // ulysses, 1)
    runs = ring_runs(seq_len, cp, ulysses)
    reach = [np.zeros(lo.shape, dtype=bool) for _ in range(r)]
    for first, last, j in runs:
        reach[j] |= np.maximum(lo, first) < np.minimum(last, ends)
    seen = np.ones(lo.shape[:-2] + (r, r), dtype=bool)
    for k in range(r):
        for s in range(1, r):
            seen[..., k, s] = reach[(k - s) % r][..., owner == k].any(axis=(-2, -1))
    return seen


def ring_own(seq_len: int, cp: int, ulysses: int, mbs: int, lo: np.ndarray, ends: np.ndarray,
             owner: np.ndarray) -> np.ndarray:
    """[..., ring ranks] the ring's own work outside the fallback's calls
    (``cost_models.ring_merges``: its merges, concatenations and calls' wrappers over the steps
    :func:`steps_seen` computes), in the fallback's elements; 0 at ``cp`` 1."""
    if cp == 1:
        return np.zeros(lo.shape[:-2] + (1,))
    seen = steps_seen(lo, ends, owner, seq_len, cp, ulysses)
    counts = (ring_steps(seq_len, cp, ulysses) * seen[..., None]).sum(axis=-2)
    return own_work(counts, mbs, ulysses)


def rank_elements(mix: DocumentMix, dp: int, cp: int, ulysses: int = 1, mbs: int = 1,
                  chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the fallback's work per micro-batch and rank in score elements per head, ``[groups, dp x cp]``
    in mesh order (dp outer, cp inner); the same for one document filling every row, ``[dp x cp]``).
    Work: each row's rectangles (each run of a rank's queries, :func:`ring_runs`, cut every
    ``chunk``; keys from the row's own earliest document start) plus ``BLOCK_ELEMENTS`` per call
    (a row and a key run it reaches, :func:`_calls`) and ``BLOCK_ROW_ELEMENTS`` per call and
    ``chunk`` queries (module docstring). Micro-batches as in
    ``busiest_share`` (wrapping around fewer rows than one)."""
    s = mix.seq_len
    chunk = chunk or FALLBACK_CHUNK
    bounds = _blocks(s, cp, ulysses, chunk)[0]
    lo = np.minimum.reduceat(row_doc_starts(mix), bounds, axis=1)           # [rows, blocks]: each row's own
    k = dp * mbs
    groups = max(mix.rows // k, 1)
    lo = lo[np.resize(np.arange(mix.rows), groups * k)].reshape(groups, dp, mbs, -1)
    return (_layout_work(s, dp, cp, ulysses, mbs, chunk, lo),
            _layout_work(s, dp, cp, ulysses, mbs, chunk, None)[0])


def pinned_cores(cluster: Cluster, cfg: ParallelConfig) -> int:
    """The cores ``cfg``'s ranks share round-robin on a local CPU cluster (``mesh.pin_cpu_rank``:
    local rank ``L`` on core ``L mod cores`` when there are more ranks than cores), when every rank
    is one (dp, cp) worker (no pipeline, no TP); 0 otherwise (no sharing, or not modelled)."""
    cores = cluster.cores_per_node
    if (not local_cpu(cluster) or cfg.pp > 1 or cfg.tp > 1 or cfg.world != cluster.devices_per_node
            or not shares_cores(cores, cfg.world)):
        return 0
    return cores


def busiest(work: np.ndarray, cores: int = 0) -> np.ndarray:
    """[groups]: what each micro-batch waits for, of the ranks' ``work`` ``[groups, ranks]``: the
    busiest rank; on ``cores`` shared cores (:func:`pinned_cores`) the busiest core's mean over
    its ranks: a rank that waits (a collective, the ring's exchange) blocks and yields its core
    to the others pinned there, so a core runs its ranks' work one after another (the roofline
    prices each rank at its share of a core: the mean, not the busiest, is that core's time)."""
    if not shares_cores(cores, work.shape[1]):
        return work.max(axis=1)
    core = np.arange(work.shape[1]) % cores
    return np.stack([work[:, core == c].mean(axis=1) for c in range(cores)], axis=1).max(axis=1)


_CACHE: dict[tuple, tuple[DocumentMix, float]] = {}  # (documents.per_mix)


def fallback_share(mix: DocumentMix, dp: int, cp: int, ulysses: int = 1, mbs: int = 1, cores: int = 0) -> float:
    """The busiest rank's fallback work (:func:`busiest`, on ``cores`` shared cores) over the same
    with one document per row, averaged over the micro-batches (module docstring); cached
    per (mix, layout, cores). A ring the runtime cannot split is priced as ``cp`` 1 (the
    feasibility rule refuses it anyway)."""
    ulysses = max(ulysses, 1)
    if not mix.pieces or mix.rows < 1:  # a mix of figures only (no simulated rows): its own share
        return mix.attention_share
    if cp > 1 and sequence_problem(mix.seq_len, cp):
        cp = ulysses = 1
    def compute() -> float:
        work, one = rank_elements(mix, dp, cp, ulysses, mbs)
        full = float(busiest(one[None], cores)[0])
        return float(busiest(work, cores).mean()) / full if full > 0 else 1.0
    return per_mix(_CACHE, mix, (dp, cp, ulysses, mbs, cores), compute, 256)


@lru_cache(maxsize=1024)
def ring_factor(seq_len: int, dp: int, cp: int, ulysses: int = 1, mbs: int = 1, cores: int = 0) -> float:
    """The busiest rank's fallback work with one document per row in a layout (:func:`busiest` on
    ``cores``) over ``1 / cp`` of cp 1's on the same rows (what ``CPU_TORCH_ATTENTION_SLOWDOWN``
    prices, cp 1's calls included): the ring's (query block, key run) calls per row beyond cp 1's
    (:func:`ring_calls`, forward and backward alike), each ``BLOCK_ELEMENTS`` and
    ``BLOCK_ROW_ELEMENTS`` per ``FALLBACK_CHUNK`` queries, Ulysses' at ``1 / u`` of the heads
    but every call whole, the blocks' rectangles (cp 1's when a zigzag chunk holds whole
    blocks) and the ring's own work (:func:`ring_own`, every step computed). 1.0 at cp 1; a
    ring the runtime cannot split is priced as cp 1 (:func:`fallback_share`)."""
    if cp == 1 or sequence_problem(seq_len, cp):
        return 1.0
    one = _layout_work(seq_len, dp, cp, max(ulysses, 1), mbs, FALLBACK_CHUNK, None)
    per_rank = _layout_work(seq_len, 1, 1, 1, mbs, FALLBACK_CHUNK, None)[0, 0] / cp
    return float(busiest(one, cores)[0]) / per_rank


def fallback_work(mix: DocumentMix | None, seq_len: int, dp: int, cp: int, ulysses: int = 1, mbs: int = 1,
                  cores: int = 0) -> float:
    """What the CPU's plain-torch kernel does for a causal attention core on the busiest rank, over
    ``1 / cp`` of cp 1's with one document per row: the packed documents' :func:`fallback_share`
    (``mix``; None: one document per row) times the layout's :func:`ring_factor`. The one place
    the CPU estimate prices the fallback's layout (``cost_models.layer_work.attention_share``)."""
    share = 1.0 if mix is None else fallback_share(mix, dp, cp, ulysses, mbs, cores)
    return share * ring_factor(seq_len, dp, cp, max(ulysses, 1), mbs, cores)
