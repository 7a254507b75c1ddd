"""Search: every configuration of the device count, priced, pruned, ranked.

Space: the candidates of planner/search/candidates.py - every degree tuple, micro-batch size, expert-parallel degree
and variant (schedule, vpp, DP sharding, recompute, sequence parallel) the feasibility predicate's per-axis parts
accept (planner/feasibility.py), within the search's documented space choices. Pipeline stages are cut between stage
groups only (``ModelGraph.stage_groups``). With cp > 1 the context-parallel method (ring, Ulysses or the hybrid:
``ParallelConfig.ulysses``) changes only the layer times, so each tuple takes the Ulysses degree whose layers are
fastest (``_best_ulysses``) and records the others as rejected with that reason. Pruning keeps the space whole but
cheap, with two bounds per degree tuple (dp, pp, cp, tp, mbs), computed once for all its variants:
- **memory floor** (``cost_models.memory.memory_floor``, a lower bound of the one memory rule): the model
  states that FSDP with full recompute leaves on the fullest rank (at least the average over pp ranks) plus
  the reserve. Above the device memory, no variant can fit; all are rejected with that reason.
- **time floor**: the rank's compute, TP/CP communication and mixed-precision copies at their least
  (``cost_models.mp_casts.least_mp_casts``: work every variant does) with perfect pipeline balance, no
  recompute, plus the smallest bubble any schedule here reaches (interleaving with the most chunks tried,
  v = 4 unless ``--fix vpp`` allows more: ``(pp-1) t / v``), i.e. ``m t + (pp-1) t / v`` with
  ``t = sum(fwd + bwd + comm) / pp`` (``cost_models.pipeline.linear_step`` on equal stages), and
  at least ``m`` times the busiest rank's work when whole stage groups are dealt to the pp ranks
  (planner/search/rank_floor.py: 80 blocks on 64 ranks leave some rank two; one device type). On a cluster
  with a WAN, at least ``cost_models.wan_cost.wan_floor_s`` (the gradients' cross-group phase; a WAN pipeline
  boundary's activations one after another). Above what a variant must beat to be solved
  (``planner.search.incumbents``: the ``solve_top``-th best estimate so far, and for a variant a generated
  schedule may run across the WAN the best such one beyond them), no variant can matter; all are pruned.
Tuples and variants are visited best floor first (one heap), so good incumbents come early and the pruned search
solves exactly what the unpruned one would. Inside a tuple, each variant gets its own floor (its schedule's closed
form on perfectly balanced stages, plus its recompute, at least its busiest rank's; with a pipeline boundary on
the WAN, plus the stall of its most units in flight: ``wan_cost.pipeline_wan_floor_s``), and variants the cost
model proves no better than another (``candidates.DOMINATED``) are skipped.
Surviving variants get the closed-form estimate on an even stage split, their memory checked first
(``cost_models.pipeline_memory.memory_bound``, a lower bound of the fullest rank on any split, rejects a
variant before the exact ``fullest_rank`` where it is over the device already; 1F1B across a WAN cut also
with a deeper warm-up: planner/search/wan_warmup.py; on mixed devices also with dp shares by speed:
planner/search/shares_variant.py); the best ``solve_top`` are then re-partitioned by the ILP
(planner/search/partition.py) and simulated in full ("fully solved"); the best of those is the plan.

Pins (``planner.search.pins.Pins``, ``autopar plan --fix``) narrow the space before any of this: only the degrees,
micro-batch sizes and variants they admit are priced; when none fits, the error names the pins and the least memory
per device a pinned layout needs (planner/search/no_fit.py). The attention kernel: kernel_choice.py."""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from cost_models.cluster import Cluster
from cost_models.engines import engine_of
from cost_models.estimate import Estimate, estimate
from cost_models.pipeline_memory import fullest_rank, inflight_closed, memory_bound
from cost_models.pipeline_memo import forget as forget_simulations
from cost_models.layer_costs import LayerCosts
from cost_models.mp_casts import least_mp_casts
from cost_models.pipeline import estimate_step, linear_step
from cost_models.wan_cost import BalancedPipe, WanHop, cheapest_wan_hops, deep_allowance, pipeline_wan_floor_s, wan_floor_s
from planner.low_comm import low_comm_problem, parse_low_comm
from planner.precision import default_dtype
from cost_models.profile_db import calibration
from cost_models.memory import Reserve, framework_reserve, memory_floor
from cost_models.offload import offload_saves
from cost_models.seq_chunks import searched_chunks
from cost_models.shared_cores import ranks_cluster
from planner.errors import AutoparError
from planner.graph import ModelGraph
from planner.feasibility import Batch, layout_threads, modes_problem, sp_problem
from planner.plan import RECOMPUTE, ModelFacts, ParallelConfig
from planner.search.candidates import (DOMINATED_REASON, Point, Rejections, batch_of, compile_problem, degrees_label,
                                       facts_of, fp8_problem, points, variant_choices, variant_config, variant_count,
                                       request_problem, schedule_choices)
