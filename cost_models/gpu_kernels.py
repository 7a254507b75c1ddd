"""GPU layer time from kernel shapes: GEMMs, fused attention, memory-bound ops, launch floor.

One layer on one rank, one micro-batch, forward or backward, is the sum of its kernels:

    t = sum_GEMMs  gemm_s(M, N, K)  +  attention_s(core FLOPs, kv length)
        + memory_s(the other bytes, the other kernels)

GEMMs (one per ``Linear`` of the layer; the backward runs two: dX = dY W with shape
(M, K, N) and dW = dY^T X with shape (N, K, M))::

    gemm_s = max(2 M N K / (peak x GEMM_EFF_MAX x waves(M, N) x fill(K)),  (M K + K N + M N) x b / (bw x MEM_EFF))
             + LAUNCH_S
    waves(M, N) = tiles / (ceil(tiles / SMs) x SMs),   tiles = ceil(M / 128) ceil(N / 128)
    fill(K) = K / (K + GEMM_K_FILL)

``waves`` is wave quantization: a GEMM runs in rounds of one 128 x 128 output tile per
SM, and a last partial round leaves SMs idle (NVIDIA, "Matrix Multiplication Background
User's Guide", sections on tile and wave quantization). It is what makes the skinny
GEMMs of tensor parallelism over small hidden sizes, or of small micro-batches, run far
below peak while large ones reach GEMM_EFF_MAX. Devices without ``sms`` skip it.

``fill`` is the per-tile pipeline fill and epilogue: each output tile streams K in steps
of 64 through a multi-stage shared-memory pipeline; before its first multiply-accumulate
the pipeline loads ``stages - 1`` steps, and after its last one the epilogue writes the
tile - together the time of about ``GEMM_K_FILL`` = 256 elements of K (a 4-stage 128 x 128
x 64 tile: 3 x 64 of fill plus one step of epilogue; CUTLASS's default SM90 bf16 tiles), in
which the tile's tensor cores idle. It is what makes the GEMMs of small hidden sizes
(K = 2048) run about a tenth below those of large ones (K >= 12288) at the same tile
count.

Fused (flash) attention, forward FLOPs F of the causal-halved core, kv length S::

    attention_s = F / (peak x ATTN_EFF_MAX x S / (S + ATTN_SEQ_HALF))      (backward: 2.5 F)

FlashAttention-2 (Dao, 2023, fig. 4-7) reaches its best fraction of peak at long
sequences and loses about a third of it at 512 tokens: the saturating form with
ATTN_SEQ_HALF = 256 tokens follows those curves.

Memory-bound kernels (norms, activations, rotary, residual adds, softmax, casts)::

    memory_s = bytes / (bw x MEM_EFF)  +  kernels x LAUNCH_S

Coefficients (``GpuCoefficients``), each with its source. Three are fitted on the
development set of published runs (``python -m benchmarks.published_runs --fit``: mean
squared log error of step time over the 46 runs of six sources autopar expresses exactly,
each priced on the engine that ran it, with a weak prior at the documented figure;
leave-one-source-out errors printed beside the fit; 2026-12-02: in-sample median 4.5 %,
held out 5.9 %):
- ``gemm_eff_max`` 0.69 (fitted; documented prior 0.80: large bf16/fp16 cuBLAS GEMMs
  sustain ~80 % of dense peak on A100, 700-800 of 989 TFLOP/s on H100 SXM); what a whole
  training step's GEMMs sustain is lower than an isolated benchmark's (clocks under power
  limits, L2 contention with concurrent NCCL kernels); ``gemm_k_fill`` 256 (derived above);
- ``attn_eff_max`` 0.38 (fitted; prior 0.55) and ``attn_seq_half`` 256 tokens:
  FlashAttention-2's forward + backward reaches 50-73 % of peak on A100 at head dim
  64-128 and long sequences, about two thirds of that at 512 tokens. The fit sits below
  that: 21 of the 46 runs are 2021-22 Megatron-LM, whose unfused attention is priced as
  flash (benchmarks/published_express.py says why), and the held-out fits without them
  move it only to 0.36-0.47;
- ``mem_eff`` 0.64 (fitted; prior 0.80): elementwise kernels reach 80-90 % of HBM
  bandwidth (STREAM-like copies on A100 / H100 reach ~85-90 %); eager training's
  memory-bound kernels sustain less (small tensors, strided views, reductions in norms
  and softmax);
- ``launch_s`` 5 us: the per-kernel floor of eager PyTorch (launch + dispatch, which
  stays exposed when kernels are short).
Any of them can be replaced by a fitted value: a profile's calibration keys
``gpu.<field>`` (``benchmarks/published_runs.py --fit`` fits them on the development set).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Mapping

TILE = 128
BWD_ATTN_FACTOR = 2.5  # flash backward FLOPs / forward FLOPs


@dataclass(frozen=True)
class GpuCoefficients:
    """The GPU kernel model's coefficients (module docstring: values and sources)."""
    gemm_eff_max: float = 0.69
    attn_eff_max: float = 0.38
    attn_seq_half: float = 256.0
    gemm_k_fill: float = 256.0
    mem_eff: float = 0.64
    launch_s: float = 5e-6

    @staticmethod
    def of(cal: Mapping[str, float] | None) -> "GpuCoefficients":
        """Defaults overridden by calibration keys ``gpu.<field>``."""
        base = GpuCoefficients()
        if not cal:
            return base
        over = {f.name: float(cal[f"gpu.{f.name}"]) for f in fields(base) if f"gpu.{f.name}" in cal}
        return replace(base, **over) if over else base


