"""estimate(graph, cluster, config, partition) -> Estimate: one training step, priced.

Step time (seconds)::

    step = pipeline(stage fwd/bwd times, schedule, m micro-batches, p2p)
         + exposed DP communication + optimizer step

- Stage time = sum over its layers of compute (cost_models/compute.py) + TP
  communication + exposed CP communication + recompute, per micro-batch.
- TP: every row-parallel linear (and the vocabulary-parallel embedding) ends in an
  all-reduce of the layer's activation [mbs, S/cp, h] in the forward and one in the
  backward; with sequence parallel each becomes a reduce-scatter plus an all-gather
  (same bytes, no replicated norms). TP collectives sit on the critical path: fully exposed.
- CP (ring attention, Ulysses or their hybrid; cost_models/context_parallel.py): the ring
  passes K and V around (cp / ulysses - 1 steps of 2 * mbs * S/cp * kv_heads * head_dim *
  dtype bytes), overlapping the attention compute of the previous step, so only
  ``max(0, comm - attention core time)`` is exposed (the backward sends K, V and their
  gradients); Ulysses adds four all-to-alls of q, k, v and the output, forward and backward.
- EP (routed experts split over ``ep`` of the dp x cp ranks): each MoE layer's token
  all-to-alls, dispatch and combine, forward and backward (cost_models/experts.py), on the
  critical path like TP's, or under the engine's 1F1B overlap what the other micro-batch's
  compute does not hide, plus the passes without a partner (``experts.unpaired_ep_s``); the
  experts' gradients are reduced over their own group (dp x cp x tp / ep ranks), the dense ones over dp x cp.
- PP: the simulator of cost_models/pipeline.py on the per-stage times (the closed
  form when ``fast=True``), p2p = the stage boundary's activation over the pp link.
- DP and the optimizer step (cost_models/dp_cost.py): the gradient / parameter traffic as the
  runtime issues it, hidden behind the backward where the engine overlaps it, and AdamW at the
  device's memory bandwidth; the step's scalar all-reduces (loss, gradient norm: ``sync``).
- Engine (cost_models/engines.py): what the engine that runs the layout hides. autopar's
  runtime by default; published runs under their own. Its switches decide whether TP
  collectives hide behind the layer's GEMMs, whether gradient reduction hides behind the
  backward (else all of it is exposed), ZeRO-1's form (all-reduce + broadcast, or
  reduce-scatter + all-gather) and whether its parameter gather hides behind the next
  forward, and whether pipeline p2p hides behind the steady state (then only the fill and
  drain hops, ``2 (pp - 1)``, are exposed).
- CPU runtime work (cost_models/cpu_runtime.py): the data-parallel wrappers' per-unit work each
  micro-batch (breakdown ``runtime``), the EP dispatch's host work (in ``ep_comm``); the ranks
  a layout runs with fewer CPU processes and more threads each: ``shared_cores.ranks_cluster``.
- Shared cores: a pipeline's compute is sped up by how many ranks are idle at once
  (cost_models/shared_cores.py); DP traffic on a node with more ranks than cores hides
  behind nothing (overlap 0): gloo's communication needs the cores the compute holds.

Memory per pp rank: cost_models/memory.py with the in-flight micro-batches the simulator reports for that rank.

Calibration (``profile.calibration``, fitted by ``autopar calibrate``): ``overlap``
replaces ``OVERLAP[backend]``; ``opt_scale`` multiplies the optimizer time (a CPU
AdamW does not run at memory bandwidth); ``step_overhead_s`` is added to every step (Python,
the loss all-reduce and logging of the training loop: breakdown ``overhead``);
``mem_reserve_gib`` + ``mem_reserve_frac`` x tensor bytes replaces the framework
reserve on CPU clusters (measured peak RSS includes the interpreter and torch, and the
allocator's retained and fragmented memory grows with the tensors). compute.py and comm.py read their own keys.

MFU = model FLOPs of the step (full-square attention, forward + backward; with packed
documents the attention at its document-masked work, ``layer_work.model_flops_per_seq``) /
(step x world x peak). Every figure carries its source: ``profile`` where measured
layer times or collective times were used, ``roofline`` / ``model`` otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from cost_models import comm as comm_mod, pipeline as pipe_mod, wan as wan_mod
from cost_models.cluster import Cluster
from cost_models.compute import calibration_note
from cost_models.profile_db import calibration
from cost_models.layer_work import model_flops_per_seq
from cost_models.cpu_runtime import figure as runtime_figure, wrapper_unit_s
from cost_models.dp_cost import dp_and_optimizer, step_sync_s
from cost_models.dp_units import stage_wrapper_s
from cost_models.engines import Engine, engine_of
from cost_models.experts import overlap_inflight, unpaired_ep_s
from cost_models.layer_costs import LayerCosts, act_bytes_io
from cost_models.offload import host_capacity_bytes
from cost_models.memory import StageMemory
from cost_models.pipeline_memory import inflight_closed, rank_memories
from cost_models.pipeline_memo import simulated
from cost_models.mp_casts import stage_mp_casts
from cost_models.seq_chunks import stage_chunk_parts
from cost_models.speed_shares import group_view, share_groups, shares_words
from cost_models.wan_cost import crossings, stage_capacity, stage_devices, stage_slowdowns
from cost_models.shared_cores import compute_concurrency, core_speedup, shares_cores
from planner.feasibility import microbatches
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition, PlanError
from planner import schedule_ir as ir
from planner.vocab_passes import graph_for

GiB = 2**30


@dataclass
class Estimate:
    config: ParallelConfig
    partition: Partition
    global_batch: int
    microbatches: int
    step_s: float
    tokens_per_s: float
    mfu: float
    tflops_per_device: float          # model TFLOP/s per device
    memory: list[StageMemory]         # per pp rank
    capacity: float                   # bytes per device
    breakdown: dict[str, float]       # seconds per category (see module docstring)
    stage_fwd_s: list[float]          # per virtual stage, per micro-batch
    stage_bwd_s: list[float]
    bubble_frac: float
    source: str                       # profile | roofline | mixed
    sources: dict[str, str] = field(default_factory=dict)
    pipeline: Any = None              # PipelineResult (events) when simulated
    p2p_hop_s: float = 0.0            # one activation send between stages (the simulator's edge weight)
    calibration: str = "uncalibrated"  # or what the profile's fitted coefficients were fitted on
    engine: str = "autopar"           # the engine whose overlaps are priced (cost_models/engines.py)
    schedule_ir: Any = None           # the schedule IR priced when config.schedule is custom (planner/schedule_ir.py)
    wan: list[dict] = field(default_factory=list)  # where the mesh crosses the WAN (cost_models/wan_cost.py)
    devices: list[str] = field(default_factory=list)  # mixed devices: "group: device" per pp rank
    host_capacity: float = math.inf   # host bytes a rank may pin for offloaded activations (cost_models/offload.py)
    split: pipe_mod.SplitCost = pipe_mod.SplitCost()  # what a backward split into I and W costs (split_cost)

    @property
    def fits(self) -> bool:
        """Every rank within its device memory, and its offloaded activations within its host share."""
        return all(m.total <= self.capacity and m.host <= self.host_capacity for m in self.memory)

    def shortfall(self) -> tuple[int, float]:
        """(pp rank, bytes over capacity) of the worst rank; bytes <= 0 when it fits."""
        worst = max(range(len(self.memory)), key=lambda r: self.memory[r].total)
        return worst, self.memory[worst].total - self.capacity

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_str(), "label": self.config.label(),
            "step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "tflops_per_device": self.tflops_per_device, "fits": self.fits,
            "microbatches": self.microbatches, "global_batch": self.global_batch,
            "memory_gib": [m.total / GiB for m in self.memory],
            "memory": [m.to_dict() for m in self.memory], "capacity_gib": self.capacity / GiB,
            "breakdown": self.breakdown, "bubble_frac": self.bubble_frac,
            "stage_fwd_s": self.stage_fwd_s, "stage_bwd_s": self.stage_bwd_s, "p2p_hop_s": self.p2p_hop_s,
            "split_backward": {"extra": self.split.extra, "first_whole": self.split.first_whole},
            "source": self.source, "sources": self.sources, "calibration": self.calibration, "engine": self.engine,
            "partition": self.partition.to_dict(), **({"wan": self.wan} if self.wan else {}),
            **({"stage_devices": self.devices} if self.devices else {}),
        }


@dataclass
class _StageCost:
    """One virtual stage, one micro-batch: the times the pipeline runs (seconds, exposed TP/CP
    communication included), their compute parts (what shared cores speed up; recompute
    counts in the backward) and the breakdown categories summed over fwd + bwd."""
    fwd: float
    bwd: float
    compute_fwd: float
    compute_bwd: float
    parts: dict[str, float]

    def sped_up(self, speed: float) -> "_StageCost":
        cut = 1 - 1 / speed
        parts = dict(self.parts, compute=self.parts["compute"] / speed, recompute=self.parts["recompute"] / speed,
                     runtime=self.parts["runtime"] / speed)
        return _StageCost(self.fwd - self.compute_fwd * cut, self.bwd - self.compute_bwd * cut,
                          self.compute_fwd / speed, self.compute_bwd / speed, parts)


def _stage_costs(graph: ModelGraph, partition: Partition, costs: LayerCosts, comp_src: set,
                 comm_src: set, cfg: ParallelConfig, placement: tuple[int, ...], m: int) -> list[_StageCost]:
    """Per virtual stage: its layers' compute, TP/CP communication and recompute (sources noted),
    and the data-parallel wrapper's work (breakdown ``runtime``): the CPU runtime's per wrapped
    unit (cost_models/cpu_runtime.py), FSDP2's mixed-precision copies on GPUs
    (cost_models/mp_casts.py, ``m`` micro-batches per step); on mixed devices sped up or slowed
    down to its rank's (``placement[j]``) device."""
    out = []
    unit_s = wrapper_unit_s(costs.c, cfg, costs.profile)  # cfg's wrapper: costs may be another zero's or pp's
    cal = calibration(costs.profile)
    for (lo, hi), rc in zip(partition.bounds, partition.recompute):
        f, b = stage_wrapper_s(graph, costs.table(cfg), cfg, lo, hi, unit_s)
        mp = stage_mp_casts(graph, cfg, lo, hi, m, costs.c, cal, costs.engine)
        f, b = f + mp.fwd, b + mp.bwd  # and the stage's copies
        cf, cb = f, b
        parts = {"compute": 0.0, "tp_comm": 0.0, "cp_comm": 0.0, "ep_comm": 0.0, "recompute": 0.0, "runtime": f + b,
                 "offload": 0.0, "ep_unpaired": 0.0}
        for i in range(lo, hi):
            c = costs.get(layer := graph.layers[i])
            comp_src.add(c.source)
            if c.tp or c.cp or c.ep_fwd:
                comm_src.add(c.comm_source)
            t = costs.pass_times(layer, rc)
            f += t.fwd
            b += t.bwd
            cf += t.compute_fwd
            cb += t.compute_bwd
            parts["compute"] += c.fwd + c.bwd
            parts["tp_comm"] += c.tp
            parts["cp_comm"] += c.cp
            parts["ep_comm"] += c.ep_fwd + c.ep_bwd
            parts["ep_unpaired"] += c.ep_unpaired
            parts["recompute"] += t.recompute
            parts["offload"] += t.offload
        out.append(_StageCost(f, b, cf, cb, parts))
    slow = stage_slowdowns(costs.c, cfg)  # mixed devices: each stage's compute on its rank's device (costs.cfg
    #                                      may be another pp's: the layer costs are shared across pp and dp)
    return [st.sped_up(1 / slow[placement[j]]) if slow[placement[j]] != 1.0 else st for j, st in enumerate(out)]


