"""Ranks that share CPU cores: compute runs faster while fewer ranks compute at once.

On a local CPU cluster with more ranks than cores, the layer times the cost model starts
from assume that every rank of the node computes at once: a profile measures them with
all ranks running together, and ``Cluster.detect``'s per-process peak is the machine's
times ``min(1, cores / n)``. That is right for data, tensor and context parallel plans,
whose ranks compute in lockstep. A pipeline's ranks do not: in its bubbles and while a
stage waits for its neighbour, the ranks that do compute share the cores among fewer.
With ``c`` ranks computing at once on ``cores`` cores each runs at ``min(1, cores / c)``
of a core, so against the all-busy figure compute is faster by::

    speedup = min(1, cores / c) / min(1, cores / n)

``c`` is the compute-weighted mean number of ranks busy at once, ``sum c(t)^2 dt / sum
c(t) dt`` over the simulated pipeline's events (the concurrency a rank sees while it
computes), times the ranks of the other mesh dimensions, which compute in lockstep with
their pipeline stage. With a core per rank (``cores >= n``) the speedup is 1: the term
vanishes. The estimate re-simulates the pipeline once with the sped-up stage times
(cost_models/estimate.py).

Every blocking collective is a synchronisation point: on shared cores the last peer to
arrive may be waiting for a time slice, so each call also pays :func:`sync_wait_s`
(cost_models/comm.py adds it), except a call right after another of its group (``chained``)
and tensor parallelism's where DTensor's figure was measured on the cluster's own ranks and
holds the wait (``wait_priced``, ``cost_models.dtensor_dispatch.prices_tp_shared_wait``).

Threads per rank (``ParallelConfig.threads``, ``planner.feasibility.rank_threads``): a layout may run
fewer processes than the local cluster's ``devices_per_node``, each with more intra-op
threads (ranks x threads = cores). :func:`ranks_cluster` is the cluster such a layout really
runs on: ``world`` devices, each computing at :func:`rank_speed` times the detected
per-process figure (its threads' GEMM speedup, :func:`thread_scaling`, from the measured
``Cluster.thread_speedup``, over the share of a core each detected process had), with the
node's memory split ``world`` ways, and each op a rank with several threads dispatches pays
their wake-up and join (:func:`thread_op_s`, the measured ``Cluster.thread_sync_us``: about
nothing on free cores, a scheduler slice per op while another process holds one). The
estimate prices every layout on it
(cost_models/estimate.py, cost_models/layer_costs.py); a layout with the detected process
count and one thread each is priced on the cluster itself.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, Protocol

from cost_models.cluster import Cluster
from planner.feasibility import rank_threads
from planner.plan import ParallelConfig

# Linux: a runnable task runs a slice of at least 0.75 ms x (1 + log2(cpus)) before another
# may take its core (EEVDF's base_slice_ns since 6.6, CFS's sched_min_granularity_ns
# before; kernel docs sched-eevdf / sched-design-CFS, default "log" scaling).
BASE_SLICE_S = 0.75e-3


class _Span(Protocol):
    start: float
    end: float


def shares_cores(cores: int, ranks: int) -> bool:
    """More ranks than cores on a node (``cores`` 0: unknown, each device computes alone)."""
    return 0 < cores < ranks


def spare_core(cores: int, ranks: int) -> bool:
    """A core left beside the ranks' compute, e.g. for a communication thread (always, when
    ``cores`` is unknown)."""
    return cores <= 0 or ranks < cores


def compute_concurrency(events: Iterable[_Span]) -> float:
    """Compute-weighted mean number of events running at once: sum c^2 dt / sum c dt (>= 1)."""
    edges = []
    for e in events:
        if e.end > e.start:
            edges.append((e.start, 1))
            edges.append((e.end, -1))
    if not edges:
        return 1.0
    edges.sort()
    num = den = 0.0
    c, t_prev = 0, edges[0][0]
    for t, d in edges:
        dt = t - t_prev
        num += c * c * dt
        den += c * dt
        c += d
        t_prev = t
    return num / den if den > 0 else 1.0


def core_speedup(cores: int, ranks: int, concurrency: float) -> float:
    """How much faster compute runs with ``concurrency`` ranks busy than with all ``ranks``
    busy on ``cores`` cores (1.0 when cores is 0, unknown, or cores >= ranks)."""
    if not shares_cores(cores, ranks):
        return 1.0
    c = max(1.0, min(float(ranks), concurrency))
    return min(1.0, cores / c) / (cores / ranks)


def sync_wait_s(cores: int, ranks: int) -> float:
    """Expected extra wait of one blocking collective (or p2p) when ``ranks`` processes share
    ``cores`` cores: a peer that is descheduled when the others arrive runs only after the
    running task's slice, ``BASE_SLICE_S x (1 + log2(cores))``. 0 with a core per rank."""
    if not shares_cores(cores, ranks):
        return 0.0
    return BASE_SLICE_S * (1 + math.floor(math.log2(cores)))


