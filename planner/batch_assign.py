"""Per-batch assignment of packed documents to context-parallel groups (contract: numpy and the
standard library only, so the runtime, the cost models and the search all call this one rule).

A global batch of packed documents is a list of *pieces*: the documents as the rows cut them
(``cu_seqlens`` boundaries and row ends; each piece attends only to itself and its positions
restart at 0, so pieces are independent sequences). The ``dp x cp`` ranks of one pipeline
stage are a pool of ``P = dp * cp`` *workers* holding the same weights. :func:`assign` gives
every piece a *group*: ``size`` consecutive workers ``first .. first + size - 1``. A piece of
group size 1 runs whole on its worker; a longer one is padded to a multiple of
``PAD_CHUNKS * size`` tokens (pad tokens come after the document: no real query sees them,
their targets are ignored) and split zigzag over its group, whose ring (or Ulysses
all-to-all) runs its attention. Only where each token is computed changes: the loss is the
global mean token loss of the same batch.

Cost of a piece of ``L`` tokens on a group of ``g`` workers, per worker (seconds, forward and
backward, :class:`WorkCost`)::

    linear * L/g + attention * L^2 / g + exposed(g)          (+ vision * images, whole pieces)

A piece may carry *images* (a multimodal sample, ``planner.batch_multimodal``: its image
tokens are part of its ``L``; its images also run through the vision encoder on the worker
that takes it, ``vision`` seconds each). Such a piece always runs whole (group size 1: its
images stay with it), so the vision term is balanced with the text by the same greedy.

``attention * L^2`` is the causal attention of the document (``L^2 / 2`` query-key pairs);
the zigzag split gives each worker ``1 / g`` of it. ``exposed`` is the group's communication
not hidden by attention (:func:`ring_exposed`: ``g - 1`` ring steps each moving the K/V of
``L / g`` tokens, hidden behind that step's visiting block, ``attention * L^2 / g^2``, and
the ring's own merges, ``(g - 1) merge L / g + ring``; or under Ulysses the all-to-alls,
never hidden).

The algorithm (deterministic, ``O(n log n + n P)`` plus ``O(P^2)`` numpy work per heavy piece;
a few milliseconds for 1,024 documents on 64 workers):

1. target ``T`` = the ideal per-worker work (every piece whole, no communication, spread
   evenly: ``sum(linear L + attention L^2 + vision images) / P``);
2. pieces are taken heaviest first. A *heavy* piece (whole work above ``HEAVY x T``, or
   more tokens than a worker holds; never one carrying images) weighs the group sizes that fit the memory, from the
   smallest whose per-worker work is at most ``T`` (and every smaller one) to ``EXTRA_SIZES``
   beyond it;
3. for each size, every window of consecutive workers the runtime forms (``Pool.windows``)
   with room; the piece takes the (size, window) whose new busiest member is least loaded,
   counting any load below ``T`` as ``T`` (finishing early gains nothing), then the one
   adding the least work in all (the least communication: no needless splitting), then the
   least loaded window, then the first;
4. the other pieces go whole, heaviest first, to the least loaded worker with room (LPT);
5. whole pieces move off the busiest worker while a move lowers it (``_refine``).

``planner.batch_layout.static_work`` prices the same batch on a fixed layout (rows of
``row_len`` tokens, one per dp rank, each split zigzag over ``cp`` ranks) with the same cost
terms: the "before" of :class:`Assignment`.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from planner.errors import AutoparError
from planner.plan import ParallelConfig

PAD_CHUNKS = 2  # a group piece is cut into 2 g zigzag chunks: its length is padded to a multiple of 2 g
METHODS = ("ring", "ulysses")
HEAVY = 0.3       # a piece whose whole work exceeds this share of a worker's fair share may be split
EXTRA_SIZES = 1   # sizes weighed beyond the smallest that brings a piece under the fair share
TARGETS = (1.0, 0.8, 0.9, 0.7, 0.6, 0.5)  # the greedy's targets, in fair shares, in the order tried
HEAVY_BUDGET = 80           # targets tried: at least 2, as many as keep the heavy pieces placed under this
GOOD_ENOUGH = 1.01          # a run within 1% of the ideal balance ends the search
REFINE_ROUNDS = 2           # moves of whole pieces off the busiest worker, per worker


class AssignError(AutoparError):
    """A batch that no assignment can run (one line naming the problem and the fix)."""


@dataclass(frozen=True)
class WorkCost:
    """Seconds (forward + backward, all layers of one stage) per unit of work on one worker.

    ``linear``: per token (GEMMs, norms, loss); ``attention``: per squared document token (a
    causal document of ``L`` tokens costs ``attention * L^2``); ``exchange``: per token of a
    K/V block one ring step passes (forward and backward together); ``alltoall``: per token a
    worker holds, for Ulysses' all-to-alls (q, k, v, output; forward and backward);
    ``latency``: per ring step or all-to-all round; ``method``: how a group's attention runs;
    ``vision``: per image a piece carries (vision encoder and projector, multimodal batches);
    ``merge``: per query a ring worker merges per visiting step, ``ring``: per group share, the
    ring's own work beside its attention (a CPU's plain ring path; 0 where not priced)."""
    linear: float
    attention: float
    exchange: float = 0.0
    alltoall: float = 0.0
    latency: float = 0.0
    method: str = "ring"
    vision: float = 0.0
    merge: float = 0.0
    ring: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise AssignError(f"method {self.method!r}: use one of {', '.join(METHODS)}")
        if min(self.linear, self.attention, self.exchange, self.alltoall, self.latency, self.vision, self.merge,
               self.ring) < 0:
            raise AssignError("work costs must be non-negative seconds")


@dataclass(frozen=True)
class Pool:
    """The workers: ``workers`` (``dp * cp``), the largest group ``max_group`` (the plan's CP
    budget), the tokens one worker may hold (``capacity``, from its memory), the group sizes
    the runtime can form (``sizes``; default every size up to ``max_group``: a ring runs on
    any number of workers; Ulysses needs sizes dividing the heads) and whether a group of
    size ``g`` must start at a multiple of ``g`` (``aligned``: fewer process groups to build,
    ``P / g`` per size instead of ``P - g + 1``)."""
    workers: int
    max_group: int
    capacity: int
    sizes: Optional[tuple[int, ...]] = None
    aligned: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_group < 1 or self.capacity < 1:
            raise AssignError(f"pool of {self.workers} workers, groups up to {self.max_group}, capacity "
                              f"{self.capacity} tokens: all must be positive")
        if self.max_group > self.workers:
            raise AssignError(f"groups up to {self.max_group} workers in a pool of {self.workers}: "
                              f"max_group must be at most dp x cp")

    def group_sizes(self) -> tuple[int, ...]:
        """The allowed group sizes, ascending, 1 always among them."""
        allowed = range(1, self.max_group + 1) if self.sizes is None else self.sizes
        return tuple(sorted({1, *(g for g in allowed if 1 <= g <= self.max_group)}))

    def windows(self, g: int) -> range:
        """First workers of the groups of size ``g`` the runtime forms."""
        return range(0, self.workers - g + 1, g if self.aligned else 1)


@dataclass(frozen=True)
class Placement:
    """Where one piece runs: workers ``first .. first + size - 1`` (the group), its length and
    its padded length (a multiple of ``PAD_CHUNKS * size`` when ``size > 1``)."""
    piece: int
    first: int
    size: int
    length: int
    padded: int

    @property
    def workers(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass(frozen=True)
class Assignment:
    """The pieces' placements (in piece order), per worker its seconds of work and tokens held
    (padding included), and ``ideal``: the per-worker work of a perfect balance (every piece
    whole, no communication)."""
    placements: tuple[Placement, ...]
    work: tuple[float, ...]
    tokens: tuple[int, ...]
    ideal: float
    group_order: tuple[int, ...] = field(default=())  # pieces of size > 1 in the order every worker runs them

    @property
    def step(self) -> float:
        """The busiest worker's seconds."""
        return max(self.work)

    def spread(self) -> float:
        """Busiest over mean worker work (1.0: perfectly even)."""
        mean = sum(self.work) / len(self.work)
        return self.step / mean if mean > 0 else 1.0

    def on_worker(self, w: int) -> list[Placement]:
        """The placements worker ``w`` takes part in, in the order it runs them: whole pieces
        first (piece order), then its groups in ``group_order`` (the same order on every
        member, so the groups' collectives never wait on each other in a cycle)."""
        mine = [p for p in self.placements if p.size == 1 and p.first == w]
        rank = {piece: i for i, piece in enumerate(self.group_order)}
        groups = [p for p in self.placements if p.size > 1 and w in p.workers]
        return mine + sorted(groups, key=lambda p: rank[p.piece])


