"""Stage splits of one configuration: the even split Megatron-LM and torchtitan use (the search's
first estimate), the ILP's inputs (``partition_problem``), and the ILP's split with its full
estimate (``split_and_estimate`` / ``best_partition``; the solver is planner/search/partition.py).
"""
from __future__ import annotations

from dataclasses import replace

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, estimate
from cost_models.pipeline_memory import inflight_closed, rule_of
from cost_models.layer_costs import LayerCosts, act_bytes_io, layer_pass_times
from cost_models.profile_db import calibration
from cost_models.memory import chunk_memory, framework_reserve
from cost_models.mp_casts import stage_mp_casts
from cost_models.offload import offload_saves
from cost_models.wan_cost import hsdp_replicas, stage_capacity, stage_slowdowns
from planner.feasibility import recompute_attention_problem
from planner.graph import BLOCK_KINDS, ModelGraph
from planner.plan import RECOMPUTE, ParallelConfig, Partition
from planner.recompute_rules import recompute_policies
from planner.search.schedule_gen import best_schedule
from planner.search.split_moves import split_note, with_split_moves
from planner.search.vocab_schedule import passes_partition, passes_problem, with_vocab_passes
from planner.search.wan_warmup import with_deep_warmup

# The stage ILP's solver (planner/search/partition_solvers.py): HiGHS where highspy is installed (the
# 'highs' extra), else CBC. HiGHS proves the interleaved splits CBC leaves at a 2% gap after its 10 s
# limit in under a second (Llama-3 70B, pp4 v2 with per-stage recompute: 0.76 s against 10.2 s).
ILP_SOLVER = "auto"


def even_split(graph: ModelGraph, stages: int, recompute: str = "none", ends_as_layers: bool = False) -> Partition:
    """Equal numbers of repeated blocks per stage, as Megatron-LM and torchtitan split a model
    (the first stages take the remainder): the layers before the first block (embeddings) ride
    with the first stage, those after a stage's last block (a projector, the final norm and
    head) with the next stage or the last. ``ends_as_layers`` (Megatron-Core's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``,
    ``Engine.split_ends``): the layers before the first block and those after the last each count
    as one block of the split, and may be a stage of their own (:func:`end_units`). Models with
    fewer blocks than stages: equal numbers of stage groups (``ModelGraph.stage_groups``). In layers."""
    groups = end_units(graph) if ends_as_layers else graph.stage_groups()
    weight = [1 if ends_as_layers else sum(graph.layers[i].kind in BLOCK_KINDS for i in range(lo, hi))
              for lo, hi in groups]
    total = sum(weight)
    if total < stages:
        return expand_groups(Partition.even(len(groups), stages, recompute), groups)
    q, r = divmod(total, stages)
    bounds, start, have = [], 0, 0
    for g, w in enumerate(weight):
        have += w
        if len(bounds) < stages - 1 and have >= q + (1 if len(bounds) < r else 0):
            bounds.append((start, g + 1))
            start, have = g + 1, 0
    bounds.append((start, len(groups)))
    return expand_groups(Partition(bounds, [recompute] * stages), groups)


def end_units(graph: ModelGraph) -> list[tuple[int, int]]:
    """The units of Megatron-Core's split with the embedding and the loss accounted as layers: the
    layers before the first block, each block (with any non-block layers up to the next block), and
    the layers after the last block (the final norm and head). Megatron's own embedding and loss
    stages, not autopar's runtime's: its stage boundaries are ``ModelGraph.stage_groups``."""
    blocks = [i for i, l in enumerate(graph.layers) if l.kind in BLOCK_KINDS]
    if not blocks:
        return graph.stage_groups()
    units = [(0, blocks[0])] if blocks[0] > 0 else []
    units += [(a, b) for a, b in zip(blocks, blocks[1:] + [blocks[-1] + 1])]
    if blocks[-1] + 1 < len(graph.layers):
        units.append((blocks[-1] + 1, len(graph.layers)))
    return units


