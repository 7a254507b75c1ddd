"""Per pp rank memory of a pipeline (``cost_models.memory``'s rule over each rank's chunks), and the
in-flight micro-batches of the built-in schedules' closed forms; the estimate's memory and the
search's memory-first check (:func:`fullest_rank`; :func:`fast_memory` gives every rank's figures
the same way; :func:`memory_bound`, a lower bound of it without a split, goes first) call it. With
sequence chunks
(``cfg.seq_chunks = k``) the in-flight figures count (stage, chunk) units, each ``1/k`` of a
micro-batch's activations, and every sequence in flight adds its KV store
(``cost_models/seq_chunks.py``)."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Sequence

from cost_models import pipeline as pipe_mod
from cost_models.cluster import Cluster
from cost_models.profile_db import calibration
from cost_models.layer_costs import LayerCosts
from cost_models.memory import (LayerTable, MemoryRule, StageMemory, chunk_id, chunk_memory, framework_reserve,
                                rank_memory)
from cost_models.seq_chunks import kv_store_bytes, per_unit
from cost_models.wan_cost import hsdp_replicas, stage_capacity
from planner import schedule_ir as ir
from planner.feasibility import microbatches
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition
from planner.schedule_check import held_at_peak


def rank_memories(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition,
                  table: LayerTable, inflight_chunks: Sequence[int], cal: dict[str, float],
                  on_rank: Sequence[Sequence[int]], seqs_held: Sequence[int] | None = None,
                  schedule: "ir.Schedule | None" = None) -> list[StageMemory]:
    """Memory of every pp rank (``memory.rank_memory``): its chunks (``on_rank[r]``) with the
    in-flight (chunk, micro-batch) pairs the pipeline holds there, spread evenly over the chunks;
    with the plan's own ``schedule`` placing several chunks on a rank (one micro-batch per unit), the pairs each chunk holds when the
    rank's activation bytes peak under that order (``schedule_check.held_at_peak``: a rank whose
    chunks differ in size, such as vocabulary passes beside blocks, holds what the order holds).
    With sequence chunks: pairs of (stage, sequence chunk) units, ``1/k`` of a micro-batch's
    activations and back-propagation working set each (``seq_chunks.per_unit``), plus the KV store
    of the ``seqs_held[r]`` sequences in flight (default :func:`seqs_bound`). Each distinct rank is
    priced once per table (``LayerTable.rank_memo``, by its chunks' ``memory.chunk_id``; the
    figures are frozen)."""
    price = _RankPricer(graph, cluster, cfg, partition, table, cal, on_rank)
    if schedule is not None and cfg.seq_chunks == 1 and schedule.v > 1:
        return [price.under(schedule, r) for r in range(cfg.pp)]
    return [price(r, inflight_chunks[r], seqs_held[r] if seqs_held is not None else None) for r in range(cfg.pp)]


class _RankPricer:
    """One (configuration, split)'s rank memory (:func:`rank_memories`' rule), rank by rank."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition,
                 table: LayerTable, cal: dict[str, float], on_rank: Sequence[Sequence[int]]) -> None:
        rule = rule_of(graph, cfg, table, hsdp_replicas(cluster, cfg))
        self.g, self.cfg, self.part, self.table, self.on_rank = graph, cfg, partition, table, on_rank
        self.reserve = framework_reserve(cluster.backend != "gloo", cal)
        stage_ids = split_ids(rule, partition.bounds, partition.recompute)
        self.ids = [tuple(stage_ids[j] for j in chunks) for chunks in on_rank]  # per rank: its chunks' ids
        self._kv: dict[int, float] = {}

    def kv_bytes(self, r: int) -> float:
        """The KV store of one sequence over rank ``r``'s layers (0 without sequence chunks)."""
        if self.cfg.seq_chunks == 1:
            return 0.0
        if r not in self._kv:
            self._kv[r] = kv_store_bytes(self.g, self.cfg, [i for j in self.on_rank[r]
                                                            for i in range(*self.part.bounds[j])])
        return self._kv[r]

    def under(self, schedule: "ir.Schedule", r: int) -> StageMemory:
        """Rank ``r``'s memory holding what ``schedule`` holds at its activation peak, chunk by chunk."""
        chunks = [self.table.chunks[i] for i in self.ids[r]]
        acts = {j: x.act for j, x in zip(self.on_rank[r], chunks)}
        held = held_at_peak(schedule, r, [acts.get(j, 0.0) for j in range(len(self.part.bounds))])
        counts = tuple(held.get(j, 0) for j in self.on_rank[r])
        key, memo = (self.ids[r], counts, self.reserve), self.table.rank_memo
        if key not in memo:
            memo[key] = replace(rank_memory(chunks, list(counts), self.reserve), inflight=sum(counts))
        return memo[key]

    def __call__(self, r: int, inflight: int, seqs_held: int | None = None) -> StageMemory:
        """Rank ``r``'s memory with ``inflight`` (chunk, micro-batch) pairs (``seqs_held``: sequences)."""
        k, ids, n = self.cfg.seq_chunks, self.ids[r], len(self.on_rank[r])
        kv = (seqs_held if seqs_held is not None else seqs_bound(inflight, k)) * self.kv_bytes(r) if k > 1 else 0.0
        key, memo = (ids, inflight, self.reserve, k, kv), self.table.rank_memo
        if key not in memo:
            m = rank_memory([per_unit(self.table.chunks[i], k) for i in ids], [inflight / n] * n, self.reserve)
            memo[key] = replace(m, activations=m.activations + kv, inflight=inflight)
        return memo[key]


