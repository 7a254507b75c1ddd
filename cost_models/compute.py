"""Layer compute time on one rank: measured profile first, a model otherwise.

On GPU clusters the model is the kernel model of cost_models/gpu_kernels.py: every
GEMM of the layer priced at its own (M, N, K) after sharding, the fused attention core
by its kv length, the remaining bytes at HBM bandwidth and a launch floor per kernel
(``cost_models.gpu_layer.gpu_layer_time``). On local CPU clusters it is the roofline below;
the per-layer work both read (shapes, shares of the attention core) is in cost_models/layer_work.py.

Roofline (CPU), per part of a layer (attention, MLP, norm, ...):

    t = max(FLOPs / (peak x EFF_MATMUL), bytes / (bandwidth x EFF_MEMORY))

summed over the layer's parts (a part is either matmul-bound or memory-bound; summing
the per-part maxima charges each its own bound), plus ``CPU_OP_OVERHEAD_S`` per tensor op
eager mode dispatches (``Layer.fwd_ops`` / ``bwd_ops``, per micro-batch whatever its size)
and under TP the DTensor dispatch per sharded module (:func:`dtensor_dispatch_s`, measured by the profile;
added to profiled layer times too: the profiler runs plain local shards).
Backward takes the backward FLOPs and bytes of the capture. The efficiency factors are defined once, here:

- ``EFF_MEMORY`` (0.70): fraction of memory bandwidth elementwise kernels sustain.
- The peak is the *measured* GEMM throughput of one process on
  a large square matmul (``Cluster.detect``); a layer's skinnier matmuls run below it,
  and 0.70 is an uncalibrated default (a profile replaces the roofline; calibration
  against measured runs is the fidelity issue's job).

Sharding, the way the runtime shards (see codegen/runtime/tensor_parallel.py):
- TP divides the FLOPs and bytes of attention (by heads), MLP (column->row) and the
  vocabulary-parallel head/embedding: the layer's ``tp_flops_frac`` part; norms and
  residual adds stay whole unless sequence parallel splits them along the sequence.
- CP divides everything by cp (each rank holds S/cp tokens); the attention core's
  S x S work is divided by cp as well (ring attention: each rank computes its queries
  against all keys, zigzag keeps it balanced).
- Causal attention does half the S x S work of what the FLOP counter records; the
  time uses the halved figure (model FLOPs for MFU use the full one, as is customary).
- Packed documents (``ModelGraph.documents``, cost_models/documents.py): a causal flash
  attention core does ``attention_share`` of the work of one document filling the row
  (:func:`attention_share`; FLOPs, times, per-op recompute and the model FLOPs of MFU
  alike), and on GPUs its kernel efficiency sees the shorter of the token-weighted mean
  document and the ring block's kv length. An eager kernel given the documents' mask (SDPA
  in autopar's runtime, unfused in older engines) computes every score of the whole square, not
  the causal half (``layer_work.full_square``). Memory does not change with documents (flash and
  SDPA activations are linear in tokens; an unfused kernel materialises the S x S scores).
- Micro-batch size scales FLOPs and bytes linearly from the captured batch.

Calibration (``profile.calibration``, fitted to measured runs by ``autopar calibrate``,
see cost_models/calibrate.py): ``eff_matmul`` and ``eff_memory`` replace the roofline's
efficiency factors, ``op_overhead_s`` the per-op cost; ``compute_scale`` multiplies every layer time, measured or
roofline (a profiled layer timed alone runs faster than inside a training step that
shares the cores with collectives, the optimizer and the other ranks' Python).
"""
from __future__ import annotations

from dataclasses import replace

from cost_models import gpu_kernels as gk
from cost_models.cluster import Cluster
from cost_models.dtensor_dispatch import dtensor_dispatch_s
from cost_models.engines import DEFAULT_ENGINE, Engine
from cost_models.gpu_layer import gpu_layer_time
from cost_models.layer_work import (LayerTime, attention_share, attn_core_flops, document_masked, full_square,
                                    shard_factor)
from cost_models.shared_cores import thread_op_s
from cost_models.op_recompute import checkpointed, kept_flops
from cost_models.profile_db import PROFILED_KERNELS, calibration
from planner.vocab_passes import head_share
from planner.graph import Layer, ModelGraph
from planner.plan import ParallelConfig

