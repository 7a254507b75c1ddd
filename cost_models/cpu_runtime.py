"""The CPU runtime's own work per micro-batch, beside the layers' compute and the collectives.

On a local CPU cluster (gloo, eager PyTorch, one Python thread driving each rank) the
machinery that makes a layout run costs CPU time of its own, per micro-batch, that neither
the roofline nor the collectives' alpha-beta times contain. Priced here as mechanisms, each
a count the layout decides times a per-call figure measured on this machine's kind of CPU
(torch 2.13, 2 gloo ranks of one thread on a 2-core Xeon; how each was measured is written
beside it; the profiler measures them again on the same setups, each paired round by round with
what it adds to, below):

- **Data-parallel wrappers** (codegen/runtime/data_parallel.py), per wrapped unit (each block
  and the stage root: ``cost_models.dp_units.stage_units`` counts them) and micro-batch, forward and backward:
  FSDP2's ``replicate`` (ddp / zero1 with TP parameters or a pipeline) copies each parameter
  in and out of its buffers and runs its hooks: ``CPU_REPLICATE_UNIT_S``; ``fully_shard``
  (fsdp / zero2) adds its unshard / reshard bookkeeping and the copies around every
  all-gather beyond the collective itself: ``CPU_FSDP_UNIT_S``, and around every gradient
  reduce-scatter (each micro-batch without a pipeline): ``CPU_FSDP_REDUCE_UNIT_S``. DDP's
  bucketed reducer (``planner.sharding.uses_ddp_reducer``) measured 0.006-0.02 ms per unit: 0.
  What grows with a unit's size (FSDP2's fresh gather / reduce buffers and copies, fresh pages
  above 64 MiB) a profile measures by unit size, and ``cost_models.dp_cost.fsdp_measured_s``
  prices each unit at it, less these fixed figures.
- **DTensor dispatch** per TP-sharded module and micro-batch (sharding propagation, wrapping and
  unwrapping local tensors, the conversions' autograd nodes), priced with the layer time
  (``cost_models.dtensor_dispatch.dtensor_dispatch_s`` counts the modules), by kind: a column or
  row linear (or vocabulary embedding), whose blocking collectives run between compute,
  ``CPU_DTENSOR_MODULE_S``; a sequence-parallel norm, which converts its shard and issues no
  collective, ``CPU_DTENSOR_NORM_S``.
- **EP dispatch on gloo** (codegen/runtime/expert_parallel.py ``TokenDispatch``), per MoE
  layer and micro-batch: beside the count exchange and the two row all-to-alls that
  cost_models/experts.py prices from the collective model, the host copies of the counts
  (``.tolist()``), the sort of the received rows by expert, and torch's functional uneven
  all-to-all with its autograd node and wait: ``CPU_EP_DISPATCH_S``, forward and backward.

- **The lockstep wait** of tensor parallelism's blocking collectives: each call waits until the
  last rank of the group arrives, and ranks that ran the same segment of compute arrive apart
  (their cores' speed wanders), more so after a longer segment; the profile's collectives are
  timed back to back, without it. Priced as a share of the layer's compute:
  ``CPU_LOCKSTEP_WAIT_FRAC`` (:func:`lockstep_wait_s`, in the layer's ``tp_comm``). The profiler
  does not measure it: the same pairing inside a profile (GEMMs for 8 ms, then the all-reduce,
  against each alone, in batches behind a barrier) gave 0.00, 0.04, 0.07 and 0.19 in four tries.
- **A backward split into I and W** (zero-bubble and generated schedules): torch's split walks the
  autograd graph twice (the input gradients keeping the intermediates, then the weight gradients
  from them), which costs more than one whole backward: ``CPU_SPLIT_BACKWARD_FRAC`` of the
  backward, priced by the pipeline simulator (``cost_models.pipeline.SplitCost``; the estimate's ``split_cost``).

Nothing on GPU clusters (there the host runs ahead of the kernels; unmeasured: 0). A profile
of the cluster (``autopar profile``) and the first-run machine calibration
(``planner.entry.calibration``) measure the wrappers', the EP dispatch's and DTensor's figures
again on their ranks (``cost_models.profile_runtime.measure_runtime``, the same setups as the
defaults, each paired round by round with what it adds to: the unwrapped stack with the
collectives the wrapper issues, those of its units with parameters, back to back, where the
defaults took the collectives timed alone for every unit, about 0.05 ms per unit more;
``ProfileDB.runtime``), and ``autopar profile`` the split backward's with the layers; a measured
figure replaces the default. The calibration keys ``replicate_unit_s``,
``fsdp_unit_s``, ``fsdp_reduce_unit_s``, ``ep_dispatch_s``, ``dtensor_module_s`` and ``dtensor_norm_s``
replace the measured figures where a calibration gives them (``autopar calibrate`` does not fit them:
a CPU roofline fit stores the two DTensor figures scaled with the layers, cost_models/calibrate.py).
"""
from __future__ import annotations

