"""Collective communication time on one dimension of the device mesh.

Mesh and placement
------------------
The mesh is ``[pp, dp, cp, tp]``, outer to inner (tp varies fastest)::

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i,   node = rank // devices_per_node

A group of dimension ``d`` has ``size = mesh[d]`` members spaced ``stride`` ranks
apart, ``stride`` = product of the sizes of the dimensions inside ``d``. Its link
class (:func:`group_layout`, taken from the group that holds rank 0):

- ``intra``: all members on one node;
- ``inter``: one member per node;
- ``mixed``: ``per_node`` > 1 members on each of ``nodes`` > 1 nodes.

Cost model (alpha-beta, ring algorithms)
----------------------------------------
``B`` = per-rank buffer bytes (all_reduce: the tensor; all_gather: the gathered
OUTPUT; reduce_scatter: the full INPUT; all_to_all: the per-rank buffer;
send_recv: the message), ``n`` = group size, ``bw`` = per-device one-direction
bandwidth of the link (bytes/s), ``alpha`` = its latency (s)::

    all_reduce      2 (n-1)/n * B / bw  +  2 (n-1) * alpha     (reduce-scatter + all-gather)
    all_gather        (n-1)/n * B / bw  +    (n-1) * alpha
    reduce_scatter    (n-1)/n * B / bw  +    (n-1) * alpha
    all_to_all        (n-1)/n * B / bw  +    (n-1) * alpha     (pairwise exchange)
    send_recv                 B / bw  +          alpha

``n = 1`` or ``B <= 0`` costs 0 s.

On NCCL clusters two things change, as NCCL does them:
- ``bw`` is the link's nominal figure times the bus efficiency NCCL reaches on it
  (``NCCL_BUS_EFF``): nccl-tests report ~230 of 300 GB/s bus bandwidth over A100 NVLink
  and ~360 of 450 over H100 NVLink (0.78-0.80), and 91-96 % of line rate over InfiniBand
  (NVIDIA/nccl-tests issues 100, 119, 149);
- an all-reduce pays the smaller of the ring's latency and the tree's,
  ``min(2 (n-1), 2 ceil(log2 n)) * alpha``: NCCL switches to its double binary tree where
  the ring's latency grows with the group (large groups, small messages).
The alpha-beta form itself is the size dependence: a message reaches half the bus
bandwidth at ``B = alpha * bw`` (about 1 MB over NVLink, 0.5 MB over IB).

Hierarchical (``mixed``) groups, ``g = per_node`` members on each of ``k = nodes``
nodes; the intra phases use the intra link, the inter phases the network::

    all_reduce      intra RS(B, g) + inter AR(B/g, k) + intra AG(B, g)
    all_gather      inter AG(B/g, k) + intra AG(B, g)
    reduce_scatter  intra RS(B, g) + inter RS(B/g, k)
    all_to_all      (g-1)/n * B / bw_intra + (g-1) alpha_intra + (n-g)/n * B / bw_inter + (n-g) alpha_inter
    send_recv       one hop on the inter link (a ring step is as slow as its node-crossing hop)

Inter-node bandwidth per device is ``cluster.inter.bandwidth_gbs``: each device
uses its own NIC, whether the group has one member per node or ``g`` concurrent
inter-node sub-groups (one per local index) run side by side. Phases run one
after another (no overlap between phases).

Across cluster groups (regions joined by a WAN: cost_models/topology.py)
-----------------------------------------------------------------------
A group whose members lie in ``k > 1`` cluster groups, ``g`` in each, runs hierarchically
(:func:`_wan_group_time`): the in-group phases as above on the ``g`` members of one group, and
``g`` concurrent rings of ``k`` across the WAN carrying ``B / g`` each, every flow of the
dimension sharing the link's aggregate bandwidth (``cost_models.wan``: ``dim_span``,
``flow_link``); a pipeline boundary on the cut is one WAN hop per rank pair
(:func:`p2p_hops`), the boundary's pairs sharing the link. A group the runtime reduces flat
(``flat=True``: FSDP2's ``replicate``, which takes a one-dimensional mesh,
``planner.sharding.dp_replicas``) is one ring over all its ``n`` members (:func:`_flat_wan_time`):
each of its ``2(n - 1)`` (all-reduce) or ``n - 1`` steps moves ``B / n`` per member and waits for
its WAN edge, one flow per group of the dimension sharing the link, plus the link's latency.
Never from a profile (it measures the node links only).

Measured profile
----------------
When a :class:`ProfileDB` has samples for ``(kind, n, link)`` its interpolated
time is used (source ``"profile"``). For a ``mixed`` group without such samples the
hierarchical formula is composed from the profile's intra and inter samples when
every phase is measured; a phase without samples falls back to the model and the
result is then reported as ``"model"``. On a local CPU cluster a layout that runs fewer
processes than the profile timed its collectives with gets their data movement faster by its
processes' larger share of the cores (``cost_models.shared_cores.profiled_comm_factor``), not
their per-call latency (:func:`profiled_time`).

Calibration: a profile's ``calibration`` (``autopar calibrate``) may hold
``comm_scale`` (every collective and p2p time is multiplied by it) and
``comm_scale.<kind>`` (that kind only, instead), and ``comm_latency_s`` (added to
every collective / p2p call: the synchronisation cost of a blocking call between
processes that share cores; not to tensor parallelism's on CPU clusters, whose DTensor figure
holds it: ``collective_time``'s ``sync_priced``), fitted to measured training runs: a
collective inside a training step contends with compute for the cores, which the
profiler's collective-only measurements do not see.

``local-cpu`` clusters take their alpha-beta figures from ``Cluster.detect``
(gloo defaults); a profile overrides them, as for any cluster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Mapping, Sequence

from cost_models import wan
from cost_models.cluster import Cluster, ClusterError, Link
from cost_models.profile_db import COLLECTIVE_KINDS, FSDP_UNIT, ProfileDB
from cost_models.shared_cores import profiled_comm_factor, sync_wait_s

DIMS = ("pp", "dp", "cp", "tp")
NCCL_BUS_EFF = {"intra": 0.80, "inter": 0.90}
LinkClass = Literal["intra", "inter", "mixed"]
Source = Literal["profile", "model"]


@dataclass(frozen=True)
class Mesh:
    """Parallel degrees; mesh order [pp, dp, cp, tp], outer to inner."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        """Number of ranks the mesh uses."""
        return self.pp * self.dp * self.cp * self.tp

    def size(self, dim: str) -> int:
        """Degree of one dimension."""
        return int(getattr(self, _check_dim(dim)))

    def stride(self, dim: str) -> int:
        """Rank distance between neighbouring members of a ``dim`` group."""
        i = DIMS.index(_check_dim(dim))
        s = 1
        for inner in DIMS[i + 1:]:
            s *= getattr(self, inner)
        return s

    @classmethod
    def of(cls, mesh: "Mesh | Mapping[str, int]") -> "Mesh":
        """Accept a Mesh or a dict such as ``{"pp": 2, "dp": 4, "tp": 8}`` (missing dims = 1)."""
        if isinstance(mesh, Mesh):
            return mesh
        unknown = set(mesh) - set(DIMS)
        if unknown:
            raise ClusterError(f"unknown mesh dimension {sorted(unknown)[0]!r}: use {', '.join(DIMS)}")
        m = cls(**{d: int(mesh.get(d, 1)) for d in DIMS})
        for d in DIMS:
            if m.size(d) < 1:
                raise ClusterError(f"mesh dimension {d} = {m.size(d)}: degrees must be >= 1")
        return m


@dataclass(frozen=True)
class GroupLayout:
    """How one process group of a mesh dimension lies on the nodes."""

    size: int
    link: LinkClass
    per_node: int
    nodes: int


@dataclass(frozen=True)
class CommEstimate:
    """Seconds for one collective and where the figure came from."""

    seconds: float
    source: Source


def _check_dim(dim: str) -> str:
    if dim not in DIMS:
        raise ClusterError(f"unknown mesh dimension {dim!r}: use one of {', '.join(DIMS)}")
    return dim


def group_layout(cluster: Cluster, mesh: Mesh | Mapping[str, int], dim: str) -> GroupLayout:
    """Size, link class, members per node and nodes spanned by the ``dim`` group holding rank 0."""
    m = Mesh.of(mesh)
    if m.world > cluster.world:
        raise ClusterError(
            f"mesh {m.pp}x{m.dp}x{m.cp}x{m.tp} needs {m.world} devices but cluster {cluster.name!r} "
            f"has {cluster.world}: lower the degrees or add nodes")
    size = m.size(dim)
    if size == 1:
        return GroupLayout(size=1, link="intra", per_node=1, nodes=1)
    return _layout(size, m.stride(dim), cluster.devices_per_node)


@lru_cache(maxsize=4096)
def _layout(size: int, stride: int, dpn: int) -> GroupLayout:
    """Group of ``size`` ranks ``stride`` apart from rank 0 on nodes of ``dpn`` devices (cached:
    the search asks for the same few layouts thousands of times)."""
    counts: dict[int, int] = {}
    for k in range(size):
        node = (k * stride) // dpn
        counts[node] = counts.get(node, 0) + 1
    nodes = len(counts)
    per_node = max(counts.values())
    if nodes == 1:
        link: LinkClass = "intra"
    elif per_node == 1:
        link = "inter"
    else:
        link = "mixed"
    return GroupLayout(size=size, link=link, per_node=per_node, nodes=nodes)


def _ring_time(kind: str, nbytes: float, n: int, link: Link, bus_eff: float = 1.0, tree: bool = False) -> float:
    """Flat ring/pairwise alpha-beta time on one link class (module docstring); ``bus_eff``
    scales the bandwidth, ``tree`` lets an all-reduce take the tree's latency when smaller."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = link.bandwidth_bps * bus_eff, link.latency_s
    if kind == "all_reduce":
        steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n))) if tree else 2 * (n - 1)
        return 2 * (n - 1) / n * nbytes / bw + steps * alpha
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha
    if kind == "send_recv":
        return nbytes / bw + alpha
    raise ClusterError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVE_KINDS)}")


