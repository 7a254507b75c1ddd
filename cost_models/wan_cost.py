"""What a layout pays on the links between cluster groups (the WAN), per mesh dimension.

Reads the placement rules of :mod:`cost_models.wan` and prices with :mod:`cost_models.comm`:

- :func:`crossings`: for each mesh dimension whose groups span cluster groups, or pipeline
  boundary that crosses one, where (which groups, how many flows share the link), the link one
  flow sees (GB/s, latency) and the WAN seconds per step before any overlap: a pipeline
  boundary carries ``2 m`` activations (forward one way, gradients back); DP's gradient
  reduction its reduce-scatter's cross-group phase (``hier``: reduce inside each group,
  exchange across, broadcast back); CP and TP per call.
- :func:`outer_step_s`: low-communication DP's exchange (``ParallelConfig.low_comm``): every rank
  all-gathers its local parameters' pseudo-gradients (the shard under FSDP, the whole replica
  otherwise, as codegen/runtime/outer_loop.py sends them) in the wire dtype with the ranks at
  the same place in the other groups, blocking, once per ``H`` inner steps.
- :func:`wan_floor_s`: a lower bound of the step of any variant of a degree tuple, from the WAN
  alone (the search prunes with it): every sharding reduces each gradient at least once, whose
  cross-group phase no overlap can shorten (the step is at least that long), and a pipeline
  boundary on the WAN carries each micro-batch's activation one after another.
- :func:`pipeline_wan_floor_s`: one variant's pipeline on perfectly balanced stages with its WAN
  boundaries' stalls (``cost_models.wan.stall_s`` at the smallest activation a boundary can send):
  a lower bound of the search's fast pass on that variant (the search prunes variants with it
  before pricing them).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cost_models import comm as comm_mod
from cost_models import wan
from cost_models.cluster import Cluster
from cost_models.experts import ep_mesh
from cost_models.layer_costs import act_bytes_io
from cost_models.memory import layer_experts
from planner.graph import ModelGraph
from planner.low_comm import WIRE_BYTES, inner_dp, parse_low_comm
from planner.plan import ParallelConfig, Partition
from planner.precision import GRAD_REDUCE_BYTES
from planner.sharding import dp_replicas, dp_wrapper


@dataclass(frozen=True)
class Crossing:
    """One mesh dimension (or pipeline boundary) on the WAN: seconds per step, before overlap."""

    dim: str               # pp | dp | cp | tp | ep | edp (the experts' dp group) | outer (low-communication DP)
    where: str             # in words: the boundary, or the group's members per cluster group
    groups: list[str]      # the cluster groups it joins
    flows: int             # transfers sharing the link at once
    gbs_per_flow: float    # what one flow gets, GB/s
    latency_ms: float      # one-way
    seconds: float         # WAN seconds per step (pp: 2 m hops; dp: the gradients' cross-group phase,
    #                        or the whole ring when flat; outer: one exchange, made once per H steps)
    mode: str = ""         # dp, edp: "hierarchical" or "flat" (planner.sharding.dp_replicas, expert_replicas)

    def to_dict(self) -> dict:
        return asdict(self)


def _mesh(cfg: ParallelConfig, dp_flat: bool = False) -> comm_mod.Mesh:
    if dp_flat:  # the gradients are reduced over dp x cp (CP ranks hold the same weights), in one group under low_comm
        return comm_mod.Mesh(pp=cfg.pp, dp=inner_dp(cfg.dp, cfg.low_comm) * cfg.cp, cp=1, tp=cfg.tp)
    return comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp)


def _names(cluster: Cluster, groups: tuple[int, ...] | range) -> list[str]:
    assert cluster.topology is not None
    return [cluster.topology.groups[g].name for g in groups]


def crossings(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition | None,
              m: int) -> list[Crossing]:
    """Every place ``cfg``'s mesh crosses the WAN of ``cluster`` (empty on a one-group cluster)."""
    outer = _outer_crossing(graph, cluster, cfg)
    if cluster.topology is None:
        return [outer] if outer is not None else []
    out = _pp_crossings(graph, cluster, cfg, partition, m) + ([outer] if outer is not None else [])
    for dim in ("dp", "cp", "tp"):
        mesh = _mesh(cfg, dp_flat=dim == "dp")
        span = wan.dim_span(cluster, mesh.size(dim), mesh.stride(dim), mesh.world)
        if span is None:
            continue
        mode = ("hierarchical" if hsdp_replicas(cluster, cfg) > 1 else "flat") if dim == "dp" else ""
        secs = _grad_wan_s(graph, cluster, cfg, span, mesh if mode == "flat" else None) if dim == "dp" else 0.0
        flows, link = wan.flat_ring_link(cluster, span) if mode == "flat" else (span.flows, span.link)
        out.append(Crossing(dim, f"{span.per_group} of each {dim} group's {mesh.size(dim)} ranks in each of "
                                 f"{span.groups} groups", _names(cluster, span.spanned),
                            flows, link.bandwidth_gbs, link.latency_us / 1e3, secs, mode))
    return out + _expert_crossings(graph, cluster, cfg)


