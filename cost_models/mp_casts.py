"""The per-micro-batch copies of FSDP2's mixed precision on a GPU, seconds per pipeline stage.

Under a mixed-precision plan (``planner.precision.mixed_precision``) autopar's runtime wraps every
layout in FSDP2 with one ``MixedPrecisionPolicy`` (codegen/runtime/precision.py): fp32 masters,
compute-dtype copies gathered per unit, gradients reduced and accumulated in fp32; torchtitan runs
the same policy. Besides the collectives (cost_models/dp_cost.py) each unit's parameters and
gradients then pass through memory-bound kernels, per element (bytes):

- an unshard casts the rank's fp32 shard to the compute dtype (read 4, write 2 per element of the
  shard) and copies the gathered copy out of the all-gather buffer into the parameters (read 2,
  write 2 per element of the unit). Without a pipeline a unit unshards for every forward call,
  and again for its backward when it reshards after the forward
  (``planner.sharding.reshard_after_forward``); a pipeline schedule keeps its stages gathered for
  the step's micro-batches: one unshard per step, its share per micro-batch;
- every backward call casts the unit's compute-dtype gradients to fp32 (read 2, write 4 per element
  of the unit) and adds them to the fp32 gradient it keeps (read 4 + 4, write 4 per element): its
  shard when it reduce-scatters every micro-batch (FSDP / ZeRO-2 without a pipeline), the whole
  unit when gradients accumulate unsynced until the last micro-batch (``replicate``, pipelines).

Per-call work is paid by every sequence chunk (cost_models/seq_chunks.py); the pipeline's once-
per-step unshard is not. The bytes run at the kernel model's HBM rate (``gpu_kernels.memory_seconds``),
two kernels per pass (a unit's foreach cast and its copy or add; a unit per layer holding
parameters, as the runtime wraps blocks). The stage ILP adds the same per layer
(planner/search/stage_split.py), so both price a stage alike. Engines without FSDP2's policy (Megatron-Core: bf16 parameters, fp32 main gradients
accumulated by its fused weight-gradient GEMMs) pay none of it (``Engine.fsdp2_mixed_precision``);
fp32 plans and CPU clusters (whose wrappers' measured work is ``cpu_runtime.wrapper_unit_s``) neither.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import gpu_kernels as gk
from cost_models.cluster import Cluster
from cost_models.engines import Engine
from cost_models.memory import layer_params_local
from cost_models.model_states import dp_group
from planner.graph import Layer, ModelGraph
from planner.plan import ParallelConfig
from planner.precision import DTYPE_BYTES, GRAD_REDUCE_BYTES, MASTER_BYTES, mixed_precision
from planner.sharding import SHARDED_PARAMS, reshard_after_forward

KERNELS_PER_PASS = 2  # per unit: the foreach cast and the copy (or the add)


@dataclass(frozen=True)
class MpCasts:
    """One layer's (or stage's) mixed-precision copies for one micro-batch, seconds: what every
    forward and backward call pays (each sequence chunk is a call), and the pipeline's once-per-step
    unshard's share of a micro-batch (paid by the forward)."""
    per_call_fwd: float = 0.0
    per_call_bwd: float = 0.0
    per_microbatch_fwd: float = 0.0

    @property
    def fwd(self) -> float:
        """The forward's seconds per micro-batch (whole sequences)."""
        return self.per_call_fwd + self.per_microbatch_fwd

    def __add__(self, o: "MpCasts") -> "MpCasts":
        return MpCasts(self.per_call_fwd + o.per_call_fwd, self.per_call_bwd + o.per_call_bwd,
                       self.per_microbatch_fwd + o.per_microbatch_fwd)


def layer_mp_casts(layer: Layer, graph: ModelGraph, cfg: ParallelConfig, m: int, cluster: Cluster,
                   cal: dict[str, float] | None, engine: Engine) -> MpCasts:
    """The copies of ``layer`` (one wrapped unit when it holds parameters) under ``cfg`` with ``m``
    micro-batches per step (module docstring); zero off FSDP2's policy, in fp32 and on CPU clusters."""
    if cluster.backend == "gloo" or not (engine.fsdp2_mixed_precision and mixed_precision(cfg.dtype)):
        return MpCasts()
    full = layer_params_local(layer, cfg.tp, cfg.pp, cfg.ep, graph.hidden)
    if not full:
        return MpCasts()
    shard = full / (dp_group(cfg) if cfg.zero in SHARDED_PARAMS else 1)
    elem = DTYPE_BYTES[cfg.dtype]
    unshard = (MASTER_BYTES + elem) * shard + 2 * elem * full
    synced = cfg.zero in SHARDED_PARAMS and cfg.pp == 1  # reduce-scattered every micro-batch
    grads = (elem + GRAD_REDUCE_BYTES) * full + 3 * GRAD_REDUCE_BYTES * (shard if synced else full)
    gpu, co = gk.gpu_spec(cluster, cfg.dtype), gk.GpuCoefficients.of(cal)
    bwd = gk.memory_seconds(grads, KERNELS_PER_PASS, gpu, co)
    if cfg.pp > 1:
        return MpCasts(0.0, bwd, gk.memory_seconds(unshard, KERNELS_PER_PASS, gpu, co) / m)
    again = reshard_after_forward(cfg.zero, cfg.pp, dp_group(cfg))
    fwd = gk.memory_seconds(unshard, KERNELS_PER_PASS, gpu, co)
    return MpCasts(fwd, bwd + (fwd if again else 0.0), 0.0)


def stage_mp_casts(graph: ModelGraph, cfg: ParallelConfig, lo: int, hi: int, m: int, cluster: Cluster,
                   cal: dict[str, float] | None, engine: Engine) -> MpCasts:
    """The copies of the stage holding layers ``lo:hi``: its layers' summed."""
    return sum((layer_mp_casts(graph.layers[i], graph, cfg, m, cluster, cal, engine) for i in range(lo, hi)),
               MpCasts())
