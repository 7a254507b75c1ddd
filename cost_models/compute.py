"""Layer compute time on one rank: measured profile first, roofline otherwise.

Roofline, per part of a layer (attention, MLP, norm, ...):

    t = max(FLOPs / (peak x EFF_MATMUL), bytes / (bandwidth x EFF_MEMORY))

summed over the layer's parts (a part is either matmul-bound or memory-bound; summing
the per-part maxima charges each its own bound). Backward takes the backward FLOPs and
bytes of the capture. The efficiency factors are defined once, here:

- ``EFF_MATMUL`` (0.60 on GPUs): sustained fraction of peak for the matmuls and fused
  attention of a transformer layer at training shapes (Megatron reports 40-60% MFU on
  A100/H100; cuBLAS large GEMMs reach ~80% of peak).
- ``EFF_MEMORY`` (0.70): fraction of HBM bandwidth elementwise kernels sustain.
- For local CPU clusters the peak is the *measured* GEMM throughput of one process on
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
- Micro-batch size scales FLOPs and bytes linearly from the captured batch.

Calibration (``profile.calibration``, fitted to measured runs by ``autopar calibrate``,
see cost_models/calibrate.py): ``eff_matmul`` and ``eff_memory`` replace the roofline's
efficiency factors; ``compute_scale`` multiplies every layer time, measured or
roofline (a profiled layer timed alone runs faster than inside a training step that
shares the cores with collectives, the optimizer and the other ranks' Python).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.cluster import Cluster
from planner.graph import Layer, ModelGraph
from planner.plan import ParallelConfig

EFF_MATMUL_GPU = 0.60
EFF_MATMUL_CPU = 0.70
EFF_MEMORY = 0.70
BWD_ATTN_CORE_FACTOR = 2.5  # flash backward = 2.5x its forward FLOPs


@dataclass
class LayerTime:
    fwd_s: float
    bwd_s: float
    source: str  # "profile" | "roofline"


def attn_core_flops(layer: Layer, batch: int) -> float:
    """Forward FLOPs of Q K^T and P V for ``batch`` sequences (full square, no causal halving)."""
    a = layer.attention
    if a is None:
        return 0.0
    return 4.0 * batch * a.heads * a.seq_len * a.kv_len * a.head_dim


def _shard_factor(layer: Layer, cfg: ParallelConfig) -> float:
    """Fraction of a layer's per-token work one rank does under tp / sp / cp."""
    f = layer.tp_flops_frac
    rest_div = cfg.tp if cfg.sp else 1
    return (f / cfg.tp + (1.0 - f) / rest_div) / cfg.cp


def calibration(profile) -> dict[str, float]:
    """The fitted coefficients of a ProfileDB (``{}`` without a profile or a calibration)."""
    return getattr(profile, "calibration", None) or {}


def roofline_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
                  cal: dict[str, float] | None = None) -> LayerTime:
    cal = cal or {}
    is_cpu = cluster.backend == "gloo"
    peak = cluster.peak_flops("fp32" if is_cpu or cfg.dtype == "fp32" else cfg.dtype)
    eff = cal.get("eff_matmul", EFF_MATMUL_CPU if is_cpu else EFF_MATMUL_GPU)
    bw = cluster.device.mem_bw_gbs * 1e9 * cal.get("eff_memory", EFF_MEMORY)
    scale = cfg.mbs / graph.batch
    dscale = (2 if cfg.dtype != "fp32" else 4) / graph.dtype_bytes
    core = attn_core_flops(layer, graph.batch)
    causal_cut = 0.5 * core if layer.attention is not None and layer.attention.causal else 0.0
    fwd = bwd = 0.0
    shard = _shard_factor(layer, cfg)
    for op in layer.ops:
        f_fwd, f_bwd = op.fwd_flops, op.bwd_flops
        if op.kind == "attention" and causal_cut:
            f_fwd -= causal_cut
            f_bwd -= causal_cut * BWD_ATTN_CORE_FACTOR
        op_div = (cfg.tp if op.tp_style != "replicated" else (cfg.tp if cfg.sp else 1)) * cfg.cp
        bytes_f = op.fwd_bytes * dscale
        fwd += max(max(f_fwd, 0.0) / (peak * eff), bytes_f / bw) * scale / op_div
        share = (op.fwd_bytes / layer.fwd_bytes) if layer.fwd_bytes else 0.0
        bytes_b = layer.bwd_bytes * share * dscale
        bwd += max(max(f_bwd, 0.0) / (peak * eff), bytes_b / bw) * scale / op_div
    if not layer.ops:
        fwd = layer.fwd_bytes * dscale / bw * scale * shard
        bwd = layer.bwd_bytes * dscale / bw * scale * shard
    return LayerTime(fwd, bwd, "roofline")


def layer_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
               profile=None) -> LayerTime:
    """Forward and backward seconds of ``layer`` for one micro-batch of ``cfg.mbs`` sequences
    on one rank: from ``profile`` (a ProfileDB) when it measured this layer class at this
    tp/cp, interpolated across shapes; from the roofline otherwise. A calibrated profile's
    ``compute_scale`` multiplies either."""
    cal = calibration(profile)
    k = cal.get("compute_scale", 1.0)
    if profile is not None:
        got = profile.layer_time(layer.signature, cfg.mbs, graph.seq_len, cfg.tp, cfg.cp)
        if got is not None:
            return LayerTime(got[0] * k, got[1] * k, "profile")
    t = roofline_time(layer, graph, cluster, cfg, cal)
    return LayerTime(t.fwd_s * k, t.bwd_s * k, t.source) if k != 1.0 else t