from planner.search.heap import frozen_heap
from planner.search.incumbents import Incumbents
from planner.search.kernel_choice import AttentionChoice, attention_choice
from planner.search.no_fit import nothing_fits
from planner.search.pins import Pins
from planner.search.rank_floor import RankFloors
from planner.search.result import SearchResult
from planner.search.shares_variant import with_speed_shares
from planner.search.stage_split import fast_splits, generates, split_and_estimate
from planner.search.wan_warmup import deepen, undeepened

GiB = 2**30


@dataclass
class _Space:
    """One search: its inputs, the model's facts, the layer costs per (tp, cp, mbs, sp) and the
    tallies (rejections, counts) every phase adds to."""
    graph: ModelGraph
    cluster: Cluster
    global_batch: int
    profile: object
    facts: ModelFacts
    batch: Batch
    dtype: str
    loss: str
    attention: AttentionChoice                        # the kernel per CP degree (planner/search/kernel_choice.py)
    rej: Rejections
    res: SearchResult
    pins: Pins = field(default_factory=Pins)
    fp8: str = "none"                                 # the request's float8 recipe and regional compilation
    compile: bool = False
    low_comm: str = ""                                # autopar plan --low-comm: also price these variants
    cost_cache: dict = field(default_factory=dict)
    table_cache: dict = field(default_factory=dict)   # memory tables, shared by the layer costs of every key
    ulysses_cache: dict = field(default_factory=dict)  # (cp, tp, ep, mbs) -> the best Ulysses degree
    split_cache: dict = field(default_factory=dict)    # (pp, vpp, recompute, dp cp tp) -> the fast pass's splits
    stage_cache: dict = field(default_factory=dict)    # per LayerCosts.key: one micro-batch's seconds over the layers
    copies_cache: dict = field(default_factory=dict)   # (dp, pp, cp, tp, ep, m) -> the least mixed-precision copies
    leanest: tuple[float, bool] = (math.inf, False)   # least bytes per device any rejected layout needs, exact?
    bounded: list[tuple] = field(default_factory=list)  # (bound, cfg, costs, m): the memory bound's rejections
    rank_floors: RankFloors = field(init=False)       # the busiest rank's floors (planner/search/rank_floor.py)

    def __post_init__(self) -> None:
        self.rank_floors = RankFloors(self.graph, self.cluster)

    def exact_leanest(self) -> None:
        """Where nothing fits: the bound's rejections priced exactly while their bound (<= their need) is
        below the least need found, so the error names the leanest layout's exact need."""
        for low, cfg, costs, m in sorted(self.bounded, key=lambda x: x[0]):
            if low >= self.leanest[0]:
                break
            self.note_need(_fast_estimate(self, cfg, costs, m, bound=False)[2], exact=True)

    def note_need(self, need: float, exact: bool) -> None:
        """Record the memory a layout that did not fit needs (``exact``: priced; else a floor)."""
        if need < self.leanest[0]:
            self.leanest = (need, exact)

    def costs(self, base: ParallelConfig) -> LayerCosts:
        key = LayerCosts.key(base)
        if key not in self.cost_cache:
            self.cost_cache[key] = LayerCosts(self.graph, self.cluster, base, self.profile, self.table_cache)
        return self.cost_cache[key]


