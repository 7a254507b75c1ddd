"""A layout's pipeline with its head as vocabulary passes, under a schedule generated for it.

For a one-stage-per-rank layout ``e`` (pp ranks, 1f1b or zb-h1), :func:`with_vocab_passes`
prices the same layout with the head split into ``pp`` vocabulary passes (``planner/vocab_passes.py``:
pass ``j`` the last virtual stage of rank ``j``, placement ``looped(pp, 2)``):

1. the graph's head becomes the passes (``vocab_passes.with_vocab_passes``) and the layers before it
   are split over the ``pp`` first stages as the caller gives (``stage_split.passes_body``: evenly,
   the head no longer weighing on the last one);
2. the interleaved 1F1B order on that placement prices the stages (``cfg.vpp = 2``, schedule
   ``custom``: the IR is the plan's own);
3. a schedule is generated for those stage times (``schedule_gen.generate`` with the stages'
   activations, at most what the interleaved order holds per rank) and priced again;

and keeps the faster of the two that fits. The search (``stage_split.with_generated_schedule``)
keeps it where it is faster than ``e``; ``benchmarks/schedule_gen.py`` prints both orders.
"""
from __future__ import annotations

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, estimate
from planner import vocab_passes as vp
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition
from planner.schedule_ir import Action, Schedule, builtin, builtin_problem, looped
from planner.search.schedule_gen import generate


def passes_problem(graph: ModelGraph, cfg: ParallelConfig) -> str | None:
    """Why one-stage-per-rank layout ``cfg`` cannot be priced with ``graph``'s head as vocabulary
    passes (None: it can): the graph's reason (``vocab_passes.problem``) or the layout's
    (``vocab_passes.layout_problem`` of :func:`passes_config`)."""
    if cfg.vpp != 1 or cfg.schedule not in ("1f1b", "zb-h1"):
        return "vocabulary passes follow a one-stage-per-rank pipeline (1f1b or zb-h1)"
    return vp.problem(graph, cfg.pp) or vp.layout_problem(passes_config(cfg))


def passes_config(cfg: ParallelConfig) -> ParallelConfig:
    """``cfg`` with its head as vocabulary passes: each rank's second stage, the plan's own schedule."""
    return cfg.replace(vpp=2, schedule="custom", vocab_passes=True)


def passes_partition(graph: ModelGraph, body: Partition) -> Partition:
    """The stages of ``body`` (a split of ``graph``'s layers before its head over the ``pp`` first
    stages) then one stage per vocabulary pass, over ``vocab_passes.with_vocab_passes(graph, pp)``'s layers."""
    n, pp = len(graph.layers) - 1, len(body.bounds)
    return Partition(list(body.bounds) + [(n + j, n + j + 1) for j in range(pp)], list(body.recompute) + ["none"] * pp)


def with_vocab_passes(graph: ModelGraph, cluster: Cluster, e: Estimate, body: Partition, profile=None,
                      engine=None) -> Estimate | None:
    """Layout ``e.config`` with its head as vocabulary passes, under the faster of the interleaved
    order and a generated schedule that fits (module docstring); None where it cannot run
    (:func:`passes_problem`) or nothing fits."""
    fits = [x for x in vocab_pass_estimates(graph, cluster, e, body, profile, engine).values() if x.fits]
    return min(fits, key=lambda x: x.step_s) if fits else None


def vocab_pass_estimates(graph: ModelGraph, cluster: Cluster, e: Estimate, body: Partition, profile=None,
                         engine=None) -> dict[str, Estimate]:
    """``{"interleaved": ..., "generated": ...}``: layout ``e.config`` with vocabulary passes under the
    interleaved 1F1B order (where it can be made for the micro-batches) and under a schedule
    generated for its stage times within each rank's memory (where one micro-batch of each stage
    fits); empty where the passes cannot run (:func:`passes_problem`)."""
    cfg, m, p = e.config, e.microbatches, e.config.pp
    if passes_problem(graph, cfg):
        return {}
    g2 = vp.with_vocab_passes(graph, p)  # priced as is (estimate's graph_for leaves a graph with passes alone)
    part = passes_partition(graph, body)
    cfg2 = passes_config(cfg)
    kw = dict(profile=profile, engine=engine)
    out = {}
    if not builtin_problem("interleaved-1f1b", p, m, 2):
        out["interleaved"] = estimate(g2, cluster, cfg2, part, e.global_batch,
                                      schedule=builtin("interleaved-1f1b", p, m, 2), **kw)
    first = out.get("interleaved") or estimate(g2, cluster, cfg2, part, e.global_batch,
                                               schedule=Schedule("gpipe", m, looped(p, 2), _gpipe_orders(p, m)), **kw)
    gen = schedule_for(g2, first)
    if gen is not None:
        out["generated"] = estimate(g2, cluster, cfg2, part, e.global_batch, schedule=gen, **kw)
    return out


def schedule_for(g2: ModelGraph, first: Estimate) -> Schedule | None:
    """A schedule generated for the stage times of ``first`` (a layout with vocabulary passes over
    ``g2``, the graph with them, priced under another order) within each rank's memory
    (:func:`memory_limits`); None where not one micro-batch of each stage fits a rank."""
    act = [sum(g2.layers[i].act_bytes for i in range(lo, hi)) for lo, hi in first.partition.bounds]
    try:
        return generate(first.stage_fwd_s, first.stage_bwd_s, first.microbatches, p2p=first.p2p_hop_s, act=act,
                        limit=memory_limits(first, act), stage_rank=looped(first.config.pp, 2),
                        name="generated+vocab", split=first.split)
    except ValueError:
        return None


def memory_limits(first: Estimate, act: list[float]) -> list[float]:
    """Per rank, the activations (in ``act``'s units) the generator may hold: the device capacity
    less the rank's other memory in ``first``'s estimate, over the bytes the memory model charged
    per unit of ``act`` that ``first``'s own order held at its peak (so the generated order's
    activations, priced by the same model, fit as ``first``'s would at that peak)."""
    from planner.schedule_check import peak_activations
    held = peak_activations(first.schedule_ir, act)
    out = []
    for mem, h in zip(first.memory, held):
        per_unit = mem.activations / h if h > 0 else 1.0
        out.append(max(0.0, first.capacity - (mem.total - mem.activations)) / per_unit)
    return out


def _gpipe_orders(p: int, m: int):
    """All forwards then all backwards of both stages of each rank on ``looped(p, 2)``."""
    out = []
    for r in range(p):
        fw = [Action("F", s, mb) for s in (r, r + p) for mb in range(m)]
        bw = [Action("B", s, mb) for s in (r + p, r) for mb in range(m)]
        out.append(tuple(fw + bw))
    return tuple(out)
