"""From a model and a cluster to a Plan: search, partition, and the plan file's contents.

``plan_model`` is what ``autopar plan`` and ``auto_parallelize`` call;
``evaluate_config`` is ``autopar evaluate``: it prices one configuration the user
already runs, with the ILP's stage split or an even one.
"""
from __future__ import annotations

from typing import Any, Callable

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, estimate
from cost_models.engines import engine_of
from cost_models.pipeline import stage_placement
from cost_models.pipeline import ScheduleError
from cost_models.wan_cost import dp_spans
from planner.errors import AutoparError, PlanError
from planner.graph import ModelGraph
from planner.search.pins import Pins, as_pins
from planner.plan import SCHEDULES, ParallelConfig, Plan
from planner.schedule_ir import Schedule
from planner.feasibility import degrees_problem, expert_groups_problem, problems
from planner.search.candidates import batch_of, facts_of
from planner.search.result import SearchResult
from planner.vocab_passes import stage_layers
from planner.search.space import search
from planner.search.seq_lens import SeqLens, as_histogram, with_documents
from planner.search.stage_split import config_even_split
from planner.search.stage_split import split_and_estimate
from planner.search.user_schedule import search_for_schedule
from planner.frontend.tp_layout import tp_layout

GiB = 2**30


def _estimate_dict(e: Estimate) -> dict[str, Any]:
    d = e.to_dict()
    for k in ("config", "label", "partition"):
        d.pop(k, None)
    return _rounded(d)