def speed_split(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig) -> Partition:
    """:func:`even_split` on a cluster of one device type; on mixed devices (``wan_cost.stage_slowdowns``)
    blocks in proportion to each stage's device speed (a slower stage gets fewer), each stage at
    least one stage group: the search's fast pass prices this split, the ILP then refines it."""
    S = cfg.pp * cfg.vpp
    slow = stage_slowdowns(cluster, cfg)
    if len(set(slow)) <= 1:
        return even_split(graph, S, cfg.recompute)
    groups = graph.stage_groups()
    weight = [sum(graph.layers[i].kind in BLOCK_KINDS for i in range(lo, hi)) for lo, hi in groups]
    inv = [1 / slow[j % cfg.pp] for j in range(S)]
    targets = [sum(weight) * sum(inv[:j + 1]) / sum(inv) for j in range(S - 1)]
    bounds, start, have = [], 0, 0.0
    for g, w in enumerate(weight):
        have += w
        k = len(bounds)
        if k < S - 1 and have >= targets[k] - 1e-9 and g + 1 > start and len(groups) - g - 1 >= S - 1 - k:
            bounds.append((start, g + 1))
            start = g + 1
    if len(bounds) != S - 1:
        return even_split(graph, S, cfg.recompute)
    bounds.append((start, len(groups)))
    return expand_groups(Partition(bounds, [cfg.recompute] * S), groups)


def fast_splits(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig) -> list[Partition]:
    """The splits the search's fast pass prices, in turn until one fits: :func:`even_split`, and
    on mixed devices :func:`speed_split` before it."""
    even = even_split(graph, cfg.pp * cfg.vpp, cfg.recompute)
    if not cluster.mixed:
        return [even]
    fast = speed_split(graph, cluster, cfg)
    return [even] if fast.bounds == even.bounds else [fast, even]


def expand_groups(part: Partition, groups: list[tuple[int, int]]) -> Partition:
    """A split of the stage groups as a split of the layers."""
    return Partition([(groups[a][0], groups[b - 1][1]) for a, b in part.bounds], list(part.recompute))


def partition_problem(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, profile=None):
    """The ILP's inputs for one configuration: per stage group (layers a boundary may not
    split) times per recompute policy (``layer_pass_times``) and its memory figures
    (``cost_models.memory.chunk_memory`` of the group: states, activations, overshoot,
    weight-gradient working set), the schedule's in-flight micro-batches per virtual stage
    and the tensor bytes a device holds beside the reserve (``framework_reserve``). With k
    sequence chunks a unit in flight is ``1/k`` of a micro-batch (the chunks' KV store, a few
    percent of their activations, is left to the estimate's check)."""
    from planner.search.partition import PartitionProblem
    from planner.feasibility import microbatches

    m = microbatches(cfg, global_batch)
    from cost_models import comm as comm_mod

    mesh = comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp)
    costs = LayerCosts(graph, cluster, cfg.replace(recompute="none"), profile)  # recompute is priced below
    rule = rule_of(graph, cfg, costs.table(cfg), hsdp_replicas(cluster, cfg))
    groups = graph.stage_groups()
    cal = calibration(profile)
    fwd, bwd, act, peak, static, transient, out_p2p, classes = [], [], [], [], [], [], [], []
    for g, (lo, hi) in enumerate(groups):
        passes = {p: [layer_pass_times(costs.get(l), p) for l in graph.layers[lo:hi]] for p in RECOMPUTE}
        mp = stage_mp_casts(graph, cfg, lo, hi, m, costs.c, cal, costs.engine)  # the estimate's stage rule too
        fwd.append({p: sum(t.fwd for t in ts) + mp.fwd for p, ts in passes.items()})
        bwd.append({p: sum(t.bwd for t in ts) + mp.bwd for p, ts in passes.items()})
        mem = {p: chunk_memory(rule, range(lo, hi), p) for p in RECOMPUTE}
        act.append({p: c.act for p, c in mem.items()})
        peak.append({p: c.peak for p, c in mem.items()})
        static.append(mem["none"].states)
        transient.append(mem["none"].transient)
        classes.append("|".join(l.signature for l in graph.layers[lo:hi]))
        if cfg.pp > 1 and g + 1 < len(groups):
            nxt = graph.layers[hi]
            nb = act_bytes_io(nxt, graph, cfg) / cfg.seq_shards
            out_p2p.append(comm_mod.p2p_time(nb, cluster, mesh, profile).seconds)
        else:
            out_p2p.append(0.0)
    S = cfg.pp * cfg.vpp
    sched = cfg.schedule if cfg.pp > 1 else "1f1b"
    k = cfg.seq_chunks
    units = [inflight_closed(sched, cfg.pp, m, cfg.vpp, j % cfg.pp, k) if cfg.pp > 1 else k for j in range(S)]
    inflight = [u / k / cfg.vpp for u in units]
    reserve = framework_reserve(cluster.backend != "gloo", calibration(profile))
    return PartitionProblem(fwd=fwd, bwd=bwd, act=act, static=static, out_p2p=out_p2p, classes=classes, pp=cfg.pp,
                            v=cfg.vpp, m=m, schedule=sched, inflight=inflight, peak=peak, transient=transient,
                            capacity=reserve.tensor_room(stage_capacity(cluster, cfg)),
                            slow=[stage_slowdowns(cluster, cfg)[j % cfg.pp] for j in range(S)])