EFF_MATMUL_CPU = 0.70
EFF_MEMORY = 0.70
BWD_ATTN_CORE_FACTOR = 2.5  # flash backward = 2.5x its forward FLOPs
# Eager PyTorch on a CPU pays a fixed cost per dispatched op (dispatcher, autograd node,
# allocator) beside its FLOPs and bytes: 6 us, measured with torch 2.13 on a 2-core EPYC as the
# step time a plain single-thread training loop of gpt-mini adds per extra micro-batch (4.4 ms
# for its 654 captured ops: 0.264 s for 8 sequences in one micro-batch, 0.295 s in eight). It
# makes small micro-batches cost what they do; ``compute_scale`` (calibration) scales it too.
CPU_OP_OVERHEAD_S = 6e-6
# A CPU runs packed documents' masked attention and CP's blocks (ring or Ulysses, both RingCompute) through
# the flash kernels' plain-torch fallback (kernels/attention_torch.py, fp32 chunks): each FLOP
# about 3x slower than fused SDPA, which a plain causal call gets (torch 2.13, a 2-core Xeon, one thread, llama-mini's attention
# on a causal row of 2,048 tokens, forward + backward: 895 ms against 308 ms).
CPU_TORCH_ATTENTION_SLOWDOWN = 3.0


def op_recompute_share(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None) -> float:
    """Share of ``layer``'s forward FLOPs that per-op recompute (``selective-op``) runs again:
    1 - (kept matmul FLOPs + attention-core FLOPs) / forward FLOPs, for the captured batch
    (``op_recompute.kept_flops``); 0 for layers the runtime does not
    checkpoint. Where the layer time has no kernel breakdown (CPU roofline, profiled
    layers) the recompute is this share of the forward time."""
    if not checkpointed(layer) or layer.fwd_flops <= 0:
        return 0.0
    kept = kept_flops(layer, graph)
    a = layer.attention
    fwd = layer.fwd_flops
    if a is not None:
        core, share = attn_core_flops(layer, graph.batch), attention_share(layer, graph, cfg)
        kept += core * (0.5 if a.causal else 1.0) * share
        fwd -= core * 0.5 * (1.0 - share)  # the work packed documents leave out (0 without them)
    return min(1.0, max(0.0, 1.0 - kept / fwd)) if fwd > 0 else 0.0


def calibration_note(profile) -> str:
    """One line for plans and reports: whether the estimate uses fitted coefficients, and which."""
    cal = calibration(profile)
    if not cal:
        return "uncalibrated"
    return profile.calibration_source or "calibrated (autopar calibrate)"


def memory_bandwidth(cluster: Cluster, cal: dict[str, float] | None = None) -> float:
    """Bytes/s a memory-bound kernel sustains on one device: the nominal bandwidth times the
    GPU kernel model's ``mem_eff`` on GPUs, ``EFF_MEMORY`` (or the calibrated ``eff_memory``)
    on CPUs."""
    bw = cluster.device.mem_bw_gbs * 1e9
    if cluster.backend != "gloo":
        return bw * gk.GpuCoefficients.of(cal).mem_eff
    return bw * (cal or {}).get("eff_memory", EFF_MEMORY)


