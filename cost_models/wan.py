"""Where a mesh dimension's groups cross the links between cluster groups (the WAN), and what it costs.

A cluster with structure (:mod:`cost_models.topology`) has groups of nodes (regions) joined by
links of aggregate bandwidth ``W`` (bytes/s, one direction) and one-way latency ``L``. Ranks fill
nodes and nodes fill groups in order, and the mesh is ``[pp, dp, cp, tp]`` outer to inner, so TP
and CP stay inside a node, DP inside a group whenever ``pp`` is a multiple of the groups
(``pp`` = groups: one stage per region), and pipeline boundaries fall on the group cuts.

A dimension's group *spans* ``k > 1`` cluster groups when its members lie in more than one; its
``g = size / k`` members per group then run it hierarchically (:func:`cost_models.comm.collective_time`):
the intra-group phase as any group on those nodes, and ``g`` concurrent rings of ``k`` members
across the WAN, with the collective's ``B / g`` bytes. Every group of the dimension runs at
once, so ``flows = (world / size) x g`` transfers share the link: each gets
``min(device NIC, W / flows)`` (:func:`flow_link`). The ring passes every spanned pair: the
slowest pair's bandwidth and latency count.

A pipeline boundary crosses the WAN when one of its rank pairs does; its ``stride = dp cp tp``
pairs send at once, so one hop of ``B`` bytes takes ``B / min(NIC, W / stride) + L`` (the
``L`` is where the simulator charges the latency; the ``B / ...`` part also bounds the step from
below: :func:`link_floor_s`, the link carries every micro-batch's activation one after another).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cost_models.cluster import Cluster, Link


@dataclass(frozen=True)
class WanSpan:
    """How the groups of one mesh dimension cross cluster groups: ``groups`` spanned by the worst
    group of the dimension, ``per_group`` members in each, ``flows`` transfers across the
    link at once, and ``link``: the per-flow bandwidth and the latency of the slowest pair."""

    groups: int
    per_group: int
    flows: int
    link: Link
    spanned: tuple[int, ...] = ()  # the cluster groups the worst group of the dimension spans


def group_bounds(cluster: Cluster) -> tuple[int, ...]:
    """First rank of each cluster group after the first (empty: one group)."""
    if cluster.topology is None:
        return ()
    dpn = cluster.devices_per_node
    return tuple(cluster.topology.first_node(g) * dpn for g in range(1, cluster.n_groups))


def dim_span(cluster: Cluster, size: int, stride: int, world: int) -> WanSpan | None:
    """The span of a dimension of ``size`` members ``stride`` ranks apart in a mesh of ``world``
    ranks (None: every group of it stays inside one cluster group)."""
    bounds = group_bounds(cluster)
    if not bounds or size <= 1:
        return None
    k, members = _span(size, stride, world, bounds)
    if k <= 1:
        return None
    per_group = max(1, size // k)
    flows = (world // size) * per_group
    return WanSpan(groups=k, per_group=per_group, flows=flows, link=flow_link(cluster, members, flows),
                   spanned=members)


def span_groups(cluster: Cluster, size: int, stride: int, world: int) -> int:
    """:func:`dim_span`'s ``groups`` (1 where it is None) without pricing the link."""
    bounds = group_bounds(cluster)
    return _span(size, stride, world, bounds)[0] if bounds and size > 1 else 1