from cost_models.cluster import Cluster
from cost_models.profile_db import calibration
from planner.graph import Layer
from planner.plan import ParallelConfig
from planner.sharding import dp_wrapper

# Medians of four runs of 2 gloo ranks (one thread each, pinned by nothing, load average 1-3),
# per unit and micro-batch, forward + backward, over an unwrapped stack of 8 units of two
# 64 x 64 linears on [4, 16, 64]: replicate 0.24 / 0.29 / 0.24 / 0.28 ms (0.27 at 4 ranks);
# fully_shard with gradient sync off, less its two all-gathers of the unit (0.21 ms each),
# 1.3 / 1.5 / 2.3 / 3.3 ms; sync on over sync off, less the unit's reduce-scatter (0.30-0.43
# ms), 1.3 / 3.0 / 1.3 / 0.7 ms.
CPU_REPLICATE_UNIT_S = 0.26e-3
CPU_FSDP_UNIT_S = 1.9e-3
CPU_FSDP_REDUCE_UNIT_S = 1.3e-3
# One MoE layer's TokenDispatch forward + backward (64 rows of 64, 4 experts over 2 ranks) less
# the local expert GEMMs, four row all-to-alls and one count all-to-all timed alone: 6.9 / 1.4 /
# 2.8 / 3.1 ms (8.2 at 4 ranks on the 2 cores: waiting, not computing, so not scaled by them).
CPU_EP_DISPATCH_S = 3.0e-3
# 2 gloo ranks, 16 column + row linear pairs of 64 features (32 per rank) on 16 tokens, forward +
# backward under torch's ColwiseParallel / RowwiseParallel over the same pairs as plain local
# shards, less the 32 all-reduces timed alone (31 of them issued: the first input took no
# gradient): 45.2 ms against 0.84 ms, 7.7 ms of it the all-reduces, 2026-12-03 (per module: DTensor's dispatch, and what its blocking all-reduces cost
# between compute beyond back to back); again as the profile measures it (the local shards and
# their all-reduces paired with the DTensor stack, cost_models.profile_runtime) 0.90-1.32 ms in
# nine tries, 2026-12-07.
CPU_DTENSOR_MODULE_S = 1.15e-3
# 2 gloo ranks, 16 RMSNorms of 64 features under torch's SequenceParallel, each handed the local
# sequence shard [2, 16, 64] and its output taken back to local (as a block's residual stream
# reaches its norms), forward + backward, against the same norms plain on the shard, paired as the
# profile pairs them: 0.41 / 0.42 / 0.43 ms per norm (0.26-0.27 chained DTensor to DTensor), while
# the linear pairs' figure read 0.94-1.08 ms in the same launches, 2026-12-07 (before, every
# sequence-parallel norm was priced at the linears' figure).
CPU_DTENSOR_NORM_S = 0.42e-3

# A llama-fid block (hidden 512, one thread, one process, [1, 128, 512]) whose backward runs split as
# the schedule runtime splits it (codegen.runtime.torch_compat.split_backward), over its whole
# backward: +6% / +11% / +4% (one, two, four blocks), +5-8% at 512 tokens, +12-16% at 32 (the second
# walk's fixed part weighs more).
CPU_SPLIT_BACKWARD_FRAC = 0.08

# 2 gloo ranks of one thread on the 2-core VM, 2026-12-05, 60 iterations x 3 trials (medians): fp32
# 384 x 384 GEMMs, then a 1 KB all-reduce, against the GEMMs alone and the all-reduce alone (1.0-2.2
# ms): segments of 6.7 / 16.2 ms waited 1.05 / 1.92 ms more per call (15.8% / 11.9% of the segment),
# again an hour later 5.0 / 14.3 ms -> 1.03 / 1.71 ms (20.4% / 12.0%); segments of 0.05-1.6 ms nothing.
CPU_LOCKSTEP_WAIT_FRAC = 0.12