def profiled_comm_factor(cluster: Cluster, profiled_ranks: int) -> float:
    """What a collective a profile timed with ``profiled_ranks`` processes on the node takes when
    ``cluster.devices_per_node`` processes run instead, over the profiled time. gloo's collectives
    are CPU work of the calling process (copies and reductions over loopback), and the profiler
    times every group of a size at once (``cost_models.profile_comm.measure_collectives``), so a
    call runs at its process's share of a core: ``min(1, cores / profiled) / min(1, cores /
    running)``. Fewer processes than profiled (e.g. dp2 on a ``local-cpu:4`` profile of a
    2-core machine) halve the time; 1.0 off local CPU clusters or with a core per process."""
    if not local_cpu(cluster) or profiled_ranks <= 0:
        return 1.0
    return min(1.0, cluster.cores_per_node / profiled_ranks) / cluster.core_share


def local_cpu(cluster: Cluster) -> bool:
    """A one-node CPU cluster whose cores are known (``local-cpu``): threads per rank apply."""
    return cluster.backend == "gloo" and cluster.nodes == 1 and cluster.cores_per_node > 0


def thread_scaling(cluster: Cluster, threads: int) -> float:
    """How much faster one process computes on ``threads`` intra-op threads than on one: the
    measured ``cluster.thread_speedup`` on all ``cores_per_node`` threads, as the power law
    ``threads ** (log speedup / log cores)`` between (exact at 1 and at every core; linear
    when not measured); threads past the cores add nothing."""
    cores = cluster.cores_per_node
    t = min(max(threads, 1), max(cores, 1))
    if t == 1 or cores <= 1:
        return 1.0
    full = cluster.thread_speedup or float(cores)
    return t ** (math.log(max(full, 1.0)) / math.log(cores))


def thread_op_s(cluster: Cluster, cfg: ParallelConfig) -> float:
    """Seconds each op a rank of ``cfg`` dispatches adds for its intra-op threads' wake-up and
    join: the measured ``cluster.thread_sync_us`` when the rank runs more than one thread
    (every op counted: at these sizes torch parallelises nearly all), else 0."""
    if not local_cpu(cluster) or rank_threads(cfg.threads, cluster.cores_per_node, cfg.world) < 2:
        return 0.0
    return cluster.thread_sync_us * 1e-6


def rank_speed(cluster: Cluster, ranks: int, threads: int) -> float:
    """Compute speed of one of ``ranks`` processes running ``threads`` threads each, over the
    cluster's per-device figure (``devices_per_node`` single-thread processes sharing the
    cores, ``Cluster.detect``): ``thread_scaling x min(1, cores / (ranks x threads))`` over
    ``Cluster.core_share``."""
    cores = cluster.cores_per_node
    return thread_scaling(cluster, threads) * min(1.0, cores / (ranks * max(threads, 1))) / cluster.core_share


def ranks_cluster(cluster: Cluster, cfg: ParallelConfig) -> Cluster:
    """The cluster ``cfg`` runs on (module docstring): ``cluster`` itself unless it is a local
    CPU cluster and ``cfg`` runs another process count or thread count than its detected one."""
    if not local_cpu(cluster):
        return cluster
    n, cores = cluster.devices_per_node, cluster.cores_per_node
    threads = rank_threads(cfg.threads, cores, cfg.world)
    if cfg.world == n and threads == rank_threads(0, cores, n):
        return cluster
    k = rank_speed(cluster, cfg.world, threads)
    d = cluster.device
    device = replace(d, memory_gib=d.memory_gib * n / cfg.world, mem_bw_gbs=d.mem_bw_gbs * k,
                     peak_tflops={key: v * k for key, v in d.peak_tflops.items()})
    return replace(cluster, devices_per_node=cfg.world, device=device)