@dataclass(frozen=True)
class P2pHops:
    """The pipeline's hops, seconds: one per rank boundary (entry r: rank r -> r + 1, the last one
    the wrap-around an interleaved schedule uses), and each WAN boundary's bandwidth part (what
    the link carries one micro-batch after another: ``cost_models.wan.link_floor_s``)."""
    hops: list[float]
    wan_bw: list[float]
    is_wan: list[bool] = field(default_factory=list)  # per boundary (stage i -> i + 1): on the WAN

    @property
    def slowest(self) -> float:
        return max(self.hops, default=0.0)

    def per_chunk(self, k: int) -> list[float]:
        """Each hop for one of ``k`` sequence chunks of a micro-batch: a WAN boundary's bandwidth
        part over ``k`` and its latency whole, a boundary inside the cluster over ``k``
        (bandwidth-bound); the last entry (the wrap-around) the slowest of them."""
        if not self.is_wan:
            return [h / k for h in self.hops]
        bw = iter(self.wan_bw)
        out = [h - (1 - 1 / k) * next(bw) if wan else h / k for h, wan in zip(self.hops, self.is_wan)]
        return out + [max(out)]


def _p2p_hops(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition, profile,
              comm_src: set) -> P2pHops:
    """Per boundary: the largest stage boundary's activation over the link that boundary crosses
    (``comm.p2p_hops``: node links, or the WAN with its latency); no hops without PP."""
    if cfg.pp == 1:
        return P2pHops([], [])
    sizes = [act_bytes_io(graph.layers[hi], graph, cfg) / cfg.seq_shards
             for (lo, hi) in partition.bounds[:-1] if hi < len(graph.layers)]
    if not sizes:
        return P2pHops([0.0] * cfg.pp, [])
    mesh = comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp)
    ests = comm_mod.p2p_hops(max(sizes), cluster, mesh, profile)
    comm_src.update(e.source for e in ests)
    hops = [e.seconds for e in ests]
    links = wan_mod.boundary_links(cluster, cfg.pp, mesh.stride("pp"))
    wan_bw = [max(sizes) / k.bandwidth_bps for k in links if k is not None]
    return P2pHops(hops + [max(hops)], wan_bw, [k is not None for k in links])