# The documented figures the fitted coefficients started from (the fit's prior).
DOCUMENTED = GpuCoefficients(gemm_eff_max=0.80, attn_eff_max=0.55, mem_eff=0.80)


@dataclass(frozen=True)
class GpuSpec:
    """What the kernel model needs of one device: dense peak (FLOP/s) for the compute dtype,
    memory bandwidth (bytes/s), streaming multiprocessors (0: unknown, no wave quantization)."""
    peak: float
    bw: float
    sms: int = 0


def gpu_spec(cluster, dtype: str) -> GpuSpec:
    """A cluster's device (``cost_models.cluster.Cluster``) at its ``dtype`` peak."""
    return GpuSpec(peak=cluster.peak_flops(dtype), bw=cluster.device.mem_bw_gbs * 1e9, sms=cluster.device.sms)


def wave_efficiency(m: int, n: int, sms: int) -> float:
    """Busy fraction of the SMs over the waves of 128 x 128 output tiles (1.0 when sms = 0)."""
    if sms <= 0:
        return 1.0
    tiles = math.ceil(max(m, 1) / TILE) * math.ceil(max(n, 1) / TILE)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_seconds(m: float, n: float, k: float, elem_bytes: float, gpu: GpuSpec, co: GpuCoefficients) -> float:
    """One (M x K) @ (K x N) GEMM: compute- or memory-bound, plus the launch floor."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    eff = co.gemm_eff_max * wave_efficiency(int(m), int(n), gpu.sms) * k / (k + co.gemm_k_fill)
    t_flops = 2.0 * m * n * k / (gpu.peak * eff)
    t_bytes = (m * k + k * n + m * n) * elem_bytes / (gpu.bw * co.mem_eff)
    return max(t_flops, t_bytes) + co.launch_s


def attention_efficiency(kv_len: float, co: GpuCoefficients) -> float:
    """Fraction of peak a fused attention kernel sustains at ``kv_len`` keys per query."""
    return co.attn_eff_max * kv_len / (kv_len + co.attn_seq_half)


def attention_seconds(fwd_flops: float, kv_len: float, gpu: GpuSpec, co: GpuCoefficients,
                      backward: bool = False) -> float:
    """Fused attention core of ``fwd_flops`` forward FLOPs (already halved when causal)."""
    if fwd_flops <= 0:
        return 0.0
    f = fwd_flops * (BWD_ATTN_FACTOR if backward else 1.0)
    return f / (gpu.peak * attention_efficiency(kv_len, co)) + co.launch_s


def memory_seconds(nbytes: float, kernels: float, gpu: GpuSpec, co: GpuCoefficients) -> float:
    """Memory-bound kernels moving ``nbytes`` in all, each with the launch floor."""
    return max(nbytes, 0.0) / (gpu.bw * co.mem_eff) + max(kernels, 0.0) * co.launch_s