def split_and_estimate(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, profile=None,
                       time_limit: float = 10.0, uniform_recompute: bool = False,
                       engine=None, generate: bool = False, vocab_passes: bool = True) -> tuple[Estimate, dict]:
    """``cfg`` simulated in full on its best stage split: the ILP's, unless the simulator
    rates the even split faster or the ILP's does not fit (the ILP optimises a linear model
    of the schedule; the simulator is the judge). Returns the estimate and the solver info.
    ``uniform_recompute``: every stage keeps ``cfg.recompute`` (a pinned policy). ``engine``
    (cost_models/engines.py) prices both splits; the ILP's coefficients are autopar's.
    ``generate``: try a schedule generated for the split's stage times instead of ``cfg``'s
    (:func:`with_generated_schedule`) and 1F1B with a deeper warm-up before a WAN cut
    (``planner/search/wan_warmup.py``), keeping the faster (the search, where the schedule is
    not pinned; ``vocab_passes``: and the head as vocabulary passes). Both splits, and a generated or
    deepened schedule's, then move one stage group at a time off the busiest rank where the simulator
    rates that faster
    (``planner/search/split_moves.py``: the ILP's model ignores where the bottleneck sits)."""
    part, info = best_partition(graph, cluster, cfg, global_batch, profile, time_limit, uniform_recompute)
    start = estimate(graph, cluster, cfg, part, global_batch, profile=profile, engine=engine)
    e, moves, which = *with_split_moves(graph, cluster, start, profile, engine), "the ILP's split"
    if cfg.pp * cfg.vpp > 1:
        even = estimate(graph, cluster, cfg, speed_split(graph, cluster, cfg), global_batch, profile=profile,
                        engine=engine)
        same = even.partition == start.partition  # (moved alike: no need to move it again)
        e_even, moves_even = (even, 0) if same else with_split_moves(graph, cluster, even, profile, engine)
        if not e.fits or (e_even.fits and e_even.step_s < e.step_s):
            start, e, moves, which = even, e_even, moves_even, "the even split"
            info = dict(info, chosen="even split (simulated faster or the ILP split did not fit)")
    if generate:
        generated = with_generated_schedule(graph, cluster, e, profile, engine, info, vocab_passes)
        deepened = with_deep_warmup(graph, cluster, e, global_batch, profile, engine, info)
        e, info = min(generated, deepened, key=lambda x: x[0].step_s)
        if e.schedule_ir is not None and not e.config.vocab_passes:  # the new schedule may favour another split
            e, more = with_split_moves(graph, cluster, e, profile, engine)
            moves += more
    note = split_note(start, e, moves, which)
    return e, (dict(info, split_moves=note) if note else info)


GEN_MAX_WORK = 65_536  # generate a schedule only where pp^2 x micro-batches stays within this (~0.15 s)


def generates(cfg: ParallelConfig, m: int) -> bool:
    """Whether :func:`with_generated_schedule` tries a generated schedule for ``cfg`` with ``m``
    micro-batches: one stage per rank under 1f1b or zb-h1 without sequence chunks (the generator
    orders whole micro-batches), ``pp^2 m`` within :data:`GEN_MAX_WORK`."""
    return cfg.pp > 1 and cfg.vpp == 1 and cfg.schedule in ("1f1b", "zb-h1") and cfg.seq_chunks == 1 \
        and cfg.pp ** 2 * m <= GEN_MAX_WORK