def estimate(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition,
             global_batch: int, *, profile=None, fast: bool = False, costs: "LayerCosts | None" = None,
             engine: "Engine | str | None" = None, schedule: "ir.Schedule | None" = None) -> Estimate:
    """Price one configuration with one stage split on ``engine`` (None: autopar's runtime). ``fast``:
    the pipeline's closed form (an upper bound, exact for uniform stages) instead of simulating it.
    ``costs`` shares per-layer costs between calls with the same ``LayerCosts.key`` (the search).
    ``schedule``: the pipeline's own schedule IR when ``cfg.schedule`` is ``custom``, checked where it was
    made (``planner.schedule_file``, ``schedule_gen.generate``, ``schedule_ir``'s generators)."""
    cfg.validate()
    graph = graph_for(graph, cfg.vocab_passes, cfg.pp)  # the head as vocabulary passes: the split covers them
    if len(partition.bounds) != cfg.pp * cfg.vpp:
        raise PlanError(f"partition has {len(partition.bounds)} stages, config needs pp*vpp = {cfg.pp * cfg.vpp}")
    if cfg.dp_shares:
        return _by_shares(graph, cluster, cfg, partition, global_batch, profile=profile, fast=fast, engine=engine)
    m = microbatches(cfg, global_batch)
    placement = pipe_mod.stage_placement(cfg, m, schedule)
    eng = engine_of(engine)
    if costs is None or costs.key(costs.cfg) != costs.key(cfg) or costs.engine != eng or costs.g is not graph:
        costs = LayerCosts(graph, cluster, cfg, profile, engine=eng)
    cluster = costs.c  # the ranks cfg runs: fewer CPU ranks with more threads each (shared_cores.ranks_cluster)
    comp_src, comm_src = set(), set()
    stages = _stage_costs(graph, partition, costs, comp_src, comm_src, cfg, placement, m)

    # ---- pipeline ----------------------------------------------------------------
    hops = _p2p_hops(graph, cluster, cfg, partition, profile, comm_src)
    p2p, attn = hops.slowest, stage_chunk_parts(graph, partition, costs, cfg, m) if cfg.seq_chunks > 1 else None
    pipe_s, inflight_chunks, bubble, result = _pipeline(cfg, m, stages, hops, fast, eng.p2p_overlap, schedule, attn,
                                                        split := split_cost(cluster, profile))
    speed = _shared_core_speedup(cluster, cfg, bubble, result)
    if speed > 1.0:  # fewer ranks compute at once than the layer times assume: re-run at that speed
        stages, attn = [st.sped_up(speed) for st in stages], attn and attn.scaled(1 / speed)
        pipe_s, inflight_chunks, bubble, result = _pipeline(cfg, m, stages, hops, fast, eng.p2p_overlap, schedule,
                                                            attn, split)

    # ---- per-rank memory, data parallel, optimizer ------------------------------------------
    cal, table = calibration(profile), costs.table(cfg)
    on_rank = [[j for j, at in enumerate(placement) if at == r] for r in range(cfg.pp)]
    memory = rank_memories(graph, cluster, cfg, partition, table, overlap_inflight(inflight_chunks, cfg, eng, m), cal,
                           on_rank, result and result.peak_inflight, schedule if cfg.schedule == "custom" else None)
    mine = on_rank[max(range(cfg.pp), key=lambda r: sum(stages[j].fwd + stages[j].bwd for j in on_rank[r]))]
    rank_f, rank_b = (sum(getattr(stages[j], k) for j in mine) for k in ("fwd", "bwd"))
    dp_exposed, opt_s = dp_and_optimizer(graph, cluster, cfg, partition, table, on_rank, mine, m, (rank_f, rank_b),
                                         profile, comm_src, eng)

    overhead = cal.get("step_overhead_s", 0.0)
    ep_alone = unpaired_ep_s(cfg.pp, cfg.vpp, m, [st.parts["ep_unpaired"] for st in stages], on_rank)
    sync = step_sync_s(cluster, cfg, profile, comm_src)  # the loss's and the gradient norm's all-reduces
    terms = dict(ep_comm=ep_alone, dp_comm=dp_exposed, optimizer=opt_s, overhead=overhead, sync=sync)
    step = pipe_s + sum(terms.values())
    breakdown = _breakdown(stages, mine, m, cfg.pp, pipe_s, p2p, terms)
    src = "profile" if comp_src == {"profile"} else ("roofline" if "profile" not in comp_src else "mixed")
    return Estimate(
        config=cfg, partition=partition, global_batch=global_batch, microbatches=m,
        **_throughput(graph, cluster, cfg, global_batch, step), memory=memory, capacity=stage_capacity(cluster, cfg),
        breakdown=breakdown, stage_fwd_s=[st.fwd for st in stages], stage_bwd_s=[st.bwd for st in stages],
        bubble_frac=max(0.0, bubble), source=src, host_capacity=host_capacity_bytes(cluster),
        sources={"compute": src, "comm": "profile" if comm_src == {"profile"} else ("model" if comm_src else "none")},
        pipeline=result, p2p_hop_s=p2p, calibration=calibration_note(profile), engine=eng.name,
        schedule_ir=schedule if cfg.schedule == "custom" else None, split=split,
        wan=[x.to_dict() for x in crossings(graph, cluster, cfg, partition, m)], devices=stage_devices(cluster, cfg))