def outer_step_s(cluster: Cluster, cfg: ParallelConfig, params_rank: float, profile=None) -> float:
    """One low-communication exchange of ``params_rank`` parameters per rank, seconds (module docstring)."""
    low = parse_low_comm(cfg.low_comm)
    if low is None:
        return 0.0
    inner = inner_dp(cfg.dp, cfg.low_comm) * cfg.cp
    mesh = comm_mod.Mesh(pp=cfg.pp, dp=low.groups, cp=1, tp=inner * cfg.tp)  # the ranks at one place in each group
    return comm_mod.collective_time("all_gather", outer_bytes(cfg, params_rank) * low.groups, cluster, mesh, "dp",
                                    profile).seconds


def outer_bytes(cfg: ParallelConfig, params_rank: float) -> float:
    """Bytes one rank puts on the wire per exchange: its parameters in the wire dtype."""
    low = parse_low_comm(cfg.low_comm)
    return 0.0 if low is None else params_rank * WIRE_BYTES[low.dtype]


def _outer_crossing(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig) -> Crossing | None:
    low = parse_low_comm(cfg.low_comm)
    if low is None:
        return None
    inner = inner_dp(cfg.dp, cfg.low_comm) * cfg.cp
    params = sum(layer.params for layer in graph.layers) / (cfg.pp * cfg.tp) / (inner if cfg.zero == "fsdp" else 1)
    mesh = comm_mod.Mesh(pp=cfg.pp, dp=low.groups, cp=1, tp=inner * cfg.tp)
    span = wan.dim_span(cluster, low.groups, mesh.stride("dp"), mesh.world)
    names = _names(cluster, span.spanned) if span is not None else []
    gbs, lat = (span.link.bandwidth_gbs, span.link.latency_us / 1e3) if span is not None else (0.0, 0.0)
    return Crossing("outer", f"every {low.every} steps, {outer_bytes(cfg, params) / 1e9:.3g} GB per rank in "
                             f"{low.dtype}", names, span.flows if span else 0, gbs, lat,
                    outer_step_s(cluster, cfg, params))


def _pp_crossings(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition | None,
                  m: int) -> list[Crossing]:
    if cfg.pp == 1:
        return []
    stride = _mesh(cfg).stride("pp")
    nbytes = _boundary_bytes(graph, cfg, partition)
    out = []
    for i, link in enumerate(wan.boundary_links(cluster, cfg.pp, stride)):
        if link is None:
            continue
        a, b = cluster.group_of_rank(i * stride), cluster.group_of_rank((i + 2) * stride - 1)
        hop = nbytes / link.bandwidth_bps + link.latency_s
        out.append(Crossing("pp", f"stage {i} -> {i + 1}", _names(cluster, range(a, b + 1)), stride,
                            link.bandwidth_gbs, link.latency_us / 1e3, 2 * m * hop))
    return out


def _boundary_bytes(graph: ModelGraph, cfg: ParallelConfig, partition: Partition | None) -> float:
    """The largest activation a stage boundary sends, bytes per rank (any layer's without a split)."""
    cuts = ([hi for lo, hi in partition.bounds[:-1] if hi < len(graph.layers)] if partition is not None
            else range(1, len(graph.layers)))
    return max((act_bytes_io(graph.layers[i], graph, cfg) / cfg.seq_shards for i in cuts), default=0.0)