@lru_cache(maxsize=4096)
def _span(size: int, stride: int, world: int, bounds: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(most cluster groups one dimension group spans, the groups it spans) over all the dimension's groups."""
    def region(rank: int) -> int:
        return sum(rank >= b for b in bounds)

    block = size * stride
    worst: tuple[int, ...] = (0,)
    for base in range(0, world, block):
        for off in range(stride):
            spanned = tuple(sorted({region(base + off + k * stride) for k in range(size)}))
            if len(spanned) > len(worst):
                worst = spanned
    return len(worst), worst


def flow_link(cluster: Cluster, groups: tuple[int, ...], flows: int) -> Link:
    """One flow's link across the spanned ``groups``: the slowest pair's aggregate bandwidth over
    ``flows`` (capped by a device's NIC, ``cluster.inter``) and the largest one-way latency."""
    topo = cluster.topology
    assert topo is not None
    pairs = [topo.link(a, b) for a in groups for b in groups if a != b]
    bw = min(min(p.bandwidth_gbs for p in pairs) / max(1, flows), cluster.inter.bandwidth_gbs)
    return Link(bandwidth_gbs=bw, latency_us=max(p.latency_us for p in pairs))


def flat_ring_link(cluster: Cluster, span: WanSpan) -> tuple[int, Link]:
    """(flows, one flow's link) when the dimension's groups each run as one flat ring instead of
    ``span.per_group`` concurrent ones: one flow per group of the dimension shares the link."""
    flows = max(1, span.flows // span.per_group)
    return flows, flow_link(cluster, span.spanned, flows)


def boundary_links(cluster: Cluster, pp: int, stride: int) -> list[Link | None]:
    """Per pipeline boundary (stage i -> i+1): the per-flow WAN link when it crosses cluster groups
    (``stride`` rank pairs sending at once), else None."""
    if cluster.topology is None:
        return [None] * (pp - 1)
    bounds = group_bounds(cluster)
    out: list[Link | None] = []
    for i in range(pp - 1):
        lo, hi = i * stride, (i + 2) * stride - 1  # the boundary's ranks: [lo, hi]
        crossed = tuple(g for g, b in enumerate(bounds, start=1) if lo < b <= hi)
        if not crossed:
            out.append(None)
            continue
        spanned = tuple(range(crossed[0] - 1, crossed[-1] + 1))
        out.append(flow_link(cluster, spanned, stride))
    return out


def link_floor_s(m: int, hop_bw_s: list[float], stage_s: float) -> float:
    """Lower bound of a pipeline step whose busiest WAN boundary carries ``m`` activations one after
    another (``hop_bw_s``: each boundary's bandwidth part of one hop, s; forward and backward go
    opposite ways, so each direction carries ``m``), plus one micro-batch through every stage
    (``stage_s``: the sum of the stages' forward and backward, s)."""
    busiest = max(hop_bw_s, default=0.0)
    return m * busiest + stage_s if busiest > 0 else 0.0


def stall_s(m: int, p: int, cut: int, t: float, hop: float, inflight: int) -> float:
    """What a WAN boundary adds to a pipeline's closed form (seconds), for the search's fast pass.

    Boundary ``cut`` (stage ``cut`` -> ``cut + 1``) delays each crossing by ``hop`` (bandwidth +
    latency) both ways. The rank upstream of it holds ``inflight`` micro-batches; a micro-batch's
    round trip from that rank through the ``p - cut`` stages downstream and back takes
    ``(p - cut) t + 2 hop`` (``t``: a stage's forward + backward), so the steady state runs one
    micro-batch per ``max(t, ((p - cut) t + 2 hop) / inflight)``: more micro-batches in flight
    (GPipe, interleaving, deeper warm-up) hide the hop. Plus the first micro-batch's round trip,
    ``2 hop``, which nothing hides. The simulator charges the same hops edge by edge (the plan's
    figure); this form is within 15% of it on tests/test_wan.py's cases (it misses how a stall
    at the cut delays the 1F1B order of the ranks around it: up to 13% low)."""
    if p <= 1 or hop <= 0:
        return 0.0
    k = max(1, min(inflight, m))
    extra = max(0.0, ((p - cut) * t + 2 * hop) / k - t)
    return 2 * hop + m * extra


def rank_devices(cluster: Cluster, pp: int, stride: int, dtype: str = "bf16") -> list:
    """Per pipeline rank (its ``stride`` consecutive ranks): the slowest device (lowest ``dtype``
    peak) of the cluster groups those ranks lie in; the cluster's device without groups."""
    if cluster.topology is None:
        return [cluster.device] * pp
    out = []
    for r in range(pp):
        groups = {cluster.group_of_rank(k) for k in (r * stride, (r + 1) * stride - 1)}
        devs = [cluster.group_device(g) for g in sorted(groups)]
        out.append(min(devs, key=lambda d: cluster.peak_flops(dtype, d)))
    return out


def slowdowns(cluster: Cluster, pp: int, stride: int, dtype: str = "bf16") -> list[float]:
    """Per pipeline rank: its device's compute time over the cluster's ``[device]`` (the reference
    every layer is priced on): the ratio of their ``dtype`` peaks (memory-bound work assumed to
    scale alike: a roofline approximation). All 1 on a cluster of one device type."""
    ref = cluster.peak_flops(dtype)
    return [ref / cluster.peak_flops(dtype, d) for d in rank_devices(cluster, pp, stride, dtype)]


def capacity_bytes(cluster: Cluster, pp: int, stride: int) -> float:
    """Device memory every pipeline rank is held to: the smallest of their devices' (bytes)."""
    return min(d.memory_gib * 2**30 for d in rank_devices(cluster, pp, stride))

