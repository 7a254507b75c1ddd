"""Search: every configuration of the device count, priced, pruned, ranked.

Space. Every factorisation ``world = dp x pp x cp x tp`` that the runtime can run for
this model (the one feasibility rule, ``planner.feasibility.tp_problem`` / ``cp_problem`` /
``pp_problem`` / ``sp_problem`` on the graph's facts and its adapter's limits: tp
dividing heads, kv heads and hidden, cp splitting the sequence into zigzag chunks, pp at
most the number of stage groups), tp inside a node and dp dividing the global batch,
times micro-batch size (divisors of the per-replica batch up to ``max_mbs``), schedule
(GPipe, 1F1B, interleaved with v in {2, 4}, ZB-H1), DP sharding (DDP, ZeRO-1, FSDP),
recompute (none, selective, selective-op, full; selective-op not under
ZB-H1) and sequence parallel (on/off when tp > 1). Pipeline
stages are cut between stage groups only (``ModelGraph.stage_groups``). For a model with
routed experts, every expert-parallel degree (``ep``) is a degree tuple of its own. With
cp > 1 the context-parallel method (ring, Ulysses or the hybrid: ``ParallelConfig.ulysses``)
changes only the layer times, so each tuple takes the Ulysses degree whose layers are
fastest (``_best_ulysses``) and records the others as rejected with that reason.

Pruning keeps the space whole but cheap, with two bounds per degree tuple
(dp, pp, cp, tp, mbs), computed once for all its variants:
- **memory floor**: the model states that FSDP with full recompute leaves on the
  fullest rank (at least the average over pp ranks) plus the reserve. Above the
  device memory, no variant can fit; all are rejected with that reason.
- **time floor**: the rank's compute and TP/CP communication (critical-path work
  every variant does) with perfect pipeline balance, no recompute, plus the
  smallest bubble any schedule here reaches (interleaving with v = 4:
  ``(pp-1) t / 4``), i.e. ``m t + (pp-1) t / 4`` with ``t = sum(fwd + bwd + comm) / pp``.
  At or above the incumbent's step time, no variant can win; all are pruned.
Tuples are visited in increasing floor, so a good incumbent comes early. Inside a
tuple, each variant gets its own floor (its schedule's closed form on perfectly
balanced stages, plus its recompute), and variants the cost model proves no better
than another (``DOMINATED``) are skipped.
Surviving variants get the closed-form estimate on an even stage split; the best
``solve_top`` are then re-partitioned by the ILP (planner/search/partition.py) and
simulated in full ("fully solved"), and the best of those is the plan.

Pins (``planner.search.pins.Pins``, ``autopar plan --fix``) narrow the space before any of this:
only the degrees, micro-batch sizes and variants they admit are enumerated, counted and
priced; when none of those fits, the error names the pins and the least memory per device
a pinned layout needs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, LayerCosts, estimate, layer_pass_times
from cost_models.pipeline import estimate_step
from cost_models.memory import RESERVE_CPU, RESERVE_GPU, dp_group
from planner.errors import AutoparError
from planner.graph import ModelGraph
from planner.search.pins import Pins
from planner.feasibility import (cp_problem, default_attention, ep_problem, pp_problem, sp_problem, tp_problem,
                                 zero_problem)
from planner.plan import RECOMPUTE, SCHEDULES, ZERO, ModelFacts, ParallelConfig, recompute_policies
from planner.search.stage_split import even_split, split_and_estimate

GiB = 2**30
# The DP sharding modes the search tries: planner.plan.ZERO without zero2 (with pp > 1 it holds
# and moves what fsdp does; with pp = 1 it only trades fsdp's per-layer gathers for every layer
# held gathered), to keep the space small; ``--fix zero=zero2`` prices it.
ZEROS = tuple(z for z in ZERO if z != "zero2")


@dataclass
class SearchResult:
    best: Estimate
    alternatives: list[Estimate]                  # next best (fit), ranked
    rejected: dict[str, list[str]]                # reason -> example configurations
    rejected_counts: dict[str, int]
    considered: int = 0
    pruned: int = 0
    estimated: int = 0
    fully_solved: int = 0
    solve_s: float = 0.0
    partition_info: dict = field(default_factory=dict)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class _Rejections:
    def __init__(self) -> None:
        self.examples: dict[str, list[str]] = {}
        self.counts: dict[str, int] = {}

    def add(self, reason: str, example: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 3:
            ex.append(example)


def facts_of(graph: ModelGraph) -> ModelFacts:
    """What the feasibility rule (``planner.feasibility.config_problems``) needs of ``graph``."""
    return ModelFacts(heads=tuple(sorted({l.attention.heads for l in graph.layers if l.attention})),
                      kv_heads=tuple(sorted({l.attention.kv_heads for l in graph.layers if l.attention})),
                      hidden=graph.hidden, units=len(graph.stage_groups()), seq_len=graph.seq_len,
                      limits=dict(graph.limits), experts=max((l.moe.experts for l in graph.layers if l.moe), default=0))


def degree_tuples(graph: ModelGraph, cluster: Cluster, global_batch: int, rej: _Rejections,
                  pins: Pins | None = None) -> Iterator[tuple[int, int, int, int]]:
    """(dp, pp, cp, tp) that the ``pins`` admit and that satisfy the structural constraints
    (the runtime's feasibility rule per degree, the node size, the batch); the others are
    recorded in ``rej`` (those the pins leave out are not)."""
    world = cluster.world
    facts = facts_of(graph)
    pins = pins or Pins()
    for tp in divisors(world):
        if not pins.allows("tp", tp) or (tp == 1 and not pins.allows("sp", False)):
            continue
        if tp > cluster.devices_per_node:
            rej.add(f"tp={tp} exceeds {cluster.devices_per_node} devices per node", f"tp={tp}")
            continue
        if why := tp_problem(tp, facts):
            rej.add(why, f"tp={tp}")
            continue
        for cp in divisors(world // tp):
            if not pins.allows("cp", cp):
                continue
            if why := cp_problem(cp, facts):
                rej.add(why, f"cp={cp}")
                continue
            for pp in divisors(world // (tp * cp)):
                if not pins.allows("pp", pp):
                    continue
                if why := pp_problem(pp, facts):
                    rej.add(why, f"pp={pp}")
                    continue
                dp = world // (tp * cp * pp)
                if not pins.allows("dp", dp):
                    continue
                if global_batch % dp:
                    rej.add(f"global batch {global_batch} not divisible by dp={dp}", f"dp={dp} pp={pp} cp={cp} tp={tp}")
                    continue
                yield dp, pp, cp, tp


def variants(dp: int, pp: int, cp: int, tp: int, mbs: int, m: int, n_layers: int, dtype: str,
              loss: str, facts: ModelFacts, dominated: bool = True, pins: Pins | None = None,
              ep: int = 1, ulysses: int = 1) -> Iterator[ParallelConfig]:
    """The variants of one degree tuple (``n_layers``: the stage groups) that the ``pins``
    admit. With ``dominated=False`` the variants the cost model proves no better are left
    out (see ``DOMINATED``) unless the pins leave out what dominates them. Sequence
    parallel is offered only where the runtime can run it (``planner.feasibility.sp_problem``);
    the attention kernel is flash unless the model cannot use it."""
    pins = pins or Pins()
    sp_ok = sp_problem(tp, cp, facts) is None
    attention = default_attention(facts.limits)
    zeros = ("ddp",) if dp * cp == 1 else tuple(z for z in (ZERO if "zero" in pins.choice else ZEROS)
                                                 if pins.allows("zero", z))
    for sched, v in schedule_choices(pp, m, n_layers, pins):
        if not dominated and sched == "gpipe" and pins.allows("schedule", "1f1b"):
            continue
        for zero in zeros:
            if zero_problem(zero, tp, dp * cp, facts, ep):
                continue
            for rc in (r for r in recompute_policies(sched, pp) if pins.allows("recompute", r)):
                for sp in (s for s in ((False, True) if sp_ok else (False,)) if pins.allows("sp", s)):
                    if ep_problem(ep, dp, cp, facts, tp, sp):  # a MoE model under TP needs SP
                        continue
                    if not dominated and sp_ok and not sp and pins.allows("sp", True):
                        continue
                    yield ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, ulysses=ulysses, mbs=mbs,
                                         schedule=sched, vpp=v,
                                         zero=zero, recompute=rc, sp=sp, dtype=dtype, loss=loss, attention=attention)


def schedule_choices(pp: int, m: int, n_layers: int, pins: Pins) -> list[tuple[str, int]]:
    """(schedule, vpp) to try for ``pp`` stages and ``m`` micro-batches: every schedule,
    interleaved with v in {2, 4} (or the pinned vpp values) where the micro-batches and
    stage groups allow; a pinned schedule or vpp applies only when pp > 1."""
    if pp == 1:
        return [("1f1b", 1)]
    vs: Sequence[int] = (2, 4)
    if "vpp" in pins.lo or "vpp" in pins.hi:  # a pinned range, up to one stage group per virtual stage
        vs = range(max(2, pins.lo.get("vpp", 2)), pins.hi.get("vpp", n_layers // pp) + 1)
    out = [(s, 1) for s in SCHEDULES if s != "interleaved-1f1b"]
    out += [("interleaved-1f1b", v) for v in vs if m % pp == 0 and pp * v <= n_layers]
    return [(s, v) for s, v in out if pins.allows("schedule", s) and pins.allows("vpp", v)]


# Variants the cost model never prefers, with the one that dominates them (no slower, no
# more memory), so the search skips them and counts them as pruned:
DOMINATED = {
    "gpipe": "1f1b: the same step time with min(pp, m) instead of m micro-batches in flight",
    "sp=off": "sp=on: the same TP traffic (reduce-scatter + all-gather = all-reduce) and sequence-sharded norms",
}
_DOMINATED_REASON = ("dominated (" + ", ".join(f"{k} by {v.split(':')[0]}" for k, v in DOMINATED.items())
                     + ": no faster, more memory)")


@dataclass
class _Space:
    """One search: its inputs, the model's facts, the layer costs per (tp, cp, mbs, sp) and the
    tallies (rejections, counts) every phase adds to."""
    graph: ModelGraph
    cluster: Cluster
    global_batch: int
    profile: object
    facts: ModelFacts
    dtype: str
    loss: str
    attention: str
    rej: _Rejections
    res: SearchResult
    pins: Pins = field(default_factory=Pins)
    cost_cache: dict = field(default_factory=dict)
    table_cache: dict = field(default_factory=dict)   # memory tables, shared by the layer costs of every key
    ulysses_cache: dict = field(default_factory=dict)  # (cp, tp, ep, mbs) -> (best Ulysses degree, feasible ones)
    leanest: tuple[float, bool] = (math.inf, False)   # least bytes per device any rejected layout needs, exact?

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

    @property
    def label(self) -> str:
        ep = f" ep={self.ep}" if self.moe else ""
        uly = f" ulysses={self.ulysses}" if self.ulysses > 1 else ""
        return f"dp={self.dp} pp={self.pp} cp={self.cp}{uly} tp={self.tp}{ep} mbs={self.mbs}"


def search(graph: ModelGraph, cluster: Cluster, global_batch: int, *, profile=None, top_k: int = 5,
           solve_top: int = 3, max_mbs: int = 8, dtype: str | None = None, loss: str = "eager",
           pins: Pins | None = None, ilp_time_limit: float = 10.0,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Find the configuration with the best predicted step time that fits among those the
    ``pins`` admit: degree tuples with their floors, then every variant's closed-form
    estimate on an even split, then the ILP split and the simulated schedule for the best few."""
    t0 = time.perf_counter()
    facts = facts_of(graph)
    if "any" in facts.limits:
        raise AutoparError(f"{graph.name} cannot run on autopar's runtime: {facts.limits['any']}")
    if loss == "fused" and "fused_loss" in facts.limits:
        raise AutoparError(f"--loss fused: {facts.limits['fused_loss']}; plan with --loss eager")
    res = SearchResult(best=None, alternatives=[], rejected={}, rejected_counts={})  # type: ignore[arg-type]
    space = _Space(graph, cluster, global_batch, profile, facts,
                   dtype or ("fp32" if cluster.backend == "gloo" else "bf16"), loss,
                   default_attention(facts.limits), _Rejections(), res, pins or Pins())
    tuples = _tuples_with_floors(space, max_mbs)
    if progress:
        progress(f"{len(tuples)} degree tuples after the memory floor; {res.considered} configurations")
    ranked = _ranked_variants(space, tuples)
    _solve_best(space, ranked, solve_top, ilp_time_limit, top_k)
    res.solve_s = time.perf_counter() - t0
    return res


def _tuples_with_floors(space: _Space, max_mbs: int) -> list[_Tuple]:
    """Every (dp, pp, cp, tp, ep, mbs) the structural rules allow, with a time floor (compute and
    TP/CP/EP communication per rank plus the best schedule's bubble); tuples whose memory floor
    (FSDP states and full recompute) exceeds the device are rejected."""
    g, rej = space.graph, space.rej
    reserve = RESERVE_GPU if space.cluster.backend != "gloo" else RESERVE_CPU
    tuples = []
    pins = space.pins
    # a pinned mbs may pass the default cap: up to its upper bound, or uncapped under a lower bound only
    max_mbs = pins.hi.get("mbs", math.inf if "mbs" in pins.lo else max_mbs)
    for dp, pp, cp, tp in degree_tuples(g, space.cluster, space.global_batch, rej, pins):
        per_replica = space.global_batch // dp
        sizes = [d for d in divisors(per_replica) if d <= max_mbs and pins.allows("mbs", d)]
        if not sizes:
            rej.add(f"no micro-batch size {pins.describe('mbs')} divides the {per_replica} sequences per replica",
                    f"dp={dp} pp={pp} cp={cp} tp={tp}")
        for mbs in sizes:
            m = per_replica // mbs
            if pp > 1 and m < pp:  # the pipeline schedules need a micro-batch per stage at least
                rej.add(f"{m} micro-batches for pp={pp}: the schedules need at least one per stage",
                        f"dp={dp} pp={pp} cp={cp} tp={tp} mbs={mbs}")
                continue
            for ep in _ep_degrees(space, dp, cp, tp):
                u = _best_ulysses(space, dp, pp, cp, tp, ep, mbs)
                t = _tuple_floor(space, dp, pp, cp, tp, ep, mbs, m, reserve, u)
                if t is not None:
                    tuples.append(t)
    return sorted(tuples)


def _base_config(space: _Space, dp: int, pp: int, cp: int, tp: int, ep: int, mbs: int,
                 ulysses: int = 1) -> ParallelConfig:
    """The configuration a degree tuple's layer costs and floors are priced with."""
    return ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, ulysses=ulysses, mbs=mbs, dtype=space.dtype,
                          loss=space.loss, sp=sp_problem(tp, cp, space.facts) is None, attention=space.attention,
                          zero="fsdp" if ep > 1 else "ddp")


