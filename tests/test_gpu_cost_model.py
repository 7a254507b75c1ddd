"""The GPU cost model: kernel efficiency curves, NCCL collectives, overlap accounting, and
the development set of published runs (benchmarks/published_runs.py)."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import published_express as px
from benchmarks import published_runs as pr
from cost_models import comm
from cost_models import gpu_kernels as gk
from cost_models.cluster import parse_cluster
from cost_models.gpu_layer import gpu_layer_time
from cost_models.engines import exposed_s
from cost_models.shared_cores import sync_wait_s
from planner.plan import ParallelConfig

H100 = gk.GpuSpec(peak=989e12, bw=3350e9, sms=132)
CO = gk.GpuCoefficients()


def _tflops(m: int, n: int, k: int, gpu: gk.GpuSpec = H100) -> float:
    return 2.0 * m * n * k / gk.gemm_seconds(m, n, k, 2, gpu, CO)


def test_gemm_throughput_grows_with_size_and_stays_under_its_ceiling():
    sizes = [2**i for i in range(6, 15)]
    rates = [_tflops(s, s, s) for s in sizes]
    assert all(b >= a for a, b in zip(rates, rates[1:])), rates
    assert max(rates) <= H100.peak * CO.gemm_eff_max
    assert rates[-1] > 0.9 * H100.peak * CO.gemm_eff_max  # large GEMMs reach the ceiling
    assert rates[0] < 0.05 * H100.peak                     # tiny ones are launch- and wave-bound


def test_skinny_gemms_run_below_square_ones_of_the_same_work():
    square = _tflops(4096, 4096, 4096)
    skinny = _tflops(64, 4096, 4096 * 64)  # same FLOPs, 64 rows: too few tiles to fill the SMs
    assert skinny < 0.5 * square


def test_wave_quantization():
    assert gk.wave_efficiency(128 * 132, 128, 132) == 1.0
    assert gk.wave_efficiency(128 * 133, 128, 132) == pytest.approx(133 / 264)
    assert gk.wave_efficiency(5, 5, 0) == 1.0  # no SM count: no quantization
    assert all(0 < gk.wave_efficiency(m, n, 108) <= 1.0 for m in (1, 200, 5000) for n in (1, 700, 9000))


def test_attention_efficiency_grows_with_length_up_to_its_maximum():
    effs = [gk.attention_efficiency(s, CO) for s in (128, 512, 2048, 8192, 131072)]
    assert all(b > a for a, b in zip(effs, effs[1:]))
    assert effs[-1] < CO.attn_eff_max and effs[-1] > 0.99 * CO.attn_eff_max
    assert effs[1] == pytest.approx(CO.attn_eff_max * 512 / (512 + CO.attn_seq_half))
    f = 1e12
    assert gk.attention_seconds(f, 4096, H100, CO, backward=True) == pytest.approx(
        gk.BWD_ATTN_FACTOR * (gk.attention_seconds(f, 4096, H100, CO) - CO.launch_s) + CO.launch_s)


def test_memory_bound_kernels():
    t = gk.memory_seconds(1e9, 10, H100, CO)
    assert t == pytest.approx(1e9 / (H100.bw * CO.mem_eff) + 10 * CO.launch_s)
    assert gk.memory_seconds(0, 0, H100, CO) == 0.0


def test_coefficients_from_a_calibration():
    co = gk.GpuCoefficients.of({"gpu.gemm_eff_max": 0.5, "compute_scale": 2.0})
    assert co.gemm_eff_max == 0.5 and co.mem_eff == CO.mem_eff
    assert gk.GpuCoefficients.of(None) == CO


def _cl(spec: str):
    return parse_cluster(spec)


@pytest.mark.parametrize("kind,factor", [("all_reduce", 2), ("all_gather", 1), ("reduce_scatter", 1)])
def test_nccl_collectives_reach_the_bus_bandwidth_for_large_messages(kind, factor):
    c = _cl("dgx-h100")
    n, big = 8, 64 * 2**30
    t = comm.collective_time(kind, big, c, {"tp": n}, "tp").seconds
    bw = c.intra.bandwidth_bps * comm.NCCL_BUS_EFF["intra"]
    assert t == pytest.approx(factor * (n - 1) / n * big / bw, rel=1e-3)


def test_nccl_all_reduce_latency_is_the_smaller_of_ring_and_tree():
    c = _cl("dgx-h100:64")
    tiny = 1.0
    alpha = c.inter.latency_s
    t = comm.collective_time("all_reduce", tiny, c, {"dp": 64, "tp": 8}, "dp").seconds  # one rank per node
    assert t == pytest.approx(2 * math.ceil(math.log2(64)) * alpha, rel=1e-3)
    two = comm.collective_time("all_reduce", tiny, c, {"dp": 2, "tp": 8}, "dp").seconds
    assert two == pytest.approx(2 * alpha, rel=1e-3)  # n = 2: ring and tree agree


def test_gloo_collectives_keep_the_plain_ring():
    c = _cl("local-cpu:4")
    nbytes = 2**20
    t = comm.collective_time("all_reduce", nbytes, c, {"dp": 4}, "dp").seconds
    ring = 2 * 3 / 4 * nbytes / c.intra.bandwidth_bps + 2 * 3 * c.intra.latency_s
    assert t == pytest.approx(ring + sync_wait_s(c.cores_per_node, 4))  # + a slice where cores are shared


def test_hierarchical_all_reduce_uses_each_link_once():
    c = _cl("dgx-a100-80g:4")
    B = 2**30
    t = comm.collective_time("all_reduce", B, c, {"dp": 32}, "dp").seconds
    rs = comm.link_time("reduce_scatter", B, 8, c, "intra")
    ar = comm.link_time("all_reduce", B / 8, 4, c, "inter")
    ag = comm.link_time("all_gather", B, 8, c, "intra")
    assert t == pytest.approx(rs + ar + ag)


def test_overlap_accounting():
    assert exposed_s(1.0, 5.0) == 0.0               # fully hidden, no tail: adds nothing
    assert exposed_s(1.0, 0.0) == 1.0               # nothing to hide behind: adds all of it
    assert exposed_s(1.0, 0.4) == pytest.approx(0.6)
    assert exposed_s(1.0, 5.0, tail_s=0.1) == pytest.approx(0.1)  # the last bucket stays exposed
    assert exposed_s(1.0, 0.5, tail_s=0.1) == pytest.approx(0.1 + 0.4)
    assert exposed_s(0.0, 1.0, tail_s=1.0) == 0.0
    assert exposed_s(1.0, 0.0, tail_s=5.0) == 1.0   # a tail cannot exceed the collective


def test_tensor_parallel_shards_gemms_into_less_efficient_shapes():
    from planner.frontend.load import load_graph

    g = load_graph("gpt-small", batch=1, seq_len=1024)
    block = next(l for l in g.layers if l.kind == "transformer_block")
    c = _cl("dgx-h100")
    t1 = gpu_layer_time(block, g, c, ParallelConfig(tp=1, mbs=1))
    t8 = gpu_layer_time(block, g, c, ParallelConfig(tp=8, mbs=1, sp=True))
    speedup = (t1.fwd_s + t1.bwd_s) / (t8.fwd_s + t8.bwd_s)
    assert 1.2 < speedup < 4.0  # faster, but far from 8x: 768 / 8 = 96-wide GEMMs waste the SMs
    big = gpu_layer_time(block, g, c, ParallelConfig(tp=1, mbs=16))
    assert (big.fwd_s + big.bwd_s) < 16 * (t1.fwd_s + t1.bwd_s)  # larger micro-batches run closer to peak


@pytest.mark.parametrize("tp", [1, 4])
def test_fused_loss_recomputes_its_logits_and_never_writes_them(tp):
    """loss=fused prices the head as autopar's fused kernel runs (FUSED_LOSS_FWD_SLOWDOWN measured
    on an H200): the logits GEMM in the forward kernel, again in the backward with the two dense
    backward GEMMs and one write of the chunk gradients, and none of the loss's memory-bound
    kernels; at H200 shapes it costs 1.3-1.5x the eager head (measured 1.48x at H 4096)."""
    from cost_models.gpu_layer import FUSED_LOSS_FWD_SLOWDOWN
    from cost_models.layer_work import gemm_shape
    from planner.frontend.load import load_graph

    g = load_graph("llama-1b", batch=1, seq_len=2048)
    head = next(l for l in g.layers if l.kind == "head")
    c = _cl("dgx-h100")
    gpu = gk.gpu_spec(c, "bf16")
    co = gk.GpuCoefficients()
    m, n, k = gemm_shape(head.linears[0], 4 * 2048, tp)
    fused = gpu_layer_time(head, g, c, ParallelConfig(tp=tp, mbs=4, loss="fused"))
    eager = gpu_layer_time(head, g, c, ParallelConfig(tp=tp, mbs=4))
    fwd = FUSED_LOSS_FWD_SLOWDOWN * gk.gemm_seconds(m, n, k, 2, gpu, co)
    assert fused.fwd_s == pytest.approx(fwd, rel=1e-9)
    assert fused.bwd_s == pytest.approx(fwd + gk.gemm_seconds(m, k, n, 2, gpu, co) + gk.gemm_seconds(n, k, m, 2, gpu, co)
                                        + gk.memory_seconds(m * n * 2, 1, gpu, co), rel=1e-9)
    assert eager.fwd_s > gk.gemm_seconds(m, n, k, 2, gpu, co)  # eager pays its softmax and loss in HBM
    assert 1.2 < (fused.fwd_s + fused.bwd_s) / (eager.fwd_s + eager.bwd_s) < 1.6


# ---- the development set ------------------------------------------------------------------
def _runs():
    runs = []
    for path in pr.DATA:
        with open(path, encoding="utf-8") as f:
            runs += json.load(f)["runs"]
    return runs


def test_every_run_is_expressed_approximated_or_skipped_with_a_reason():
    runs = _runs()
    cases = [px.express(r) for r in runs]
    skipped = [c for c in cases if isinstance(c, str)]
    # FP8 and torch.compile runs are expressed (issue 27); only the parallel-block architecture is not
    assert len(runs) == 54 + 33 and len(skipped) == 8 and all("parallel blocks" in c for c in skipped)
    modes = [c for c in cases if not isinstance(c, str) and (c.cfg.fp8 != "none" or c.cfg.compile)]
    assert len(modes) == 26 and {c.cfg.fp8 for c in modes} == {"none", "tensorwise"}
    for run, c in zip(runs, cases):
        if isinstance(c, str):
            continue
        assert c.cfg.world == run["num_gpus"], run["id"]
        assert px.published_step_s(c) > 0


def test_every_run_names_its_source_and_engine():
    from cost_models.engines import ENGINES

    cases = [c for r in _runs() if not isinstance(c := px.express(r), str)]
    assert {c.source for c in cases} == {"SC21", "Korthikanti", "Megatron README", "Llama 3", "torchtitan",
                                         "MegaScale"}
    assert all(c.engine in ENGINES for c in cases)


def test_eq3_counts_the_recomputed_forward():
    m = {"seq_len": 2048, "layers": 96, "hidden": 12288, "vocab": 51200}
    # 96 B s l h^2 = 4/3 of 72 B s l h^2 (forward + backward): Eq. 3 includes the recomputed forward
    assert px.eq3_flops(m, 1) / (72 * 2048 * 96 * 12288**2) == pytest.approx(4 / 3, rel=0.05)


def test_model_flops_is_korthikanti_eq7_for_a_gpt():
    from benchmarks.published_express import model_flops

    s, l, h, v = 2048, 96, 12288, 51200
    m = {"seq_len": s, "layers": l, "hidden": h, "vocab": v, "heads": 96, "kv_heads": 96, "arch": "gpt",
         "ffn_hidden": 4 * h}
    eq7 = 72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * h * l))
    assert model_flops(m, 1) == pytest.approx(eq7, rel=1e-9)


@pytest.mark.slow
def test_published_runs_are_predicted_within_the_target():
    graphs = pr.Graphs()
    exact = [c for r in _runs() if not isinstance(c := px.express(r), str) and px.approx_reason(r) is None]
    assert len(exact) == 72
    rows = [pr.predict(c, graphs) for c in exact]
    # issue 26's target on the eager bf16 runs; the float8 / compiled ones are reported beside them
    eager = [r for c, r in zip(exact, rows) if c.cfg.fp8 == "none" and not c.cfg.compile]
    s = pr.summary([r["error"] for r in eager])
    assert len(eager) == 46 and s["median_abs"] <= 0.08 and s["within_25"] >= 0.9, s
    fits = {c.source: [] for c in exact}
    for c, r in zip(exact, rows):
        fits[c.source].append(r["fits"])
    assert all(all(v) for k, v in fits.items() if k != "Llama 3"), fits  # Llama 3's memory: see its docstring


def test_planning_against_a_job_autopar_cannot_run_says_why_and_goes_on():
    """``published_runs --plan`` over a job no autopar layout can run (torchtitan's 8B at CP2 with
    float8 and compile on 8 GPUs, global batch 4: compile under CP and float8 under TP are
    refused, dp8 does not divide the batch) records the reason instead of stopping the report: that
    autopar's runtime refuses the published layout too, and why."""
    runs = [r for path in pr.DATA for r in json.load(open(path, encoding="utf-8"))["runs"]]
    case = next(c for c in map(px.express, runs) if not isinstance(c, str) and c.run_id == "tt2412_t2_8B_cp2")
    got = pr.plan_against(case, pr.Graphs())
    assert got["pick"] is None and got["speedup"] is None and got["why"].startswith("no plan: ")
    assert got["why"].startswith("no plan: their layout refused too: ") and got["theirs_on_autopar_s"] > 0
    assert "compile=on with cp > 1" in got["why"], got["why"]
