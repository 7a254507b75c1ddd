"""Generated pipeline schedules: list scheduling over the stages' own F / I / W times.

:func:`generate` builds a schedule IR (``planner/schedule_ir.py``, one stage per rank, looped)
for measured or modelled per-stage forward ``F``, input-gradient ``I`` and weight-gradient ``W``
seconds, a p2p hop and a per-rank limit on the activations held, by a discrete-event list
scheduler:

- each rank runs one action at a time; candidates are its next forward (micro-batches in
  order, while the activations it would hold stay within the rank's limit), its next
  input-gradient backward (in order) and its pending weight-gradient passes;
- an action's earliest start is when its input is there (the previous stage's F, the next
  stage's I, plus the hop across ranks) and the rank is free; every round commits the action
  with the earliest start over all ranks (ties: backward, then forward, then weight pass - the
  backward is on the critical path and frees memory; a first stage's backward, which feeds no other
  rank, after a forward);
- a weight pass (which nothing waits for) runs only when it fits in the gap before the
  rank's next forward or backward could start, or when nothing else can run; an I followed
  directly by its W is written as one B;
- the first stage never splits: its backward runs whole (B) where its I would. Torch's schedule
  runtime runs nothing in a first stage's I (its inputs take no gradient) and the whole backward in
  its W, holding the stage's activations until then (``planner.schedule_check.frees``,
  ``cost_models.pipeline.SplitCost.first_whole``): a split there would only move the whole backward,
  and the memory it frees, to the W.

The result is checked (``planner/schedule_check.py``) and priced by the same simulator as the
built-ins; :func:`best_schedule` keeps it only when it is faster than the best built-in at the
same memory (the limit defaults to 1F1B's activations on each rank), so a generated schedule is
never slower than the built-ins it is compared with.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from cost_models.pipeline import PipelineResult, SplitCost, simulate, simulate_schedule
from planner.schedule_check import check, frees, peak_activations
from planner.schedule_ir import Action, Schedule, builtin, builtin_problem, looped
from planner.search.incumbents import faster

_PRIORITY = {"I": 0, "F": 1, "W": 2}
_FIRST_BACKWARD = 1.5  # a first stage's backward feeds no other rank: at a tie, a forward (which does) first


@dataclass
class _State:
    """The list scheduler's state: per stage the next forward and backward micro-batch, per rank
    the time it is free, the activations it holds and its weight passes not yet run."""
    stage_rank: tuple[int, ...]
    m: int
    dur: dict[str, list[float]]
    act: list[float]
    limit: list[float]
    p2p: float
    next_f: list[int] = field(default_factory=list)
    next_i: list[int] = field(default_factory=list)
    free: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    pending_w: list[list[tuple[int, int]]] = field(default_factory=list)
    end: dict[tuple[str, int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p, n = max(self.stage_rank) + 1, len(self.stage_rank)
        self.next_f, self.next_i = [0] * n, [0] * n
        self.free, self.held, self.pending_w = [0.0] * p, [0.0] * p, [[] for _ in range(p)]
        self.on_rank = [[s for s in range(n) if self.stage_rank[s] == r] for r in range(p)]
        # a forward of stage s leaves room to carry its micro-batch through the rank's later stages
        self.need = [sum(self.act[t] for t in self.on_rank[self.stage_rank[s]] if t >= s) for s in range(n)]

    def ready(self, dep: tuple[str, int, int], s: int) -> float | None:
        """When ``dep``'s output is at stage ``s``'s rank (None: not run yet)."""
        if dep not in self.end:
            return None
        return self.end[dep] + (self.p2p if self.stage_rank[dep[1]] != self.stage_rank[s] else 0.0)


def generate(fwd: Sequence[float], bwd: Sequence[float], m: int, *, wgrad: Sequence[float] | None = None,
             p2p: float = 0.0, act: Sequence[float] | None = None, limit: Sequence[float] | None = None,
             stage_rank: Sequence[int] | None = None, name: str = "generated",
             split: SplitCost = SplitCost()) -> Schedule:
    """A schedule for ``len(fwd)`` virtual stages, stage s on rank ``stage_rank[s]`` (default one stage
    per rank) and ``m`` micro-batches (times in seconds; ``bwd`` the whole backward, ``wgrad`` its
    weight part, default ``cost_models.pipeline.split_backward``; ``split`` what running them apart
    costs, which the order is planned with); ``act[s]`` one micro-batch's activations on stage s
    and ``limit[r]`` the most rank r may hold (default: 1F1B's, ``min(p - r, m)`` micro-batches of
    each of its stages)."""
    n = len(fwd)
    placement = tuple(stage_rank) if stage_rank is not None else looped(n, 1)
    p = max(placement) + 1
    i, w = split.parts(bwd, wgrad)
    i[0], w[0] = float(bwd[0]), 0.0  # the first stage's backward runs whole (B) where its I would (_merge)
    act = [1.0] * n if act is None else list(act)
    limit = default_limit(placement, m, act) if limit is None else list(limit)
    st = _State(placement, m, {"F": list(fwd), "I": i, "W": w}, act, limit, p2p)
    if any(lim < sum(act[s] for s in st.on_rank[r]) - 1e-12 for r, lim in enumerate(limit)):
        raise ValueError(f"no schedule within the activation limits {limit}: raise them to one micro-batch "
                         "of each stage a rank holds")
    orders: list[list[Action]] = [[] for _ in range(p)]
    cands = [_candidate(r, st) for r in range(p)]
    for _ in range(3 * n * m):
        best = min((c for c in cands if c is not None), key=lambda c: c[:3], default=None)
        if best is None:
            break
        r, a, start = best[3:]
        _commit(st, r, a, start)
        orders[r].append(a)
        touched = {r} | {placement[t] for t in (a.stage - 1, a.stage + 1) if 0 <= t < n}
        for q in touched:  # only the ranks whose inputs this action made see new candidates
            cands[q] = _candidate(q, st)
    if any(f < m for f in st.next_f) or any(i < m for i in st.next_i) or any(st.pending_w):
        raise ValueError(f"no schedule within the activation limits {limit}: raise them")
    return check(Schedule(name, m, placement, tuple(tuple(_merge(o)) for o in orders)))


def default_limit(placement: Sequence[int], m: int, act: Sequence[float]) -> list[float]:
    """The activations each rank may hold by default: what the built-in for the placement holds at
    its peak (``act``-weighted) - 1F1B's ``min(p - r, m)`` micro-batches with one stage per rank,
    interleaved 1F1B's on a looped placement of ``v`` stages per rank (when it can be made for ``m``)."""
    p, n = max(placement) + 1, len(placement)
    if n > p and tuple(placement) == looped(p, n // p) and not builtin_problem("interleaved-1f1b", p, m, n // p):
        return peak_activations(builtin("interleaved-1f1b", p, m, n // p), list(act))
    return [min(p - r, m) * sum(a for s, a in enumerate(act) if placement[s] == r) for r in range(p)]


def _commit(st: _State, r: int, a: Action, start: float) -> None:
    st.end[(a.kind, a.stage, a.mb)] = st.free[r] = start + st.dur[a.kind][a.stage]
    if a.kind == "F":
        st.next_f[a.stage] += 1
        st.held[r] += st.act[a.stage]
    else:
        if a.kind == "I":
            st.next_i[a.stage] += 1
            st.pending_w[r].append((a.stage, a.mb))
        else:
            st.pending_w[r].remove((a.stage, a.mb))
        if frees(a.kind, a.stage):  # (the first stage's activations: at its W)
            st.held[r] -= st.act[a.stage]


def _candidate(r: int, st: _State):
    """(key, priority, tie, rank, action, start) of rank r's next action, or None when it must
    wait. ``key`` orders the ranks' candidates; it is the start but for a weight pass taken while
    the rank waits for another rank: then the pass's end (committed only if nothing anywhere
    starts before it ends, so no input can arrive meanwhile). Ties: backward, then forward (the
    deepest stage first: it brings a backward nearer), then a first stage's backward (it feeds no
    other rank), then weight pass."""
    last, free, opts = len(st.stage_rank) - 1, st.free[r], []
    for s in st.on_rank[r]:
        if st.next_i[s] < st.next_f[s]:  # the next backward, once its forward ran here
            mb = st.next_i[s]
            t = st.ready(("F", s, mb) if s == last else ("I", s + 1, mb), s)
            if t is not None:
                t = max(free, t)
                opts.append((t, _PRIORITY["I"] if s else _FIRST_BACKWARD, s, r, Action("I", s, mb), t))
        if st.next_f[s] < st.m and st.held[r] + st.need[s] <= st.limit[r] + 1e-12:
            mb = st.next_f[s]
            t = 0.0 if s == 0 else st.ready(("F", s - 1, mb), s)
            if t is not None:
                t = max(free, t)
                opts.append((t, _PRIORITY["F"], -s, r, Action("F", s, mb), t))
    pend = st.pending_w[r]
    if pend:
        s, mb = pend[0]
        w, dw = Action("W", s, mb), st.dur["W"][s]
        nxt = min((o[0] for o in opts), default=None)
        if nxt is not None and free + dw <= nxt + 1e-12:  # fits in the gap
            return (free, _PRIORITY["W"], 0, r, w, free)
        if nxt is None:  # nothing else here yet: now if nothing else is left, else only if no input comes sooner
            done = all(st.next_i[t] == st.m and st.next_f[t] == st.m for t in st.on_rank[r])
            return (free if done else free + dw, _PRIORITY["W"], 0, r, w, free)
    return min(opts) if opts else None


def _merge(order: list[Action]) -> list[Action]:
    """An I followed directly by its own W written as one full backward B, and the first stage's every
    I as its B (its W, of no duration, dropped)."""
    out: list[Action] = []
    for a in order:
        if a.stage == 0 and a.kind in "IW":
            if a.kind == "I":
                out.append(Action("B", 0, a.mb))
        elif a.kind == "W" and out and out[-1] == Action("I", a.stage, a.mb):
            out[-1] = Action("B", a.stage, a.mb)
        else:
            out.append(a)
    return out


@dataclass(frozen=True)
class Choice:
    """The schedule :func:`best_schedule` keeps: a built-in's name, or a generated IR."""

    name: str
    result: PipelineResult
    schedule: Schedule | None = None  # the generated IR (None: the built-in ``name``)


def best_schedule(fwd: Sequence[float], bwd: Sequence[float], m: int, *, p2p: float = 0.0,
                  builtins: Sequence[str] = ("1f1b", "zb-h1"), split: SplitCost = SplitCost()) -> Choice:
    """The fastest of the ``builtins`` (one stage per rank) and the generated schedule at 1F1B's
    activation memory per rank, simulated alike (a split backward costing ``split``); the generated
    one wins only when strictly faster."""
    p = len(fwd)
    best = None
    for name in builtins:
        res = simulate(name, p, m, fwd, bwd, p2p=p2p, split=split)
        if best is None or res.step_s < best.result.step_s:
            best = Choice(name, res)
    gen = generate(fwd, bwd, m, p2p=p2p, split=split)
    res = simulate_schedule(gen, fwd, bwd, p2p=p2p, split=split)
    if best is None or faster(res.step_s, best.result.step_s):
        best = Choice("generated", res, gen)
    return best