def _rank_seconds(space: _Space, base: ParallelConfig) -> float:
    """One micro-batch through every layer on one rank: compute + TP / CP / EP communication (on
    the critical path in every variant of ``base``'s degrees)."""
    costs = space.costs(base)
    return sum(c.fwd + c.bwd + c.tp + c.cp + c.ep_fwd + c.ep_bwd for c in map(costs.get, space.graph.layers))


def _best_ulysses(space: _Space, dp: int, pp: int, cp: int, tp: int, ep: int, mbs: int) -> int:
    """The context-parallel method of a degree tuple: the Ulysses degree (``_ulysses_degrees``)
    whose layers take the least time per micro-batch. Nothing else in a layout depends on it
    (memory, schedules, sharding; nor dp and pp, the outer mesh dimensions), so it is chosen
    once per (cp, tp, ep, mbs) and the others are recorded as rejected with that reason."""
    if cp == 1:
        return 1
    key = (cp, tp, ep, mbs)
    if key not in space.ulysses_cache:
        degrees = _ulysses_degrees(space, cp, tp)
        times = {u: _rank_seconds(space, _base_config(space, dp, pp, cp, tp, ep, mbs, u)) for u in degrees}
        space.ulysses_cache[key] = (min(degrees, key=lambda u: (times[u], u)), degrees)
    best, degrees = space.ulysses_cache[key]
    for u in degrees:
        if u != best:
            space.rej.add(f"ulysses={u}: slower layers than ulysses={best} on the same degrees",
                          _base_config(space, dp, pp, cp, tp, ep, mbs, u).label())
    return best