@dataclass(order=True)
class _Tuple:
    """(dp, pp, cp, tp, mbs) with its time floor (seconds), ordered by it."""
    floor_s: float
    dp: int
    pp: int
    cp: int
    tp: int
    mbs: int
    m: int = field(compare=False)
    n_var: int = field(compare=False)
    costs: LayerCosts | None = field(compare=False, default=None)  # its layer costs (default sp)
    ep: int = field(compare=False, default=1)
    moe: bool = field(compare=False, default=False)  # the model has routed experts: ep is named, even ep=1
    ulysses: int = field(compare=False, default=1)   # CP's Ulysses degree (ParallelConfig.cp_method)
    point: Point | None = field(compare=False, default=None)  # as candidates.Point (its one Ulysses degree)

    @property
    def label(self) -> str:
        return degrees_label(self.dp, self.pp, self.cp, self.tp, self.mbs, self.ep, self.moe, self.ulysses)


def search(graph: ModelGraph, cluster: Cluster, global_batch: int, *, profile=None, top_k: int = 5,
           solve_top: int = 3, max_mbs: int = 8, dtype: str | None = None, loss: str = "eager",
           pins: Pins | None = None, ilp_time_limit: float = 10.0,
           progress: Callable[[str], None] | None = None, fp8: str = "none", compile: bool = False,
           low_comm: str = "", prune: bool = True) -> SearchResult:
    """Find the configuration with the best predicted step time that fits among those the
    ``pins`` admit: degree tuples with their floors, then every variant's closed-form
    estimate on an even split, then the ILP split and the simulated schedule for the best few.
    ``prune=False``: no time floor prunes anything (the same plan, slower: tests compare)."""
    t0 = time.perf_counter()
    facts, batch = facts_of(graph), batch_of(graph, global_batch)
    parse_low_comm(low_comm)  # a bad --low-comm: one line before anything is priced
    if why := request_problem(facts, batch, loss) or fp8_problem(fp8, cluster) or compile_problem(compile, cluster):
        raise AutoparError(f"{graph.name}: {why}")
    res = SearchResult(best=None, alternatives=[], rejected={}, rejected_counts={})  # type: ignore[arg-type]
    dtype, pins = dtype or default_dtype(cluster.backend), pins or Pins()
    space = _Space(graph, cluster, global_batch, profile, facts, batch, dtype, loss,
                   attention_choice(graph, cluster, facts, dtype, loss, pins.choice.get("attention")), Rejections(),
                   res, pins, fp8=fp8, compile=compile, low_comm=low_comm)
    forget_simulations()  # each search prices its own (cost_models/pipeline_memo.py)
    with frozen_heap():  # the heap alive before the search: out of the collector's passes (planner/search/heap.py)
        tuples = _tuples_with_floors(space, max_mbs)
        if progress:
            progress(f"{len(tuples)} degree tuples after the memory floor; {res.considered} configurations")
        ranked = _ranked_variants(space, tuples, Incumbents(max(solve_top, 1), prune))
        _solve_best(space, ranked, solve_top, ilp_time_limit, top_k)
    res.solve_s = time.perf_counter() - t0
    return res


