"""One-group moves of a pipeline's stage split, judged by the simulator.

The stage ILP (planner/search/partition.py) minimises a linear model of the schedule that does
not depend on *where* the busiest stage sits: ``(m - 1) M + sum_j t_j`` for 1F1B. The pipeline
does. A rank waits for the first unit to reach it (the forwards of the ranks before it) and,
after its last backward, the ranks before it still run theirs; the ranks after it only bound
it when their round trip outlasts its warm-up. So the step is roughly
``max_r (m R_r + sum_{j<r} t_j)``: one stage group moved from the busiest rank to an earlier
one can shorten the step even where the ILP's bottleneck ``M`` stays the same or grows (a heavy
last stage: the head and loss of a large vocabulary). On Llama-3 70B over two regions (pp4,
2 sequence chunks, 1F1B deepened before the WAN cut) the ILP's 21 / 20 / 20 / 22 stage groups
run 18.40 s, 21 / 21 / 20 / 21 18.26 s (``benchmarks/multi_region.py``).

:func:`with_split_moves` takes an estimate of one stage per rank and prices the splits that move
one stage group from its busiest rank to each of the :data:`MAX_TARGETS` least busy other ranks
(the ranks between pass one group along: ``wan_warmup.relieved``), keeps the fastest that fits, and
repeats from it while a move helps, at most :data:`MAX_ROUNDS` times. Each candidate is a full estimate of the same configuration and
schedule (a custom schedule's IR is reused: it orders stages, not layers).
"""
from __future__ import annotations

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, estimate
from planner.graph import ModelGraph
from planner.search.wan_warmup import relieved
from planner.search.incumbents import faster, fastest_fitting

MAX_ROUNDS = 3   # moves applied one after another at most
MAX_TARGETS = 4  # ranks a round tries moving a group to (the least busy ones)


def rank_busy(e: Estimate) -> list[float]:
    """Seconds each pp rank computes per step: the simulator's busy time, else its stages' forward
    and backward per micro-batch times the micro-batch count (one stage per rank)."""
    if e.pipeline is not None:
        return list(e.pipeline.busy_s)
    return [e.microbatches * (f + b) for f, b in zip(e.stage_fwd_s, e.stage_bwd_s)]


def moves_apply(e: Estimate) -> bool:
    """Whether :func:`with_split_moves` prices moves for ``e``: a pipeline of one stage per rank
    (``vpp = 1``: not interleaved, not dualpipev's V) that fits."""
    return e.config.pp > 1 and e.config.vpp == 1 and e.fits


def with_split_moves(graph: ModelGraph, cluster: Cluster, e: Estimate, profile, engine) -> tuple[Estimate, int]:
    """``e``, or the same configuration and schedule on the fastest fitting split reached by
    moving one stage group at a time off the busiest rank (module docstring), with the number
    of moves made."""
    if not moves_apply(e):
        return e, 0
    groups, best, moves = graph.stage_groups(), e, 0
    for _ in range(MAX_ROUNDS):
        busy = rank_busy(best)
        src = max(range(len(busy)), key=busy.__getitem__)
        targets = sorted((r for r in range(len(busy)) if r != src), key=busy.__getitem__)[:MAX_TARGETS]
        tries = [estimate(graph, cluster, best.config, part, best.global_batch, profile=profile, engine=engine,
                          schedule=best.schedule_ir)
                 for part in relieved(best.partition, groups, src, targets)]
        found = fastest_fitting(tries)
        if found is None or not faster(found.step_s, best.step_s):
            break
        best, moves = found, moves + 1
    return best, moves


def split_note(start: Estimate, final: Estimate, moves: int, which: str) -> str:
    """What the plan says of its split when groups moved: ``start``'s layers per stage (``which``
    split: the ILP's or the even one) and ``final``'s, which may also hold a deeper warm-up's move
    for memory (``wan_warmup.deepen``); "" without moves."""
    if not moves:
        return ""
    a, b = ("/".join(str(hi - lo) for lo, hi in x.partition.bounds) for x in (start, final))
    return f"layers per stage {a} ({which}) -> {b}: {moves} stage group(s) moved off the busiest rank"