def padded_length(length: int, g: int) -> int:
    """``length`` rounded up to the multiple of ``PAD_CHUNKS * g`` a zigzag split over ``g`` needs."""
    if g == 1:
        return length
    q = PAD_CHUNKS * g
    return -(-length // q) * q


def ring_exposed(tokens: float, g: int, visiting: float, cost: WorkCost) -> float:
    """Seconds of a group's communication one worker does not hide: ``g - 1`` ring steps each
    passing the K/V of ``tokens`` (a worker's share), each hidden behind ``visiting / (g - 1)``
    seconds of attention on the visiting block; under Ulysses the all-to-alls of a worker's
    ``tokens``, ``(g - 1) / g`` of them leaving it, not hidden."""
    if g <= 1:
        return 0.0
    if cost.method == "ulysses":
        return cost.alltoall * tokens * (g - 1) / g + cost.latency
    step = cost.exchange * tokens + cost.latency
    return (g - 1) * np.maximum(0.0, step - visiting / (g - 1))  # arrays of ``visiting`` too


def piece_work(length: int, g: int, cost: WorkCost) -> float:
    """Per-worker seconds of a piece of ``length`` tokens on a group of ``g`` (module docstring)."""
    return float(group_work(length, np.array([g]), cost)[0])


def group_work(length: int, sizes: np.ndarray, cost: WorkCost) -> np.ndarray:
    """:func:`piece_work` for each group size of ``sizes`` (vectorised: the same formula as
    :func:`padded_length` and :func:`ring_exposed`, term by term)."""
    g = sizes.astype(np.float64)
    q = PAD_CHUNKS * sizes
    n = np.where(sizes > 1, -(-length // q) * q, length).astype(np.float64)
    att = cost.attention * n * n / g
    share = n / g
    if cost.method == "ulysses":
        comm = cost.alltoall * share * (g - 1) / g + cost.latency
    else:  # the ring's transfers beyond its visiting blocks, and its own merges
        comm = (g - 1) * np.maximum(0.0, cost.exchange * share + cost.latency - att * (1 - 1 / g) / np.maximum(g - 1, 1))
        comm = comm + (g - 1) * cost.merge * share + cost.ring
    return cost.linear * share + att + np.where(sizes > 1, comm, 0.0)


def _fitting_sizes(n: int, sizes: np.ndarray, pool: Pool, cost: WorkCost) -> tuple[np.ndarray, np.ndarray]:
    """The group sizes whose per-worker tokens fit a piece of ``n`` tokens, and its per-worker
    work on each (the same for every target: computed once per length and batch)."""
    q = PAD_CHUNKS * sizes
    per = np.where(sizes > 1, -(-n // q) * q, n) // sizes
    fits = sizes[per <= pool.capacity]
    if fits.size == 0:
        raise AssignError(f"a document of {n} tokens needs more than {pool.max_group} workers of "
                          f"{pool.capacity} tokens each: raise the CP budget (cp) or the memory per rank")
    return fits, group_work(n, fits, cost)


def _candidate_sizes(fits: np.ndarray, work: np.ndarray, target: float) -> tuple[list[int], list[float]]:
    """Step 2: of the fitting sizes (:func:`_fitting_sizes`), the smallest whose per-worker work
    is at most ``target``, the one below it and ``EXTRA_SIZES`` beyond it, with their work."""
    under = np.flatnonzero(work <= target)
    first = int(under[0]) if under.size else fits.size - 1
    keep = slice(max(first - 1, 0), first + 1 + EXTRA_SIZES)
    return fits[keep].tolist(), work[keep].tolist()


@lru_cache(maxsize=1024)
def _window_index(workers: int, g: int, step: int) -> np.ndarray:
    """``[windows, g]`` worker indices of the windows of ``g`` starting every ``step`` workers."""
    idx = np.arange(0, workers - g + 1, step)[:, None] + np.arange(g)
    idx.setflags(write=False)  # shared by every call
    return idx


def _best_window(load: np.ndarray, held: np.ndarray, n: int, g: int, work: float, target: float,
                 pool: Pool) -> Optional[tuple[tuple, int]]:
    """Step 3 for one size: (key, first worker) of the best window of ``g`` with room for
    ``n`` padded tokens, or None. Key: the window's new busiest load (no better than
    ``target``: below it nothing is gained), the work the split adds in all (``g x work``:
    less communication), the window's present load, then its place."""
    step = g if pool.aligned else 1
    idx = _window_index(load.size, g, step)
    loads = load[idx]
    room = held[idx].max(axis=1) + n // g <= pool.capacity
    if not room.any():
        return None
    busiest = np.where(room, np.maximum(loads.max(axis=1) + work, target), np.inf)
    total = loads.sum(axis=1)
    k = int(np.lexsort((total, busiest))[0])  # ties: the least loaded window, then the first
    return (float(busiest[k]), g * work, float(total[k]), g, k * step), k * step


def _place_heavy(n: int, fitting: tuple[np.ndarray, np.ndarray], load: np.ndarray, held: np.ndarray, pool: Pool,
                 target: float) -> tuple[int, int, float]:
    """Steps 2 and 3 for one heavy piece of ``n`` tokens (its :func:`_fitting_sizes`): (size,
    first worker, per-worker work), placed."""
    best = None
    for g, w in zip(*_candidate_sizes(*fitting, target)):
        got = _best_window(load, held, padded_length(n, g), g, w, target, pool)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], g, got[1], w)
    if best is None:
        raise AssignError(f"no group of workers has room for a document of {n} tokens: raise the memory per "
                          "rank (capacity) or the CP budget")
    _, g, f, w = best
    load[f:f + g] += w
    held[f:f + g] += padded_length(n, g) // g
    return g, f, w


def _place_whole(load: np.ndarray, held: np.ndarray, order: np.ndarray, lengths: np.ndarray,
                 work: np.ndarray, capacity: int) -> dict[int, int]:
    """Step 4 (LPT with a heap of (load, worker)): piece -> worker for whole pieces; ``load``
    and ``held`` updated."""
    loads, helds = load.tolist(), held.tolist()
    heap = [(x, w) for w, x in enumerate(loads)]
    heapq.heapify(heap)
    out: dict[int, int] = {}
    for i, n, x in zip(order.tolist(), lengths[order].tolist(), work[order].tolist()):
        skipped = []
        while heap and helds[heap[0][1]] + n > capacity:
            skipped.append(heapq.heappop(heap))
        if not heap:
            raise AssignError(f"no worker has room for a document of {n} tokens: the batch holds more tokens "
                              f"than {len(loads)} workers x {capacity}; raise the memory per rank or shrink the batch")
        _, w = heapq.heappop(heap)
        loads[w] += x
        helds[w] += n
        out[i] = w
        heapq.heappush(heap, (loads[w], w))
        for item in skipped:
            heapq.heappush(heap, item)
    load[:] = loads
    held[:] = helds
    return out


def _assign_at(lens: np.ndarray, solo: np.ndarray, pool: Pool, cost: WorkCost,
               target: float, whole: np.ndarray, fitting: dict) -> "_Draft":
    """Steps 2 to 4 with heavy pieces split toward ``target`` seconds per worker; pieces
    marked ``whole`` (carrying images) never split; ``fitting``: length -> its
    :func:`_fitting_sizes`, filled as needed and kept across targets."""
    order = np.lexsort((np.arange(lens.size), -solo))  # heaviest first, then batch order
    heavy = (solo > HEAVY * target) | (lens > pool.capacity)
    if pool.max_group == 1:
        heavy[:] = lens > pool.capacity
    heavy &= ~whole
    load = np.zeros(pool.workers)
    held = np.zeros(pool.workers, dtype=np.int64)
    sizes = np.ones(lens.size, dtype=np.int64)
    first = np.zeros(lens.size, dtype=np.int64)
    work = solo.copy()
    allowed = np.array(pool.group_sizes())
    for i in order[heavy[order]].tolist():
        n = int(lens[i])
        if n not in fitting:
            fitting[n] = _fitting_sizes(n, allowed, pool, cost)
        sizes[i], first[i], work[i] = _place_heavy(n, fitting[n], load, held, pool, target)
    whole = order[(sizes[order] == 1) & ~heavy[order]]
    for i, w in _place_whole(load, held, whole, lens, work, pool.capacity).items():
        first[i] = w
    _refine(sizes == 1, first, work, load, held, lens, pool.capacity)
    return _Draft(float(load.max()), sizes, first, work, load, held)


def _refine(whole: np.ndarray, first: np.ndarray, work: np.ndarray, load: np.ndarray, held: np.ndarray,
            lens: np.ndarray, capacity: int) -> None:
    """Step 5: up to ``REFINE_ROUNDS x P`` moves of one whole piece off the busiest worker, to
    the least loaded one with room, each the move leaving the two the least busy (and only
    when it lowers the busiest); in place."""
    for _ in range(REFINE_ROUNDS * len(load)):
        b = int(np.argmax(load))
        mine = np.flatnonzero(whole & (first == b))
        if mine.size == 0:
            return
        room = held[None, :] + lens[mine, None] <= capacity          # [pieces, workers]
        room[:, b] = False
        dest = np.where(room, load[None, :], np.inf).argmin(axis=1)  # the least loaded with room, per piece
        after = np.where(room[np.arange(mine.size), dest], np.maximum(load[b] - work[mine], load[dest] + work[mine]),
                         np.inf)
        k = int(np.argmin(after))
        if not after[k] < load[b] * (1 - 1e-12):
            return
        i, w = int(mine[k]), int(dest[k])
        load[b] -= work[i]
        load[w] += work[i]
        held[b] -= lens[i]
        held[w] += lens[i]
        first[i] = w


@dataclass
class _Draft:
    """One greedy run's result, before it is made an :class:`Assignment` (only the winner is)."""
    step: float
    sizes: np.ndarray
    first: np.ndarray
    work: np.ndarray
    load: np.ndarray
    held: np.ndarray

    def done(self, lens: np.ndarray, ideal: float) -> Assignment:
        grouped = np.flatnonzero(self.sizes > 1)
        order = grouped[np.lexsort((grouped, -self.work[grouped], -self.sizes[grouped]))]  # biggest, heaviest first
        placements = tuple(Placement(i, f, g, n, padded_length(n, g))
                           for i, (f, g, n) in enumerate(zip(self.first.tolist(), self.sizes.tolist(), lens.tolist())))
        return Assignment(placements, tuple(self.load.tolist()), tuple(self.held.tolist()), ideal,
                          tuple(order.tolist()))


def assign(lengths: Sequence[int], pool: Pool, cost: WorkCost,
           images: Optional[Sequence[int]] = None) -> Assignment:
    """Group size and workers for every piece of one global batch (module docstring): the
    greedy run toward each of ``TARGETS`` times the fair share (lower ones split the heavy
    pieces finer, leaving room for the next; as many as keep the heavy pieces placed in all
    under ``HEAVY_BUDGET``, at least two: the time stays bounded on large pools), the least
    busy busiest worker winning (the first on a tie). ``lengths``: the pieces' token counts, in
    batch order; ``images``: the images each piece carries (default none; a piece with images
    runs whole and costs ``cost.vision`` per image more). Deterministic: the same inputs give
    the same assignment on every rank. :class:`AssignError` when a piece or the batch cannot fit."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size == 0 or int(lens.min()) < 1:
        raise AssignError("a batch needs at least one piece, each of at least one token")
    imgs = np.zeros(lens.size, dtype=np.int64) if images is None else np.asarray(images, dtype=np.int64).reshape(-1)
    if imgs.shape != lens.shape or (imgs.size and int(imgs.min()) < 0):
        raise AssignError(f"{imgs.size} image counts for {lens.size} pieces: give one non-negative count per piece")
    solo = cost.linear * lens + cost.attention * lens.astype(np.float64) ** 2 + cost.vision * imgs
    ideal = float(solo.sum()) / pool.workers
    best: Optional[_Draft] = None
    error: Optional[AssignError] = None
    heavy = int((((solo > HEAVY * ideal) | (lens > pool.capacity)) & (imgs == 0)).sum())
    runs = max(2, HEAVY_BUDGET // max(heavy, 1))
    fitting: dict = {}
    for k in TARGETS[:runs]:
        try:
            got = _assign_at(lens, solo, pool, cost, k * ideal, imgs > 0, fitting)
        except AssignError as e:
            error = error or e
            continue
        if best is None or got.step < best.step:
            best = got
        if got.step <= ideal * GOOD_ENOUGH or pool.max_group == 1:
            break
    if best is None:
        raise error  # type: ignore[misc]
    return best.done(lens, ideal)


def row_tokens(pool: Pool, pp: int) -> int | None:
    """Tokens of each worker's micro-batch row: ``pool.capacity`` under a pipeline (its stages'
    buffers keep the first step's shape: rows are padded); None without one (what it holds)."""
    return pool.capacity if pp > 1 else None


def padded_work(a: Assignment, pool: Pool, cost: WorkCost, pp: int) -> tuple[float, ...]:
    """Per worker seconds of ``a`` as the runtime runs it: pad tokens up to :func:`row_tokens`
    cost linear work (their attention is skipped, their loss ignored)."""
    row = row_tokens(pool, pp)
    return a.work if row is None else tuple(w + cost.linear * (row - n) for w, n in zip(a.work, a.tokens))


def microbatch_ranges(lengths: Sequence[int], n: int) -> list[range]:
    """The pieces (indices) of each of ``n`` micro-batches: consecutive blocks of ``1 / n`` of the
    batch's tokens (whole rows: pieces never cross a row end)."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    cuts = np.searchsorted(ends, np.arange(1, n + 1) * (int(ends[-1]) // n), side="right") if len(ends) else [0] * n
    return [range(a, b) for a, b in zip([0, *cuts[:-1].tolist()], cuts.tolist())]


PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # what per-batch assignment has run under a pipeline


def per_batch_problem(cfg: ParallelConfig, global_batch: int, pool: Pool, method: str, heads: int = 0,
                      kv_heads: int = 0) -> Optional[str]:
    """Why the runtime cannot run per-batch assignment for this layout (one line), or None: a
    pool of ``dp x cp`` workers, no TP or recompute; without a pipeline one micro-batch per step
    (``global_batch == dp x mbs``); with one (gpipe or 1f1b, vpp 1) each micro-batch assigned on
    its own (:func:`microbatch_ranges`), rows padded (:func:`row_tokens`); Ulysses groups only of
    sizes dividing ``heads`` and ``kv_heads`` (0: unknown)."""
    if pool.workers != cfg.dp * cfg.cp:
        return f"per-batch pool of {pool.workers} workers, but dp x cp = {cfg.dp * cfg.cp}"
    if cfg.tp > 1:
        return "per-batch assignment runs without tensor parallelism yet (tp = 1)"
    if cfg.dp_shares:
        return "per-batch assignment places every batch's pieces itself: plan without dp_shares"
    if cfg.pp > 1 and (cfg.vpp > 1 or cfg.schedule not in PIPELINE_SCHEDULES):
        return (f"per-batch assignment runs under a pipeline only with schedule {' or '.join(PIPELINE_SCHEDULES)} "
                f"and vpp = 1 (got {cfg.schedule}, vpp = {cfg.vpp})")
    if cfg.pp == 1 and global_batch != cfg.dp * cfg.mbs:
        return (f"per-batch assignment runs one micro-batch per step without a pipeline: set mbs = global batch / "
                f"dp ({global_batch} / {cfg.dp})")
    if cfg.recompute != "none":
        return "per-batch assignment runs without recompute yet (recompute=none)"
    if method == "ulysses":
        bad = [g for g in pool.group_sizes() if g > 1 and (heads % g or kv_heads % g)]
        if bad:
            return (f"Ulysses groups of {bad} workers do not divide the {heads} heads / {kv_heads} kv heads: "
                    "pass sizes that divide both, or use ring groups")
    return None