DTENSOR_KEYS = ("dtensor_module_s", "dtensor_norm_s")  # per TP-sharded linear; per sequence-parallel norm
KEYS = ("replicate_unit_s", "fsdp_unit_s", "fsdp_reduce_unit_s", "ep_dispatch_s", "dtensor_module_s",
        "dtensor_norm_s", "split_backward_frac", "lockstep_wait_frac")
DEFAULTS = {"replicate_unit_s": CPU_REPLICATE_UNIT_S, "fsdp_unit_s": CPU_FSDP_UNIT_S,
            "fsdp_reduce_unit_s": CPU_FSDP_REDUCE_UNIT_S, "ep_dispatch_s": CPU_EP_DISPATCH_S,
            "dtensor_module_s": CPU_DTENSOR_MODULE_S, "dtensor_norm_s": CPU_DTENSOR_NORM_S,
            "split_backward_frac": CPU_SPLIT_BACKWARD_FRAC, "lockstep_wait_frac": CPU_LOCKSTEP_WAIT_FRAC}


def measured(key: str, profile=None) -> float:
    """One per-call figure (seconds) as measured: the profile's (``ProfileDB.runtime``, written by
    ``cost_models.profile_runtime.measure_runtime``), else the default measured above."""
    return (getattr(profile, "runtime", None) or {}).get(key, DEFAULTS[key])


def figure(key: str, profile=None) -> float:
    """One per-call figure (seconds) as priced: the profile's calibrated value, else :func:`measured`."""
    return calibration(profile).get(key, measured(key, profile))


def wrapper_unit_s(cluster: Cluster, cfg: ParallelConfig, profile=None) -> tuple[float, float]:
    """(forward, backward) seconds the data-parallel wrapper adds per wrapped unit and
    micro-batch under ``cfg`` on ``cluster`` (module docstring); (0, 0) on GPUs, without a
    wrapper (``planner.sharding.dp_wrapper``) and under DDP's reducer. A third in the forward (the pre-forward
    gather or copy-in), the rest in the backward (copy-out, reduction bookkeeping)."""
    dp = cfg.dp * cfg.cp
    wrapper = dp_wrapper(cfg.zero, cfg.pp, cfg.tp, dp, cfg.dtype)
    if cluster.backend != "gloo" or wrapper in ("none", "ddp-reducer"):
        return 0.0, 0.0
    if wrapper == "fully_shard":
        s = figure("fsdp_unit_s", profile)
        if cfg.pp == 1:  # gradients reduce-scattered every micro-batch (pipelines: once per step)
            s += figure("fsdp_reduce_unit_s", profile)
    else:
        s = figure("replicate_unit_s", profile)
    return s / 3, 2 * s / 3


def ep_dispatch_s(layer: Layer, cluster: Cluster, cfg: ParallelConfig, profile=None) -> tuple[float, float]:
    """(forward, backward) seconds of the EP dispatch's host-side work in one MoE ``layer`` per
    micro-batch on a CPU cluster (module docstring), half each way; (0, 0) without experts,
    without EP or on GPUs."""
    if layer.moe is None or cfg.ep == 1 or cluster.backend != "gloo":
        return 0.0, 0.0
    s = figure("ep_dispatch_s", profile)
    return s / 2, s / 2


def lockstep_wait_s(compute_s: float, cluster: Cluster, cfg: ParallelConfig, profile=None) -> float:
    """Seconds a layer's blocking tensor-parallel collectives wait for the slowest rank of the
    group on a CPU cluster, beyond their own time, per micro-batch (module docstring): the
    measured ``lockstep_wait_frac`` of ``compute_s``, the layer's forward + backward compute that
    its collectives cut into segments (each call waits for the ranks' spread over the segment
    before it, so the waits add up to a share of the compute between them); 0 on GPUs (the host
    runs ahead and the kernels keep pace) and without TP."""
    if cluster.backend != "gloo" or cfg.tp == 1:
        return 0.0
    return figure("lockstep_wait_frac", profile) * compute_s
