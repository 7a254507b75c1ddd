"""Pipeline schedule simulation: step time, bubble, in-flight activations, events.

Model
-----
``p`` ranks, ``m`` micro-batches, ``S = p * v`` virtual stages (``v = 1`` except for
interleaved 1F1B); virtual stage ``s`` lives on rank ``s % p`` and is chunk ``s // p``
of that rank. Operations: ``F(s, mb)`` forward, ``B(s, mb)`` backward (full
backward for gpipe/1f1b/interleaved; input-gradient only for zb-h1) and, for zb-h1,
``W(s, mb)`` weight gradient. Durations (seconds) come per virtual stage:
``fwd[s]``, ``bwd[s]``, ``wgrad[s]``.

Dependencies (``p2p`` seconds added on every edge between different ranks)::

    F(s, mb)  after  F(s-1, mb)                       (s > 0)
    B(s, mb)  after  B(s+1, mb)   (s < S-1)   or   F(S-1, mb)   (s = S-1)
    W(s, mb)  after  B(s, mb)

Each schedule fixes, per rank, the order of its operations (independent of the
durations). Operations on a rank run one at a time in that order, each as soon
as its dependency is met, so the step is the longest path through this DAG;
an order that can never finish raises ``ScheduleError`` (deadlock).

Orders per rank ``r`` (stage ``r`` when v = 1):

- ``gpipe``: F(0..m-1) then B(0..m-1).
- ``1f1b``: ``w = min(p-1-r, m)`` warm-up forwards, then (F, B) pairs, then the
  remaining backwards (PipeDream-flush).
- ``interleaved-1f1b`` (Megatron-LM / torch ``ScheduleInterleaved1F1B``; needs
  ``m % p == 0``): the k-th forward runs chunk ``(k // p) % v`` on micro-batch
  ``(k // (p v)) p + k % p``; backwards the same with the chunk reversed;
  ``min(2 (p-1-r) + (v-1) p, m v)`` warm-up forwards, then (F, B) pairs, then the
  remaining backwards. ``v = 1`` runs the ``1f1b`` order.
- ``zb-h1`` (zero bubble H1, Qi et al. 2023): the 1f1b order of F and B; rank r
  holds back its W's by r micro-batches (in the steady phase W(j - r) follows
  B(j)), runs one held-back W after each cool-down B and the rest at the end. B
  alone carries the backward critical path and later ranks, which hold fewer
  activations in 1F1B, send their B's early; so every rank keeps at most
  ``min(p, m)`` micro-batches between F and W - rank 0's 1F1B peak. For uniform
  stages with m >= p the step is ``m (F+B+W) + (p-1) max(F + B - min(W, B), B)``,
  i.e. the paper's bubble (p-1)(F+B-W) when W <= F, against 1F1B's (p-1)(F+B+W).

Result
------
- ``step_s``: makespan (last end; all ranks start at 0).
- ``bubble_frac = 1 - mean_r(busy_r) / step_s``: the share of rank-time idle.
  For uniform 1F1B/GPipe stages this is exactly ``(p-1) / (m+p-1)``.
- ``busy_s[r]``: seconds rank r computes.
- ``peak_inflight[r]``: most micro-batches at once whose forward has run on rank r
  while their activations are still held (gpipe/1f1b/interleaved: until B; zb-h1:
  until B too, because B consumes the bulk of the activations - what W still
  needs (layer inputs and output gradients, the smaller part) is counted
  separately in ``peak_pending_w``). On interleaved a micro-batch counts once while
  any of its chunks is held; ``peak_inflight_chunks[r]`` counts (chunk, mb) pairs,
  the figure to multiply by one chunk's activation bytes. Without interleaving
  both are the same.
- ``events``: one :class:`Event` per operation, sorted by (start, rank).

zb-h1 without measured weight-gradient times splits a backward ``b`` into ``(1 - WGRAD_FRAC) b``
input gradient (B) and ``WGRAD_FRAC b`` weight gradient (W): :func:`split_backward`, for all.

Linear form (:func:`linear_step`, the ILP's objective)
------------------------------------------------------
Per virtual stage ``t_j = F_j + B_j``, rank load ``R_r = sum_{j % p == r} t_j``, ``M = max_r R_r``::

    gpipe, 1f1b, interleaved-1f1b   m M + (sum_j t_j - M) / v
    zb-h1                           m M + (p-1)/p sum_j max(F_j + beta B_j, gamma B_j)

(:func:`zb_h1_bubble_terms` gives ``beta, gamma``). Linear in the stage times, so an ILP can
minimise it; for uniform stages (m >= p for zb-h1, p2p = 0) it equals the simulator and the
closed form exactly. For uneven stages it is an approximation, bounded like the simulator:
``m M <= linear_step <= estimate_step`` (:func:`throughput_floor`, the busiest rank's work, is
a lower bound of every schedule; the closed form is an upper bound of both).

Closed form (:func:`estimate_step`)
-----------------------------------
With ``f = max(fwd) + p2p``, ``b = max(bwd) + p2p``, ``w = max(wgrad)`` (per chunk
on interleaved; ``p2p`` counts 0 when p = 1)::

    gpipe, 1f1b        (m + p - 1) (f + b)
    interleaved-1f1b   (m v + p - 1) (f + b)
    zb-h1 (m >= p)     m (f + b + w) + (p - 1) max(f + b - min(w, b), b)
    zb-h1 (m < p)      the simulator run on uniform stages (f, b, w): O(p m) work

Exact for uniform stages with ``p2p = 0`` (the simulator reproduces it to
rounding); an upper bound otherwise: the orders do not depend on durations, so
the makespan (a longest path) only grows when every duration is raised to the
maximum, and charging ``p2p`` to every operation instead of every cross-rank edge
only adds weight to every path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Sequence

from planner.feasibility import interleave_problem
from planner.plan import SCHEDULES  # the one list of schedules (callers of the simulator import it from here too)
_F, _B, _W = 0, 1, 2
_KIND_NAMES = ("F", "B", "W")
WGRAD_FRAC = 0.5  # zb-h1 without measured W: the weight gradient's share of the backward (module docstring)


def split_backward(bwd: float, wgrad_frac: float = WGRAD_FRAC) -> tuple[float, float]:
    """(input-gradient B, weight-gradient W) seconds of a backward of ``bwd`` seconds."""
    return bwd * (1.0 - wgrad_frac), bwd * wgrad_frac


def zb_h1_bubble_terms(wgrad_frac: float = WGRAD_FRAC) -> tuple[float, float]:
    """``(beta, gamma)`` of zb-h1's per-stage bubble increment ``max(F + beta B, gamma B)`` for a
    stage of forward F and whole backward B (Qi et al. 2023's ``max(f + b - min(w, b), b)``
    with ``b, w = split_backward(B)``)."""
    b, w = split_backward(1.0, wgrad_frac)
    return b - min(w, b), b


def throughput_floor(p: int, m: int, fwd: Sequence[float], bwd: Sequence[float]) -> float:
    """``m`` times the busiest rank's forward + backward seconds: no schedule finishes sooner."""
    return m * max(sum(fwd[j] + bwd[j] for j in range(r, len(fwd), p)) for r in range(p))


