"""The data-parallel traffic of one training step and the optimizer step, priced (seconds).

- DP (over the flattened dp x cp group, since CP ranks hold the same weights), as the runtime
  (codegen/runtime/data_parallel.py) does it: DDP (FSDP2 ``replicate``) all-reduces gradients once
  per step (accumulation over micro-batches skips the sync); ZeRO-1 is that all-reduce plus, after
  the optimizer step, each parameter broadcast from the rank that updated it (priced as an
  all-gather of the parameters; not overlapped). ZeRO-2 and FSDP (``fully_shard``) without a
  pipeline reduce-scatter gradients every micro-batch and all-gather parameters every micro-batch
  (FSDP twice: forward and backward); under a pipeline schedule torch's stages keep parameters
  unsharded and skip gradient sync until the last micro-batch, so it is one all-gather and one
  reduce-scatter per step. Each is issued per wrapped unit (cost_models/dp_units.py: each block,
  and the stage root holding the other layers): one call each, with its share of the bytes (and its
  own latency) - except DDP / ZeRO-1 without a pipeline or TP (``planner.sharding.uses_ddp_reducer``),
  which all-reduce per 25 MiB bucket. **Overlap assumption**: gradient traffic overlaps the backward of the last
  micro-batch (per-micro-batch FSDP/ZeRO-2 traffic the whole forward and backward), with efficiency
  ``OVERLAP[backend]`` (streams on NCCL overlap well; gloo shares the CPU with compute), or a
  calibration's fitted ``overlap``; none where every core runs a rank (no core for the
  communication thread: it competes with the compute it would hide behind), calibrated or not.
  :func:`exposed_s`: the last call (unit or bucket: its reduction starts only when the backward is
  over) is always exposed; the rest only where it exceeds the window.
- Optimizer: AdamW over every parameter the rank updates, at the device's effective memory bandwidth
  (``compute.memory_bandwidth``): the engine's bytes per parameter
  (``Engine.optimizer_bytes_per_param``: a fused kernel in autopar's runtime, Megatron and
  torchtitan; the eight passes of a foreach AdamW otherwise). Measured here: the fused CPU kernel
  0.6 ns per parameter (6.4 M parameters, 2 threads, 4.0 ms; the default per-parameter loop
  16.3 ms).

The step composes these with the pipeline (cost_models/estimate.py): :func:`dp_and_optimizer`
gives the exposed DP communication and the optimizer step of the busiest pipeline rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models import comm as comm_mod
from cost_models.cluster import Cluster
from cost_models.compute import memory_bandwidth
from cost_models.cpu_runtime import wrapper_unit_s
from cost_models.dp_units import stage_unit_params, stage_units
from cost_models.engines import Engine, exposed_s
from cost_models.experts import ep_mesh
from cost_models.memory import LayerTable
from cost_models.profile_db import FSDP_UNIT, calibration
from cost_models.model_states import dp_group
from cost_models.shared_cores import spare_core
from cost_models.wan_cost import hsdp_replicas, outer_step_s
from planner.graph import ModelGraph
from planner.low_comm import parse_low_comm
from planner.plan import ParallelConfig, Partition
from planner.precision import DTYPE_BYTES, GRAD_REDUCE_BYTES, MASTER_BYTES, mixed_precision
from planner.sharding import (DDP_BUCKET_BYTES, SHARDED_PARAMS, expert_replicas, shard_ranks, uses_ddp_reducer,
                              zero1_broadcasts)

# DP-communication overlap efficiency where the engine overlaps it: nccl 0.82 fitted on the
# published runs (benchmarks/published_runs.py --fit; prior 0.8), gloo from the local fidelity runs.
OVERLAP = {"nccl": 0.82, "gloo": 0.3}

@dataclass(frozen=True)
class DpTraffic:
    """Gradient / parameter traffic of the dp x cp group in one step, seconds."""
    overlappable: float   # may hide behind compute
    after_step: float     # after the optimizer step (ZeRO-1's parameter broadcast)
    last_call: float      # its last call, which nothing follows to hide it


def dp_comm(cluster: Cluster, cfg: ParallelConfig, m: int, params: float, units: int, profile,
             comm_src: set, engine: Engine, experts: bool = False, fp8_share: float = 0.0,
             unit_params: list[float] | None = None) -> DpTraffic:
    """The dp x cp group's traffic as the runtime issues it: one call per DDP bucket under DDP's
    reducer (``uses_ddp_reducer``), one per wrapped unit of the rank (``units``) otherwise; for
    the routed experts (``experts``) over their own data-parallel group (``model_states.dp_group``,
    ``cost_models.experts.ep_mesh``). FSDP every micro-batch, where the profile measured FSDP2
    units by size (``unit_params``, given where :func:`fsdp_units_priced`), at those times
    (:func:`fsdp_measured_s`)."""
    dpg = dp_group(cfg, experts)
    if dpg == 1:
        return DpTraffic(0.0, 0.0, 0.0)
    flat = ep_mesh(cfg) if experts else comm_mod.Mesh(pp=cfg.pp, dp=dpg, cp=1, tp=cfg.tp)
    grads = params * GRAD_REDUCE_BYTES  # gradients are reduced in fp32 (planner.precision.mixed_precision)
    calls = max(1, math.ceil(grads / DDP_BUCKET_BYTES)) if uses_ddp_reducer(cfg.zero, cfg.pp, cfg.tp, cfg.dtype) \
        else units
    k = expert_replicas(cfg.ep, hsdp_replicas(cluster, cfg)) if experts else hsdp_replicas(cluster, cfg)  # > 1: HSDP

    def ct(kind: str, per_param: float = GRAD_REDUCE_BYTES, n_calls: int = calls) -> float:
        if k > 1 and kind in ("all_gather", "reduce_scatter"):
            return hsdp_time(kind, params * per_param / n_calls, cluster, cfg, dpg, k, profile, comm_src) * n_calls
        # across cluster groups the runtime runs DP flat where dp_replicas says 1 (one ring)
        e = comm_mod.collective_time(kind, params * per_param / n_calls, cluster, flat, "dp", profile,
                                     flat=k == 1)
        comm_src.add(e.source)
        return e.seconds * n_calls

    per_microbatch = m if per_microbatch_dp(cfg) else 1
    # parameters are gathered as their compute copies; under float8 tensorwise the blocks' linears
    # (``fp8_share`` of them) as float8 (torchao's FSDP float8 all-gather)
    f8 = fp8_share if cfg.fp8 == "tensorwise" else 0.0
    gather = DTYPE_BYTES[cfg.dtype] * (1 - f8) + 1.0 * f8
    # the owners send the updated parameters: Megatron's distributed optimizer its compute copies,
    # autopar's ShardedOptimizer its fp32 masters in buckets per owner (``zero1_broadcasts`` calls)
    after = 0.0 if cfg.zero != "zero1" else ct("all_gather", gather) if engine.dist_opt_reduce_scatter \
        else ct("all_gather", MASTER_BYTES, zero1_broadcasts(params * MASTER_BYTES, dpg))
    if cfg.zero == "zero1" and engine.dist_opt_reduce_scatter:
        comm = ct("reduce_scatter")  # each owner receives only its shard's gradients
    elif cfg.zero in ("ddp", "zero1"):
        comm = ct("all_reduce")
    elif cfg.zero == "zero2":
        comm = per_microbatch * (ct("reduce_scatter") + ct("all_gather", gather))
    else:
        gathers = 2 if per_microbatch_dp(cfg) else 1  # fsdp: forward and backward, unless held by the pipeline
        measured = None if unit_params is None else \
            fsdp_measured_s(cluster, cfg, flat, unit_params, profile, wrapped_in_stage=not experts)
        if measured is not None:
            comm_src.add("profile")
        comm = per_microbatch * (measured if measured is not None else
                                 gathers * ct("all_gather", gather) + ct("reduce_scatter"))
    return DpTraffic(comm, after, comm / (per_microbatch * calls))


def fsdp_measured_s(cluster: Cluster, cfg: ParallelConfig, flat: comm_mod.Mesh, unit_params: list[float],
                    profile, wrapped_in_stage: bool = True) -> float | None:
    """One micro-batch of FSDP's traffic, seconds: each unit of ``unit_params`` parameters (per
    rank, unsharded) at what the profile measured an FSDP2 unit of its fp32 bytes to add to a
    forward and backward over the ``flat`` mesh's dp group (``comm.fsdp_units_time``: its two
    all-gathers and its reduce-scatter with their buffers and copies, as FSDP2 issues them on
    gloo, which its collectives timed alone do not show above about 16 MiB:
    ``cost_models.profile_runtime``), less the wrapper's fixed per-unit work the stage times
    already hold (``cpu_runtime.wrapper_unit_s``, counted by ``dp_units.stage_units``; not the
    routed experts' units: ``wrapped_in_stage`` False). None where the group has no such figures
    (across nodes): the collectives price it."""
    fixed = sum(wrapper_unit_s(cluster, cfg, profile)) if wrapped_in_stage else 0.0
    return comm_mod.fsdp_units_time([p * DTYPE_BYTES["fp32"] for p in unit_params], cluster, flat, "dp", profile,
                                    less=fixed)


def fsdp_units_priced(cluster: Cluster, cfg: ParallelConfig, profile) -> bool:
    """Whether FSDP is priced by its units as the profile measured them (:func:`fsdp_measured_s`):
    FSDP every micro-batch (no pipeline), fp32 (the profile's units gather fp32 parameters; mixed
    precision gathers bf16 copies, float8 tensorwise float8 ones), no HSDP, and a profile with
    ``profile_db.FSDP_UNIT`` samples (CPU profiles). Else the collectives price it."""
    return (cfg.zero == "fsdp" and per_microbatch_dp(cfg) and not mixed_precision(cfg.dtype) and cfg.fp8 != "tensorwise"
            and hsdp_replicas(cluster, cfg) == 1 and profile is not None and profile.measured(FSDP_UNIT))


def hsdp_time(kind: str, nbytes: float, cluster: Cluster, cfg: ParallelConfig, dpg: int, k: int, profile,
               comm_src: set) -> float:
    """One FSDP2 HSDP collective over a dp group of ``dpg`` ranks replicated across ``k`` cluster
    groups (``wan_cost.hsdp_replicas``), seconds: the parameters' all-gather inside a group only;
    the gradients' reduce-scatter inside a group, then the all-reduce of its shard (``1 / g`` of
    the bytes) across the groups by the ``g`` ranks at each place of a group."""
    g = dpg // k
    inner = comm_mod.collective_time(kind, nbytes, cluster, comm_mod.Mesh(pp=cfg.pp, dp=g, cp=1, tp=cfg.tp),
                                     "dp", profile) if g > 1 else None
    t = inner.seconds if inner is not None else 0.0
    if inner is not None:
        comm_src.add(inner.source)
    if kind == "reduce_scatter":
        across = comm_mod.Mesh(pp=cfg.pp, dp=k, cp=1, tp=g * cfg.tp)  # the ranks at one place in each group
        t += comm_mod.collective_time("all_reduce", nbytes / g, cluster, across, "dp", profile).seconds
    return t


def dp_and_optimizer(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, partition: Partition, table: LayerTable,
                      on_rank: list[list[int]], mine: list[int], m: int, rank_fb: tuple[float, float], profile,
                      comm_src: set, engine: Engine) -> tuple[float, float]:
    """(exposed DP communication, optimizer step) seconds: the gradient / parameter traffic of the
    rank holding the most parameters (routed experts over their own group), hidden behind the
    busiest rank's (``mine``) backward, or its whole step when FSDP / ZeRO-2 communicate every
    micro-batch (forward and backward per micro-batch: ``rank_fb``), and its AdamW pass."""
    cal = calibration(profile)
    held = [(sum(table.params[i] for j in js for i in range(*partition.bounds[j])),
             sum(table.experts[i] for j in js for i in range(*partition.bounds[j]))) for js in on_rank]
    P, Pe = max(held)  # the rank with the most parameters, and its routed experts' share
    lin = max(sum(table.fp8_params[i] for j in js for i in range(*partition.bounds[j])) for js in on_rank)
    units = max(1, sum(stage_units(graph, table, cfg, *partition.bounds[j]) for j in mine))  # as the runtime wraps
    priced = fsdp_units_priced(cluster, cfg, profile)  # (before listing units: a GPU search's candidates skip it)
    sizes = [p for j in mine for p in stage_unit_params(graph, table, cfg, *partition.bounds[j])] if priced else None
    own = Pe if cfg.ep > 1 else 0.0  # the routed experts' own units: under EP only (else in their blocks')
    dp = dp_comm(cluster, cfg, m, P - own, units, profile, comm_src, engine,
                 fp8_share=lin / (P - own) if cfg.fp8 != "none" and P > own else 0.0, unit_params=sizes)
    if own:  # one FSDP unit per routed-experts module (codegen/runtime/data_parallel.py shard_experts)
        e_sizes = [p for j in mine for p in stage_unit_params(graph, table, cfg, *partition.bounds[j], experts=True)]
        ex = dp_comm(cluster, cfg, m, own, max(1, len(e_sizes)), profile, comm_src, engine, experts=True,
                     unit_params=e_sizes if priced else None)
        dp = DpTraffic(dp.overlappable + ex.overlappable, dp.after_step + ex.after_step, max(dp.last_call, ex.last_call))
    ov = cal.get("overlap", OVERLAP.get(cluster.backend, 0.5)) if engine.dp_overlap else 0.0
    if not spare_core(cluster.cores_per_node, min(cfg.world, cluster.devices_per_node)):
        ov = 0.0  # no spare core for the communication thread: it competes with the compute it would hide behind
    window = (m * sum(rank_fb) if per_microbatch_dp(cfg) else rank_fb[1]) * ov
    after = exposed_s(dp.after_step, rank_fb[0] * ov) if engine.param_gather_overlap else dp.after_step
    dp_exposed = exposed_s(dp.overlappable, window, dp.last_call) + after
    low = parse_low_comm(cfg.low_comm)  # low-communication DP: one blocking exchange every H steps
    dp_exposed += outer_step_s(cluster, cfg, (P - Pe) / (dp_group(cfg) if cfg.zero == "fsdp" else 1), profile) / (
        low.every if low else 1)
    dp_exposed += token_local_sync_s(cluster, cfg, partition, table, on_rank, profile, comm_src)
    shard, shard_e = (1, 1) if cfg.zero == "ddp" else (dp_group(cfg), dp_group(cfg, experts=True))
    if cfg.zero in SHARDED_PARAMS and (k := hsdp_replicas(cluster, cfg)) > 1:  # HSDP: one group's ranks shard
        shard, shard_e = shard_ranks(shard, k), shard_ranks(shard_e, expert_replicas(cfg.ep, k))
    opt_params = (P - Pe) / shard + Pe / shard_e
    opt_s = engine.optimizer_bytes_per_param * opt_params / memory_bandwidth(cluster, cal)
    return dp_exposed, opt_s * cal.get("opt_scale", 1.0)


def token_local_sync_s(cluster: Cluster, cfg: ParallelConfig, partition: Partition, table: LayerTable,
                        on_rank: list[list[int]], profile, comm_src: set) -> float:
    """The once-per-step all-reduce over tp of the gradients of the MoE parameters every tp rank
    holds whole (``memory.layer_token_local``), on the rank holding the most of them, after
    the backward (nothing hides it); sharded over dp x cp by FSDP / ZeRO-2."""
    held = max((sum(table.token_local[i] for j in js for i in range(*partition.bounds[j])) for js in on_rank),
               default=0.0)
    if not held:
        return 0.0
    nbytes = held * GRAD_REDUCE_BYTES / (dp_group(cfg) if cfg.zero in SHARDED_PARAMS else 1)
    mesh = comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp)
    e = comm_mod.collective_time("all_reduce", nbytes, cluster, mesh, "tp", profile)
    comm_src.add(e.source)
    return e.seconds


SYNC_BYTES = 8  # one float64 / float32 scalar: the loss sum, a squared gradient norm


def step_sync_s(cluster: Cluster, cfg: ParallelConfig, profile, comm_src: set) -> float:
    """The step's own blocking scalar all-reduces after the backward, seconds (latency-bound): the
    loss over all ranks (codegen/runtime/train.py ``global_loss``), and the squared gradient norm
    (codegen/runtime/optim.py ``clip_grad_norm_``) over every mesh dimension gradients are
    sharded on - dp x cp under FSDP / ZeRO-2 (and the experts' own group under EP), tp under
    TP (with FSDP the TP-sharded gradients reduce over both) - and over pp; under sequence
    parallel, the gradients left partial over tp (the norms' and the row-parallel biases', reduced
    before the norm) in one flat all-reduce, latency-bound like the scalars (a few vectors of the
    hidden size). Replicated gradients (DDP, ZeRO-1 without TP) add nothing beyond the loss's call."""
    dims = []  # (mesh, dim) of each call after the loss's
    mesh = comm_mod.Mesh(pp=cfg.pp, dp=dp_group(cfg), cp=1, tp=cfg.tp)
    sharded = cfg.zero in SHARDED_PARAMS
    if sharded:
        dims += [(mesh, "dp")] * (2 if cfg.tp > 1 else 1) + ([(ep_mesh(cfg), "dp")] if cfg.ep > 1 else [])
    tp_calls = (2 if cfg.sp else 1) if cfg.tp > 1 else 0  # the norm's, and sequence parallel's partial gradients
    dims += [(mesh, "tp")] * tp_calls + [(mesh, "pp")] * (cfg.pp > 1)
    world = comm_mod.Mesh(pp=1, dp=cfg.world, cp=1, tp=1)
    total = 0.0
    for m, dim in [(world, "dp")] + dims:
        e = comm_mod.collective_time("all_reduce", SYNC_BYTES, cluster, m, dim, profile)
        comm_src.add(e.source)
        total += e.seconds
    return total


def per_microbatch_dp(cfg: ParallelConfig) -> bool:
    """ZeRO-2 / FSDP without a pipeline communicate every micro-batch (module docstring)."""
    return cfg.zero in SHARDED_PARAMS and cfg.pp == 1