def link_time(kind: str, nbytes: float, n: int, cluster: Cluster, link: Literal["intra", "inter"]) -> float:
    """Model time of one flat collective on one link class of ``cluster`` (NCCL's bus
    efficiency and tree latency on NCCL clusters, the plain ring on gloo)."""
    nccl = cluster.backend == "nccl"
    return _ring_time(kind, nbytes, n, cluster.intra if link == "intra" else cluster.inter,
                      NCCL_BUS_EFF[link] if nccl else 1.0, tree=nccl)


class _Phase:
    """Times one flat phase from the profile when measured, else the model; tracks the source."""

    def __init__(self, cluster: Cluster, profile: ProfileDB | None):
        self.cluster = cluster
        self.profile = profile
        self.all_measured = True

    def __call__(self, kind: str, nbytes: float, n: int, link: Literal["intra", "inter"]) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        if self.profile is not None:
            t = profiled_time(self.profile, self.cluster, kind, n, link, nbytes)
            if t is not None:
                return t
        self.all_measured = False
        return link_time(kind, nbytes, n, self.cluster, link)


def collective_time(kind: str, nbytes: float, cluster: Cluster, mesh: Mesh | Mapping[str, int], dim: str,
                    profile: ProfileDB | None = None, *, flat: bool = False, chained: bool = False,
                    sync_priced: bool = False, wait_priced: bool = False) -> CommEstimate:
    """Seconds for one ``kind`` collective of ``nbytes`` (per-rank buffer) over a ``dim`` group.
    A group spanning cluster groups runs hierarchically, or as one ring when ``flat`` (module
    docstring). ``chained``: issued right after another collective of the same group, with no
    compute between (the EP dispatch after its count exchange): every peer is already running, so
    no shared-core wait (``shared_cores.sync_wait_s``) is added; measured, an all-to-all over 4
    ranks on 2 cores right after another costs its back-to-back time, 2.49 / 2.67 ms against
    2.54 / 2.26 back-to-back and 3.46 / 3.14 after compute (benchmarks/collective_in_step.py).
    ``sync_priced``: what the call costs between compute beyond its back-to-back time is priced by
    the caller (tensor parallelism's DTensor figure and lockstep wait on CPU clusters,
    ``cost_models.dtensor_dispatch.prices_tp_sync``), so a calibration's ``comm_latency_s``, which
    stands for that cost, is not added. ``wait_priced``: so is the wait for peers descheduled on
    shared cores (DTensor's figure measured on the cluster's own ranks,
    ``dtensor_dispatch.prices_tp_shared_wait``): no ``sync_wait_s`` either."""
    if kind not in COLLECTIVE_KINDS:
        raise ClusterError(f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVE_KINDS)}")
    m = Mesh.of(mesh)
    lay = group_layout(cluster, m, dim)
    span = wan.dim_span(cluster, lay.size, m.stride(dim), m.world)
    if span is not None:
        return _group_time(kind, float(nbytes), lay, cluster, profile, _Wan(span, m.stride(dim), flat),
                           chained or wait_priced, sync_priced)
    return _group_time(kind, float(nbytes), lay, cluster, profile, chained=chained or wait_priced,
                       sync_priced=sync_priced)