def _ulysses_degrees(space: _Space, cp: int, tp: int) -> list[int]:
    """The Ulysses degrees to try with ``cp`` x ``tp`` (``ParallelConfig.cp_method``): 1 (ring
    attention), cp (Ulysses) and the divisors between (the 2-D hybrid) that split every
    attention's heads and kv heads per tp rank and that the pins admit; the others are
    recorded as rejected."""
    out = []
    for u in divisors(cp):
        if not space.pins.allows("ulysses", u):
            continue
        if why := cp_problem(cp, space.facts, u, tp):
            space.rej.add(why, f"cp={cp} ulysses={u} tp={tp}")
            continue
        out.append(u)
    return out


def _ep_degrees(space: _Space, dp: int, cp: int, tp: int) -> list[int]:
    """The expert-parallel degrees to try with ``dp`` x ``cp`` x ``tp`` (1 for a model without
    routed experts): every ``ep`` dividing both the experts and dp x cp x tp that the pins
    admit; 1 stays a candidate, because expert parallelism can lose. Degrees the runtime
    cannot run (with tp > 1: without sequence parallel, every degree) are recorded as rejected."""
    if not space.facts.experts:
        return [1]
    out = []
    sp = tp > 1 and sp_problem(tp, cp, space.facts) is None
    for ep in divisors(math.gcd(space.facts.experts, dp * cp * tp)):
        if not space.pins.allows("ep", ep):
            continue
        if why := ep_problem(ep, dp, cp, space.facts, tp, sp):
            space.rej.add(why, f"ep={ep}")
            continue
        out.append(ep)
    return out