def rule_of(graph: ModelGraph, cfg: ParallelConfig, table: LayerTable, replicas: int = 1) -> MemoryRule:
    """``MemoryRule(graph, cfg, table, replicas)``, built once per what it reads of ``cfg`` (the DP
    sharding, dtype, degrees and low-communication groups) and kept in ``table``."""
    key = (cfg.zero, cfg.dtype, cfg.dp, cfg.cp, cfg.pp, cfg.tp, cfg.ep, cfg.low_comm, replicas)
    rule = table.rules.get(key)
    if rule is None:
        rule = table.rules[key] = MemoryRule(graph, cfg, table, replicas)
    return rule


def split_ids(rule: MemoryRule, bounds: Sequence[tuple[int, int]], policies: Sequence[str]) -> tuple[int, ...]:
    """``memory.chunk_id`` of every stage of a split (``bounds[j]``: stage j's half-open layer range
    under ``policies[j]``), kept per (rule id, split) in the table: the search checks many variants
    of one rule on the same split."""
    key = (rule.id, tuple(bounds), tuple(policies))
    ids = rule.t.split_ids.get(key)
    if ids is None:
        ids = rule.t.split_ids[key] = tuple(chunk_id(rule, range(*b), rc) for b, rc in zip(bounds, policies))
    return ids


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
    (the closed forms' in-flight micro-batches), without the times. ``costs``: cfg's layer costs
    (same ``LayerCosts.key``). None where the fast estimate simulates the schedule instead
    (V-shaped and custom schedules)."""
    if simulated_memory(cfg):
        return None
    inflight, on_rank = _closed_inflight(cfg, global_batch)
    memory = rank_memories(graph, costs.c, cfg, partition, costs.table(cfg), inflight, calibration(profile), on_rank)
    return memory, stage_capacity(costs.c, cfg)


def fullest_rank(graph: ModelGraph, cfg: ParallelConfig, partition: Partition, global_batch: int,
                 costs: LayerCosts, profile=None) -> tuple[int, float, float] | None:
    """(pp rank, its bytes, bytes per device) of :func:`fast_memory`'s fullest rank (the first of the
    largest totals; the search checks a variant fits before pricing its times), None where
    :func:`fast_memory` is. Ranks holding the same chunks (equal ``memory.chunk_id`` s and KV store)
    differ only in their in-flight pairs, and with at least one pair per chunk a rank's total never
    falls as they grow (``memory.overshoot`` is then its chunk's constant peak, the activations grow,
    the reserve with them), so one rank per such group is priced, the one with the most in flight
    (and, where it reaches the largest total, the earlier ranks of its group, for the first of ties)."""
    if simulated_memory(cfg):
        return None
    inflight, on_rank = _closed_inflight(cfg, global_batch)
    price = _RankPricer(graph, costs.c, cfg, partition, costs.table(cfg), calibration(profile), on_rank)
    groups: dict[tuple, list[int]] = {}
    for r in range(cfg.pp):
        groups.setdefault((price.ids[r], price.kv_bytes(r)) if inflight[r] >= len(on_rank[r]) else (r,), []).append(r)
    top = {max(rs, key=lambda r: (inflight[r], -r)): rs for rs in groups.values()}
    totals = {r: price(r, inflight[r]).total for r in top}
    most = max(totals.values())
    for r in [r for r in top if totals[r] == most]:  # the earlier ranks of a group reaching it may tie it
        totals.update((q, price(q, inflight[q]).total) for q in top[r] if q < r)
    r = min(q for q, t in totals.items() if t == most)
    return r, most, stage_capacity(costs.c, cfg)


BOUND_SLACK = 1e-9  # memory_bound's relative margin: its sums and the split's per-stage sums round differently


def memory_bound(graph: ModelGraph, cfg: ParallelConfig, global_batch: int, costs: LayerCosts,
                 profile=None) -> tuple[float, float] | None:
    """(a lower bound of :func:`fullest_rank`'s bytes on any split of cfg's ``pp * vpp`` stages under
    the uniform ``cfg.recompute``, bytes per device), None where :func:`fullest_rank` is; cheap: no
    split, one ``memory.chunk_memory`` of all layers (kept in the table) and the closed forms.

    Proof. ``memory.rank_memory`` gives rank r ``total_r = T_r + reserve.of(T_r)``, increasing in its
    tensor bytes ``T_r`` (``Reserve.frac >= 0``), with ``T_r`` = its chunks' states (``ChunkMemory.
    states``: weights, grads, optimizer, pinned) + activations + buffers. Its activations plus buffers
    are at least ``sum_c x_r act_c``: the chunk c with the largest overshoot adds ``overshoot_c -
    work_c`` to the activations and ``work_c`` to the buffers, ``overshoot_c >= 0``, and the largest
    transient and the KV store are >= 0; ``x_r = inflight_r / n_r`` the pairs per chunk
    (with k sequence chunks ``seq_chunks.per_unit`` divides act by k: ``x_r / k``). States and act
    are sums over layers (linear in ``LayerTable``'s per-layer figures), so the chunks of all ranks
    add up to ``chunk_memory`` of all layers, and ``max_r T_r >= (S + min_r(x_r) A / k) / pp`` with
    S, A that chunk's states and activations. Less :data:`BOUND_SLACK` for rounding."""
    if simulated_memory(cfg):
        return None
    rule = rule_of(graph, cfg, costs.table(cfg), hsdp_replicas(costs.c, cfg))
    whole = chunk_memory(rule, range(len(graph.layers)), cfg.recompute)
    inflight, on_rank = _closed_inflight(cfg, global_batch)
    x = min(i / len(c) for i, c in zip(inflight, on_rank) if c) / cfg.seq_chunks
    tensors = (whole.states + x * whole.act) / cfg.pp * (1.0 - BOUND_SLACK)
    reserve = framework_reserve(costs.c.backend != "gloo", calibration(profile))
    return tensors + reserve.of(tensors), stage_capacity(costs.c, cfg)


def simulated_memory(cfg: ParallelConfig) -> bool:
    """Whether the fast estimate takes cfg's in-flight micro-batches from a simulation (V-shaped and
    custom schedules), not the closed forms this module's fast checks read."""
    return cfg.schedule == "custom" or cfg.schedule in ir.V_SCHEDULES


def _closed_inflight(cfg: ParallelConfig, global_batch: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """The closed forms' in-flight (chunk, micro-batch) pairs per pp rank and each rank's virtual stages."""
    return _closed_forms(cfg.schedule, cfg.pp, cfg.vpp, cfg.seq_chunks, microbatches(cfg, global_batch))


@lru_cache(maxsize=1024)
def _closed_forms(schedule: str, pp: int, vpp: int, k: int, m: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """:func:`_closed_inflight` of these values, kept (the search asks for each many times): the
    built-in schedules' placement reads only the schedule, pp and vpp."""
    inflight = tuple(inflight_closed(schedule, pp, m, vpp, r, k) for r in range(pp)) if pp > 1 else (1,)
    on_rank: list[list[int]] = [[] for _ in range(pp)]
    for j, at in enumerate(pipe_mod.stage_placement(ParallelConfig(pp=pp, vpp=vpp, schedule=schedule), m)):
        on_rank[at].append(j)
    return inflight, tuple(map(tuple, on_rank))
