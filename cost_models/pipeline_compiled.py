"""A schedule's duration-independent part, compiled once for the pipeline simulator
(cost_models/pipeline.py): per rank, each operation's dependency, the hop it crosses, the id it
completes, its duration index and the rank it may wake; the per-rank peaks of what is held; how
many operations take each duration. Kept per built-in (schedule, p, m, v, k) by
:func:`compile_builtin` and per schedule IR by :func:`compile_kept`: a search compiles each of its
schedules once per process.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from planner import schedule_ir as ir
from planner.schedule_check import frees

Op = tuple[int, int, int]  # (kind, virtual stage, micro-batch); kind 0=F, 1=B or I, 2=W
_IR_KIND = {"F": 0, "B": 1, "W": 2, "I": 3}  # duration index: F, full B, W, input-grad I
KIND_NAMES = tuple(_IR_KIND)  # the kind of each duration index


@dataclass(frozen=True)
class Compiled:
    """Duration-independent part of a simulation (module docstring)."""

    name: str
    p: int
    m: int
    v: int
    orders: list[list[Op]]  # per rank: (duration kind 0..3 = F, B, W, I; stage; mb)
    # per rank, per op: (dep_id, hop, op_id, duration_index, wake_rank); dep_id 3*S*m is a
    # sentinel that is always ready, wake_rank p means nobody to wake; hop: the rank boundary
    # the dependency crosses (:func:`_hop_index`)
    steps: list[list[tuple[int, int, int, int, int]]]
    peaks: tuple[list[int], list[int], list[int]]
    chunk_of: list[int]
    work: list[list[tuple[int, int]]]  # per rank: (duration index, how many ops take it)
    k: int = 1  # sequence chunks: durations per (kind, stage, chunk), index (kind S + stage) k + unit % k


@lru_cache(maxsize=32)
def compile_builtin(schedule: str, p: int, m: int, v: int, k: int = 1) -> Compiled:
    """:func:`compile_schedule` of the built-in ``schedule`` (``planner.schedule_ir.builtin``), kept."""
    return compile_schedule(ir.builtin(schedule, p, m, v, k))


@lru_cache(maxsize=64)
def compile_kept(s: ir.Schedule) -> Compiled:
    """:func:`compile_schedule` of a schedule IR (a plan's own: generated, deepened or a file's),
    kept while it stays among the last 64 distinct ones: the search prices one on many splits."""
    return compile_schedule(s)


def _hop_index(ra: int, rb: int, p: int) -> int:
    """Which hop an edge from rank ``ra`` to rank ``rb`` waits on: p (none) on one rank, the
    boundary r of r -> (r + 1) % p between neighbours (either direction), p + 1 (the slowest
    boundary) between ranks that are not neighbours (a custom placement)."""
    if ra == rb:
        return p
    if rb == (ra + 1) % p:
        return ra
    return rb if ra == (rb + 1) % p else p + 1


def compile_schedule(s: ir.Schedule) -> Compiled:
    """The compiled form of ``s`` (module docstring); the actions of one kind on one stage share
    all but their unit's terms (:func:`_action_terms`), worked out once per rank."""
    p, m, n, sr, nk = s.p, s.n_microbatches, s.n_stages, s.stage_rank, s.seq_chunks
    edge = [_hop_index(sr[j], sr[j + 1], p) for j in range(n - 1)]  # the hop between stage j and j + 1
    orders, steps = [], []
    for r in range(p):
        order, rs = [], []
        per: dict[tuple[str, int], tuple] = {}  # (kind, stage) -> what its actions share
        for kind, st, mb in s.actions(r):
            c = per.get((kind, st))
            if c is None:
                c = per[kind, st] = _action_terms(kind, st, r, p, m, n, nk, sr, edge)
            k, dep, by_mb, hop, oid, di, wake = c
            order.append((k, st, mb))  # (a chunk's same-stage dependencies: met by the checked order)
            rs.append((dep + by_mb * mb, hop, oid + mb, di + mb % nk, wake))
        orders.append(order)
        steps.append(rs)
    chunk_of = [s.stages_of(r).index(st) for st, r in enumerate(sr)]
    work = [sorted(Counter(di for _, _, _, di, _ in rs).items()) for rs in steps]
    return Compiled(s.name, p, m, s.v, orders, steps, _peaks(orders, s.v, nk), chunk_of, work, nk)


def _action_terms(kind: str, st: int, r: int, p: int, m: int, n: int, nk: int, sr: Sequence[int],
                  edge: list[int]) -> tuple[int, int, int, int, int, int, int]:
    """What every action of ``kind`` on stage ``st`` (rank ``r``) shares in the compiled steps:
    (duration kind, dependency id at unit 0, its step per unit (0: the always-ready sentinel),
    hop, op id at unit 0, duration index at chunk 0, rank to wake). An F waits for the previous
    stage's F (none on stage 0) and wakes the next stage's rank; a B or I waits for the next
    stage's backward (the last stage: its own F) and wakes the previous stage's rank; a W waits
    for its own B or I."""
    sm = n * m
    if kind == "F":
        dep, by_mb, hop = ((st - 1) * m, 1, edge[st - 1]) if st else (3 * sm, 0, p)
        done, wake = 0, sr[st + 1] if st < n - 1 else -1
    elif kind == "W":
        dep, by_mb, hop, done, wake = sm + st * m, 1, p, 2, -1
    else:  # B or I: the backward the previous stage waits for
        dep, by_mb, hop = (st * m, 1, p) if st == n - 1 else (sm + (st + 1) * m, 1, edge[st])
        done, wake = 1, sr[st - 1] if st else -1
    if wake == r or wake < 0:
        wake = p  # the sentinel slot of `blocked`: never matches
    k = _IR_KIND[kind]
    return k, dep, by_mb, hop, (done * n + st) * m, (k * n + st) * nk, wake


def _peaks(orders: list[list[Op]], v: int, k: int = 1) -> tuple[list[int], list[int], list[int]]:
    """Per rank: peak micro-batches held (F until the action that frees them, ``schedule_check.frees``;
    with k sequence chunks, sequences with a chunk held), peak (chunk, unit) pairs held, peak W's
    pending (from an I to its W; the first stage's, which holds the whole, counts as held)."""
    mbs_peak, chunk_peak, w_peak = [], [], []
    for order in orders:
        held = best = pend = wbest = 0
        per_mb: dict[int, int] = {}
        distinct = dbest = 0
        for kind, st, unit in order:
            mb = unit // k
            if kind == 0:
                held += 1
                best = max(best, held)
                c = per_mb.get(mb, 0)
                if c == 0:
                    distinct += 1
                    dbest = max(dbest, distinct)
                per_mb[mb] = c + 1
                continue
            if kind != 1 and st > 0:  # a W pending from its I (the first stage's W holds the activations)
                pend += 1 if kind == 3 else -1
                wbest = max(wbest, pend)
            if frees(KIND_NAMES[kind], st):
                held -= 1
                per_mb[mb] -= 1
                if per_mb[mb] == 0:
                    distinct -= 1
        mbs_peak.append(dbest if v > 1 or k > 1 else best)
        chunk_peak.append(best)
        w_peak.append(wbest)
    return mbs_peak, chunk_peak, w_peak