def _tuple_floor(space: _Space, dp: int, pp: int, cp: int, tp: int, ep: int, mbs: int, m: int,
                 reserve: float, ulysses: int = 1) -> "_Tuple | None":
    """One degree tuple with its time floor, or None when its memory floor rejects it (recorded)."""
    res, rej, pins = space.res, space.rej, space.pins
    cap = space.cluster.memory_bytes
    base = _base_config(space, dp, pp, cp, tp, ep, mbs, ulysses)
    costs = space.costs(base)
    t_rank = _rank_seconds(space, base) / pp
    # bubble: no schedule here does better than interleaving with v = 4: (pp-1) t / 4
    floor_s = m * t_rank + (pp - 1) * t_rank / 4
    # memory floor: FSDP states (16 bytes/param over dp*cp; routed experts over their own group) on the average rank
    table = costs.table(base)
    experts = sum(table.experts)
    states = (sum(table.params) - experts) / (dp * cp) + experts / dp_group(base, experts=True)
    mem_floor = states / pp * 16 + min(table.act["full"]) + reserve
    n_var = sum(1 for _ in variants(dp, pp, cp, tp, mbs, m, space.facts.units, space.dtype, space.loss,
                                     space.facts, pins=pins, ep=ep, ulysses=ulysses))
    res.considered += n_var
    t = _Tuple(floor_s, dp, pp, cp, tp, mbs, m, n_var, costs, ep, moe=bool(space.facts.experts), ulysses=ulysses)
    if mem_floor > cap:
        space.note_need(mem_floor, exact=False)
        rej.add(f"OOM even with FSDP + full recompute: needs >= {mem_floor / GiB:.1f} GiB of "
                f"{cap / GiB:.1f} GiB", t.label, n_var)
        res.pruned += n_var
        return None
    return t


