"""Per-batch assignment priced: the rates :mod:`planner.batch_assign` balances, from this cost
model, and the expected step time over sampled batches against fixed context-parallel layouts.

**Rates** (:func:`work_cost`). A worker is one rank of the ``dp x cp`` pool holding whole
pieces, so its layers are priced at ``cp = 1``, one row of the graph's ``seq_len`` tokens
(``S``) per micro-batch, under the plan's tp, recompute, dtype and kernels
(``cost_models.layer_costs``: forward, backward and recompute of every layer of the stage,
the busiest pipeline stage being ``1 / pp`` of them). Priced twice, with the attention cores
at their full causal work (one document filling the row) and at none of it (a document mix
whose ``attention_share`` is 0): ``linear = T0 / S``, ``attention = (T1 - T0) / S^2``. The
attention kernel's efficiency is taken at ``S`` for every length (short documents run the
kernel less efficiently: the attention term is optimistic for them, for both sides of the
comparison). ``exchange``: the seconds per token of a ring step's K/V block (all attention
layers; forward once, backward K/V and their gradients: 3x), from the communication model's
``send_recv`` over a ring of the whole ``dp x cp`` pool laid on the mesh as CP is (the
slowest links a group may cross); ``latency``: the same for an empty block. Under
Ulysses, ``alltoall``: the four all-to-alls per layer, forward and backward. On a CPU,
``merge`` and ``ring``: the plain ring path's own work (the groups' ``RingAttention``:
``cost_models.ring_merges.plain_ring_elements``) at the fallback's seconds per element
(:func:`fallback_element_s`); 0 on GPUs.

**Memory** (:func:`capacity_tokens`): the tokens a worker may hold, from a fixed layout's
estimate: what its activations leave free of the device, at its activation bytes per token.

**Comparison** (:func:`compare`): for each sampled batch, the busiest worker's seconds after
:func:`planner.batch_assign.assign` and on each fixed layout (``static_work``), plus the
per-step work both share (data-parallel reduction, optimizer: ``fixed_s``). Each fixed layout
is judged by its mean over the batches; the best one is the baseline. Under a pipeline each
micro-batch is assigned on its own and every worker's row is padded to the pool's capacity:
the pad tokens cost linear work (``planner.batch_assign.padded_work``), and a step is the
pipeline's over its micro-batches (``planner.batch_layout.pipeline_step``), on both sides.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from cost_models import comm as comm_mod
from cost_models.cluster import Cluster
from cost_models.context_parallel import cp_meshes, ring_step_bytes, ulysses_bytes
from cost_models.documents import pack_mix
from cost_models.fallback_attention import rank_elements
from cost_models.layer_costs import LayerCosts, layer_pass_times
from cost_models.ring_merges import plain_ring_elements
from planner.batch_assign import Pool, WorkCost, assign, microbatch_ranges, padded_work
from planner.batch_layout import pipeline_step, static_work
from planner.graph import DocumentMix, ModelGraph
from planner.plan import ParallelConfig


def _no_attention(seq_len: int) -> DocumentMix:
    """A document mix whose attention cores do no work (the linear part's probe)."""
    return DocumentMix(seq_len=seq_len, documents=seq_len, tokens=seq_len, median=1, p90=1, longest=1, cut=0,
                       rows=1, sampled=False, attention_share=0.0, mean_tokens=float(seq_len))


def stage_seconds(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, profile) -> float:
    """Forward + backward + recompute seconds of all layers, one micro-batch, over pp."""
    costs = LayerCosts(graph, cluster, cfg, profile)
    total = 0.0
    for layer in graph.layers:
        t = layer_pass_times(costs.get(layer), cfg.recompute)
        total += t.fwd + t.bwd
    return total / cfg.pp


def fallback_element_s(graph: ModelGraph, cluster: Cluster, worker: ParallelConfig) -> float:
    """Seconds of one fallback score element per head (``cost_models.fallback_attention``'s unit),
    all layers of the stage, forward + backward, on a CPU cluster (0 elsewhere): the roofline's
    fallback core for one document filling a row of ``worker`` (cp 1, one row; the profile
    times the fused kernel there, not the fallback) over that row's modelled elements."""
    if cluster.backend != "gloo":
        return 0.0
    s = graph.seq_len
    one = pack_mix([s], s)
    t1 = stage_seconds(replace(graph, documents=one), cluster, worker, None)
    t0 = stage_seconds(replace(graph, documents=_no_attention(s)), cluster, worker, None)
    return max(t1 - t0, 0.0) / float(rank_elements(one, 1, 1)[1][0])


def work_cost(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, profile=None,
              method: Optional[str] = None) -> WorkCost:
    """The :class:`WorkCost` of one worker of ``cfg``'s ``dp x cp`` pool (module docstring);
    ``method``: ``ring`` or ``ulysses`` (default: Ulysses when the plan's CP is all Ulysses)."""
    method = method or ("ulysses" if cfg.cp > 1 and cfg.ulysses == cfg.cp else "ring")
    worker = replace(cfg, dp=cfg.dp * cfg.cp, cp=1, ulysses=1, mbs=1)
    s = graph.seq_len
    t1 = stage_seconds(replace(graph, documents=None), cluster, worker, profile)
    t0 = stage_seconds(replace(graph, documents=_no_attention(s)), cluster, worker, profile)
    linear, attention = t0 / s, max(t1 - t0, 0.0) / (s * s)
    budget = cfg.dp * cfg.cp  # the pool: groups up to all of it
    if budget < 2:
        return WorkCost(linear=linear, attention=attention, method=method)
    ring_cfg = replace(cfg, dp=1, cp=budget, ulysses=1, mbs=1)
    uly_cfg = replace(cfg, dp=1, cp=budget, ulysses=budget, mbs=1)
    ring_mesh, uly_mesh = cp_meshes(ring_cfg)[0], cp_meshes(uly_cfg)[1]
    exchange = latency = alltoall = 0.0
    layers = [l for l in graph.layers if l.attention is not None and l.attention.causal]
    for l in layers:
        nbytes = ring_step_bytes(l.attention, ring_cfg)
        step = comm_mod.collective_time("send_recv", nbytes, cluster, ring_mesh, "cp", profile).seconds
        empty = comm_mod.collective_time("send_recv", 1.0, cluster, ring_mesh, "cp", profile).seconds
        exchange += 3 * (step - empty) / (s / budget)
        latency += 3 * empty
        a2a = comm_mod.collective_time("all_to_all", ulysses_bytes(l.attention, uly_cfg), cluster, uly_mesh, "cp",
                                       profile).seconds
        alltoall += 2 * a2a / (s / budget) * budget / max(budget - 1, 1)  # per token held, before the (g-1)/g
    per_row, fixed = plain_ring_elements(budget)
    element = fallback_element_s(graph, cluster, worker) if layers else 0.0
    return WorkCost(linear=linear, attention=attention, exchange=max(exchange, 0.0) / cfg.pp,
                    alltoall=alltoall / cfg.pp, latency=latency / cfg.pp, method=method,
                    merge=per_row * element, ring=fixed * element)


def capacity_tokens(tokens_per_rank: float, activations: float, other: float, device_bytes: float) -> int:
    """Tokens a worker may hold: a fixed layout holding ``tokens_per_rank`` per rank needs
    ``activations`` bytes for them beside ``other`` bytes (weights, gradients, optimizer,
    buffers, reserve); the device's ``device_bytes`` leave room for this many."""
    if activations <= 0:
        return int(tokens_per_rank)
    return max(int(tokens_per_rank), int(tokens_per_rank * (device_bytes - other) / activations))


@dataclass(frozen=True)
class Layout:
    """A fixed layout of the same pool: ``dp`` rows of ``row_len`` tokens, each over ``cp`` ranks
    by ``method`` (None: the rates' own; ``ring`` or ``ulysses``)."""
    dp: int
    cp: int
    row_len: int
    method: Optional[str] = None

    @property
    def label(self) -> str:
        return f"dp{self.dp} cp{self.cp}" + (f" {self.method}" if self.method else "")


@dataclass(frozen=True)
class Comparison:
    """Seconds per step over the sampled batches: per-batch assignment, each fixed layout and
    the ideal balance (``Assignment.ideal``), each with the shared ``fixed_s``; the spread
    (busiest over mean worker) of the best fixed layout and of the assignment, per batch."""
    per_batch: tuple[float, ...]
    static: dict[str, tuple[float, ...]]
    ideal: tuple[float, ...]
    spread_before: tuple[float, ...]
    spread_after: tuple[float, ...]
    fixed_s: float

    @staticmethod
    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs)

    @property
    def best_static(self) -> str:
        return min(self.static, key=lambda k: (self.mean(self.static[k]), k))

    @property
    def speedup(self) -> float:
        """Mean step of the best fixed layout over the mean step with per-batch assignment."""
        return self.mean(self.static[self.best_static]) / self.mean(self.per_batch)

    @property
    def ideal_gap(self) -> float:
        """Mean step with per-batch assignment over the ideal balance's (1.0: no gap)."""
        return self.mean(self.per_batch) / self.mean(self.ideal)

    @property
    def bound(self) -> float:
        """The most any assignment could gain: the best fixed layout's mean step over the ideal
        balance's (every worker the same work, no communication)."""
        return self.mean(self.static[self.best_static]) / self.mean(self.ideal)

    def summary(self) -> dict:
        m = self.mean
        return {"per_batch_s": m(self.per_batch), "static_s": {k: m(v) for k, v in self.static.items()},
                "best_static": self.best_static, "ideal_s": m(self.ideal), "speedup": self.speedup,
                "ideal_gap": self.ideal_gap, "bound": self.bound, "spread_before": m(self.spread_before),
                "spread_after": m(self.spread_after), "fixed_s": self.fixed_s, "batches": len(self.per_batch)}