def _tuples_with_floors(space: _Space, max_mbs: int) -> list[_Tuple]:
    """Every (dp, pp, cp, tp, ep, mbs) the feasibility predicate's per-degree parts allow (``candidates.points``),
    with a time floor (compute and TP/CP/EP communication per rank plus the best schedule's bubble); tuples the
    request's modes leave no variant (``feasibility.modes_problem``: compile or float8 under TP / CP) or whose
    memory floor (FSDP states and full recompute) exceeds the device are rejected."""
    reserve = framework_reserve(space.cluster.backend != "gloo", calibration(space.profile))
    tuples, pins = [], space.pins
    # a pinned mbs may pass the default cap: up to its upper bound, or uncapped under a lower bound only
    max_mbs = pins.hi.get("mbs", math.inf if "mbs" in pins.lo else max_mbs)
    for p in points(space.facts, space.cluster, space.batch, space.rej, pins, max_mbs):
        if why := modes_problem(space.dtype, space.fp8, space.compile, p.tp, p.cp):
            space.rej.add(why, degrees_label(p.dp, p.pp, p.cp, p.tp, p.mbs, p.ep, bool(space.facts.experts),
                                             max(p.ulysses)), requested=True)
            continue
        u = _best_ulysses(space, p)
        t = _tuple_floor(space, p.dp, p.pp, p.cp, p.tp, p.ep, p.mbs, p.m, reserve, u)
        if t is not None:
            tuples.append(t)
    return sorted(tuples)


def _base_config(space: _Space, dp: int, pp: int, cp: int, tp: int, ep: int, mbs: int,
                 ulysses: int = 1) -> ParallelConfig:
    """The configuration a degree tuple's layer costs and floors are priced with."""
    return ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, ulysses=ulysses, mbs=mbs, dtype=space.dtype,
                          loss=space.loss, fp8=space.fp8, compile=space.compile, sp=sp_problem(tp, cp, space.facts, space.batch) is None,
                          attention=space.attention.of(cp),
                          zero="fsdp" if ep > 1 else "ddp", threads=layout_threads(space.cluster, dp * pp * cp * tp))


def _rank_seconds(space: _Space, base: ParallelConfig) -> float:
    """One micro-batch through every layer on one rank: compute + TP / CP / EP communication (on
    the critical path in every variant of ``base``'s degrees); once per layer costs."""
    return sum(space.rank_floors.groups(space.costs(base), "none"))  # (recompute none: fwd_pass + bwd_pass)


def _best_ulysses(space: _Space, p: Point) -> int:
    """The context-parallel method of a degree tuple: the Ulysses degree (of ``p.ulysses``, the
    ones the runtime can run) whose layers take the least time per micro-batch. Nothing else in
    a layout depends on it (memory, schedules, sharding; nor dp and pp, the outer mesh
    dimensions), so it is chosen once per (cp, tp, ep, mbs) and the others are recorded as
    rejected with that reason."""
    if p.cp == 1:
        return 1
    key = (p.cp, p.tp, p.ep, p.mbs)
    if key not in space.ulysses_cache:
        times = {u: _rank_seconds(space, _base_config(space, p.dp, p.pp, p.cp, p.tp, p.ep, p.mbs, u))
                 for u in p.ulysses}
        space.ulysses_cache[key] = min(p.ulysses, key=lambda u: (times[u], u))
    best = space.ulysses_cache[key]
    for u in p.ulysses:
        if u != best:
            space.rej.add(f"ulysses={u}: slower layers than ulysses={best} on the same degrees",
                          _base_config(space, p.dp, p.pp, p.cp, p.tp, p.ep, p.mbs, u).label())
    return best


