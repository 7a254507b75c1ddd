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
  backward is on the critical path and frees memory);
- a weight pass (which nothing waits for) runs only when it fits in the gap before the
  rank's next forward or backward could start, or when nothing else can run; an I followed
  directly by its W is written as one B.

The result is checked (``planner/schedule_check.py``) and priced by the same simulator as the
built-ins; :func:`best_schedule` keeps it only when it is faster than the best built-in at the
same memory (the limit defaults to 1F1B's activations on each rank), so a generated schedule is
never slower than the built-ins it is compared with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cost_models.pipeline import PipelineResult, simulate, simulate_schedule, split_backward
from planner.schedule_check import check
from planner.schedule_ir import Action, Schedule, looped
from planner.search.incumbents import faster

_PRIORITY = {"I": 0, "F": 1, "W": 2}


@dataclass
class _Rank:
    free: float = 0.0
    next_f: int = 0
    next_i: int = 0
    held: float = 0.0


def generate(fwd: Sequence[float], bwd: Sequence[float], m: int, *, wgrad: Sequence[float] | None = None,
             p2p: float = 0.0, act: Sequence[float] | None = None, limit: Sequence[float] | None = None,
             name: str = "generated") -> Schedule:
    """A schedule for ``len(fwd)`` stages on as many ranks and ``m`` micro-batches (times in
    seconds; ``bwd`` the whole backward, ``wgrad`` its weight part, default
    :func:`split_backward`); ``act[s]`` one micro-batch's activations on stage s and
    ``limit[r]`` the most rank r may hold (default: 1F1B's, ``min(p - r, m)`` micro-batches)."""
    p = len(fwd)
    w = [split_backward(b)[1] for b in bwd] if wgrad is None else list(wgrad)
    i = [b - x for b, x in zip(bwd, w)]
    act = [1.0] * p if act is None else list(act)
    limit = [min(p - r, m) * act[r] for r in range(p)] if limit is None else list(limit)
    dur = {"F": list(fwd), "I": i, "W": w}
    end: dict[tuple[str, int, int], float] = {}
    ranks = [_Rank() for _ in range(p)]
    pending_w: list[list[int]] = [[] for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    cands = [_candidate(r, ranks[r], pending_w[r], end, dur, p, m, p2p, act, limit) for r in range(p)]
    for _ in range(3 * p * m):
        best = min((c for c in cands if c is not None), key=lambda c: c[:3], default=None)
        if best is None:
            raise ValueError(f"no schedule within the activation limits {limit}: raise them")
        _, _, r, a, start = best
        st = ranks[r]
        end[(a.kind, a.stage, a.mb)] = st.free = start + dur[a.kind][a.stage]
        orders[r].append(a)
        if a.kind == "F":
            st.next_f += 1
            st.held += act[r]
        elif a.kind == "I":
            st.next_i += 1
            st.held -= act[r]
            pending_w[r].append(a.mb)
        else:
            pending_w[r].remove(a.mb)
        for q in range(max(0, r - 1), min(p, r + 2)):  # only a rank and its neighbours see new inputs
            cands[q] = _candidate(q, ranks[q], pending_w[q], end, dur, p, m, p2p, act, limit)
    return check(Schedule(name, m, looped(p, 1), tuple(tuple(_merge(o)) for o in orders)))


def _candidate(r: int, st: _Rank, pend: list[int], end: dict, dur: dict, p: int, m: int, p2p: float,
               act: Sequence[float], limit: Sequence[float]):
    """(key, priority, rank, action, start) of rank r's next action, or None when it must wait.
    ``key`` orders the ranks' candidates; it is the start but for a weight pass taken while the
    rank waits for another rank: then the pass's end (committed only if nothing anywhere starts
    before it ends, so no input can arrive meanwhile)."""
    opts = []
    if st.next_i < st.next_f:  # the next backward, once its forward ran here
        mb = st.next_i
        dep = ("F", r, mb) if r == p - 1 else ("I", r + 1, mb)
        if dep in end:
            t = max(st.free, end[dep] + (p2p if r < p - 1 else 0.0))
            opts.append((t, _PRIORITY["I"], r, Action("I", r, mb), t))
    if st.next_f < m and st.held + act[r] <= limit[r] + 1e-12:
        mb = st.next_f
        if r == 0 or ("F", r - 1, mb) in end:
            t = max(st.free, end[("F", r - 1, mb)] + p2p if r else 0.0)
            opts.append((t, _PRIORITY["F"], r, Action("F", r, mb), t))
    if pend:
        w = Action("W", r, pend[0])
        nxt = min((o[0] for o in opts), default=None)
        if nxt is not None and st.free + dur["W"][r] <= nxt + 1e-12:  # fits in the gap
            return (st.free, _PRIORITY["W"], r, w, st.free)
        if nxt is None:  # nothing else here yet: now if nothing else is left, else only if no input comes sooner
            done = st.next_i == m and st.next_f == m
            return (st.free if done else st.free + dur["W"][r], _PRIORITY["W"], r, w, st.free)
    return min(opts) if opts else None


def _merge(order: list[Action]) -> list[Action]:
    """An I followed directly by its own W written as one full backward B."""
    out: list[Action] = []
    for a in order:
        if a.kind == "W" and out and out[-1] == Action("I", a.stage, a.mb):
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
                  builtins: Sequence[str] = ("1f1b", "zb-h1")) -> Choice:
    """The fastest of the ``builtins`` (one stage per rank) and the generated schedule at 1F1B's
    activation memory per rank, simulated alike; the generated one wins only when strictly faster."""
    p = len(fwd)
    best = None
    for name in builtins:
        res = simulate(name, p, m, fwd, bwd, p2p=p2p)
        if best is None or res.step_s < best.result.step_s:
            best = Choice(name, res)
    gen = generate(fwd, bwd, m, p2p=p2p)
    res = simulate_schedule(gen, fwd, bwd, p2p=p2p)
    if best is None or faster(res.step_s, best.result.step_s):
        best = Choice("generated", res, gen)
    return best
