"""``autopar plan --schedule FILE``: the search's layouts that can run a user's schedule, priced with it.

A schedule file fixes the pipeline's shape: ``pp`` ranks, ``v`` stages per rank and ``m``
micro-batches. The search (planner/search/space.py) runs with ``pp`` pinned, once per (dp, mbs)
whose global batch splits into exactly ``m`` micro-batches, and ranks every layout it admits with
its built-in schedules; the best :data:`REPRICED` of those (by their built-in estimate, one per layout) are
priced again running the user's schedule (``schedule=custom``, vpp = its stages per rank, the
even stage split as ``autopar evaluate --schedule`` prices it) and the fastest that fits and runs
is the plan. Nothing here writes a rule of its own: the layouts, the feasibility predicate and the
pricing are the search's and the estimate's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate
from planner.errors import AutoparError
from planner.graph import ModelGraph
from planner.schedule_ir import Schedule
from planner.search.pins import Pins
from planner.search.result import SearchResult
from planner.search.space import search

REPRICED = 8  # layouts priced with the user's schedule (each one simulation of its IR)


@dataclass
class Scheduled:
    """The plan's estimate under the user's schedule and the runner-ups, fastest first."""

    best: Estimate
    alternatives: list[Estimate]
    why: str  # one line for the plan's search record


def shape_pins(pins: Pins, schedule: Schedule, global_batch: int, world: int, source: str) -> list[Pins]:
    """``pins`` with ``pp`` pinned to the schedule's ranks and (dp, mbs) to each pair whose
    micro-batches are the schedule's (``global_batch = m x dp x mbs``, dp dividing the devices
    left by pp); one line naming the fix when there is none."""
    s, out = schedule, []
    if not pins.allows("pp", s.p):
        raise AutoparError(f"{source} runs pp={s.p} but --fix {pins.to_str()} excludes it: "
                           "drop the pp pin or give a schedule for the pinned pp")
    for dp in range(1, world // s.p + 1):
        rows = dp * s.n_microbatches
        if (world // s.p) % dp or global_batch % rows:
            continue
        fixed = {"pp": s.p, "dp": dp, "mbs": global_batch // rows}
        if all(pins.allows(k, v) for k, v in fixed.items()):
            out.append(Pins({**pins.lo, **fixed}, {**pins.hi, **fixed}, dict(pins.choice)))
    if not out:
        raise AutoparError(f"{source} runs pp={s.p} with {s.n_microbatches} micro-batches: --global-batch must be "
                           f"{s.n_microbatches} x dp x mbs for a dp that divides {world // s.p}"
                           + (f" and --fix {pins.to_str()} admits" if pins else "") + f", not {global_batch}")
    return out


def search_for_schedule(graph: ModelGraph, cluster: Cluster, global_batch: int, schedule: Schedule, source: str,
                        pins: Pins, evaluate_config: Callable, profile=None, **search_kw) -> tuple[SearchResult,
                                                                                              "Scheduled"]:
    """The search run for every (dp, mbs) that gives the schedule's micro-batches
    (:func:`shape_pins`), its ranked layouts then priced running the schedule
    (:func:`price_with_schedule`); the search record is the first run's with the counts of all."""
    res, ranked = None, []
    for p in shape_pins(pins, schedule, global_batch, cluster.world, source):
        try:
            r = search(graph, cluster, global_batch, profile=profile, pins=p, **dict(search_kw, top_k=10**6))
        except AutoparError:  # nothing of this (dp, mbs) fits
            continue
        ranked += [r.best] + r.alternatives
        if res is None:
            res = r
        else:
            res.considered, res.pruned = res.considered + r.considered, res.pruned + r.pruned
            res.estimated, res.fully_solved = res.estimated + r.estimated, res.fully_solved + r.fully_solved
    ranked.sort(key=lambda e: e.step_s)
    got = price_with_schedule(graph, cluster, global_batch, ranked, schedule, source, evaluate_config, profile)
    if res is None:  # unreachable: price_with_schedule raised on an empty ranking
        raise AutoparError(f"{source}: nothing to plan")
    res.best, res.alternatives = got.best, got.alternatives
    res.split_note = ""  # the schedule is priced on the even split (evaluate_config)
    return res, got


def price_with_schedule(graph: ModelGraph, cluster: Cluster, global_batch: int, ranked: list[Estimate],
                        schedule: Schedule, source: str, evaluate_config: Callable, profile=None) -> Scheduled:
    """Re-price the best layouts of ``ranked`` (the search's estimates, best first) whose global
    batch gives the schedule's micro-batches, running ``schedule``; the fastest that fits wins.
    ``evaluate_config`` is planner.search.planning's (what ``autopar evaluate`` prices with)."""
    s, seen, priced = schedule, set(), []
    shapes = sorted({e.microbatches for e in ranked if e.config.pp == s.p})
    for e in ranked:
        cfg = e.config.replace(schedule="custom", vpp=s.v, vocab_passes=False)  # the file orders the model's stages
        if e.config.pp != s.p or e.microbatches != s.n_microbatches or cfg.to_str() in seen:
            continue
        seen.add(cfg.to_str())
        try:
            mine, problems = evaluate_config(graph, cluster, cfg, global_batch, profile=profile, schedule=s)
        except AutoparError:
            continue
        if not problems and mine.fits:
            priced.append(mine)
        if len(seen) >= REPRICED:
            break
    if not priced:
        have = ", ".join(map(str, shapes)) or "none"
        raise AutoparError(f"{source}: no layout with pp={s.p} runs {s.n_microbatches} micro-batches of global batch "
                           f"{global_batch} and fits (the pp={s.p} layouts run {have}): write the schedule for one "
                           "of those or change --global-batch")
    priced.sort(key=lambda x: x.step_s)
    why = (f"{source}: the user's schedule (pp={s.p}, {s.v} stage(s) per rank, {s.n_microbatches} micro-batches) "
           f"on the best {len(seen)} layouts with that shape")
    return Scheduled(priced[0], priced[1:], why)