def _tuple_floor(space: _Space, dp: int, pp: int, cp: int, tp: int, ep: int, mbs: int, m: int,
                 reserve: Reserve, ulysses: int = 1) -> "_Tuple | None":
    """One degree tuple with its time floor, or None when its memory floor rejects it (recorded)."""
    res, rej, pins = space.res, space.rej, space.pins
    base = _base_config(space, dp, pp, cp, tp, ep, mbs, ulysses)
    cap = ranks_cluster(space.cluster, base).memory_bytes  # fewer CPU ranks: each has more of the memory
    costs = space.costs(base)
    t_rank = _rank_seconds(space, base) / pp + sum(_copies(space, base, m))
    # bubble: no schedule here does better than interleaving with the most chunks tried (v >= 4; zb-h1's
    # bubble is at least (pp-1) t / 2): the step-time model's linear form on perfectly balanced stages
    v = max([4] + [v for _, v in schedule_choices(pp, m, space.facts, pins)])
    floor_s = linear_step("interleaved-1f1b", pp, m, v, [t_rank] * pp, [0.0] * pp)
    low = [base.replace(low_comm=space.low_comm)] if space.low_comm and not low_comm_problem(space.low_comm, dp) else []
    floor_s = max(floor_s, min(wan_floor_s(space.graph, space.cluster, c, m) for c in [base, *low]),  # 0 without a WAN
                  space.rank_floors.step_floor(costs, "none", pp, m))
    mem_floor = reserve.of(memory_floor(space.graph, base, costs.table(base)))
    point = Point(dp, pp, cp, tp, mbs, m, ep, (ulysses,), base.threads)
    n_var = variant_count(point, space.facts, space.batch, space.dtype, **_variant_request(space))
    res.considered += n_var
    t = _Tuple(floor_s, dp, pp, cp, tp, mbs, m, n_var, costs, ep, moe=bool(space.facts.experts), ulysses=ulysses,
               point=point)
    if mem_floor > cap:
        space.note_need(mem_floor, exact=False)
        rej.add(f"OOM even with FSDP + full recompute: needs >= {mem_floor / GiB:.1f} GiB of "
                f"{cap / GiB:.1f} GiB", t.label, n_var)
        res.pruned += n_var
        return None
    return t


def _variant_request(space: _Space) -> dict:
    """The request's arguments to ``candidates.variant_choices`` / ``variant_count`` beyond the tuple."""
    return dict(pins=space.pins, fp8=space.fp8, compile=space.compile, low_comm=space.low_comm,
                offload=offload_saves(space.cluster), seq_chunks=searched_chunks(space.cluster))


def _copies(space: _Space, base: ParallelConfig, m: int) -> tuple[float, float]:
    """(forward, backward) seconds of the mixed-precision copies a rank of ``base``'s degrees pays per
    micro-batch in every variant (``cost_models.mp_casts.least_mp_casts``); once per degrees and m."""
    key = (base.dp, base.pp, base.cp, base.tp, base.ep, m)
    if key not in space.copies_cache:
        c = least_mp_casts(space.graph, base, m, space.cluster, calibration(space.profile), engine_of(None))
        space.copies_cache[key] = (c.fwd, c.bwd)
    return space.copies_cache[key]


def _balanced_stage_times(space: _Space, costs: LayerCosts, pp: int, m: int) -> dict[str, tuple[float, float]]:
    """Per recompute policy, (forward, backward) seconds of one micro-batch on one of ``pp``
    perfectly balanced stages, by the estimator's own per-layer rule (``layer_pass_times``), with the
    copies every variant pays (:func:`_copies`); the sums over the layers once per layer costs
    (``_Space.stage_cache``)."""
    key = LayerCosts.key(costs.cfg)
    if key not in space.stage_cache:
        sums = {}
        for policy in RECOMPUTE:
            times = [costs.pass_times(l, policy) for l in space.graph.layers]
            sums[policy] = (sum(x.fwd for x in times), sum(x.bwd for x in times))
        space.stage_cache[key] = sums
    cf, cb = _copies(space, costs.cfg, m)
    return {policy: (f / pp + cf, b / pp + cb) for policy, (f, b) in space.stage_cache[key].items()}