def _by_shares(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition, global_batch: int,
               **kw: Any) -> Estimate:
    """``cfg`` with unequal data-parallel shares (``cost_models/speed_shares.py``): each (group, share)
    priced as the layout with ``mbs = share`` on the cluster as that group's ranks see it, over the same
    micro-batch count; the step is the slowest one's (the gradients meet after every replica's
    backward) with its breakdown, the memory the fullest one's (the most of its device's)."""
    m = microbatches(cfg, global_batch)
    parts = [estimate(graph, group_view(cluster, sg.group), cfg.replace(mbs=sg.share, dp_shares=""), partition,
                      cfg.dp * sg.share * m, **kw) for sg in share_groups(cluster, cfg)]
    slowest = max(parts, key=lambda e: e.step_s)
    fullest = max(parts, key=lambda e: max(x.total for x in e.memory) / e.capacity)
    return replace(slowest, memory=fullest.memory, capacity=fullest.capacity, config=cfg, global_batch=global_batch,
                   devices=[shares_words(cluster, cfg)], **_throughput(graph, cluster, cfg, global_batch, slowest.step_s))


def _throughput(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, global_batch: int,
                step: float) -> dict[str, float]:
    """A step of ``step`` seconds as the Estimate's throughput fields: tokens/s, MFU against the
    reference device's peak at the dtype the plan computes in, and model TFLOP/s per device (the
    model's FLOPs doc-masked)."""
    model_flops = model_flops_per_seq(graph) * global_batch
    peak = cluster.peak_flops(cluster.compute_dtype(cfg.dtype))
    return dict(step_s=step, tokens_per_s=global_batch * graph.seq_len / step,
                mfu=model_flops / (step * cfg.world * peak), tflops_per_device=model_flops / step / cfg.world / 1e12)