def linear_step(schedule: str, p: int, m: int, v: int, fwd: Sequence[float], bwd: Sequence[float],
                wgrad_frac: float = WGRAD_FRAC) -> float:
    """The step seconds linear in the stage times (module docstring): the ILP's objective."""
    t = [f + b for f, b in zip(fwd, bwd)]
    M = max(sum(t[r::p]) for r in range(p))
    if schedule == "zb-h1":
        beta, gamma = zb_h1_bubble_terms(wgrad_frac)
        return m * M + (p - 1) / p * sum(max(f + beta * b, gamma * b) for f, b in zip(fwd, bwd))
    return m * M + (sum(t) - M) / v


class ScheduleError(ValueError):
    """A bad schedule request or an order that deadlocks; one-line message."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class Event:
    """One operation as simulated: times in seconds from the start of the step."""

    rank: int
    stage: int
    chunk: int
    mb: int
    kind: str
    start: float
    end: float


@dataclass
class PipelineResult:
    """Outcome of :func:`simulate` (see the module docstring for definitions)."""

    schedule: str
    p: int
    m: int
    v: int
    step_s: float
    bubble_frac: float
    busy_s: list[float]
    peak_inflight: list[int]
    peak_inflight_chunks: list[int]
    peak_pending_w: list[int]
    _raw: tuple = field(repr=False, default=())

    @cached_property
    def events(self) -> list[Event]:
        """All operations, sorted by (start, rank); built on first access."""
        orders, starts, dur, p = self._raw
        n_stages = len(dur) // 3
        out: list[Event] = []
        for r, order in enumerate(orders):
            st = starts[r]
            for i, (kind, s, mb) in enumerate(order):
                out.append(Event(r, s, s // p, mb, _KIND_NAMES[kind], st[i], st[i] + dur[kind * n_stages + s]))
        out.sort(key=lambda e: (e.start, e.rank))
        return out


# ---- per-rank operation orders ------------------------------------------------------------
Op = tuple[int, int, int]  # (kind, virtual stage, micro-batch)


def _order_gpipe(p: int, m: int, r: int) -> list[Op]:
    return [(_F, r, mb) for mb in range(m)] + [(_B, r, mb) for mb in range(m)]


def _order_1f1b(p: int, m: int, r: int) -> list[Op]:
    w = min(p - 1 - r, m)
    order: list[Op] = [(_F, r, mb) for mb in range(w)]
    for j in range(m - w):
        order.append((_F, r, w + j))
        order.append((_B, r, j))
    order.extend((_B, r, mb) for mb in range(m - w, m))
    return order


def _order_interleaved(p: int, m: int, v: int, r: int) -> list[Op]:
    total = m * v
    group = p * v

    def fwd(k: int) -> Op:
        chunk = (k // p) % v
        return (_F, chunk * p + r, (k // group) * p + k % p)

    def bwd(k: int) -> Op:
        chunk = v - 1 - (k // p) % v
        return (_B, chunk * p + r, (k // group) * p + k % p)

    w = min(2 * (p - 1 - r) + (v - 1) * p, total)
    order = [fwd(k) for k in range(w)]
    for k in range(total - w):
        order.append(fwd(w + k))
        order.append(bwd(k))
    order.extend(bwd(k) for k in range(total - w, total))
    return order


def _order_zb_h1(p: int, m: int, r: int) -> list[Op]:
    w = min(p - 1 - r, m)
    order: list[Op] = [(_F, r, mb) for mb in range(w)]
    next_w = 0  # next micro-batch whose W has not been placed
    for j in range(m - w):  # steady: F, B, then the W held back r micro-batches
        order.append((_F, r, w + j))
        order.append((_B, r, j))
        if j - next_w >= r:
            order.append((_W, r, next_w))
            next_w += 1
    for mb in range(m - w, m):  # cool-down: one held-back W after each B
        order.append((_B, r, mb))
        if next_w <= mb:
            order.append((_W, r, next_w))
            next_w += 1
    order.extend((_W, r, mb) for mb in range(next_w, m))
    return order


def schedule_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """Per-rank ordered operations ``(kind, virtual_stage, mb)``; kind 0=F, 1=B, 2=W."""
    _check_args(schedule, p, m, v)
    if schedule == "gpipe":
        return [_order_gpipe(p, m, r) for r in range(p)]
    if schedule == "1f1b" or (schedule == "interleaved-1f1b" and v == 1):
        return [_order_1f1b(p, m, r) for r in range(p)]
    if schedule == "interleaved-1f1b":
        return [_order_interleaved(p, m, v, r) for r in range(p)]
    return [_order_zb_h1(p, m, r) for r in range(p)]


def _check_args(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ScheduleError(f"pipeline {name} must be a positive integer, got {val!r}")
    if v > 1 and schedule != "interleaved-1f1b":
        raise ScheduleError(f"v = {v} chunks per rank needs schedule 'interleaved-1f1b', not {schedule!r}")
    if schedule == "interleaved-1f1b" and (why := interleave_problem(p, v, m)):
        raise ScheduleError(why)


def _per_stage(name: str, values: Sequence[float] | float, n: int) -> list[float]:
    if isinstance(values, (int, float)):
        vals = [float(values)] * n
    else:
        vals = [float(x) for x in values]
    if len(vals) != n:
        raise ScheduleError(f"{name} has {len(vals)} entries, expected {n} (one per virtual stage)")
    if any(not (x >= 0) for x in vals):
        raise ScheduleError(f"{name} times must be >= 0 seconds")
    return vals


# ---- simulation --------------------------------------------------------------------------
@dataclass(frozen=True)
class _Compiled:
    """Duration-independent part of a simulation, cached per (schedule, p, m, v)."""

    orders: list[list[Op]]
    # per rank, per op: (dep_id, cross_rank, op_id, duration_index, wake_rank); dep_id
    # 3*S*m is a sentinel that is always ready, wake_rank p means nobody to wake
    steps: list[list[tuple[int, bool, int, int, int]]]
    peaks: tuple[list[int], list[int], list[int]]


@lru_cache(maxsize=32)
def _compile(schedule: str, p: int, m: int, v: int) -> _Compiled:
    return _compile_orders(schedule_orders(schedule, p, m, v), p, m, v)


def _compile_orders(orders: list[list[Op]], p: int, m: int, v: int) -> _Compiled:
    n_stages = p * v
    last = n_stages - 1
    sm = n_stages * m
    steps = []
    for r, order in enumerate(orders):
        rs = []
        for kind, s, mb in order:
            if kind == _F:
                if s:
                    dep, cross = (s - 1) * m + mb, (s - 1) % p != r
                else:
                    dep, cross = 3 * sm, False  # the sentinel slot: ready at 0
                wake = (s + 1) % p if s < last else -1
            elif kind == _B:
                if s == last:
                    dep, cross = s * m + mb, False
                else:
                    dep, cross = sm + (s + 1) * m + mb, (s + 1) % p != r
                wake = (s - 1) % p if s else -1
            else:
                dep, cross, wake = sm + s * m + mb, False, -1
            if wake == r or wake < 0:
                wake = p  # the sentinel slot of `blocked`: never matches
            rs.append((dep, cross, (kind * n_stages + s) * m + mb, kind * n_stages + s, wake))
        steps.append(rs)
    return _Compiled(orders=orders, steps=steps, peaks=_peaks(orders, v))


def simulate(schedule: str, p: int, m: int, fwd: Sequence[float] | float, bwd: Sequence[float] | float, *,
             wgrad: Sequence[float] | float | None = None, p2p: float | Sequence[float] = 0.0, v: int = 1) -> PipelineResult:
    """Simulate one training step of ``schedule`` (times in seconds; module docstring).

    ``fwd``/``bwd`` (and ``wgrad`` for zb-h1) give one entry per virtual stage
    (``p * v``), or a single number for all. For zb-h1, ``bwd`` is the input-gradient
    time B and ``wgrad`` the weight-gradient time W (default: :func:`split_backward`).
    ``p2p``: one hop for all cross-rank edges, or one per rank boundary r -> (r + 1) % p (a WAN cut).
    """
    _check_args(schedule, p, m, v)
    f, b, wt = _durations(schedule, p * v, fwd, bwd, wgrad)
    return _run(schedule, _compile(schedule, p, m, v), p, m, v, f, b, wt, p2p)


def simulate_orders(orders: Sequence[Sequence[tuple[int, int, int]]], m: int, fwd: Sequence[float] | float,
                    bwd: Sequence[float] | float, *, wgrad: Sequence[float] | float | None = None,
                    p2p: float = 0.0, v: int = 1) -> PipelineResult:
    """Simulate custom per-rank orders of ``(kind, virtual_stage, mb)`` (kind 0=F, 1=B, 2=W).

    ``len(orders)`` is p. Every F and B (and W, when any W is given) of every
    (stage, mb) must appear exactly once, on rank ``stage % p``; ``wgrad`` defaults
    to zeros. Raises ScheduleError on a malformed order or a deadlock.
    """
    p = len(orders)
    _check_args("gpipe", p, m, 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ScheduleError(f"pipeline v must be a positive integer, got {v!r}")
    n_stages = p * v
    lists = [[(int(k), int(s), int(mb)) for k, s, mb in order] for order in orders]
    seen: set[tuple[int, int, int]] = set()
    for r, order in enumerate(lists):
        for op in order:
            kind, s, mb = op
            if kind not in (_F, _B, _W) or not 0 <= s < n_stages or not 0 <= mb < m or s % p != r:
                raise ScheduleError(f"bad operation {op} on rank {r}: kind 0..2, stage < {n_stages} on rank stage % p, mb < {m}")
            if op in seen:
                raise ScheduleError(f"operation {op} appears twice: each (kind, stage, mb) runs once")
            seen.add(op)
    kinds = (_F, _B, _W) if any(k == _W for k, _, _ in seen) else (_F, _B)
    if len(seen) != len(kinds) * n_stages * m:
        raise ScheduleError(f"orders hold {len(seen)} operations, expected {len(kinds) * n_stages * m}: every F/B(/W) of every stage and mb once")
    f = _per_stage("fwd", fwd, n_stages)
    b = _per_stage("bwd", bwd, n_stages)
    wt = [0.0] * n_stages if wgrad is None else _per_stage("wgrad", wgrad, n_stages)
    return _run("custom", _compile_orders(lists, p, m, v), p, m, v, f, b, wt, p2p)


def _run(schedule: str, comp: _Compiled, p: int, m: int, v: int, f: list[float], b: list[float],
         wt: list[float], p2p: float | Sequence[float]) -> PipelineResult:
    hops = _per_stage("p2p", p2p, p)  # per rank boundary r -> r + 1
    n_stages = p * v
    dur = f + b + wt  # indexed kind * n_stages + stage
    end = [-1.0] * (3 * n_stages * m) + [0.0]  # end time per op id; -1 = not run yet
    starts: list[list[float]] = [[0.0] * len(o) for o in comp.steps]
    ptr = [0] * p
    free = [0.0] * p
    blocked = [-1] * (p + 1)  # the op id each rank waits on (+ a sentinel)
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        steps = comp.steps[r]
        n_ops = len(steps)
        i = ptr[r]
        t = free[r]
        st_r = starts[r]
        while i < n_ops:
            dep, cross, oid, di, wake = steps[i]
            ready = end[dep]
            if ready < 0:
                blocked[r] = dep
                break
            if cross:  # F(s) waits on boundary (s - 1) % p, B(s) on boundary s % p
                ready += hops[(di - 1) % p] if di < n_stages else hops[di % p]
            if ready > t:
                t = ready
            st_r[i] = t
            t += dur[di]
            end[oid] = t
            i += 1
            if blocked[wake] == oid:
                blocked[wake] = -1
                stack.append(wake)
        ptr[r] = i
        free[r] = t
    for r in range(p):
        if ptr[r] < len(comp.steps[r]):
            kind, s, mb = comp.orders[r][ptr[r]]
            raise ScheduleError(
                f"schedule {schedule!r} deadlocks: rank {r} waits forever at {_KIND_NAMES[kind]}(stage {s}, mb {mb})")
    step = max(free)
    busy = [m * sum(f[s] + b[s] + wt[s] for s in range(r, n_stages, p)) for r in range(p)]
    bubble = max(0.0, 1.0 - (sum(busy) / p) / step) if step > 0 else 0.0  # clamp rounding
    inflight, inflight_chunks, pending_w = comp.peaks
    return PipelineResult(schedule=schedule, p=p, m=m, v=v, step_s=step, bubble_frac=bubble, busy_s=busy,
                          peak_inflight=list(inflight), peak_inflight_chunks=list(inflight_chunks),
                          peak_pending_w=list(pending_w), _raw=(comp.orders, starts, dur, p))


def _durations(schedule: str, n_stages: int, fwd: Sequence[float] | float, bwd: Sequence[float] | float,
               wgrad: Sequence[float] | float | None) -> tuple[list[float], list[float], list[float]]:
    f = _per_stage("fwd", fwd, n_stages)
    b = _per_stage("bwd", bwd, n_stages)
    if schedule == "zb-h1":
        if wgrad is None:
            bw = [split_backward(x) for x in b]
            return f, [x for x, _ in bw], [w for _, w in bw]
        return f, b, _per_stage("wgrad", wgrad, n_stages)
    if wgrad is not None:
        raise ScheduleError(f"wgrad is only used by 'zb-h1'; for {schedule!r} put the whole backward in bwd")
    return f, b, [0.0] * n_stages


def _peaks(orders: list[list[Op]], v: int) -> tuple[list[int], list[int], list[int]]:
    """Per rank: peak micro-batches held, peak (chunk, mb) pairs held, peak W's pending."""
    mbs_peak, chunk_peak, w_peak = [], [], []
    for order in orders:
        held = best = 0
        pend = wbest = 0
        if v == 1:
            for kind, _, _ in order:
                if kind == _F:
                    held += 1
                    if held > best:
                        best = held
                elif kind == _B:
                    held -= 1
                    pend += 1
                    if pend > wbest:
                        wbest = pend
                else:
                    pend -= 1
            mbs_peak.append(best)
            chunk_peak.append(best)
        else:
            per_mb: dict[int, int] = {}
            distinct = dbest = 0
            for kind, _, mb in order:
                if kind == _F:
                    held += 1
                    best = max(best, held)
                    c = per_mb.get(mb, 0)
                    if c == 0:
                        distinct += 1
                        dbest = max(dbest, distinct)
                    per_mb[mb] = c + 1
                elif kind == _B:
                    held -= 1
                    c = per_mb[mb] - 1
                    per_mb[mb] = c
                    if c == 0:
                        distinct -= 1
            mbs_peak.append(dbest)
            chunk_peak.append(best)
        w_peak.append(wbest if any(k == _W for k, _, _ in order) else 0)
    return mbs_peak, chunk_peak, w_peak


# ---- closed form ----------------------------------------------------------------------------
def estimate_step(schedule: str, p: int, m: int, fwd: Sequence[float] | float, bwd: Sequence[float] | float, *,
                  wgrad: Sequence[float] | float | None = None, p2p: float = 0.0, v: int = 1) -> float:
    """Closed-form step seconds: exact for uniform stages with p2p = 0, else an upper bound.

    Arguments as for :func:`simulate`; the formulas are in the module docstring.
    """
    _check_args(schedule, p, m, v)
    n_stages = p * v
    fs, bs, ws = _durations(schedule, n_stages, fwd, bwd, wgrad)
    if not p2p >= 0:
        raise ScheduleError(f"p2p must be >= 0 seconds, got {p2p!r}")
    hop = p2p if p > 1 else 0.0
    f, b, w = max(fs) + hop, max(bs) + hop, max(ws)
    if schedule == "zb-h1":
        if m < p:
            return simulate("zb-h1", p, m, f, b, wgrad=w).step_s
        return m * (f + b + w) + (p - 1) * max(f + b - min(w, b), b)
    if schedule == "interleaved-1f1b":
        return (m * v + p - 1) * (f + b)
    return (m + p - 1) * (f + b)
