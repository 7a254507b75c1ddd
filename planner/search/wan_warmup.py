"""Deeper 1F1B warm-up where a pipeline boundary crosses the WAN: more units in flight hide its latency.

1F1B (with or without sequence chunks) lets rank r hold ``p - r`` units (``p - r + k - 1`` with
k chunks) before its first backward: just enough for a unit's round trip through the ranks after
it when every hop is short. Across a WAN boundary after rank ``c`` the round trip is ``2 hop``
longer (hop: the link's latency plus a unit's bytes over its share of the bandwidth), and every
rank up to ``c`` waits that long once per unit. ``d`` more warm-up forwards on those ranks
(``planner.schedule_ir.deep_warmup``) keep them busy meanwhile, at ``d`` more units' activations
each: on Llama-3 70B over two regions (pp8, 4 chunks) one more unit takes the pipeline from
18.6 s to 16.1 s (``benchmarks/multi_region.py``).

:func:`with_deep_warmup` prices ``d = 1, 2, ...`` on the configuration's own split and, where
the extra activations overfill a rank, on the splits that move one stage group from the fullest
rank to any other (:func:`relieved`: the ranks between pass one group along), keeps the fastest
that fits, and stops at the first depth that does not help. The schedule is the plan's own
(``schedule=custom``, named ``schedule_ir.DEEP_1F1B``): the runtime runs that order, as the simulator priced it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, estimate
from cost_models.wan import boundary_links
from cost_models.wan_cost import DEEP_WARMUP_MAX
from planner.graph import ModelGraph
from planner.plan import Partition
from planner.schedule_ir import DEEP_1F1B, Schedule, deep_warmup, one_f_one_b
from planner.search.incumbents import faster, fastest_fitting


def wan_cut(cluster: Cluster, pp: int, stride: int) -> int | None:
    """The last pipeline rank before a WAN boundary (rank ``c`` of boundary ``c -> c + 1``) of a
    pipeline of ``pp`` ranks ``stride`` apart, or None when no boundary crosses the WAN."""
    cuts = [c for c, link in enumerate(boundary_links(cluster, pp, stride)) if link is not None]
    return max(cuts) if cuts else None


@lru_cache(maxsize=64)
def deep_schedule(pp: int, m: int, k: int, cut: int, depth: int) -> Schedule:
    """1F1B over ``m`` micro-batches in ``k`` chunks with ``depth`` more units in flight on ranks
    ``0..cut`` (module docstring)."""
    return one_f_one_b(pp, m, k, deep_warmup(pp, cut, depth))


def relieved(part: Partition, groups: list[tuple[int, int]], fullest: int, to: list[int]) -> list[Partition]:
    """``part`` with one stage group moved from stage ``fullest`` to each stage of ``to`` in turn
    (the stages between shift their boundaries by one group: each keeps its count of groups)."""
    first = {a: g for g, (a, _) in enumerate(groups)}
    first[groups[-1][1]] = len(groups)
    counts = [first[hi] - first[lo] for lo, hi in part.bounds]
    out = []
    for dst in to:
        if dst == fullest or counts[fullest] <= 1:
            continue
        moved = counts[:fullest] + [counts[fullest] - 1] + counts[fullest + 1:]
        moved[dst] += 1
        ends = [sum(moved[:j + 1]) for j in range(len(moved))]
        bounds = [(groups[e - n][0], groups[e - 1][1]) for e, n in zip(ends, moved)]
        out.append(Partition(bounds, list(part.recompute)))
    return out


@dataclass(frozen=True)
class Deepened:
    """What :func:`deepen` found: the estimate to keep, the extra units in flight (0: the plain
    1F1B estimate it was given) and the pp rank before the WAN cut (None: no cut)."""
    estimate: Estimate
    depth: int = 0
    cut: int | None = None


def deepen(graph: ModelGraph, cluster: Cluster, e: Estimate, global_batch: int, profile=None, engine=None,
           beat: float | None = None) -> Deepened:
    """The fastest fitting estimate of ``e``'s layout and split under 1F1B with a deeper warm-up
    before its WAN cut, or ``e`` (module docstring). Where a depth overfills a rank, the splits of
    :func:`relieved` are priced: all of them, or, given ``beat`` (the search's fast pass: the step
    to beat, s), only the move to the rank with the most room, and only where ``e`` without its
    pipeline's idle time (what a deeper warm-up can hide at most) is below ``beat``."""
    cfg = e.config
    if cluster.topology is None or cfg.pp == 1 or cfg.vpp != 1 or cfg.schedule != "1f1b" or not e.fits:
        return Deepened(e)
    if beat is not None and e.step_s - e.breakdown.get("p2p", 0.0) - e.breakdown.get("bubble", 0.0) >= beat:
        return Deepened(e)
    cut = wan_cut(cluster, cfg.pp, cfg.dp * cfg.cp * cfg.tp)
    if cut is None:
        return Deepened(e)
    best, custom, groups = Deepened(e, 0, cut), cfg.replace(schedule="custom"), graph.stage_groups()
    for depth in range(1, DEEP_WARMUP_MAX + 1):
        s = deep_schedule(cfg.pp, e.microbatches, cfg.seq_chunks, cut, depth)
        tries = [estimate(graph, cluster, custom, e.partition, global_batch, profile=profile, engine=engine,
                          schedule=s)]
        if not tries[0].fits:
            by_room = sorted(range(cfg.pp), key=lambda r: tries[0].capacity - tries[0].memory[r].total)
            parts = relieved(e.partition, groups, by_room[0], by_room[-1:] if beat is not None else by_room[1:])
            tries = [estimate(graph, cluster, custom, part, global_batch, profile=profile, engine=engine, schedule=s)
                     for part in parts]
        found = fastest_fitting(tries)
        if found is None or not faster(found.step_s, best.estimate.step_s):
            break
        best = Deepened(found, depth, cut)
    return best


def undeepened(e: Estimate):
    """The configuration ``e`` deepened (:func:`deepen`): its 1F1B layout (``e``'s own otherwise)."""
    deep = e.schedule_ir is not None and e.schedule_ir.name == DEEP_1F1B
    return e.config.replace(schedule="1f1b") if deep else e.config


def with_deep_warmup(graph: ModelGraph, cluster: Cluster, e: Estimate, global_batch: int, profile, engine,
                     info: dict) -> tuple[Estimate, dict]:
    """``e``, or its layout running 1F1B with a deeper warm-up before the WAN cut
    (``schedule=custom``, :func:`deepen` trying every relieving split) where that is faster and
    fits, with the choice in ``info``."""
    found = deepen(graph, cluster, e, global_batch, profile, engine)
    if not found.depth:
        return e, info
    return found.estimate, dict(info, schedule=f"{DEEP_1F1B}: {found.depth} more unit(s) in flight before the WAN "
                                              f"cut after pp rank {found.cut}, "
                                              f"{e.step_s / found.estimate.step_s:.3f}x faster than 1f1b")