def _breakdown(stages: list[_StageCost], mine: list[int], m: int, pp: int, pipe_s: float, p2p: float,
               step_terms: dict[str, float]) -> dict[str, float]:
    """Seconds per category of the busiest rank's step (``mine``: its virtual stages): the stages'
    parts over ``m`` micro-batches, the pipeline's idle time (``bubble``, of which the p2p hops'
    share is ``p2p``), and ``step_terms``: what the step adds beside the pipeline (``dp_comm``,
    ``optimizer``, ``sync`` and ``overhead`` when not 0, and ``ep_comm``'s passes without a partner)."""
    out = {k: m * sum(stages[j].parts[k] for j in mine) for k in ("compute", "recompute", "tp_comm", "cp_comm",
                                                                   "ep_comm", "runtime", "offload")}
    out = {k: v for k, v in out.items() if v or k not in ("runtime", "offload")}
    out["ep_comm"] += step_terms.get("ep_comm", 0.0)
    busy = m * sum(stages[j].fwd + stages[j].bwd for j in mine)
    out.update(p2p=0.0, bubble=max(0.0, pipe_s - busy), dp_comm=step_terms["dp_comm"], optimizer=step_terms["optimizer"])
    out.update({k: step_terms[k] for k in ("sync", "overhead") if step_terms.get(k)})
    if pp > 1 and p2p:  # p2p inside the pipeline time: split the idle time between bubble and transfers
        out["p2p"] = min(out["bubble"], 2 * (m + pp - 1) * p2p)
        out["bubble"] -= out["p2p"]
    return out


