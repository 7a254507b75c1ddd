"""Whether a plan of packed documents runs per-batch assignment (``autopar plan --per-batch``).

The search picks the best fixed layout (its estimate is the full cost model's). For that
layout this module prices the same ``dp x cp`` ranks as a pool whose every batch is assigned
by ``planner.batch_assign.assign`` (groups up to the whole pool), on batches sampled from the
plan's document distribution: consecutive windows of ``global_batch`` rows of the packed rows
``cost_models.documents`` simulated (``DocumentMix.pieces``, documents cut at row ends, as a
packed batch carries them). Both sides are priced with the same rates
(``cost_models.batch_pricing``): per batch, the busiest worker's seconds after assignment and
on the plan's fixed layout (``static_work``), with the data-parallel reduction and optimizer
the estimate has. The expected step with assignment is the mean over the batches of the busiest
worker's seconds plus those shared ones, priced directly: it is the same program whichever
fixed layout the pool came from (a first version scaled the fixed layout's estimate by the
ratio of the two means, so the three local-cpu:4 layouts predicted three different steps for
one program; a difference of the two models went negative). Its whole pieces run the fused
kernel without masks (the rates' attention comes from a layer without documents), where the
fixed layout's estimate prices its masked kernel (on CPUs the torch fallback,
``cost_models.compute.CPU_TORCH_ATTENTION_SLOWDOWN``) at its busiest rank
(``cost_models.documents.busiest_share``). It is chosen when the runtime can run it
(``planner.batch_assign.per_batch_problem``) and it saves at least ``MIN_GAIN``; the plan
records the figures and why (``batch.per_batch``), and the emitted program runs it.

Under a pipeline (gpipe or 1f1b) each micro-batch is assigned on its own and every worker's
row is padded to one length, the record's ``capacity``: padding costs linear work, so the
shortest row that still balances wins; the lengths ``ROW_SLACK`` over the mean tokens a worker
holds per micro-batch (up to what memory allows, ``memory_capacity``) are priced and the one
with the least expected step kept.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

from cost_models.batch_pricing import Layout, capacity_tokens, compare, work_cost
from cost_models.cluster import Cluster
from cost_models.estimate import Estimate
from planner.batch_assign import AssignError, Pool, per_batch_problem
from planner.graph import ModelGraph

MIN_GAIN = 0.02         # chosen when the expected step is at least 2% shorter than the fixed layout's
MAX_BATCHES = 200       # batches sampled from the simulated rows
ALIGNED_ABOVE = 16      # pools larger than this form only aligned windows (P / g groups per size)
ROW_SLACK = (1.0625, 1.125, 1.25, 1.5)  # under a pipeline: padded rows weighed, over the mean tokens per worker


def sampled_batches(graph: ModelGraph, global_batch: int, n: int = MAX_BATCHES) -> list[list[int]]:
    """Up to ``n`` batches of ``global_batch`` consecutive simulated rows (pieces in order; the
    rows wrap around when the simulation holds fewer)."""
    mix = graph.documents
    rows: list[list[int]] = [[]]
    fill = 0
    for p in mix.pieces:
        rows[-1].append(p)
        fill += p
        if fill == mix.seq_len:
            rows.append([])
            fill = 0
    rows = [r for r in rows if r]
    count = max(1, min(n, len(rows) // global_batch))
    return [[p for k in range(global_batch) for p in rows[(b * global_batch + k) % len(rows)]] for b in range(count)]


def _heads(graph: ModelGraph) -> tuple[int, int]:
    """(heads, kv heads) every causal attention layer divides by (0 without one)."""
    from math import gcd
    dims = [l.attention for l in graph.layers if l.attention is not None and l.attention.causal]
    return gcd(*(a.heads for a in dims)), gcd(*(a.kv_heads for a in dims))


def _row_candidates(held: float, capacity: int) -> list[int]:
    """Under a pipeline, the padded row lengths weighed (``ROW_SLACK`` over the mean tokens a
    worker holds per micro-batch, ``held``), none above the memory's ``capacity``."""
    return sorted({min(capacity, math.ceil(held * f)) for f in ROW_SLACK})


def per_batch_record(graph: ModelGraph, cluster: Cluster, est: Estimate, global_batch: int, profile=None,
                     method: Optional[str] = None) -> dict[str, Any]:
    """What ``batch.per_batch`` records (module docstring): ``chosen``, ``why``, the pool, the
    rates, the memory per worker in tokens (under a pipeline: the padded row length, the one of
    ``_row_candidates`` with the least expected step) and the priced figures on the sampled batches."""
    cfg = est.config
    workers = cfg.dp * cfg.cp
    cost = work_cost(graph, cluster, cfg, profile, method)
    worst = max(est.memory, key=lambda m: m.total)
    held = cfg.mbs * graph.seq_len / cfg.cp
    capacity = capacity_tokens(held, worst.activations, worst.total - worst.activations, est.capacity)
    pool = Pool(workers, workers, capacity, aligned=workers > ALIGNED_ABOVE)
    out: dict[str, Any] = {"method": cost.method, "workers": workers, "max_group": workers, "capacity": capacity,
                           "aligned": pool.aligned, "cost": dict(cost.__dict__), "chosen": False}
    if why := per_batch_problem(cfg, global_batch, pool, cost.method, *_heads(graph)):
        return dict(out, why=why)
    fixed = est.breakdown.get("dp_comm", 0.0) + est.breakdown.get("optimizer", 0.0)
    microbatches = est.microbatches
    batches = sampled_batches(graph, global_batch)
    best, error = None, None
    for row in (_row_candidates(held, capacity) if cfg.pp > 1 else [capacity]):
        try:
            c = compare(batches, replace(pool, capacity=row), cost, [Layout(cfg.dp, cfg.cp, graph.seq_len)], fixed,
                        cfg.pp, microbatches)
        except AssignError as e:
            error = error or e
            continue
        if best is None or c.mean(c.per_batch) < best[1].mean(best[1].per_batch):
            best = (row, c)
    if best is None:
        return dict(out, why=str(error))
    row, c = best
    expected = c.mean(c.per_batch)  # the busiest worker's seconds per batch, plus the shared fixed_s
    ratio = expected / est.step_s
    out.update(c.summary(), capacity=row, expected_step_s=expected, fixed_step_s=est.step_s, ratio=ratio)
    if cfg.pp > 1:
        out.update(memory_capacity=capacity, microbatches=microbatches)
    if ratio > 1 - MIN_GAIN:
        return dict(out, why=f"per-batch assignment would take {expected:.4g} s per step against the fixed "
                             f"layout's {est.step_s:.4g} s: not {MIN_GAIN:.0%} faster")
    return dict(out, chosen=True, why=f"per-batch assignment: {expected:.4g} s per step expected against the fixed "
                                      f"layout's {est.step_s:.4g} s ({1 / ratio:.2f}x; busiest over mean worker "
                                      f"{c.mean(c.spread_before):.2f} -> {c.mean(c.spread_after):.2f})")