@dataclass(frozen=True)
class _Wan:
    """A group spanning cluster groups (``cost_models.wan``), its members' stride, and whether it
    runs as one flat ring (else hierarchically)."""
    span: wan.WanSpan
    stride: int
    flat: bool = False


def _group_time(kind: str, nbytes: float, lay: GroupLayout, cluster: Cluster,
                profile: ProfileDB | None, across: "_Wan | None" = None, chained: bool = False,
                sync_priced: bool = False) -> CommEstimate:
    if across is None:
        est = _group_time_raw(kind, nbytes, lay, cluster, profile)
    elif across.flat and kind != "send_recv":
        est = CommEstimate(_flat_wan_time(kind, nbytes, lay.size, across.span, cluster), "model")
    else:
        est = _wan_group_time(kind, nbytes, across, cluster, profile)
    if est.seconds and not chained:
        est = CommEstimate(est.seconds + sync_wait_s(cluster.cores_per_node, cluster.devices_per_node), est.source)
    cal = getattr(profile, "calibration", None)
    if cal and est.seconds:
        k = cal.get(f"comm_scale.{kind}", cal.get("comm_scale", 1.0))
        alpha = 0.0 if sync_priced else cal.get("comm_latency_s", 0.0)
        if k != 1.0 or alpha:
            return CommEstimate(est.seconds * k + alpha, est.source)
    return est


