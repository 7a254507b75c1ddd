"""Check a schedule IR (``planner/schedule_ir.py``) before anything runs it: one line per problem.

:func:`check` raises :class:`~planner.schedule_ir.ScheduleError` naming the FIRST problem, in
this order:

1. shape: at least one rank and micro-batch, every stage placed on an existing rank, every rank
   holding a stage;
2. each action: a known kind, an existing stage and micro-batch, on the rank holding its stage;
3. every action once, and each (stage, micro-batch) has a forward and exactly one backward:
   ``B``, or ``I`` and ``W``;
4. dependencies (with sequence chunks, also the chunk order: ``schedule_ir.chunk_deps``)
   satisfiable across ranks (no deadlock): the ranks are executed symbolically, each
   running its next action as soon as what it waits for has run anywhere (sends never block
   in torch's runtime; only a compute action waits for its input) - a rank stuck for good names
   the action and what it waits for;
5. memory: with ``act_bytes`` (one micro-batch's activations per stage) and ``limit_bytes`` (per
   rank), the peak activations a rank holds (from a stage's F until its B or I) within the limit.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from planner.schedule_ir import BACKWARDS, KINDS, Action, Schedule, ScheduleError, chunk_deps, parts


def check(s: Schedule, act_bytes: Sequence[float] | None = None,
          limit_bytes: Sequence[float] | float | None = None, where: str = "schedule") -> Schedule:
    """``s`` if it can run (module docstring), else ScheduleError; ``where`` names it in messages."""
    _check_shape(s, where)
    _check_actions(s, where)
    _check_complete(s, where)
    _check_deadlock(s, where)
    if act_bytes is not None and limit_bytes is not None:
        _check_memory(s, act_bytes, limit_bytes, where)
    return s


def _check_shape(s: Schedule, where: str) -> None:
    if s.p < 1:
        raise ScheduleError(f"{where}: no ranks; give one row of actions per pp rank")
    if isinstance(s.n_microbatches, bool) or not isinstance(s.n_microbatches, int) or s.n_microbatches < 1:
        raise ScheduleError(f"{where}: {s.n_microbatches!r} micro-batches; it needs at least one")
    k = s.seq_chunks
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or s.n_microbatches % k:
        raise ScheduleError(f"{where}: {k!r} sequence chunks do not divide its {s.n_microbatches} units; "
                            "give units = micro-batches x chunks")
    if not s.stage_rank:
        raise ScheduleError(f"{where}: no stages; each rank must run the actions of at least one stage")
    for st, r in enumerate(s.stage_rank):
        if not 0 <= r < s.p:
            raise ScheduleError(f"{where}: stage {st} placed on rank {r}, but there are {s.p} ranks")
    for r in range(s.p):
        if r not in s.stage_rank:
            raise ScheduleError(f"{where}: rank {r} holds no stage; every pp rank needs at least one")


def _check_actions(s: Schedule, where: str) -> None:
    seen: set[Action] = set()
    for r in range(s.p):
        for i, a in enumerate(s.actions(r)):
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise ScheduleError(f"{where}: rank {r} action {i} ({a}) is not one of {', '.join(KINDS)}")
            if not 0 <= a.stage < s.n_stages:
                raise ScheduleError(f"{where}: rank {r} runs {a}, but there are {s.n_stages} stages (0..{s.n_stages - 1})")
            if not 0 <= a.mb < s.n_microbatches:
                raise ScheduleError(f"{where}: rank {r} runs {a}, but there are {s.n_microbatches} micro-batches "
                                    f"(0..{s.n_microbatches - 1})")
            if s.stage_rank[a.stage] != r:
                raise ScheduleError(f"{where}: rank {r} runs {a}, but stage {a.stage} lives on rank "
                                    f"{s.stage_rank[a.stage]}; move the action to that rank's row")
            if a in seen:
                raise ScheduleError(f"{where}: rank {r} runs {a} twice; every action runs once")
            seen.add(a)


def _check_complete(s: Schedule, where: str) -> None:
    # the actions are distinct and in range (_check_actions): n of one kind is one per (stage, micro-batch)
    n, count = s.n_stages * s.n_microbatches, Counter(a.kind for r in range(s.p) for a in s.actions(r))
    if count["F"] == n and ((count["B"], count["I"], count["W"]) in ((n, 0, 0), (0, n, n))):
        return
    have = {(a.kind, a.stage, a.mb) for r in range(s.p) for a in s.actions(r)}
    for st in range(s.n_stages):
        for mb in range(s.n_microbatches):
            name = f"stage {st} micro-batch {mb}"
            if ("F", st, mb) not in have:
                raise ScheduleError(f"{where}: {name} has no forward; add {st}F{mb}")
            b, i, w = (("B", st, mb) in have), (("I", st, mb) in have), (("W", st, mb) in have)
            if b and (i or w):
                raise ScheduleError(f"{where}: {name} has a full backward {st}B{mb} and a split one "
                                    f"({st}I{mb}/{st}W{mb}); keep one")
            if not b and not (i and w):
                missing = f"{st}B{mb}" if not (i or w) else (f"{st}W{mb}" if i else f"{st}I{mb}")
                raise ScheduleError(f"{where}: {name} has no complete backward; add {missing}")


def needs(a: Action, n_stages: int) -> tuple[str, int, int] | None:
    """What ``a`` waits for from another stage or its own forward, as ``(kind, stage, mb)`` with
    kind ``F``, ``BI`` (a B or an I of that stage and micro-batch) or ``I``; None for the first
    forward. (Sequence chunks add :func:`planner.schedule_ir.chunk_deps`: :func:`all_needs`.)"""
    if a.kind == "F":
        return ("F", a.stage - 1, a.mb) if a.stage else None
    if a.kind in BACKWARDS:
        return ("BI", a.stage + 1, a.mb) if a.stage < n_stages - 1 else ("F", a.stage, a.mb)
    return ("I", a.stage, a.mb)


def all_needs(a: Action, n_stages: int, k: int = 1) -> tuple[tuple[str, int, int], ...]:
    """Everything ``a`` waits for: :func:`needs` and, with ``k`` sequence chunks, the chunk order."""
    dep = needs(a, n_stages)
    return ((dep,) if dep is not None else ()) + chunk_deps(a, k)


def _check_deadlock(s: Schedule, where: str) -> None:
    done: set[tuple[str, int, int]] = set()
    order = [s.actions(r) for r in range(s.p)]
    ptr = [0] * s.p
    progress = True
    while progress:
        progress = False
        for r in range(s.p):
            while ptr[r] < len(order[r]):
                a = order[r][ptr[r]]
                if any(dep not in done for dep in all_needs(a, s.n_stages, s.seq_chunks)):
                    break
                done.add((a.kind, a.stage, a.mb))
                if a.kind in BACKWARDS:
                    done.add(("BI", a.stage, a.mb))
                ptr[r] += 1
                progress = True
    for r in range(s.p):
        if ptr[r] < len(order[r]):
            a = order[r][ptr[r]]
            kind, st, mb = next(d for d in all_needs(a, s.n_stages, s.seq_chunks) if d not in done)
            dep = f"{st}{kind if kind != 'BI' else 'B/I'}{mb}"
            raise ScheduleError(f"{where}: deadlock - rank {r} waits forever at {a} for {dep} "
                                f"(on rank {s.stage_rank[st]}); reorder so {dep} can run first")


def frees(kind: str, stage: int) -> bool:
    """Whether an action of ``kind`` on virtual ``stage`` frees its micro-batch's activations, as torch's
    schedule runtime runs it: a B; an I, but on the first stage its W (its inputs take no gradient:
    torch runs nothing in its I and the whole backward, with the activations it reads, in its W)."""
    return kind == "B" or (kind == "I" and stage > 0) or (kind == "W" and stage == 0)


def peak_activations(s: Schedule, act_bytes: Sequence[float]) -> list[float]:
    """Per rank, the most activation bytes held at once: a stage's micro-batch from its F until
    the action that frees it (:func:`frees`; ``act_bytes[stage]`` each)."""
    return [sum(act_bytes[st] * n for st, n in held_at_peak(s, r, act_bytes).items()) for r in range(s.p)]


def held_at_peak(s: Schedule, r: int, act_bytes: Sequence[float]) -> dict[int, int]:
    """Rank ``r``'s micro-batches held per stage (``{stage: count}``, every stage of the rank) at the
    moment its activation bytes peak (``act_bytes[stage]`` per micro-batch; the first such moment)."""
    held = {st: 0 for st in s.stages_of(r)}
    best, at = 0.0, dict(held)
    total = 0.0
    for step in s.ranks[r]:
        for a in parts(step):
            if a.kind == "F":
                held[a.stage] += 1
                total += act_bytes[a.stage]
                if total > best:
                    best, at = total, dict(held)
            elif frees(a.kind, a.stage):
                held[a.stage] -= 1
                total -= act_bytes[a.stage]
    return at


def _check_memory(s: Schedule, act_bytes: Sequence[float], limit_bytes: Sequence[float] | float,
                  where: str) -> None:
    if len(act_bytes) != s.n_stages:
        raise ScheduleError(f"{where}: {len(act_bytes)} activation sizes for {s.n_stages} stages")
    limits = [float(limit_bytes)] * s.p if isinstance(limit_bytes, (int, float)) else list(limit_bytes)
    for r, (peak, lim) in enumerate(zip(peak_activations(s, act_bytes), limits)):
        if peak > lim:
            raise ScheduleError(f"{where}: rank {r} holds {peak / 2**30:.2f} GiB of activations at its peak, over "
                                f"its {lim / 2**30:.2f} GiB; run backwards earlier (fewer forwards in flight)")