def _expert_crossings(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig) -> list[Crossing]:
    """Under expert parallelism, the EP group (``ep``: every MoE layer's all-to-alls) and the
    experts' own data-parallel group (``edp``: their gradients, FSDP2 over a one-dimensional mesh,
    so one flat ring: ``planner.sharding.expert_replicas``) where they span cluster groups."""
    if cfg.ep == 1:
        return []
    mesh, out = ep_mesh(cfg), []  # the EP group is its cp dimension, the experts' dp group its dp one
    experts = sum(layer_experts(layer, graph.hidden) for layer in graph.layers) / (cfg.pp * cfg.ep)
    for dim, name in (("cp", "ep"), ("dp", "edp")):
        span = wan.dim_span(cluster, mesh.size(dim), mesh.stride(dim), mesh.world)
        if span is None:
            continue
        secs = comm_mod.collective_time("all_reduce", experts * GRAD_REDUCE_BYTES, cluster, mesh, "dp",
                                        flat=True).seconds if name == "edp" else 0.0
        flows, link = wan.flat_ring_link(cluster, span) if name == "edp" else (span.flows, span.link)
        out.append(Crossing(name, f"{span.per_group} of each {name} group's {mesh.size(dim)} ranks in each of "
                                  f"{span.groups} groups", _names(cluster, span.spanned), flows,
                            link.bandwidth_gbs, link.latency_us / 1e3, secs, "flat" if name == "edp" else ""))
    return out


def _grad_wan_s(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, span: wan.WanSpan,
                flat_mesh: comm_mod.Mesh | None = None) -> float:
    """The cross-group phase of one reduce-scatter of the average rank's gradients (a lower bound
    of every hierarchical sharding's gradient traffic over the WAN), seconds; with ``flat_mesh``
    (DP run as one ring) the ring's all-reduce of them. Under expert parallelism the routed
    experts are reduced over their own group instead (:func:`_expert_crossings`)."""
    split = cfg.ep > 1
    params = sum(layer.params - (layer_experts(layer, graph.hidden) if split else 0)
                 for layer in graph.layers) / (cfg.pp * cfg.tp)
    if flat_mesh is not None:
        return comm_mod.collective_time("all_reduce", params * GRAD_REDUCE_BYTES, cluster, flat_mesh, "dp",
                                        flat=True).seconds
    per_flow = params * GRAD_REDUCE_BYTES / span.per_group
    k = span.groups
    return (k - 1) / k * per_flow / span.link.bandwidth_bps + (k - 1) * span.link.latency_s


def stage_slowdowns(cluster: Cluster, cfg: ParallelConfig) -> list[float]:
    """Per pipeline rank: its device's compute time over the cluster's reference ``[device]``
    (``cost_models.wan.slowdowns``, at the dtype the plan computes in); all 1 on one device type."""
    if not cluster.mixed:  # every estimate asks: one device type is all 1
        return [1.0] * cfg.pp
    return wan.slowdowns(cluster, cfg.pp, cfg.dp * cfg.cp * cfg.tp, cluster.compute_dtype(cfg.dtype))


def stage_devices(cluster: Cluster, cfg: ParallelConfig) -> list[str]:
    """On a cluster of mixed devices, per pipeline rank: ``"group(s): device"`` its ranks run on
    (the slowest device when they span groups); empty on one device type."""
    if not cluster.mixed:
        return []
    stride = cfg.dp * cfg.cp * cfg.tp
    devs = wan.rank_devices(cluster, cfg.pp, stride, cluster.compute_dtype(cfg.dtype))
    out = []
    for r, d in enumerate(devs):
        groups = sorted({cluster.group_of_rank(k) for k in (r * stride, (r + 1) * stride - 1)})
        out.append(f"{'+'.join(_names(cluster, groups))}: {d.name}")
    return out


def stage_capacity(cluster: Cluster, cfg: ParallelConfig) -> float:
    """Device memory each pipeline rank is held to, bytes: the smallest device's among the ranks
    (``cost_models.wan.capacity_bytes``; the cluster's own on one device type)."""
    if cluster.topology is None:
        return cluster.memory_bytes
    sizes = {cluster.group_device(g).memory_gib for g in range(cluster.n_groups)}
    if len(sizes) == 1:  # every group's devices hold the same (every estimate asks): no rank to look up
        return sizes.pop() * 2**30
    return wan.capacity_bytes(cluster, cfg.pp, cfg.dp * cfg.cp * cfg.tp)


def wan_floor_s(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, m: int) -> float:
    """Lower bound of the step of every variant of ``cfg``'s degrees from the WAN alone (module
    docstring); 0 on a one-group cluster."""
    if cluster.topology is None:
        return 0.0
    floor = 0.0
    mesh = _mesh(cfg, dp_flat=True)
    span = wan.dim_span(cluster, mesh.size("dp"), mesh.stride("dp"), mesh.world)
    if span is not None:
        floor = _grad_wan_s(graph, cluster, cfg, span)
    if cfg.pp > 1:
        smallest = min(act_bytes_io(graph.layers[i], graph, cfg) / cfg.seq_shards for i in range(1, len(graph.layers)))
        links = [k for k in wan.boundary_links(cluster, cfg.pp, _mesh(cfg).stride("pp")) if k is not None]
        if links:
            floor = max(floor, m * smallest / min(k.bandwidth_bps for k in links))
    return floor