def with_generated_schedule(graph: ModelGraph, cluster: Cluster, e: Estimate, profile, engine,
                            info: dict, vocab_passes: bool = True) -> tuple[Estimate, dict]:
    """``e``, or the same layout and split running a schedule generated for its stage times
    (planner/search/schedule_gen.py, at 1F1B's activation memory), or (``vocab_passes``) the layout
    with its head as vocabulary passes (planner/search/vocab_schedule.py), where that is faster and
    fits: one stage per rank, and ``pp^2 m`` within :data:`GEN_MAX_WORK`."""
    cfg, m = e.config, e.microbatches
    if not generates(cfg, m):
        return e, info
    best, note = e, None
    choice = best_schedule(e.stage_fwd_s, e.stage_bwd_s, m, p2p=e.p2p_hop_s, split=e.split)
    if choice.schedule is not None:
        gen = estimate(graph, cluster, cfg.replace(schedule="custom"), e.partition, e.global_batch, profile=profile,
                       engine=engine, schedule=choice.schedule)
        if gen.fits and gen.step_s < best.step_s:
            best, note = gen, f"generated: {e.step_s / gen.step_s:.3f}x faster than {cfg.schedule}"
    tried = vocab_passes and not passes_problem(graph, cfg)
    passes = with_vocab_passes(graph, cluster, e, passes_body(graph, cfg), profile, engine) if tried else None
    if passes is not None and passes.step_s < best.step_s:
        best, note = passes, (f"the head as {cfg.pp} vocabulary passes, {passes.schedule_ir.name}: "
                              f"{e.step_s / passes.step_s:.3f}x faster than {cfg.schedule} with the head whole")
    return best, (dict(info, schedule=note) if note else info)


def config_even_split(graph: ModelGraph, cfg: ParallelConfig, ends_as_layers: bool = False) -> Partition:
    """:func:`even_split` of ``cfg``'s ``pp * vpp`` stages (``ends_as_layers``: as there); with
    vocabulary passes the layers before the head over ``pp`` stages, then the passes
    (``vocab_schedule.passes_partition``: autopar's own split, ``ends_as_layers`` does not apply)."""
    if cfg.vocab_passes:
        return passes_partition(graph, passes_body(graph, cfg))
    return even_split(graph, cfg.pp * cfg.vpp, cfg.recompute, ends_as_layers)


def passes_body(graph: ModelGraph, cfg: ParallelConfig) -> Partition:
    """The split of ``graph``'s layers before its head over ``cfg.pp`` stages, for vocabulary passes
    (``planner/search/vocab_schedule.py``): :func:`even_split`, the final norm with the last stage."""
    return even_split(replace(graph, layers=graph.layers[:-1]), cfg.pp, cfg.recompute)


def best_partition(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, profile=None,
                   time_limit: float = 10.0, uniform_recompute: bool = False) -> tuple[Partition, dict]:
    """The ILP's stage split (recompute per stage: with ``cfg.recompute = none`` the ILP may
    choose any policy per stage, unless ``uniform_recompute``) for ``cfg``; an even split when
    pp == 1."""
    n = len(graph.layers)
    if cfg.pp * cfg.vpp == 1:
        return Partition.even(n, 1, cfg.recompute), {"status": "trivial (one stage)"}
    from planner.search.partition import solve_partition

    prob = partition_problem(graph, cluster, cfg, global_batch, profile)
    uniform = cfg.recompute != "none" or uniform_recompute or cfg.seq_chunks > 1  # (chunks: no recompute)
    prob.policies = (cfg.recompute,) if uniform else tuple(
        r for r in recompute_policies(cfg.schedule, cfg.pp) if not recompute_attention_problem(r, graph.limits)
        and (r != "offload" or offload_saves(cluster)))
    r = solve_partition(prob, solver=ILP_SOLVER, time_limit=time_limit)
    info = {"status": r.status, "gap": r.gap, "solve_s": r.solve_s, "solver": r.solver,
            "objective_s": r.objective_s}
    if r.status == "infeasible" or r.partition is None:
        return even_split(graph, cfg.pp * cfg.vpp, cfg.recompute), info
    return expand_groups(r.partition, graph.stage_groups()), info
