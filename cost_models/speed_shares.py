"""Data-parallel shares proportional to device speed on a pool of mixed devices (``planner/dp_shares.py``).

Where a layout allows it (``pp = 1``, and each dp replica's ``cp x tp`` ranks inside one cluster
group: :func:`replica_groups`), replica ``d`` runs on its group's device at speed ``v_d`` (its
peak at the plan's dtype, the ratio :func:`cost_models.wan.slowdowns` scales compute by). With
``s_d`` sequences of each micro-batch its compute takes about ``s_d / v_d`` (times one sequence
on the reference device), and the step waits for the slowest replica before the gradients
meet. :func:`speed_shares` chooses integer ``s_d >= 1`` adding up to ``dp * mbs`` (the rows of
equal micro-batches) that minimise ``max_d s_d / v_d``: water filling, each row beyond the first
per rank to the rank that would finish it soonest, which is optimal for that objective.

Pricing (``cost_models.estimate``): every distinct (group, share) is priced as the layout with
``mbs = share`` on the cluster as that group's ranks see it (:func:`group_view`: every group's
device replaced by theirs, so compute scales and memory is held to their device); the step is
the slowest one's, and each must fit its own device. The links, and so the data-parallel
collectives, are the cluster's.
"""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, replace

from cost_models.cluster import Cluster
from planner.dp_shares import layout_problem, shares_text
from planner.plan import ParallelConfig


@dataclass(frozen=True)
class ShareGroup:
    """The dp ranks of one cluster group that take one share: ``ranks`` of them, ``share`` sequences each."""
    group: int
    share: int
    ranks: int


def replica_groups(cluster: Cluster, cfg: ParallelConfig) -> tuple[int, ...] | None:
    """Per dp replica, the cluster group its ranks lie in; None where shares cannot differ in
    speed: one device type, a pipeline (every replica spans the stages' ranks), expert
    parallelism or low-communication groups (``planner.dp_shares.layout_problem``), or a
    replica across groups."""
    if not cluster.mixed or cfg.dp < 2 or layout_problem(cfg.pp, cfg.ep, cfg.low_comm):
        return None
    width = cfg.cp * cfg.tp
    if any(_group(cluster, cfg, d) != cluster.group_of_rank((d + 1) * width - 1) for d in range(cfg.dp)):
        return None
    out = tuple(_group(cluster, cfg, d) for d in range(cfg.dp))
    return out if len({cluster.group_device(g).name for g in out}) > 1 else None


def _group(cluster: Cluster, cfg: ParallelConfig, replica: int) -> int:
    """The cluster group of dp replica ``replica``'s first rank (pp = 1: replicas of ``cp x tp`` ranks in order)."""
    return cluster.group_of_rank(replica * cfg.cp * cfg.tp)


def speed_shares(cluster: Cluster, cfg: ParallelConfig) -> str:
    """``cfg``'s ``dp * mbs`` rows per micro-batch shared out by device speed (module docstring), written
    as ``ParallelConfig.dp_shares``; ``""`` where the layout does not allow it or the shares come out equal."""
    groups = replica_groups(cluster, cfg)
    if groups is None:
        return ""
    speed = [cluster.peak_flops(cluster.compute_dtype(cfg.dtype), cluster.group_device(g)) for g in groups]
    shares = [1] * cfg.dp
    finish = [(2 / v, r) for r, v in enumerate(speed)]  # (when rank r would finish one row more, r)
    heapq.heapify(finish)
    for _ in range(cfg.dp * cfg.mbs - cfg.dp):
        _, r = heapq.heappop(finish)
        shares[r] += 1
        heapq.heappush(finish, ((shares[r] + 1) / speed[r], r))
    return shares_text(shares)


def share_groups(cluster: Cluster, cfg: ParallelConfig) -> list[ShareGroup]:
    """``cfg.dp_shares`` by (cluster group, share), in rank order of their first rank."""
    count = Counter((_group(cluster, cfg, d), s) for d, s in enumerate(cfg.rank_mbs))
    return [ShareGroup(g, s, n) for (g, s), n in count.items()]


def group_view(cluster: Cluster, group: int) -> Cluster:
    """``cluster`` as the ranks of ``group`` see it: every group's device is theirs (the reference
    ``[device]``, on which layers are priced, and the links unchanged)."""
    topo = cluster.topology
    if topo is None:
        return cluster
    dev = cluster.group_device(group)
    return replace(cluster, topology=replace(topo, groups=[replace(r, device=dev) for r in topo.groups],
                                             pairs=topo.pairs))


def shares_words(cluster: Cluster, cfg: ParallelConfig) -> str:
    """The shares as the report says them: per group its device, dp ranks and sequences each per micro-batch."""
    return "; ".join(f"{cluster.topology.names()[sg.group] if cluster.topology else 'all'}: "
                     f"{cluster.group_device(sg.group).name}, {sg.ranks} dp rank{'s' * (sg.ranks > 1)} taking "
                     f"{sg.share} sequence{'s' * (sg.share > 1)} of each micro-batch" for sg in share_groups(cluster, cfg))
