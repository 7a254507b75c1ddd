"""Per pp rank memory of a pipeline (``cost_models.memory``'s rule over each rank's chunks), and the
in-flight micro-batches of the built-in schedules' closed forms; the estimate's memory and the
search's memory-first check (:func:`fast_memory`) both call it. With sequence chunks
(``cfg.seq_chunks = k``) the in-flight figures count (stage, chunk) units, each ``1/k`` of a
micro-batch's activations, and every sequence in flight adds its KV store
(``cost_models/seq_chunks.py``)."""
from __future__ import annotations

from dataclasses import replace

from cost_models import pipeline as pipe_mod
from cost_models.cluster import Cluster
from cost_models.compute import calibration
from cost_models.layer_costs import LayerCosts
from cost_models.memory import LayerTable, MemoryRule, StageMemory, chunk_id, framework_reserve, rank_memory
from cost_models.seq_chunks import kv_store_bytes, per_unit
from cost_models.wan_cost import hsdp_replicas, stage_capacity
from planner import schedule_ir as ir
from planner.feasibility import microbatches
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition


def rank_memories(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition,
                  table: LayerTable, inflight_chunks: list[int], cal: dict[str, float],
                  on_rank: list[list[int]], seqs_held: list[int] | None = None) -> list[StageMemory]:
    """Memory of every pp rank (``memory.rank_memory``): its chunks (``on_rank[r]``) with the
    in-flight (chunk, micro-batch) pairs the pipeline holds there, spread evenly over the chunks.
    With sequence chunks: pairs of (stage, sequence chunk) units, ``1/k`` of a micro-batch's
    activations and back-propagation working set each (``seq_chunks.per_unit``), plus the KV store
    of the ``seqs_held[r]`` sequences in flight (default :func:`seqs_bound`). Each distinct rank is
    priced once per table (``LayerTable.rank_memo``, by its chunks' ``memory.chunk_id``; the
    figures are frozen)."""
    rule = MemoryRule(graph, cfg, table, hsdp_replicas(cluster, cfg))
    reserve = framework_reserve(cluster.backend != "gloo", cal)
    memory, memo, k = [], table.rank_memo, cfg.seq_chunks
    for r in range(cfg.pp):
        chunks = on_rank[r]
        ids = tuple(chunk_id(rule, range(*partition.bounds[j]), partition.recompute[j]) for j in chunks)
        kv = 0.0
        if k > 1:
            seqs = seqs_held[r] if seqs_held is not None else seqs_bound(inflight_chunks[r], k)
            kv = seqs * kv_store_bytes(graph, cfg, [i for j in chunks for i in range(*partition.bounds[j])])
        key = (ids, inflight_chunks[r], reserve, k, kv)
        if key not in memo:
            m = rank_memory([per_unit(table.chunks[i], k) for i in ids], [inflight_chunks[r] / len(chunks)] * len(chunks),
                            reserve)
            memo[key] = replace(m, activations=m.activations + kv, inflight=inflight_chunks[r])
        memory.append(memo[key])
    return memory


def seqs_bound(units: int, k: int) -> int:
    """Sequences that ``units`` consecutive (stage, chunk) units in flight can touch, at most."""
    return -(-units // k) + (1 if k > 1 else 0)


def inflight_closed(schedule: str, p: int, m: int, v: int, r: int, k: int = 1) -> int:
    """Peak in-flight (chunk, micro-batch) pairs on rank r, closed forms of the simulator's orders
    (with ``k`` sequence chunks: (stage, chunk) units, 1f1b holding ``k - 1`` more)."""
    if schedule == "gpipe":
        return m * k
    if schedule == "interleaved-1f1b" and v > 1:
        return min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v)
    return min(p - r + k - 1, m * k)


def fast_memory(graph: ModelGraph, cfg: ParallelConfig, partition: Partition, global_batch: int,
                costs: LayerCosts, profile=None) -> tuple[list[StageMemory], float] | None:
    """(per pp rank memory, bytes per device) as ``estimate(..., fast=True, costs=costs)`` prices them
    (the closed forms' in-flight micro-batches), without the times: the search checks a variant fits
    before pricing it. ``costs``: cfg's layer costs (same ``LayerCosts.key``). None where the fast
    estimate simulates the schedule instead (V-shaped and custom schedules)."""
    if cfg.schedule == "custom" or cfg.schedule in ir.V_SCHEDULES:
        return None
    m = microbatches(cfg, global_batch)
    inflight = ([inflight_closed(cfg.schedule, cfg.pp, m, cfg.vpp, r, cfg.seq_chunks) for r in range(cfg.pp)]
                if cfg.pp > 1 else [1])
    placement = pipe_mod.stage_placement(cfg, m)
    on_rank = [[j for j, at in enumerate(placement) if at == r] for r in range(cfg.pp)]
    memory = rank_memories(graph, costs.c, cfg, partition, costs.table(cfg), inflight, calibration(profile), on_rank)
    return memory, stage_capacity(costs.c, cfg)