DEEP_WARMUP_MAX = 4  # the most extra 1F1B warm-up units the search puts before a WAN cut (planner/search/wan_warmup.py)


def deep_allowance(schedule: str, v: int) -> int:
    """Micro-batches the WAN floors add to a schedule's closed-form in-flight count on every rank:
    :data:`DEEP_WARMUP_MAX` under 1F1B of one stage per rank (the search may deepen its warm-up
    before a WAN cut), else 0. More in flight stalls less, so the floor stays below every
    variant it stands for."""
    return DEEP_WARMUP_MAX if schedule == "1f1b" and v == 1 else 0


@dataclass(frozen=True)
class BalancedPipe:
    """One variant's pipeline on perfectly balanced stages: ``closed_s`` its schedule's closed form
    (seconds, no hops), ``rank_s`` one micro-batch's forward + backward on one rank (all its
    chunks, seconds) and ``inflight`` per pp rank the micro-batches it holds (chunks / vpp)."""

    closed_s: float
    rank_s: float
    inflight: list[int]


@dataclass(frozen=True)
class WanHop:
    """A pipeline boundary on the WAN at its cheapest: ``boundary`` (stage i -> i + 1), ``hop_s`` one
    send of the smallest activation any split can send there (bandwidth + latency) and ``bw_s`` its
    bandwidth part, seconds."""

    boundary: int
    hop_s: float
    bw_s: float


def cheapest_wan_hops(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig) -> list[WanHop]:
    """Every pipeline boundary of ``cfg`` on the WAN with its cheapest hop (:class:`WanHop`); they
    depend on the degrees, the micro-batch and sequence parallel only (the search computes them
    once per degree tuple)."""
    if cfg.pp == 1 or cluster.topology is None:
        return []
    links = wan.boundary_links(cluster, cfg.pp, _mesh(cfg).stride("pp"))
    if not any(k is not None for k in links):
        return []
    smallest = min(act_bytes_io(graph.layers[i], graph, cfg) / cfg.seq_shards for i in range(1, len(graph.layers)))
    return [WanHop(r, comm_mod.p2p_link_time(smallest, k), smallest / k.bandwidth_bps)
            for r, k in enumerate(links) if k is not None]


def pipeline_wan_floor_s(m: int, pp: int, pipe: BalancedPipe, hops: list[WanHop]) -> float:
    """``pipe.closed_s`` plus what the WAN adds at least (module docstring): the worst WAN boundary's
    stall (:func:`cost_models.wan.stall_s`, the search's fast pass) at its cheapest hop
    (:func:`cheapest_wan_hops`), and at least the link's floor (:func:`cost_models.wan.link_floor_s`).
    Both grow with the stage time and the hop, so balanced stages and the smallest activation
    bound the fast pass from below. ``pipe.closed_s`` itself without a WAN boundary."""
    if not hops:
        return pipe.closed_s
    stall = max(wan.stall_s(m, pp, h.boundary, pipe.rank_s, h.hop_s, pipe.inflight[h.boundary]) for h in hops)
    return max(pipe.closed_s + stall, wan.link_floor_s(m, [h.bw_s for h in hops], pp * pipe.rank_s))


def dp_spans(cluster: Cluster, cfg: ParallelConfig) -> int:
    """Cluster groups (regions) the dense dp x cp group spans, its ranks filling them in order
    (``wan.dim_span``); 1 on a one-group cluster, and under low-communication DP (a group of
    replicas lies in one region). Planning records it as the plan's ``cluster["dp_spans"]``: the
    runtime runs DP across them hierarchically (``planner.sharding.dp_replicas``)."""
    n = cfg.dp * cfg.cp
    if cfg.low_comm or n == 1:
        return 1
    mesh = comm_mod.Mesh(pp=cfg.pp, dp=n, cp=1, tp=cfg.tp)
    return wan.span_groups(cluster, n, mesh.stride("dp"), mesh.world)


def hsdp_replicas(cluster: Cluster, cfg: ParallelConfig) -> int:
    """Cluster groups the dense dp x cp group is replicated across as the runtime runs it
    (``planner.sharding.dp_replicas`` of :func:`dp_spans`): states sharded over the
    ``dp * cp / replicas`` ranks of a group (``planner.sharding.shard_ranks``); 1: flat."""
    n = cfg.dp * cfg.cp
    return dp_replicas(dp_wrapper(cfg.zero, cfg.pp, cfg.tp, n, cfg.dtype), cfg.dp, dp_spans(cluster, cfg))
