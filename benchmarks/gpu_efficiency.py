"""Measured GEMM and attention efficiency on this GPU beside the GPU kernel model's values.

For a few GEMM shapes (square, a Llama MLP, the skinny shapes of tp 8 and of a small
micro-batch) and fused-attention lengths, the measured bf16 TFLOP/s (CUDA events,
median of 20 runs after warm-up) against ``cost_models.gpu_kernels`` for the device's
preset (``--cluster``, default ``h200-8x``). CUDA only: elsewhere it prints
"skipped: no CUDA" and exits 0.

    python -m benchmarks.gpu_efficiency [--cluster h200-8x] [--out benchmarks/results/gpu_efficiency.json]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.results import write_json
from cost_models import gpu_kernels as gk
from cost_models.cluster import parse_cluster

GEMMS = [(8192, 8192, 8192), (16384, 14336, 4096), (16384, 4096, 14336), (8192, 1792, 4096),
         (8192, 4096, 1792), (512, 4096, 4096), (128, 4096, 4096)]
ATTENTION = [(1, 32, 512, 128), (1, 32, 2048, 128), (1, 32, 8192, 128), (4, 16, 1024, 64)]  # batch, heads, seq, dim


def _median_s(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="h200-8x")
    ap.add_argument("--out", default="benchmarks/results/gpu_efficiency.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return
    c = parse_cluster(args.cluster)
    gpu = gk.gpu_spec(c, "bf16")
    co = gk.GpuCoefficients()
    rows = []
    print(f"{'kernel':<34}{'measured TF/s':>14}{'model TF/s':>12}{'ratio':>8}")
    for m, n, k in GEMMS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = _median_s(lambda: x @ w)
        model = gk.gemm_seconds(m, n, k, 2, gpu, co)
        rows.append({"kernel": f"gemm {m}x{n}x{k}", "measured_tflops": 2 * m * n * k / t / 1e12,
                     "model_tflops": 2 * m * n * k / model / 1e12})
    for b, h, s, d in ATTENTION:
        q, k_, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        flops = 4.0 * b * h * s * s * d * 0.5  # causal: half the square
        t = _median_s(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
        model = gk.attention_seconds(flops, s, gpu, co)
        rows.append({"kernel": f"attention fwd b{b} h{h} s{s} d{d}", "measured_tflops": flops / t / 1e12,
                     "model_tflops": flops / model / 1e12})
    for r in rows:
        r["ratio"] = r["model_tflops"] / r["measured_tflops"]
        print(f"{r['kernel']:<34}{r['measured_tflops']:>14.1f}{r['model_tflops']:>12.1f}{r['ratio']:>8.2f}")
    write_json(args.out, {"device": torch.cuda.get_device_name(), "cluster": args.cluster, "rows": rows})


if __name__ == "__main__":
    main()