def _balanced_stage_times(costs: LayerCosts, graph: ModelGraph, pp: int) -> dict[str, tuple[float, float]]:
    """Per recompute policy, (forward, backward) seconds of one micro-batch on one of ``pp``
    perfectly balanced stages, by the estimator's own per-layer rule (``layer_pass_times``)."""
    out = {}
    for policy in RECOMPUTE:
        times = [layer_pass_times(costs.get(l), policy) for l in graph.layers]
        out[policy] = (sum(x.fwd for x in times) / pp, sum(x.bwd for x in times) / pp)
    return out


def _ranked_variants(space: _Space, tuples: list[_Tuple]) -> list[tuple[float, str, Estimate]]:
    """Every variant (schedule, vpp, sharding, recompute, sp) of the tuples whose floors beat the
    best step time found so far, priced with the closed-form pipeline on an even split; those
    that fit, fastest first."""
    g, res, rej = space.graph, space.res, space.rej
    ranked: list[tuple[float, str, Estimate]] = []
    best_s = math.inf
    for t in tuples:
        if t.floor_s >= best_s:
            # with routed experts, per expert-parallel degree: the report's "why not ep=..." reads it
            rej.add((f"ep={t.ep}: " if t.moe else "") + "time floor above the best step time found", t.label, t.n_var)
            res.pruned += t.n_var
            continue
        n_kept = 0
        costs = t.costs
        stage = _balanced_stage_times(costs, g, t.pp)
        for cfg in variants(t.dp, t.pp, t.cp, t.tp, t.mbs, t.m, space.facts.units, space.dtype, space.loss,
                             space.facts, dominated=False, pins=space.pins, ep=t.ep, ulysses=t.ulysses):
            n_kept += 1
            # variant floor: this schedule on perfectly balanced stages, with its recompute
            f, b = stage[cfg.recompute]
            v = cfg.vpp
            lb = estimate_step(cfg.schedule, t.pp, t.m, f / v, b / v, v=v) if t.pp > 1 else t.m * (f + b)
            if lb >= best_s:
                rej.add("time floor above the best step time found", cfg.label())
                res.pruned += 1
                continue
            part = even_split(g, t.pp * cfg.vpp, cfg.recompute)
            e = estimate(g, space.cluster, cfg, part, space.global_batch, profile=space.profile, fast=True,
                         costs=costs if LayerCosts.key(cfg) == LayerCosts.key(costs.cfg) else None)
            res.estimated += 1
            if not e.fits:
                r, over = e.shortfall()
                space.note_need(e.memory[r].total, exact=True)
                rej.add(f"OOM by {_bucket(over)} on stage {r}", cfg.label())
                continue
            ranked.append((e.step_s, cfg.to_str(), e))
            best_s = min(best_s, e.step_s)
        if t.n_var - n_kept:
            rej.add(_DOMINATED_REASON, t.label, t.n_var - n_kept)
            res.pruned += t.n_var - n_kept
    if not ranked:
        res.rejected, res.rejected_counts = rej.examples, rej.counts
        raise AutoparError(_nothing_fits(space))
    return sorted(ranked, key=lambda x: (x[0], x[1]))


