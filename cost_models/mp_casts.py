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
- every backward call that reduce-scatters (FSDP / ZeRO-2 without a pipeline) casts the unit's
  compute-dtype gradients to fp32 into the collective's buffer (read 2, write 4 per element of the
  unit) and adds the reduced shard to the fp32 gradient it keeps (read 4 + 4, write 4 per element of
  the shard). Where gradients accumulate unsynced until the last micro-batch (``replicate``,
  pipelines: torch's schedules turn the sync off for all but the last backward), FSDP2 adds the
  call's compute-dtype gradient into the unit's fp32 accumulator in place
  (``FSDPParam.accumulate_unsharded_grad_if_needed``: read 4 + 2, write 4 per element of the unit;
  the first call's cast, read 2 and write 4, is charged the same), and the step's one reduction
  reads the accumulator into the collective's buffer (read 4, write 4 per element of the unit)
  and adds the reduced shard (12 per element of the shard): its share per micro-batch. One
  micro-batch per step without a pipeline reduces at once (the runtime keeps the sync on for the
  last micro-batch: codegen/runtime/data_parallel.sync_gradients).

Per-call work is paid by every sequence chunk (cost_models/seq_chunks.py); the once-per-step
shares are not. The bytes run at the kernel model's HBM rate (``gpu_kernels.memory_seconds``),
two kernels per pass (a unit's foreach cast and its copy or add; a unit per layer holding
parameters, as the runtime wraps blocks). The stage ILP adds the same per layer
(planner/search/stage_split.py), so both price a stage alike. Engines without FSDP2's policy (Megatron-Core: bf16 parameters, fp32 main gradients
accumulated by its fused weight-gradient GEMMs) pay none of it (``Engine.fsdp2_mixed_precision``);
fp32 plans and CPU clusters (whose wrappers' measured work is ``cpu_runtime.wrapper_unit_s``) neither.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from cost_models import gpu_kernels as gk
from cost_models.cluster import Cluster
from cost_models.engines import Engine
from cost_models.memory import layer_params_local
from cost_models.model_states import dp_group
from planner.graph import Layer, ModelGraph
from planner.plan import ParallelConfig
from planner.precision import DTYPE_BYTES, GRAD_REDUCE_BYTES, MASTER_BYTES, mixed_precision
from planner.sharding import SHARDED_PARAMS, ZERO, reshard_after_forward

KERNELS_PER_PASS = 2  # per unit: the foreach cast and the copy (or the add)


@dataclass(frozen=True)
class MpCasts:
    """One layer's (or stage's) mixed-precision copies for one micro-batch, seconds: what every
    forward and backward call pays (each sequence chunk is a call), and the micro-batch's share of
    what is paid once per step: the pipeline's unshard (by the forward), the reduction of gradients
    accumulated unsynced (by the backward)."""
    per_call_fwd: float = 0.0
    per_call_bwd: float = 0.0
    per_microbatch_fwd: float = 0.0
    per_microbatch_bwd: float = 0.0

    @property
    def fwd(self) -> float:
        """The forward's seconds per micro-batch (whole sequences)."""
        return self.per_call_fwd + self.per_microbatch_fwd

    @property
    def bwd(self) -> float:
        """The backward's seconds per micro-batch (whole sequences)."""
        return self.per_call_bwd + self.per_microbatch_bwd

    @property
    def seconds(self) -> float:
        """Forward and backward per micro-batch."""
        return self.fwd + self.bwd

    def _figures(self) -> tuple[float, float, float, float]:
        return self.per_call_fwd, self.per_call_bwd, self.per_microbatch_fwd, self.per_microbatch_bwd

    def __add__(self, o: "MpCasts") -> "MpCasts":
        return MpCasts(*(a + b for a, b in zip(self._figures(), o._figures())))

    def times(self, k: float) -> "MpCasts":
        """Each figure times ``k``."""
        return MpCasts(*(a * k for a in self._figures()))


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
    gpu, co = gk.gpu_spec(cluster, cfg.dtype), gk.GpuCoefficients.of(cal)

    def seconds(nbytes: float) -> float:
        return gk.memory_seconds(nbytes, KERNELS_PER_PASS, gpu, co)

    reducing = (elem + GRAD_REDUCE_BYTES) * full + 3 * GRAD_REDUCE_BYTES * shard  # cast into the buffer, add the shard
    if cfg.pp == 1 and (cfg.zero in SHARDED_PARAMS or m == 1):  # every call reduces
        grads, step = seconds(reducing), 0.0
    else:  # added into the fp32 accumulator in place; the step's one reduction reads it back (4 + 4)
        grads = seconds((elem + 2 * GRAD_REDUCE_BYTES) * full)
        step = seconds(2 * GRAD_REDUCE_BYTES * full + 3 * GRAD_REDUCE_BYTES * shard) / m
    if cfg.pp > 1:
        return MpCasts(0.0, grads, seconds(unshard) / m, step)
    fwd = seconds(unshard)
    return MpCasts(fwd, grads + (fwd if reshard_after_forward(cfg.zero, cfg.pp, dp_group(cfg)) else 0.0), 0.0, step)


def stage_mp_casts(graph: ModelGraph, cfg: ParallelConfig, lo: int, hi: int, m: int, cluster: Cluster,
                   cal: dict[str, float] | None, engine: Engine) -> MpCasts:
    """The copies of the stage holding layers ``lo:hi``: its layers' summed."""
    return _layers_mp_casts(graph, range(lo, hi), cfg, m, cluster, cal, engine)


def least_mp_casts(graph: ModelGraph, cfg: ParallelConfig, m: int, cluster: Cluster, cal: dict[str, float] | None,
                   engine: Engine) -> MpCasts:
    """A lower bound of the copies one micro-batch pays on a rank of ``cfg``'s degrees in every variant
    the search prices (any DP sharding, one sequence chunk: chunks only add calls): the whole model's
    copies under the sharding that pays least, over ``cfg.pp`` (the stages hold the layers between
    them); zero wherever :func:`layer_mp_casts` is. The search's time floors add it so that they stay
    below the estimates that charge the copies."""
    every = range(len(graph.layers))
    each = (_layers_mp_casts(graph, every, cfg.replace(zero=z, seq_chunks=1), m, cluster, cal, engine) for z in ZERO)
    return min(each, key=lambda c: c.seconds).times(1 / cfg.pp)


def _layers_mp_casts(graph: ModelGraph, layers: range, cfg: ParallelConfig, m: int, cluster: Cluster,
                     cal: dict[str, float] | None, engine: Engine) -> MpCasts:
    """The copies of ``layers`` summed: each structurally distinct layer (``Layer.signature``) priced once,
    times how many of them there are."""
    count = Counter(graph.layers[i].signature for i in layers)
    first = {graph.layers[i].signature: graph.layers[i] for i in reversed(layers)}
    return sum((layer_mp_casts(first[sig], graph, cfg, m, cluster, cal, engine).times(n) for sig, n in count.items()),
               MpCasts())