def profiled_time(profile: ProfileDB, cluster: Cluster, kind: str, n: int, link: str, nbytes: float) -> float | None:
    """The profile's time of one collective (None where it has no samples) on ``cluster``'s
    processes: the part above the call's latency floor (its smallest message's time: wake-ups and
    the rendezvous, no data) moves and reduces data as CPU work of the calling process, so it runs
    at that process's share of a core (``shared_cores.profiled_comm_factor``); the floor does not.
    Measured on a 2-core VM, 2 gloo ranks alone against a 4-rank profile's groups of 2: an
    all-gather of 64 MB 64-66 ms against 120 ms (halved), of 1 MB 1.1-1.5 ms against 0.61 ms."""
    t = profile.collective_time(kind, n, link, nbytes)
    if t is None:
        return None
    floor = min(t, profile.collective_floor(kind, n, link) or 0.0)
    return floor + (t - floor) * profiled_comm_factor(cluster, profile.world)


def fsdp_units_time(unit_bytes: Sequence[float], cluster: Cluster, mesh: Mesh | Mapping[str, int], dim: str,
                    profile: ProfileDB | None, less: float = 0.0) -> float | None:
    """Seconds FSDP2 units of ``unit_bytes`` of parameters each add to a micro-batch's forward and
    backward over the ``dim`` group, as the profile measured a unit by its size
    (``profile_db.FSDP_UNIT``: its two all-gathers and its reduce-scatter with their fresh
    buffers, copies and hooks), each less ``less`` seconds priced elsewhere (at least 0), at the
    calibration's overall collective scale (its ``comm_scale``; the per-kind scales are the single
    collectives') and latency per call; None where the profile has no such samples for the group:
    GPU clusters, profiles made before them, groups across nodes or cluster groups (the
    collectives' own times price those)."""
    m = Mesh.of(mesh)
    lay = group_layout(cluster, m, dim)
    if profile is None or lay.size <= 1 or lay.link != "intra" or \
            wan.dim_span(cluster, lay.size, m.stride(dim), m.world) is not None or \
            profile.collective_time(FSDP_UNIT, lay.size, lay.link, 1.0) is None:
        return None
    cal = profile.calibration or {}
    k, alpha = cal.get("comm_scale", 1.0), cal.get("comm_latency_s", 0.0)
    return sum(max(0.0, profiled_time(profile, cluster, FSDP_UNIT, lay.size, lay.link, nb) - less) * k + 3 * alpha
               for nb in unit_bytes)