def _solve_best(space: _Space, ranked: list[tuple[float, str, Estimate]], solve_top: int, ilp_time_limit: float,
                top_k: int) -> None:
    """The ILP stage split and the simulated schedule for the best ``solve_top``; the winner and
    the runner-ups (solved ones first) go into ``space.res``."""
    res = space.res
    finals: list[tuple[float, str, Estimate]] = []
    for _, key, e in ranked[:max(solve_top, 1)]:
        e2, info = split_and_estimate(space.graph, space.cluster, e.config, space.global_batch, space.profile,
                                      ilp_time_limit, uniform_recompute="recompute" in space.pins.choice)
        res.fully_solved += 1
        res.partition_info[e.config.to_str()] = info
        if e2.fits:
            finals.append((e2.step_s, key, e2))
    finals.sort(key=lambda x: (x[0], x[1]))
    if not finals:
        finals = [ranked[0]]
    res.best = finals[0][2]
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


def _bucket(over: float) -> str:
    return f"{over / GiB:.1f} GiB"


def _nothing_fits(space: _Space) -> str:
    """Why no layout is left: the least memory per device a layout needs against the device's
    (when memory is what rejected them), else the first reasons; with pins, which ones."""
    cluster, rej, pins = space.cluster, space.rej, space.pins
    what = f"layout with {pins.to_str()}" if pins else "configuration"
    where = f"{space.graph.name} on {cluster.name} ({cluster.world} devices)"
    need, exact = space.leanest
    if need < math.inf:
        cap = cluster.memory_bytes
        knobs = ["loosen --fix"] * bool(pins) + ["add devices"] + [k for key, k in (
            ("zero", "use FSDP/ZeRO"), ("recompute", "full recompute"), ("cp", "context parallel (longer sequences)"))
            if key not in pins.keys()]
        return (f"no {what} fits {where}: the best needs {'' if exact else 'at least '}{need / GiB:.1f} GiB per "
                f"device, {cap / GiB:.1f} GiB available (smallest shortfall {(need - cap) / GiB:.1f} GiB); "
                + ", ".join(knobs[:-1]) + " or " + knobs[-1])
    reasons = "; ".join(list(rej.counts)[:3]) or "the pins leave no configuration"
    return f"no valid {what} for {where}: {reasons}" + ("; loosen --fix" if pins else "")