def _rounded(x: Any) -> Any:
    """Round floats to 6 significant digits: stable, byte-identical plan files."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def _why_not(alt: Estimate, best: Estimate, graph: ModelGraph | None = None) -> str:
    """One line on why an alternative lost: the breakdown category that grew most (with packed
    documents and exposed ring transfers, why they are exposed)."""
    diffs = {k: alt.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in alt.breakdown}
    k = max(diffs, key=lambda key: diffs[key])
    pct = (alt.step_s / best.step_s - 1) * 100
    line = f"{pct:+.1f}% step time, mostly {k.replace('_', ' ')} (+{diffs[k]:.3g} s)"
    cfg = alt.config
    if k == "cp_comm" and graph is not None and graph.documents is not None and cfg.cp // cfg.ulysses > 1:
        from cost_models.documents import full_row_share, visiting_share, visiting_text

        text = visiting_text(visiting_share(graph.documents, cfg.cp, cfg.ulysses),
                             full_row_share(graph.seq_len, cfg.cp, cfg.ulysses))
        line += f": its ring's K/V transfers are exposed, with only {text} over the packed documents"
    return line


def _documents_record(graph: ModelGraph, cfg: ParallelConfig, world: int) -> dict[str, Any]:
    """What the plan's ``batch.documents`` records (``cost_models.documents.summary``): the mix,
    the ring's visiting share for the chosen layout and for every plain ring of the device
    count (what the report's "why not cp=..." reads), and the chosen layout's busiest-rank
    attention share (what its step is priced at)."""
    from cost_models.documents import busiest_share, summary

    rings = [(cfg.cp, cfg.ulysses)] + [(cp, 1) for cp in range(2, world + 1)
                                       if world % cp == 0 and (cp, 1) != (cfg.cp, cfg.ulysses)]
    out = summary(graph.documents, rings)
    out["chosen"] = f"cp={cfg.cp}" + (f" ulysses={cfg.ulysses}" if cfg.ulysses > 1 else "")
    out["busiest_share"] = busiest_share(graph.documents, cfg.dp, cfg.cp, cfg.ulysses, cfg.mbs)  # what is priced
    return out


def build_plan(graph: ModelGraph, cluster: Cluster, e: Estimate, *, spec: str, cluster_spec: str,
               alternatives: list[Estimate] = (), rejected: dict | None = None,
               counts: dict | None = None, search_info: dict | None = None,
               schedule: Schedule | None = None) -> Plan:
    """The plan file of estimate ``e`` (``schedule``: the schedule IR of ``schedule=custom``,
    recorded in the plan so the program runs it)."""
    cfg, schedule = e.config, schedule or e.schedule_ir
    names = stage_layers([l.name for l in graph.layers], cfg.vocab_passes, cfg.pp)
    place = stage_placement(cfg, e.microbatches, schedule)
    stages = []
    for j, (lo, hi) in enumerate(e.partition.bounds):
        stages.append({"rank": place[j], "chunk": place[:j].count(place[j]), "layers": names[lo:hi],
                       "recompute": e.partition.recompute[j]})
    alts = [{"config": a.config.to_str(), "label": a.config.label(), "step_s": _rounded(a.step_s),
             "mfu": _rounded(a.mfu), "memory_gib": _rounded(max(m.total for m in a.memory) / GiB),
             "delta_pct": _rounded((a.step_s / e.step_s - 1) * 100), "why_not": _why_not(a, e, graph)}
            for a in alternatives]
    rej = {r: {"count": (counts or {}).get(r, len(ex)), "examples": ex} for r, ex in (rejected or {}).items()}
    batch: dict[str, Any] = {"global": e.global_batch, "micro": cfg.mbs, "microbatches": e.microbatches,
                             "seq_len": graph.seq_len}
    if graph.documents is not None:
        batch["documents"] = _rounded(_documents_record(graph, cfg, cluster.world))
    return Plan(
        model={"name": graph.name, "spec": spec, "fingerprint": graph.fingerprint(), "layers": [l.name for l in graph.layers],
               "params": graph.params, "hidden": graph.hidden, "vocab": graph.vocab, "adapter": graph.adapter,
               "facts": facts_of(graph).to_dict()},
        cluster={"name": cluster.name, "spec": cluster_spec, "fingerprint": cluster.fingerprint(),
                 "nodes": cluster.nodes, "devices_per_node": cluster.devices_per_node, "backend": cluster.backend,
                 "memory_gib": _rounded(cluster.memory_bytes / GiB), "device": cluster.device.name,
                 **({"cores_per_node": cluster.cores_per_node} if cluster.cores_per_node else {}),
                 **({"dp_spans": spans} if (spans := dp_spans(cluster, cfg)) > 1 else {})},
        config=cfg,
        batch=batch,
        stages=stages, tp_layout=tp_layout(graph) if cfg.tp > 1 else {},
        estimate=_estimate_dict(e), alternatives=alts, rejected=rej, search=_rounded(search_info or {}),
        schedule_ir=schedule if cfg.schedule == "custom" else None)


def plan_model(graph: ModelGraph, cluster: Cluster, global_batch: int, *, spec: str, cluster_spec: str,
               profile=None, top_k: int = 5, progress: Callable[[str], None] | None = None,
               fix: Pins | str | None = None, seq_lens: SeqLens | None = None, per_batch: bool = False,
               schedule: Schedule | None = None, schedule_source: str = "the schedule",
               images: dict[int, float] | None = None, **search_kw: Any) -> tuple[Plan, SearchResult]:
    """Search the space and return the plan with its search record. ``fix`` pins part of the
    layout (a pin string such as ``"tp=8,pp=1"`` or ``"tp<=4"``, see planner/search/pins.py): only
    configurations it admits are searched, and the plan's ``search["fix"]`` records it.
    ``seq_lens`` (a file as ``autopar plan --seq-lens`` reads, a list of document lengths or
    a {length: count} mapping) plans each sequence of ``graph.seq_len`` tokens as a row of
    those documents packed (planner/search/seq_lens.py); ``graph`` itself is left as it is.
    ``per_batch`` (packed documents only) prices per-batch assignment of each batch's
    documents for the chosen layout and records it (``batch.per_batch``; planner/search/per_batch.py).
    ``schedule`` (a user's schedule IR, read from ``schedule_source``): plan the layouts that can
    run it, priced running it (planner/search/user_schedule.py). ``images`` (a vision + language
    model's images per sample -> weight) prices assigning each batch's samples to the dp ranks
    (``batch.multimodal``; planner/search/multimodal.py)."""
    if global_batch < 1:
        raise AutoparError(f"--global-batch must be a positive integer, got {global_batch}")
    if seq_lens is not None:
        hist, source = as_histogram(seq_lens)
        graph = with_documents(graph, hist, source)
    pins = as_pins(fix).check_world(cluster.world, cluster.name)
    if images:  # refused before the search: a model without images
        from planner.search.multimodal import image_patches
        image_patches(graph)
    if schedule is None:
        res = search(graph, cluster, global_batch, profile=profile, top_k=top_k, progress=progress, pins=pins,
                     **search_kw)
    else:
        res, got = search_for_schedule(graph, cluster, global_batch, schedule, schedule_source, pins,
                                       evaluate_config, profile, progress=progress, **search_kw)
        res.alternatives = res.alternatives[:top_k]
    info = {"considered": res.considered, "pruned": res.pruned, "estimated": res.estimated,
            "fully_solved": res.fully_solved,
            "partition": {k: {kk: vv for kk, vv in v.items() if kk not in ("solve_s",)}
                          for k, v in sorted(res.partition_info.items())}}
    if pins:
        info["fix"] = pins.to_str()
    if schedule is not None:
        info["schedule"] = got.why
    if res.split_note:
        info["split"] = res.split_note
    plan = build_plan(graph, cluster, res.best, spec=spec, cluster_spec=cluster_spec,
                      alternatives=res.alternatives, rejected=res.rejected, counts=res.rejected_counts,
                      search_info=info, schedule=schedule)
    if per_batch:
        if graph.documents is None:
            raise AutoparError("--per-batch assigns packed documents per batch: give their lengths with --seq-lens")
        from planner.search.per_batch import per_batch_record
        plan.batch["per_batch"] = _rounded(per_batch_record(graph, cluster, res.best, global_batch, profile))
    if images:
        from planner.search.multimodal import multimodal_record
        plan.batch["multimodal"] = _rounded(multimodal_record(graph, cluster, res.best, global_batch, images, profile))
    return plan, res


def evaluate_config(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *,
                    even_split: bool = False, profile=None, engine=None,
                    schedule: Schedule | None = None) -> tuple[Estimate, list[str]]:
    """Price ``cfg``; returns the estimate and what the runtime cannot run of it (empty if
    nothing): :func:`evaluate_noted` without its note on the stage split."""
    e, found, _ = evaluate_noted(graph, cluster, cfg, global_batch, even_split=even_split, profile=profile,
                                 engine=engine, schedule=schedule)
    return e, found


def evaluate_noted(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int, *,
                   even_split: bool = False, profile=None, engine=None,
                   schedule: Schedule | None = None) -> tuple[Estimate, list[str], str]:
    """Price ``cfg``; returns the estimate, what the runtime cannot run of it (empty if
    nothing): the feasibility predicate (``planner.feasibility.problems``), as the search and
    the runtime apply it, and how its stage split moved off the busiest rank ("" if it did not:
    ``planner.search.split_moves.split_note``). Where one of its problems leaves nothing to
    price (the degrees do not cover the cluster, expert-parallel groups that do not exist, more
    stages than stage groups, a global batch that does not split into micro-batches,
    micro-batches the schedule cannot order), AutoparError with every problem. ``engine``
    (cost_models/engines.py; None: autopar's runtime) is the engine whose overlaps are priced.
    ``schedule``: the schedule IR of ``schedule=custom`` (a user's file); it and dualpipev are
    priced on the even split (the stage ILP models looped stages)."""
    facts = facts_of(graph)
    found = problems(cfg, facts, batch_of(graph, global_batch), cluster)
    if degrees_problem(cfg, cluster) or expert_groups_problem(cfg.ep, cfg.dp, cfg.cp, facts, cfg.tp):  # no mesh
        raise AutoparError(f"{cfg.label()} cannot be priced: " + "; ".join(found))
    try:
        if even_split or cfg.pp * cfg.vpp == 1 or cfg.schedule not in SCHEDULES:
            part = config_even_split(graph, cfg, engine_of(engine).split_ends)
            return estimate(graph, cluster, cfg, part, global_batch, profile=profile, engine=engine,
                            schedule=schedule), found, ""
        e, info = split_and_estimate(graph, cluster, cfg, global_batch, profile, engine=engine)
        return e, found, info.get("split_moves", "")
    except (PlanError, ScheduleError) as e:
        raise AutoparError(f"{cfg.label()} cannot be priced: " + "; ".join(found or [str(e)])) from None