def roofline_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
                  cal: dict[str, float] | None = None, engine: Engine = DEFAULT_ENGINE) -> LayerTime:
    """The model's layer time: the GPU kernel model on GPU clusters (as ``engine`` runs the
    layer), the roofline on CPUs."""
    cal = cal or {}
    if cluster.backend != "gloo":
        return gpu_layer_time(layer, graph, cluster, cfg, cal, engine)
    peak = cluster.peak_flops("fp32")
    eff = cal.get("eff_matmul", EFF_MATMUL_CPU)
    bw = cluster.device.mem_bw_gbs * 1e9 * cal.get("eff_memory", EFF_MEMORY)
    scale = cfg.mbs / graph.batch
    dscale = (2 if cfg.dtype != "fp32" else 4) / graph.dtype_bytes
    core = attn_core_flops(layer, graph.batch)
    causal = layer.attention is not None and layer.attention.causal
    fallback = cfg.attention == "flash" and (document_masked(layer, graph, cfg) or (causal and cfg.cp > 1))
    causal_cut = core * (1.0 - 0.5 * attention_share(layer, graph, cfg, cluster if fallback else None)) \
        if causal and not full_square(layer, graph, cfg) else 0.0  # SDPA given a document mask: the whole square
    slow = CPU_TORCH_ATTENTION_SLOWDOWN if fallback else 1.0  # masks, or CP's blocks: the torch fallback
    fwd = bwd = 0.0
    shard = shard_factor(layer, cfg)
    for op in layer.ops:
        f_fwd, f_bwd = op.fwd_flops, op.bwd_flops
        if op.kind == "attention" and causal_cut:
            f_fwd -= causal_cut
            f_bwd -= causal_cut * BWD_ATTN_CORE_FACTOR
        if op.kind == "attention":
            f_fwd, f_bwd = f_fwd * slow, f_bwd * slow
        op_div = (cfg.tp if op.tp_style != "replicated" else cfg.seq_shards) * cfg.cp
        bytes_f = op.fwd_bytes * dscale
        fwd += max(max(f_fwd, 0.0) / (peak * eff), bytes_f / bw) * scale / op_div
        share = (op.fwd_bytes / layer.fwd_bytes) if layer.fwd_bytes else 0.0
        bytes_b = layer.bwd_bytes * share * dscale
        bwd += max(max(f_bwd, 0.0) / (peak * eff), bytes_b / bw) * scale / op_div
    if not layer.ops:
        fwd = layer.fwd_bytes * dscale / bw * scale * shard
        bwd = layer.bwd_bytes * dscale / bw * scale * shard
    op_s = cal.get("op_overhead_s", CPU_OP_OVERHEAD_S) + thread_op_s(cluster, cfg)  # + the threads' wake-up
    fwd += layer.fwd_ops * op_s
    return LayerTime(fwd, bwd + layer.bwd_ops * op_s, "roofline",
                     op_recompute_s=op_recompute_share(layer, graph, cfg) * fwd)


def _ratio_scaled(got: tuple[float, float], now: LayerTime, then: LayerTime) -> tuple[float, float]:
    """A profiled (forward, backward) time, measured where the model prices ``then``, for where it
    prices ``now``: each pass times the model's own ratio of the two (1 where ``then``'s is 0)."""
    f = now.fwd_s / then.fwd_s if then.fwd_s > 0 else 1.0
    b = now.bwd_s / then.bwd_s if then.bwd_s > 0 else 1.0
    return got[0] * f, got[1] * b


def _documents_scaled(got: tuple[float, float], layer: Layer, graph: ModelGraph, cluster: Cluster,
                      cfg: ParallelConfig, cal: dict[str, float], engine: Engine) -> tuple[float, float]:
    """A profiled (forward, backward) time, measured with one document filling each sequence,
    scaled to the graph's packed documents by the model's own ratio of the two layer times."""
    return _ratio_scaled(got, roofline_time(layer, graph, cluster, cfg, cal, engine),
                         roofline_time(layer, replace(graph, documents=None), cluster, cfg, cal, engine))


# The plan options whose kernels a GPU profile's times are scaled for (:func:`_kernels_scaled`): the
# attention and loss kernels, priced from their own benchmark on the GPU (cost_models/engines.py's
# HOPPER_ATTENTION, gpu_layer.FUSED_LOSS_FWD_SLOWDOWN). Not float8 and compile: on one H200 (llama-1b,
# mbs 2; benchmarks/measured/gpu_check_h200_2026-12-04b.json) the kernel model priced them 7% / 16% /
# 26% faster (fp8, compile, both) where they ran 269% slower / 6% faster / 19% slower, so a profiled
# plan with them keeps the profile's bf16 eager time.
KERNEL_SCALED = ("attention", "loss")