def _pipeline(cfg: ParallelConfig, m: int, stages: list[_StageCost], hops: P2pHops, fast: bool,
              p2p_overlap: bool = False, schedule: "ir.Schedule | None" = None, attn=None,
              split: pipe_mod.SplitCost = pipe_mod.SplitCost()):
    """(pipeline seconds, peak in-flight chunks per rank, bubble fraction, PipelineResult or None):
    the simulator with each boundary's hop (a WAN cut charged its latency and bandwidth), or its
    closed form (the slowest hop everywhere) when ``fast``; pp = 1 runs the micro-batches back to
    back. With ``p2p_overlap`` (the engine's asynchronous p2p) the steady state hides every hop:
    the schedule runs without them and only the fill and drain hops are added. A custom schedule
    (``schedule``) and dualpipev are always simulated (no closed form). A WAN boundary carries
    every micro-batch's activation one after another: the step is at least ``wan.link_floor_s``.
    Sequence chunks (``attn``: the stages' ``seq_chunks.ChunkParts``) are simulated, each chunk's
    hop ``1/k`` of a micro-batch's bandwidth part plus a WAN's latency whole (``P2pHops.per_chunk``).
    ``split``: what a backward split into I and W costs (:func:`split_cost`)."""
    fwd, bwd = [st.fwd for st in stages], [st.bwd for st in stages]
    if cfg.pp == 1:
        return m * (fwd[0] + bwd[0]), [1], 0.0, None
    p2p = hops.slowest
    if p2p_overlap and p2p > 0:
        pipe_s, inflight, bubble, result = _pipeline(cfg, m, stages, P2pHops([0.0] * cfg.pp, []), fast,
                                                     schedule=schedule, attn=attn, split=split)
        pipe_s += 2 * sum(hops.hops[:cfg.pp - 1])
    elif cfg.schedule == "custom":
        k, parts = (cfg.seq_chunks, vars(attn)) if attn is not None else (1, {})
        result = pipe_mod.simulate_schedule(schedule, fwd, bwd, p2p=hops.per_chunk(k) or 0.0, check=False,
                                            split=split, **parts)
        pipe_s, inflight, bubble = result.step_s, list(result.peak_inflight_chunks), result.bubble_frac
    elif fast and cfg.schedule not in ir.V_SCHEDULES and attn is None:
        sched, n_stages = cfg.schedule, len(fwd)
        inflight = [inflight_closed(sched, cfg.pp, m, cfg.vpp, r) for r in range(cfg.pp)]
        node_hop = max((h for h, w in zip(hops.hops, hops.is_wan) if not w), default=0.0)
        pipe_s = pipe_mod.estimate_step(sched, cfg.pp, m, fwd, bwd, p2p=node_hop, v=cfg.vpp, split=split)
        t = max(f + b for f, b in zip(fwd, bwd)) * cfg.vpp
        pipe_s += max((wan_mod.stall_s(m, cfg.pp, r, t, h, inflight[r] // cfg.vpp)
                       for r, (h, w) in enumerate(zip(hops.hops[:cfg.pp - 1], hops.is_wan)) if w), default=0.0)
        bubble = 1.0 - m * sum(fwd[j] + bwd[j] for j in range(n_stages)) / cfg.pp / pipe_s
        result = None
    else:
        k, parts = (cfg.seq_chunks, vars(attn)) if attn is not None else (1, {})
        result = simulated(cfg.schedule, cfg.pp, m, fwd, bwd, p2p=hops.per_chunk(k) or 0.0, v=cfg.vpp,
                           seq_chunks=k, split=split, **parts)  # (cost_models/pipeline_memo.py)
        pipe_s, inflight, bubble = result.step_s, list(result.peak_inflight_chunks), result.bubble_frac
    floor = wan_mod.link_floor_s(m, hops.wan_bw, sum(fwd) + sum(bwd))
    if floor > pipe_s:
        busy = 1.0 - bubble
        pipe_s, bubble = floor, 1.0 - busy * pipe_s / floor
    return pipe_s, inflight, bubble, result


def split_cost(cluster: Cluster, profile=None) -> pipe_mod.SplitCost:
    """What a backward split into I and W costs in autopar's runtime (torch's schedule runtime) on
    ``cluster``: the first virtual stage's whole backward in its W, and every other stage's I and W
    ``1 + split_backward_frac`` times their shares (cost_models/cpu_runtime.py: the profile's
    measured figure, else the default, on a CPU cluster; on GPUs the profile's, else none)."""
    runtime = getattr(profile, "runtime", None) or {}
    if cluster.backend == "gloo" or "split_backward_frac" in runtime:
        return pipe_mod.SplitCost(extra=runtime_figure("split_backward_frac", profile), first_whole=True)
    return pipe_mod.SplitCost(first_whole=True)


def _shared_core_speedup(cluster: Cluster, cfg: ParallelConfig, bubble: float, result) -> float:
    """Compute speedup of a pipeline whose ranks share a node's cores (cost_models/shared_cores.py):
    the concurrency from the simulated events, or ``pp (1 - bubble)`` from the closed form."""
    cores = cluster.cores_per_node
    ranks = min(cfg.world, cluster.devices_per_node)
    if cfg.pp == 1 or not shares_cores(cores, ranks):  # (spares simulating the events)
        return 1.0
    c_pp = compute_concurrency(result.events) if result is not None else max(1.0, cfg.pp * (1.0 - bubble))
    return core_speedup(cores, ranks, c_pp * ranks / cfg.pp)