def _group_time_raw(kind: str, nbytes: float, lay: GroupLayout, cluster: Cluster,
                    profile: ProfileDB | None) -> CommEstimate:
    n = lay.size
    if n <= 1 or nbytes <= 0:
        return CommEstimate(0.0, "model")
    if profile is not None:
        t = profiled_time(profile, cluster, kind, n if kind != "send_recv" else 2, lay.link, nbytes)
        if t is not None:
            return CommEstimate(t, "profile")
    phase = _Phase(cluster, profile)
    if lay.link != "mixed":
        if kind == "send_recv":
            t = phase("send_recv", nbytes, 2, lay.link)
        else:
            t = phase(kind, nbytes, n, lay.link)
    else:
        g, k = lay.per_node, lay.nodes
        if kind == "all_reduce":
            t = (phase("reduce_scatter", nbytes, g, "intra") + phase("all_reduce", nbytes / g, k, "inter")
                 + phase("all_gather", nbytes, g, "intra"))
        elif kind == "all_gather":
            t = phase("all_gather", nbytes / g, k, "inter") + phase("all_gather", nbytes, g, "intra")
        elif kind == "reduce_scatter":
            t = phase("reduce_scatter", nbytes, g, "intra") + phase("reduce_scatter", nbytes / g, k, "inter")
        elif kind == "all_to_all":
            phase.all_measured = False  # no profile decomposition for a hierarchical all-to-all
            ia, ie = cluster.intra, cluster.inter
            ea, ee = (NCCL_BUS_EFF["intra"], NCCL_BUS_EFF["inter"]) if cluster.backend == "nccl" else (1.0, 1.0)
            t = ((g - 1) / n * nbytes / (ia.bandwidth_bps * ea) + (g - 1) * ia.latency_s
                 + (n - g) / n * nbytes / (ie.bandwidth_bps * ee) + (n - g) * ie.latency_s)
        else:  # send_recv
            t = phase("send_recv", nbytes, 2, "inter")
    return CommEstimate(t, "profile" if (profile is not None and phase.all_measured) else "model")


def _wan_group_time(kind: str, nbytes: float, across: _Wan, cluster: Cluster,
                    profile: ProfileDB | None) -> CommEstimate:
    """A group spanning ``k`` cluster groups with ``g`` members in each, hierarchically: the
    in-group phases as any group on those nodes, ``g`` concurrent rings of ``k`` across the WAN
    (``cost_models.wan``): all-reduce = RS in group + AR(B/g) across + AG in group (reduce inside
    each group, exchange across, broadcast back); all-gather = AG(B/g) across + AG in group;
    reduce-scatter = RS in group + RS(B/g) across; all-to-all: the in-group share of the buffer
    in group, the rest across; send/recv: one WAN hop."""
    sp = across.span
    g, k, n = sp.per_group, sp.groups, sp.per_group * sp.groups
    local = _layout(g, across.stride, cluster.devices_per_node) if g > 1 else GroupLayout(1, "intra", 1, 1)

    def loc(kd: str, b: float) -> float:
        return _group_time_raw(kd, b, local, cluster, profile).seconds

    def cross(kd: str, b: float) -> float:
        return _ring_time(kd, b, k, sp.link)

    if kind == "all_reduce":
        t = loc("reduce_scatter", nbytes) + cross("all_reduce", nbytes / g) + loc("all_gather", nbytes)
    elif kind == "all_gather":
        t = cross("all_gather", nbytes / g) + loc("all_gather", nbytes)
    elif kind == "reduce_scatter":
        t = loc("reduce_scatter", nbytes) + cross("reduce_scatter", nbytes / g)
    elif kind == "all_to_all":
        t = loc("all_to_all", nbytes * g / n) + (n - g) / n * nbytes / sp.link.bandwidth_bps + (k - 1) * sp.link.latency_s
    else:
        t = cross("send_recv", nbytes)
    return CommEstimate(t, "model")