def _ranked_variants(space: _Space, tuples: list[_Tuple], inc: Incumbents) -> list[tuple[float, str, Estimate]]:
    """Every variant (schedule, vpp, sharding, recompute, sp) of the tuples, best floor first
    (a tuple's floor is below its variants'), priced with the closed-form pipeline on an even
    split unless its floor is above what it must beat (``planner.search.incumbents``); those
    that fit, fastest first."""
    res, rej = space.res, space.rej
    ranked: list[tuple[float, str, Estimate]] = []
    heap: list[tuple] = [(t.floor_s, n, t, None) for n, t in enumerate(tuples)]  # (floor, order, tuple, variant)
    heapq.heapify(heap)
    order = len(heap)
    while heap:
        floor_s, _, t, choice = heapq.heappop(heap)
        if choice is None:
            if floor_s > inc.threshold(_may_protect(space, t.pp, t.m)):
                # with routed experts, per expert-parallel degree: the report's "why not ep=..." reads it
                rej.add((f"ep={t.ep}: " if t.moe else "") + "time floor above the best step time found", t.label,
                        t.n_var)
                res.pruned += t.n_var
                continue
            for lb, c in _variant_floors(space, t):
                heapq.heappush(heap, (lb, order, t, c))
                order += 1
            continue
        # above threshold(True) pruned, at most threshold(False) kept; between, kept if protected: the
        # configuration is built only where that asks (or the reason's examples want its label)
        cfg = _config(space, t, choice) if inc.threshold(False) < floor_s <= inc.threshold(True) else None
        if floor_s > inc.threshold(cfg is not None and _may_protect(space, t.pp, t.m) and generates(cfg, t.m)):
            rej.add("time floor above the best step time found",
                    cfg.label if cfg else lambda: _config(space, t, choice).label())
            res.pruned += 1
            continue
        cfg = cfg or _config(space, t, choice)
        e = _fast_estimate(space, cfg, t.costs if LayerCosts.key(cfg) == LayerCosts.key(t.costs.cfg) else
                           space.costs(cfg), t.m)
        e = with_speed_shares(space.graph, space.cluster, cfg, e, space.global_batch, space.profile)  # mixed devices
        res.estimated += 1
        if isinstance(e, tuple):
            r, over, need = e
            space.note_need(need if r is not None else math.inf, exact=True)  # a bound's: see exact_leanest
            rej.add(f"OOM by {_bucket(over)} on stage {r}" if r is not None else
                    f"OOM by >= {_bucket(over)} (states and in-flight activations, averaged over the pp ranks)",
                    cfg.label)
            continue
        if not e.fits:  # the devices fit; the offloaded activations overflow the host memory
            r = max(range(len(e.memory)), key=lambda k: e.memory[k].host)
            rej.add(f"offload: host memory short by {_bucket(e.memory[r].host - e.host_capacity)} on stage {r} "
                    f"(host_memory_gib in the cluster file)", cfg.label())
            continue
        if "schedule" not in space.pins.choice:  # 1F1B across a WAN cut: also with a deeper warm-up
            e = deepen(space.graph, space.cluster, e, space.global_batch, space.profile, beat=inc.threshold(False)).estimate
        ranked.append((e.step_s, cfg.to_str(), e))
        inc.add(e.step_s, _wan_generating(space, e))
    if not ranked:
        res.rejected, res.rejected_counts = rej.examples, rej.counts
        space.exact_leanest()
        raise AutoparError(nothing_fits(space.graph.name, space.cluster, space.pins, space.rej, space.leanest))
    return sorted(ranked, key=lambda x: (x[0], x[1]))


def _variant_floors(space: _Space, t: _Tuple) -> list[tuple[float, tuple]]:
    """The variants of a tuple the cost model does not prove dominated (``candidates.variant_choices``;
    :func:`_config` builds one), each with its floor: its schedule on perfectly balanced stages with
    its recompute, and with a pipeline boundary on the WAN the stall the fast pass charges it
    (seconds); the dominated ones are recorded."""
    g = space.graph
    stage = _balanced_stage_times(space, t.costs, t.pp, t.m)
    wan_hops: dict[bool, list[WanHop]] = {}  # per sequence parallel: the tuple's WAN boundaries at their cheapest
    floors: dict[tuple, float] = {}  # per what a floor reads (not the DP sharding, nor the chunk count > 1)
    out = []
    for choice in variant_choices(t.point, space.facts, space.batch, space.dtype, dominated=False,
                                  **_variant_request(space)):
        sched, v, _, rc, sp, k, _ = choice
        key = (sched, v, rc, k == 1, sp)
        if key not in floors:
            if sp not in wan_hops:  # (one configuration per sequence parallel: the rest reads the choice)
                wan_hops[sp] = cheapest_wan_hops(g, space.cluster, _config(space, t, choice))
            floors[key] = max(_variant_floor(t, sched, v, k, stage[rc], wan_hops[sp]),
                              space.rank_floors.step_floor(t.costs, rc, t.pp, t.m))
        out.append((floors[key], choice))
    if t.n_var - len(out):
        space.rej.add(DOMINATED_REASON, t.label, t.n_var - len(out))
        space.res.pruned += t.n_var - len(out)
    return out