def _spread(work: Sequence[float]) -> float:
    mean = sum(work) / len(work)
    return max(work) / mean if mean > 0 else 1.0


def compare(batches: Sequence[Sequence[int]], pool: Pool, cost: WorkCost, layouts: Sequence[Layout],
            fixed_s: float = 0.0, pp: int = 1, microbatches: int = 1) -> Comparison:
    """Price every batch (pieces in order, ``workers x`` some tokens each) with per-batch
    assignment and on each fixed layout (module docstring). Under a pipeline (``pp > 1``) each of
    its ``microbatches`` (``microbatch_ranges``) is assigned on its own, its workers' pad tokens
    priced (``padded_work``: rows padded to the pool's capacity), and a step is the pipeline's
    (``pipeline_step``) over the micro-batches' busiest workers, as for the fixed layouts."""
    if not layouts:
        raise ValueError("compare needs at least one fixed layout")
    per, ideal, after = [], [], []
    static: dict[str, list[float]] = {l.label: [] for l in layouts}
    works: dict[str, list[tuple[float, ...]]] = {l.label: [] for l in layouts}
    for lengths in batches:
        mbs = [list(lengths[r.start:r.stop]) for r in microbatch_ranges(lengths, microbatches)]
        got = [assign(mb, pool, cost) for mb in mbs]
        per.append(pipeline_step([max(padded_work(a, pool, cost, pp)) for a in got], pp) + fixed_s)
        ideal.append(pipeline_step([a.ideal for a in got], pp) + fixed_s)
        after.append(sum(_spread(padded_work(a, pool, cost, pp)) for a in got) / len(got))
        for l in layouts:
            c = replace(cost, method=l.method) if l.method else cost
            w = [static_work(mb, l.row_len, l.dp, l.cp, c) for mb in mbs]
            works[l.label].append(tuple(x for ws in w for x in ws))
            static[l.label].append(pipeline_step([max(ws) for ws in w], pp) + fixed_s)
    result = Comparison(tuple(per), {k: tuple(v) for k, v in static.items()}, tuple(ideal), (), tuple(after),
                        fixed_s)
    before = tuple(_spread(w) for w in works[result.best_static])
    return replace(result, spread_before=before)
