"""Pipeline schedule simulation: step time, bubble, in-flight activations, events.

Model
-----
A schedule is the IR of ``planner/schedule_ir.py``: per rank, the ordered actions F (forward),
B (full backward), I (input-gradient backward), W (weight-gradient backward) and overlapped
F+B (priced as the F then the B, the order the runtime issues them) of each virtual stage and
micro-batch, and each stage's rank (looped ``s % p``; V-shaped for dualpipev). The built-ins
(:func:`simulate`: gpipe, 1f1b, interleaved-1f1b, zb-h1, dualpipev) are the IR's own generators -
the same orders ``codegen/runtime/pipeline_parallel.py`` runs through torch's schedule runtime;
any other IR (a user's file, a generated schedule) goes through :func:`simulate_schedule`.
Durations (seconds) come per virtual stage: ``fwd[s]``, ``bwd[s]`` and, for split backwards,
the weight-gradient part ``wgrad[s]`` (I takes the rest).

Dependencies (``p2p`` seconds added on every edge between different ranks: one figure, or one
per rank boundary r -> (r + 1) % p, an edge between neighbours taking theirs)::

    F(s, mb)    after  F(s-1, mb)                       (s > 0)
    B/I(s, mb)  after  B/I(s+1, mb)  (s < S-1)   or   F(S-1, mb)   (s = S-1)
    W(s, mb)    after  I(s, mb)

Operations on a rank run one at a time in the IR's order, each as soon as its dependency is
met, so the step is the longest path through this DAG; an order that can never finish raises
``ScheduleError`` (deadlock). Orders of the built-ins (their docstrings in schedule_ir.py):
gpipe all F then all B; 1f1b ``min(p-1-r, m)`` warm-up F's then (F, B) pairs; interleaved-1f1b
Megatron's order (m a multiple of p; v = 1 is 1f1b's order); zb-h1 the 1f1b order of F and I
with rank r holding back its W's by r micro-batches - every rank keeps at most ``min(p, m)``
micro-batches between F and W, and for uniform stages with m >= p the step is
``m (F+B+W) + (p-1) max(F + B - min(W, B), B)`` (Qi et al. 2023's (p-1)(F+B-W) when W <= F);
dualpipev DeepSeek's DualPipeV (m >= 2p).

Result
------
- ``step_s``: makespan (last end; all ranks start at 0).
- ``bubble_frac = 1 - mean_r(busy_r) / step_s``: the share of rank-time idle.
  For uniform 1F1B/GPipe stages this is exactly ``(p-1) / (m+p-1)``.
- ``busy_s[r]``: seconds rank r computes.
- ``peak_inflight[r]``: most micro-batches at once whose forward has run on rank r
  while their activations are still held (until B, or I for a split backward: because B consumes the bulk of the activations - what W still
  needs (layer inputs and output gradients, the smaller part) is counted
  separately in ``peak_pending_w``). On interleaved a micro-batch counts once while
  any of its chunks is held; ``peak_inflight_chunks[r]`` counts (chunk, mb) pairs,
  the figure to multiply by one chunk's activation bytes. Without interleaving
  both are the same.
- ``events``: one :class:`Event` per operation, sorted by (start, rank).

A split backward without measured weight-gradient times is ``(1 - WGRAD_FRAC) b`` input
gradient (I) and ``WGRAD_FRAC b`` weight gradient (W) of the whole ``b``: :func:`split_backward`.
What the engine pays for splitting is a :class:`SplitCost` (``split=``; default none): torch's
split walks the autograd graph twice, so I and W of a stage whose inputs take gradients cost
``1 + extra`` times their shares, and its first virtual stage (inputs without gradients) runs
nothing in I and its whole backward in W. A whole backward (B) costs ``b`` either way.

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
    dualpipev          the same

Exact for uniform stages with ``p2p = 0`` (the simulator reproduces it to
rounding); an upper bound otherwise: the orders do not depend on durations, so
the makespan (a longest path) only grows when every duration is raised to the
maximum, and charging ``p2p`` to every operation instead of every cross-rank edge
only adds weight to every path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

from planner import schedule_ir as ir
from planner.errors import PlanError
from planner.plan import SCHEDULES, ParallelConfig  # the one list of schedules (callers of the simulator import it from here too)
from planner.schedule_check import check as check_schedule
from planner.schedule_ir import ScheduleError  # re-exported: the simulator's errors are the IR's
from cost_models.pipeline_compiled import KIND_NAMES, Compiled, Op, compile_builtin, compile_kept, compile_schedule
from cost_models.seq_chunks import chunk_seconds

__all__ = ["SCHEDULES", "SPLIT_SCHEDULES", "WGRAD_FRAC", "Event", "PipelineResult", "ScheduleError", "SplitCost", "estimate_step",
           "linear_step", "schedule_orders", "simulate", "simulate_orders", "simulate_schedule", "split_backward",
           "order_floor", "stage_placement", "throughput_floor", "zb_h1_bubble_terms"]
SPLIT_SCHEDULES = ("zb-h1", "dualpipev")  # built-ins that run I and W apart (simulate's wgrad applies)
WGRAD_FRAC = 0.5  # zb-h1 without measured W: the weight gradient's share of the backward (module docstring)


def split_backward(bwd: float, wgrad_frac: float = WGRAD_FRAC) -> tuple[float, float]:
    """(input-gradient B, weight-gradient W) seconds of a backward of ``bwd`` seconds."""
    return bwd * (1.0 - wgrad_frac), bwd * wgrad_frac


@dataclass(frozen=True)
class SplitCost:
    """What running a stage's backward as I then W costs in the engine, beyond one whole backward B.

    ``extra``: ``(I + W) / B - 1`` of a stage whose inputs take gradients (torch's split walks the
    autograd graph once for the inputs, keeping the intermediates, and again from them for the
    weights; cost_models/cpu_runtime.py's ``split_backward_frac``, measured by the profiler).
    ``first_whole``: the first virtual stage's inputs take no gradient, so torch's schedule runtime
    runs nothing in its I and its whole backward, at no extra, in its W (``PipelineStage``'s
    ``backward_one_chunk`` skips the first stage's input gradients, ``backward_weight_one_chunk`` runs
    its whole backward); its activations stay until then (``planner.schedule_check.frees``). The
    default is the textbook split: ``I + W = B`` on every stage."""

    extra: float = 0.0
    first_whole: bool = False

    def parts(self, bwd: Sequence[float], wgrad: Sequence[float] | None = None) -> tuple[list[float], list[float]]:
        """(I, W) seconds per virtual stage of the whole backwards ``bwd`` (``wgrad``: their weight
        parts, default :func:`split_backward`)."""
        w = [split_backward(b)[1] for b in bwd] if wgrad is None else list(wgrad)
        i, w = [(b - x) * (1.0 + self.extra) for b, x in zip(bwd, w)], [x * (1.0 + self.extra) for x in w]
        if self.first_whole and i:
            i[0], w[0] = 0.0, float(bwd[0])
        return i, w


def zb_h1_bubble_terms(wgrad_frac: float = WGRAD_FRAC) -> tuple[float, float]:
    """``(beta, gamma)`` of zb-h1's per-stage bubble increment ``max(F + beta B, gamma B)`` for a
    stage of forward F and whole backward B (Qi et al. 2023's ``max(f + b - min(w, b), b)``
    with ``b, w = split_backward(B)``)."""
    b, w = split_backward(1.0, wgrad_frac)
    return b - min(w, b), b


def throughput_floor(p: int, m: int, fwd: Sequence[float], bwd: Sequence[float]) -> float:
    """``m`` times the busiest rank's forward + backward seconds: no schedule finishes sooner."""
    return m * max(sum(fwd[j] + bwd[j] for j in range(r, len(fwd), p)) for r in range(p))


def order_floor(m: int, fwd: Sequence[float], bwd: Sequence[float], p2p: float = 0.0) -> float:
    """One stage per rank (looped): rank r cannot start before the first micro-batch's forward
    reached it (``sum_{s<r} (fwd[s] + p2p)``) and then computes ``m (fwd[r] + bwd[r])``; the
    largest of these, seconds, is a floor no order of this stage split beats."""
    return max(sum(f + p2p for f in fwd[:r]) + m * (fwd[r] + bwd[r]) for r in range(len(fwd)))


def linear_step(schedule: str, p: int, m: int, v: int, fwd: Sequence[float], bwd: Sequence[float],
                wgrad_frac: float = WGRAD_FRAC) -> float:
    """The step seconds linear in the stage times (module docstring): the ILP's objective."""
    t = [f + b for f, b in zip(fwd, bwd)]
    M = max(sum(t[r::p]) for r in range(p))
    if schedule == "zb-h1":
        beta, gamma = zb_h1_bubble_terms(wgrad_frac)
        return m * M + (p - 1) / p * sum(max(f + beta * b, gamma * b) for f, b in zip(fwd, bwd))
    return m * M + (sum(t) - M) / v


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
    seq_chunks: int = 1  # k: peak_inflight counts sequences, peak_inflight_chunks (stage, chunk) units
    _raw: tuple = field(repr=False, default=())

    @cached_property
    def events(self) -> list[Event]:
        """All operations, sorted by (start, rank); built on first access."""
        orders, starts, dur, chunk_of = self._raw
        n_stages, k = len(chunk_of), self.seq_chunks
        out: list[Event] = []
        for r, order in enumerate(orders):
            st = starts[r]
            for i, (kind, s, mb) in enumerate(order):
                end = st[i] + dur[(kind * n_stages + s) * k + mb % k]
                out.append(Event(r, s, chunk_of[s], mb, KIND_NAMES[kind], st[i], end))
        out.sort(key=lambda e: (e.start, e.rank))
        return out


# ---- per-rank operation orders (the schedule IR's, as tuples) ---------------------------------
def schedule_orders(schedule: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """Per-rank ordered operations ``(kind, virtual_stage, mb)`` of built-in ``schedule`` (the
    IR's order, planner/schedule_ir.py); kind 0=F, 1=B (the input-gradient I where the
    backward is split), 2=W."""
    s = ir.builtin(schedule, p, m, v)
    return [[(0 if a.kind == "F" else 2 if a.kind == "W" else 1, a.stage, a.mb) for a in s.actions(r)]
            for r in range(p)]


def _n_stages(schedule: str, p: int, m: int, v: int) -> int:
    """Virtual stages of built-in ``schedule`` (checked like :func:`planner.schedule_ir.builtin`, without building it)."""
    if (why := ir.builtin_problem(schedule, p, m, v)):
        raise ScheduleError(why)
    return p * ir.stages_per_rank(schedule, v)


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


def stage_placement(cfg: ParallelConfig, m: int, schedule: ir.Schedule | None = None) -> tuple[int, ...]:
    """The pp rank of each virtual stage: the plan's own schedule's (``schedule=custom``,
    checked against the layout), else the built-in's (planner.schedule_ir.placement)."""
    if cfg.pp == 1:
        return (0,) * cfg.vpp
    if cfg.schedule != "custom":
        return ir.placement(cfg.schedule, cfg.pp, cfg.vpp)
    if schedule is None:
        raise PlanError("schedule=custom needs its schedule: give the file with --schedule FILE")
    if (why := ir.layout_problem(schedule, cfg.pp, cfg.vpp, m, cfg.seq_chunks)):
        raise PlanError(why)
    return schedule.stage_rank


# ---- simulation --------------------------------------------------------------------------
CHUNK_PARTS = ("attn_fwd", "attn_bwd", "fixed_fwd", "fixed_bwd")  # a chunked pass's parts (seq_chunks.ChunkParts)


def simulate(schedule: str, p: int, m: int, fwd: Sequence[float] | float, bwd: Sequence[float] | float, *,
             wgrad: Sequence[float] | float | None = None, p2p: float | Sequence[float] = 0.0,
             v: int = 1, seq_chunks: int = 1, attn_fwd: Sequence[float] | float = 0.0,
             attn_bwd: Sequence[float] | float = 0.0, fixed_fwd: Sequence[float] | float = 0.0,
             fixed_bwd: Sequence[float] | float = 0.0, split: SplitCost = SplitCost()) -> PipelineResult:
    """Simulate one training step of built-in ``schedule`` (times in seconds; module docstring).

    ``fwd``/``bwd`` (and ``wgrad`` for the split schedules) give one entry per virtual stage, or
    a single number for all. For zb-h1 and dualpipev, ``bwd`` is the input-gradient time I and
    ``wgrad`` the weight-gradient time W (default: ``split``'s parts of the whole ``bwd``).
    ``p2p``: one hop for all cross-rank edges, or one per rank boundary r -> (r + 1) % p (a WAN cut).
    ``seq_chunks`` k > 1: each of the ``m`` micro-batches runs as k sequence chunks (the IR's
    chunk order), chunk j of a stage taking ``cost_models.seq_chunks.chunk_seconds`` of its
    fwd / bwd with ``attn_fwd`` / ``attn_bwd`` seconds of them the attention core and
    ``fixed_fwd`` / ``fixed_bwd`` the part every call pays whatever its tokens."""
    comp = compile_builtin(schedule, p, m, v, seq_chunks)
    n = len(comp.chunk_of)
    f, b = _per_stage("fwd", fwd, n), _per_stage("bwd", bwd, n)
    if schedule in SPLIT_SCHEDULES:
        if wgrad is None:
            i, w = split.parts(b)
        else:
            i, w = b, _per_stage("wgrad", wgrad, n)
            b = [x + y for x, y in zip(i, w)]
    elif wgrad is not None:
        raise ScheduleError(f"wgrad is only used by {' and '.join(SPLIT_SCHEDULES)}; for {schedule!r} put the whole "
                            "backward in bwd")
    else:
        i, w = b, [0.0] * n
    attn = tuple(_per_stage(name, x, n) for name, x in zip(CHUNK_PARTS, (attn_fwd, attn_bwd, fixed_fwd, fixed_bwd))) \
        if seq_chunks > 1 else None
    return _run(comp, f, b, w, i, p2p, attn)


def simulate_schedule(s: ir.Schedule, fwd: Sequence[float] | float, bwd: Sequence[float] | float, *,
                      wgrad: Sequence[float] | float | None = None,
                      p2p: float | Sequence[float] = 0.0, check: bool = True, split: SplitCost = SplitCost(),
                      **chunk_parts: Sequence[float] | float) -> PipelineResult:
    """Simulate the schedule IR ``s`` (checked first, planner/schedule_check.py, unless ``check`` is
    False: the estimate's schedules were checked where they were made). ``bwd`` is each
    stage's whole backward (what B takes), ``wgrad`` its weight-gradient part W (default
    :func:`split_backward`); an I takes ``bwd - wgrad``, each part priced by ``split``. A schedule in sequence chunks
    (``s.seq_chunks`` > 1) takes ``chunk_parts`` as :func:`simulate` does (``attn_fwd``,
    ``attn_bwd``, ``fixed_fwd``, ``fixed_bwd``), ``p2p`` then one chunk's hop."""
    n = s.n_stages
    f, b = _per_stage("fwd", fwd, n), _per_stage("bwd", bwd, n)
    w = [split_backward(x)[1] for x in b] if wgrad is None else _per_stage("wgrad", wgrad, n)
    if any(y > x for x, y in zip(b, w)):
        raise ScheduleError("wgrad must not exceed bwd: it is the weight-gradient part of the whole backward")
    attn = tuple(_per_stage(name, chunk_parts.get(name, 0.0), n) for name in CHUNK_PARTS) \
        if s.seq_chunks > 1 else None
    if check:
        check_schedule(s)
    i, w = split.parts(b, w)
    return _run(compile_kept(s), f, b, w, i, p2p, attn)


def simulate_orders(orders: Sequence[Sequence[tuple[int, int, int]]], m: int, fwd: Sequence[float] | float,
                    bwd: Sequence[float] | float, *, wgrad: Sequence[float] | float | None = None,
                    p2p: float | Sequence[float] = 0.0, v: int = 1) -> PipelineResult:
    """Simulate custom per-rank orders of ``(kind, virtual_stage, mb)`` (kind 0=F, 1=B, 2=W) on
    looped stages (stage on rank ``stage % p``); with any W, kind 1 is the input-gradient part
    (``bwd``) and W takes ``wgrad`` (default zeros). Raises ScheduleError on a malformed order
    or a deadlock."""
    p = len(orders)
    for name, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ScheduleError(f"pipeline {name} must be a positive integer, got {val!r}")
    split = any(int(k) == 2 for order in orders for k, _, _ in order)
    names = {0: "F", 1: "I" if split else "B", 2: "W"}
    ranks = []
    for r, order in enumerate(orders):
        steps = []
        for op in order:
            kind, st, mb = (int(x) for x in op)
            if kind not in names:
                raise ScheduleError(f"bad operation {tuple(op)} on rank {r}: kind 0..2")
            steps.append(ir.Action(names[kind], st, mb))
        ranks.append(tuple(steps))
    s = ir.Schedule("custom", m, ir.looped(p, v), tuple(ranks))
    check_schedule(s)
    n = s.n_stages
    f, b = _per_stage("fwd", fwd, n), _per_stage("bwd", bwd, n)
    w = [0.0] * n if wgrad is None else _per_stage("wgrad", wgrad, n)
    return _run(compile_schedule(s), f, [x + y for x, y in zip(b, w)], w, b, p2p)


def _chunk_durations(comp: Compiled, f: list[float], b: list[float], w: list[float], i: list[float],
                     attn: tuple[list[float], ...] | None) -> list[float]:
    """Durations indexed ``(kind n_stages + stage) k + chunk`` (F, B, W, I): each pass's chunk share
    (``seq_chunks.chunk_seconds``; ``attn``: per stage the attention cores and fixed parts of F, B)."""
    k, zero = comp.k, [0.0] * len(f)
    if k == 1:
        return f + b + w + i
    af, ab, ff, fb = attn or (zero,) * 4
    return [chunk_seconds(t, at, j, k, fx) for times, a, x in ((f, af, ff), (b, ab, fb), (w, zero, zero), (i, ab, fb))
            for t, at, fx in zip(times, a, x) for j in range(k)]


def _run(comp: Compiled, f: list[float], b: list[float], w: list[float], i: list[float],
         p2p: float | Sequence[float], attn: tuple[list[float], ...] | None = None) -> PipelineResult:
    p, m = comp.p, comp.m
    per = _per_stage("p2p", p2p, p)  # per rank boundary r -> (r + 1) % p
    hops = per + [0.0, max(per)]  # + the step index _NO_HOP (same rank) and _FAR_HOP (non-adjacent ranks)
    dur = _chunk_durations(comp, f, b, w, i, attn)  # indexed (kind n_stages + stage) k + chunk
    end = [-1.0] * (3 * len(comp.chunk_of) * m) + [0.0]  # end time per op id; -1 = not run yet
    starts: list[list[float]] = [[0.0] * len(o) for o in comp.steps]
    ptr = [0] * p
    free = [0.0] * p
    blocked = [-1] * (p + 1)  # the op id each rank waits on (+ a sentinel)
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        steps = comp.steps[r]
        n_ops = len(steps)
        k = ptr[r]
        t = free[r]
        st_r = starts[r]
        while k < n_ops:
            dep, hop, oid, di, wake = steps[k]
            ready = end[dep]
            if ready < 0:
                blocked[r] = dep
                break
            ready += hops[hop]  # 0.0 on one rank
            if ready > t:
                t = ready
            st_r[k] = t
            t += dur[di]
            end[oid] = t
            k += 1
            if blocked[wake] == oid:
                blocked[wake] = -1
                stack.append(wake)
        ptr[r] = k
        free[r] = t
    for r in range(p):
        if ptr[r] < len(comp.steps[r]):
            kind, s, mb = comp.orders[r][ptr[r]]
            raise ScheduleError(
                f"schedule {comp.name!r} deadlocks: rank {r} waits forever at {KIND_NAMES[kind]}(stage {s}, mb {mb})")
    step = max(free)
    busy = [sum(dur[di] * k for di, k in work) for work in comp.work]
    bubble = max(0.0, 1.0 - (sum(busy) / p) / step) if step > 0 else 0.0  # clamp rounding
    inflight, inflight_chunks, pending_w = comp.peaks
    return PipelineResult(schedule=comp.name, p=p, m=m // comp.k, v=comp.v, step_s=step, bubble_frac=bubble,
                          busy_s=busy, peak_inflight=list(inflight), peak_inflight_chunks=list(inflight_chunks),
                          peak_pending_w=list(pending_w), seq_chunks=comp.k,
                          _raw=(comp.orders, starts, dur, comp.chunk_of))


# ---- closed form ----------------------------------------------------------------------------
def estimate_step(schedule: str, p: int, m: int, fwd: Sequence[float] | float, bwd: Sequence[float] | float, *,
                  wgrad: Sequence[float] | float | None = None, p2p: float = 0.0, v: int = 1,
                  split: SplitCost = SplitCost()) -> float:
    """Closed-form step seconds: exact for uniform stages with p2p = 0, else an upper bound.

    Arguments as for :func:`simulate`; the formulas are in the module docstring.
    """
    n_stages = _n_stages(schedule, p, m, v)
    fs, bs = _per_stage("fwd", fwd, n_stages), _per_stage("bwd", bwd, n_stages)
    if schedule in SPLIT_SCHEDULES:
        if wgrad is None:  # (the first stage split like the others: on uniform stages its whole W times the same)
            bs, ws = SplitCost(split.extra).parts(bs)
        else:
            ws = _per_stage("wgrad", wgrad, n_stages)
    elif wgrad is not None:
        raise ScheduleError(f"wgrad is only used by {' and '.join(SPLIT_SCHEDULES)}; for {schedule!r} put the whole "
                            "backward in bwd")
    else:
        ws = [0.0] * n_stages
    if not p2p >= 0:
        raise ScheduleError(f"p2p must be >= 0 seconds, got {p2p!r}")
    hop = p2p if p > 1 else 0.0
    f, b, w = max(fs) + hop, max(bs) + hop, max(ws)
    if schedule == "dualpipev":  # no closed form: the simulator on uniform stages, O(p m)
        return simulate(schedule, p, m, f, b, wgrad=w).step_s
    if schedule == "zb-h1":
        if m < p:
            return simulate("zb-h1", p, m, f, b, wgrad=w).step_s
        return m * (f + b + w) + (p - 1) * max(f + b - min(w, b), b)
    if schedule == "interleaved-1f1b":
        return (m * v + p - 1) * (f + b)
    return (m + p - 1) * (f + b)