def _kernels_scaled(got: tuple[float, float], layer: Layer, graph: ModelGraph, cluster: Cluster,
                    cfg: ParallelConfig, cal: dict[str, float], engine: Engine) -> tuple[float, float]:
    """A profiled (forward, backward) time on a GPU, measured with the profiler's kernels
    (``PROFILED_KERNELS``: SDPA, the eager loss, ...), for ``cfg``'s attention and loss kernels
    (``KERNEL_SCALED``): scaled by the kernel model's ratio of the two layer times. On CPUs the
    profile stands as timed (the CPU fidelity runs, README, price the plans from it as timed)."""
    profiled = cfg.replace(**{k: PROFILED_KERNELS[k] for k in KERNEL_SCALED})
    if cluster.backend == "gloo" or profiled == cfg:
        return got
    return _ratio_scaled(got, roofline_time(layer, graph, cluster, cfg, cal, engine),
                         roofline_time(layer, graph, cluster, profiled, cal, engine))


def _speed_scaled(got: tuple[float, float], layer: Layer, graph: ModelGraph, cluster: Cluster,
                  profiled_on: Cluster, cfg: ParallelConfig, cal: dict[str, float]) -> tuple[float, float]:
    """A profiled (forward, backward) time, measured on ``profiled_on``'s ranks, on ``cluster``'s
    (other CPU ranks and threads: ``cost_models.shared_cores.ranks_cluster``), scaled by the
    roofline's own ratio of the two (its per-op cost does not speed up with threads)."""
    return _ratio_scaled(got, roofline_time(layer, graph, cluster, cfg, cal),
                         roofline_time(layer, graph, profiled_on, cfg, cal))


def _profiled(profile, signature: str, graph: ModelGraph, cfg: ParallelConfig) -> tuple[float, float] | None:
    """The profile's (forward, backward) seconds of a layer class, or None where it has none; a
    vocabulary pass it did not measure takes its share of its head's (``vocab_passes.head_share``:
    the rows' fraction of the head's measured time)."""
    got = profile.layer_time(signature, cfg.mbs, graph.seq_len, cfg.tp, cfg.cp, cfg.dtype)
    share = head_share(signature) if got is None else None
    if share is not None:
        whole = profile.layer_time(share.signature, cfg.mbs, graph.seq_len, cfg.tp, cfg.cp, cfg.dtype)
        got = None if whole is None else (whole[0] * share.fraction, whole[1] * share.fraction)
    return got


def layer_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
               profile=None, engine: Engine = DEFAULT_ENGINE, profiled_on: Cluster | None = None) -> LayerTime:
    """Forward and backward seconds of ``layer`` for one micro-batch of ``cfg.mbs`` sequences
    on one rank: from ``profile`` (a ProfileDB) when it measured this layer class at this
    tp/cp in ``cfg.dtype``, interpolated across shapes (on GPUs scaled to ``cfg``'s kernels:
    :func:`_kernels_scaled`); from the roofline otherwise. A calibrated profile's
    ``compute_scale`` multiplies either. ``profiled_on``: the cluster the profile measured when
    ``cluster`` is another (fewer CPU ranks with more threads, :func:`_speed_scaled`)."""
    cal = calibration(profile)
    k = cal.get("compute_scale", 1.0)
    df, db = dtensor_dispatch_s(layer, cluster, cfg, profile)
    if profile is not None:
        got = _profiled(profile, layer.signature, graph, cfg)
        if got is not None and attention_share(layer, graph, cfg) != 1.0:
            got = _documents_scaled(got, layer, graph, cluster, cfg, cal, engine)
        if got is not None:
            got = _kernels_scaled(got, layer, graph, cluster, cfg, cal, engine)
        if got is not None and profiled_on is not None and profiled_on is not cluster:
            got = _speed_scaled(got, layer, graph, cluster, profiled_on, cfg, cal)
        if got is not None:  # the profiler times plain local shards: no DTensor dispatch
            fwd = (got[0] + df) * k
            return LayerTime(fwd, (got[1] + db) * k, "profile",
                             op_recompute_s=op_recompute_share(layer, graph, cfg) * fwd)
    t = roofline_time(layer, graph, cluster, cfg, cal, engine)
    share = t.op_recompute_s / t.fwd_s if t.fwd_s > 0 else 0.0
    fwd = (t.fwd_s + df) * k
    return LayerTime(fwd, (t.bwd_s + db) * k, t.source, op_recompute_s=share * fwd,
                     experts_fwd_s=t.experts_fwd_s * k, experts_bwd_s=t.experts_bwd_s * k, moe_fwd_s=t.moe_fwd_s * k)