def _flat_wan_time(kind: str, nbytes: float, n: int, span: wan.WanSpan, cluster: Cluster) -> float:
    """One flat ring of ``n`` members across cluster groups, seconds: each ring step moves
    ``nbytes / n`` per member and is as slow as its WAN edge, whose link every group of the
    dimension shares with one flow each (``cost_models.wan.flat_ring_link``), plus the
    link's one-way latency; the all-to-all sends the ``(n - g) / n`` of the buffer bound for the
    other groups over that flow."""
    _, link = wan.flat_ring_link(cluster, span)
    bw, lat = link.bandwidth_bps, link.latency_s
    if kind == "all_to_all":
        return (n - span.per_group) / n * nbytes / bw + (n - 1) * lat
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * (nbytes / n / bw + lat)


def p2p_links(cluster: Cluster, mesh: Mesh | Mapping[str, int]) -> list[LinkClass]:
    """Link class of each pipeline boundary (stage i -> i+1), over all its rank pairs."""
    m = Mesh.of(mesh)
    group_layout(cluster, m, "pp")  # validates the mesh against the cluster
    stride = m.stride("pp")
    dpn = cluster.devices_per_node
    links: list[LinkClass] = []
    for i in range(m.pp - 1):
        # pairs (a, a + stride), a in [i*stride, (i+1)*stride): one crosses a node edge
        # iff a multiple of dpn lies in [i*stride + 1, (i+2)*stride - 1]
        lo, hi = i * stride + 1, (i + 2) * stride - 1
        first_edge = -(-lo // dpn) * dpn
        links.append("inter" if first_edge <= hi else "intra")
    return links


def p2p_hops(nbytes: float, cluster: Cluster, mesh: Mesh | Mapping[str, int],
             profile: ProfileDB | None = None) -> list[CommEstimate]:
    """One-way activation send of ``nbytes`` across each pipeline boundary (stage i -> i+1), seconds:
    over the node link its rank pairs use, or over the WAN (``cost_models.wan.boundary_links``:
    the boundary's ``dp cp tp`` pairs share it) where they cross cluster groups."""
    m = Mesh.of(mesh)
    links = p2p_links(cluster, m)
    if not links or nbytes <= 0:
        return [CommEstimate(0.0, "model") for _ in links]
    wans = wan.boundary_links(cluster, m.pp, m.stride("pp"))
    out, by_class = [], {}  # boundaries inside the cluster differ only by their link class: time each once
    for link, across in zip(links, wans):
        if across is not None:
            out.append(CommEstimate(p2p_link_time(float(nbytes), across), "model"))
            continue
        if link not in by_class:
            lay = GroupLayout(size=2, link=link, per_node=1 if link == "inter" else 2,
                              nodes=2 if link == "inter" else 1)
            by_class[link] = _group_time("send_recv", float(nbytes), lay, cluster, profile)
        out.append(by_class[link])
    return out


def p2p_link_time(nbytes: float, link: Link) -> float:
    """One send of ``nbytes`` over ``link`` (one flow's WAN link: ``cost_models.wan.boundary_links``),
    seconds: bytes over its bandwidth plus its one-way latency."""
    return _ring_time("send_recv", nbytes, 2, link)


def p2p_time(nbytes: float, cluster: Cluster, mesh: Mesh | Mapping[str, int], profile: ProfileDB | None = None,
             *, boundary: int | None = None) -> CommEstimate:
    """One-way activation send between adjacent pipeline stages, seconds (:func:`p2p_hops`).

    ``boundary`` = i times the send from stage i to i+1; None times the slowest
    boundary (a pipeline runs at the pace of its slowest hop). pp = 1 costs 0 s.
    """
    hops = p2p_hops(nbytes, cluster, mesh, profile)
    if not hops:
        return CommEstimate(0.0, "model")
    if boundary is not None:
        if not 0 <= boundary < len(hops):
            raise ClusterError(f"pipeline boundary {boundary} out of range: use 0..{len(hops) - 1}")
        return hops[boundary]
    return max(hops, key=lambda e: e.seconds)