def _config(space: _Space, t: _Tuple, choice: tuple) -> ParallelConfig:
    """The configuration of one of the tuple's variant choices (``candidates.variant_config``)."""
    return variant_config(t.point, t.ulysses, choice, space.facts, space.dtype, space.loss, space.fp8,
                          space.compile, space.attention.of(t.point.cp))


def _variant_floor(t: _Tuple, sched: str, v: int, k: int, stage: tuple[float, float], wan_hops: list[WanHop]) -> float:
    """One variant's floor (seconds): its schedule ``sched`` (vpp ``v``, ``k`` sequence chunks) in closed
    form on perfectly balanced stages of ``stage`` = (forward, backward) seconds per micro-batch with its
    recompute, and with WAN boundaries (``wan_hops``, which read sequence parallel) the stall of its most
    units in flight (``wan_cost.deep_allowance``). Nothing else of the variant."""
    f, b = stage
    lb = estimate_step(sched, t.pp, t.m, f / v, b / v, v=v) if t.pp > 1 and k == 1 \
        else t.m * (f + b)  # (sequence chunks: their fill and drain run the cheap first chunks)
    if not wan_hops:
        return lb
    held = [inflight_closed(sched, t.pp, t.m, v, r) // v + deep_allowance(sched, v) for r in range(t.pp)]
    return pipeline_wan_floor_s(t.m, t.pp, BalancedPipe(lb, f + b, held), wan_hops)


def _may_protect(space: _Space, pp: int, m: int) -> bool:
    """Whether a layout of ``pp`` stages may hold a protected variant (``_wan_generated``'s kind): a
    superset, known before pricing (a WAN, a pipeline, the schedule not pinned)."""
    return space.cluster.topology is not None and pp > 1 and "schedule" not in space.pins.choice


def _wan_generating(space: _Space, e: Estimate) -> bool:
    """A priced variant a generated schedule may run with a pipeline boundary on the WAN."""
    return generates(e.config, e.microbatches) and any(x["dim"] == "pp" for x in e.wan) \
        and "schedule" not in space.pins.choice


def _fast_estimate(space: _Space, cfg: ParallelConfig, costs: LayerCosts, m: int,
                   bound: bool = True) -> Estimate | tuple[int | None, float, float]:
    """The fast pass on one variant: the closed-form estimate on the first split of ``fast_splits``
    that fits, its memory checked before its times (``cost_models.pipeline_memory.fullest_rank``, the
    same figures); when none fits, (pp rank, bytes over, bytes needed) of the last split tried, or
    (None, bytes over at least, bytes needed at least) where ``pipeline_memory.memory_bound``, a
    lower bound of the fullest rank on every split, is over already (``bound=False``: not asked)."""
    g = space.graph
    if bound and (low := memory_bound(g, cfg, space.global_batch, costs, space.profile)) and low[0] > low[1]:
        space.bounded.append((low[0], cfg, costs, m))
        return None, low[0] - low[1], low[0]
    key = (cfg.pp, cfg.vpp, cfg.recompute, cfg.dp * cfg.cp * cfg.tp)  # what the splits depend on
    if key not in space.split_cache:
        space.split_cache[key] = fast_splits(g, space.cluster, cfg)
    for part in space.split_cache[key]:  # the even split; on mixed devices speed-weighted first
        fm = fullest_rank(g, cfg, part, space.global_batch, costs, space.profile)
        if fm is None:  # a schedule the fast pass simulates: price it, memory and all
            e = estimate(g, space.cluster, cfg, part, space.global_batch, profile=space.profile, fast=True, costs=costs)
            r = max(range(len(e.memory)), key=lambda k: e.memory[k].total)
            need, cap = e.memory[r].total, e.capacity
        else:
            (r, need, cap), e = fm, None
        if need <= cap:
            return e or estimate(g, space.cluster, cfg, part, space.global_batch, profile=space.profile, fast=True,
                                 costs=costs)
    return r, need - cap, need


def _solve_best(space: _Space, ranked: list[tuple[float, str, Estimate]], solve_top: int, ilp_time_limit: float,
                top_k: int) -> None:
    """The ILP stage split and the simulated schedule for the best ``solve_top``; the winner and
    the runner-ups (solved ones first) go into ``space.res``."""
    res = space.res
    finals: list[tuple[float, str, Estimate]] = []
    notes: dict[str, str] = {}  # key -> how its stage groups moved (planner/search/split_moves.py)
    for _, key, e in ranked[:max(solve_top, 1)] + _wan_generated(space, ranked[max(solve_top, 1):]):
        e2, info = split_and_estimate(space.graph, space.cluster, undeepened(e), space.global_batch, space.profile,
                                      ilp_time_limit, uniform_recompute="recompute" in space.pins.choice,
                                      generate="schedule" not in space.pins.choice)
        res.fully_solved += 1
        res.partition_info[undeepened(e).to_str()] = info
        notes[key] = info.get("split_moves", "")
        if e2.fits:
            finals.append((e2.step_s, key, e2))
    finals.sort(key=lambda x: (x[0], x[1]))
    if not finals:
        finals = [ranked[0]]
    res.best, res.split_note = finals[0][2], notes.get(finals[0][1], "")
    seen = {x[1] for x in finals}
    alts = ([x[2] for x in finals[1:]] + [x[2] for x in ranked if x[1] not in seen])[:top_k]
    # with routed experts: the best layout of every other expert-parallel degree too, so the
    # report can say why that degree lost (the nearest alternatives often share the winner's)
    others = {x[2].config.ep for x in ranked} - {a.config.ep for a in alts} - {res.best.config.ep}
    alts += sorted((next(x[2] for x in ranked if x[2].config.ep == ep) for ep in others), key=lambda e: e.step_s)
    # likewise the best layout of every other context-parallel method (ring, Ulysses, hybrid)
    methods = {x[2].config.cp_method for x in ranked} - {a.config.cp_method for a in alts} - {
        res.best.config.cp_method, "none"}
    alts += sorted((next(x[2] for x in ranked if x[2].config.cp_method == cm) for cm in methods),
                   key=lambda e: e.step_s)
    if space.graph.documents is not None:  # packed documents: the best of every other cp degree, for "why not cp=..."
        cps = {x[2].config.cp for x in ranked} - {a.config.cp for a in alts} - {res.best.config.cp}
        alts += sorted((next(x[2] for x in ranked if x[2].config.cp == cp) for cp in cps), key=lambda e: e.step_s)
    res.alternatives = alts
    res.rejected, res.rejected_counts = space.rej.examples, space.rej.counts


def _wan_generated(space: _Space, rest: list[tuple[float, str, Estimate]]) -> list[tuple[float, str, Estimate]]:
    """Beyond the best few: the best variant a generated schedule may run
    (``stage_split.generates``) when its pipeline has a boundary on the WAN. The fast pass charges
    such a boundary the stall of the built-in schedule's in-flight micro-batches
    (``cost_models.wan.stall_s``); a schedule generated for the stage times and hops can hold
    them back differently and hide the hop, which only the full solve sees."""
    return next(([item] for item in rest if _wan_generating(space, item[2])), [])


def _bucket(over: float) -> str:
    return f"{over / GiB:.1f} GiB"
