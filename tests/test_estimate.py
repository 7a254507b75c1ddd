"""Compute, memory and the step estimate: sources, sharding effects, schedule effects."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.calibrate import with_calibration
from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.memory import stage_memory
from cost_models.profile_db import ProfileDB
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Partition, PlanError
from planner.sharding import ZERO

GiB = 2**30


@pytest.fixture(scope="module")
def llama8b():
    return load_graph("llama3-8b", batch=1, seq_len=4096)


@pytest.fixture(scope="module")
def h100():
    return parse_cluster("dgx-h100:8")


def _est(g, c, s, gb=256, **kw):
    cfg = ParallelConfig.parse(s)
    return estimate(g, c, cfg, Partition.even(len(g.layers), cfg.pp * cfg.vpp, cfg.recompute), gb, **kw)


def test_roofline_source_and_sane_figures(llama8b, h100):
    e = _est(llama8b, h100, "dp=8,tp=8,sp=on,zero=fsdp")
    assert e.source == "roofline"
    assert 0.05 < e.mfu < 0.8
    assert e.breakdown["tp_comm"] > 0 and e.breakdown["dp_comm"] > 0
    assert e.tokens_per_s == pytest.approx(256 * 4096 / e.step_s)


def test_profile_changes_estimate(llama8b, h100):
    cfg = "dp=64,zero=fsdp,recompute=full,attention=eager"  # the profiler's kernels (PROFILED_KERNELS)
    base = _est(llama8b, h100, cfg)
    db = ProfileDB(cluster_fingerprint=h100.fingerprint(), backend="nccl", world=64, dtype="bf16")
    for l in llama8b.layers:
        if l.repeat_of is None:
            db.add_layer(l.signature, 1, 4096, 1, 1, 0.05, 0.1)
    prof = _est(llama8b, h100, cfg, profile=db)
    assert prof.source == "profile" and base.source == "roofline"
    assert prof.step_s != pytest.approx(base.step_s, rel=0.05)
    # 35 layers x 4 micro-batches x (0.05 fwd + 0.1 bwd + 0.05 recompute fwd)
    assert prof.breakdown["compute"] == pytest.approx(4 * 35 * 0.15, rel=1e-6)
    # layers timed in another dtype price nothing: a bf16 plan from fp32 timings was 7x off on an H200
    db.dtype = "fp32"
    assert _est(llama8b, h100, cfg, profile=db).step_s == pytest.approx(base.step_s)
    assert _est(llama8b, h100, cfg + ",dtype=fp32", profile=db).source == "profile"


@pytest.mark.parametrize("change", [dict(attention="flash"), dict(loss="fused")])
def test_profiled_layers_are_priced_for_the_plans_kernels_on_gpus(llama8b, h100, change):
    """The profiler times SDPA and the eager loss (``PROFILED_KERNELS``): on a GPU a plan with the
    other attention or loss kernel gets the profiled time times the kernel model's ratio of the two;
    on a CPU the profiled time as measured."""
    from cost_models.compute import layer_time, roofline_time

    timed = ParallelConfig.parse("mbs=1,dtype=bf16,attention=eager,loss=eager")
    plan = timed.replace(**change)
    changed = False
    for layer in (next(l for l in llama8b.layers if l.kind == "transformer_block"), llama8b.layers[-1]):
        db = ProfileDB(cluster_fingerprint=h100.fingerprint(), backend="nccl", world=64, dtype="bf16")
        db.add_layer(layer.signature, 1, 4096, 1, 1, 0.05, 0.1)
        assert layer_time(layer, llama8b, h100, timed, db).fwd_s == pytest.approx(0.05)
        now, then = roofline_time(layer, llama8b, h100, plan), roofline_time(layer, llama8b, h100, timed)
        got = layer_time(layer, llama8b, h100, plan, db)
        assert got.fwd_s == pytest.approx(0.05 * now.fwd_s / then.fwd_s)
        assert got.bwd_s == pytest.approx(0.1 * now.bwd_s / then.bwd_s)
        changed |= now.fwd_s + now.bwd_s != pytest.approx(then.fwd_s + then.bwd_s)
    assert changed  # the change is priced at all
    cpu = parse_cluster("local-cpu:2")
    block = next(l for l in llama8b.layers if l.kind == "transformer_block")
    db = ProfileDB(cluster_fingerprint=cpu.fingerprint(), backend="gloo", world=2, dtype="bf16")
    db.add_layer(block.signature, 1, 4096, 1, 1, 0.05, 0.1)
    assert layer_time(block, llama8b, cpu, plan, db).fwd_s == layer_time(block, llama8b, cpu, timed, db).fwd_s


def test_profiled_layers_keep_their_time_under_float8_and_compile(llama8b, h100):
    """float8 and compile are not scaled from a profile (``KERNEL_SCALED``: their modelled gains were
    not borne out on an H200), though the kernel model prices them differently."""
    from cost_models.compute import layer_time, roofline_time

    block = next(l for l in llama8b.layers if l.kind == "transformer_block")
    timed = ParallelConfig.parse("mbs=1,dtype=bf16,attention=eager,loss=eager")
    db = ProfileDB(cluster_fingerprint=h100.fingerprint(), backend="nccl", world=64, dtype="bf16")
    db.add_layer(block.signature, 1, 4096, 1, 1, 0.05, 0.1)
    for change in (dict(fp8="tensorwise"), dict(compile=True), dict(fp8="tensorwise", compile=True)):
        plan = timed.replace(**change)
        assert roofline_time(block, llama8b, h100, plan).fwd_s != pytest.approx(roofline_time(block, llama8b, h100, timed).fwd_s)
        assert layer_time(block, llama8b, h100, plan, db).fwd_s == pytest.approx(0.05)


def test_profile_dtype_round_trip_and_bad_value():
    db = ProfileDB(cluster_fingerprint="f", backend="nccl", world=1, dtype="bf16")
    d = db.to_dict()
    assert d["dtype"] == "bf16" and ProfileDB.from_dict(d).dtype == "bf16"
    del d["dtype"]
    assert ProfileDB.from_dict(d).dtype == "fp32"  # files from before the field were timed in fp32
    d["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="dtype 'bfloat16' is none of bf16, fp16, fp32") as e:
        ProfileDB.from_dict(d)
    assert "\n" not in str(e.value)


def test_memory_sharding_order(llama8b):
    layers = list(range(len(llama8b.layers)))
    mem = {z: stage_memory(llama8b, layers, ParallelConfig(dp=8, zero=z), 1) for z in ZERO}
    assert mem["ddp"].optimizer == pytest.approx(8 * mem["zero1"].optimizer)
    assert mem["zero1"].grads == pytest.approx(8 * mem["zero2"].grads)
    assert mem["zero1"].weights == pytest.approx(8 * mem["fsdp"].weights)
    P = llama8b.params
    assert mem["ddp"].weights + mem["ddp"].grads + mem["ddp"].optimizer == pytest.approx(16 * P)
    # replicate's parameter copy (ddp, zero1); zero2 holds every layer gathered through the
    # step, fsdp two layers: peak order ddp > zero1 > zero2 > fsdp
    assert mem["ddp"].buffers - mem["fsdp"].buffers > 1.5 * P  # a bf16 copy (2 B/param) less 2 layers
    totals = [mem[z].total for z in ZERO]
    assert totals == sorted(totals, reverse=True)


def test_pipelined_fsdp_keeps_parameters_gathered(llama8b):
    """Under a pipeline schedule torch's stages keep FSDP parameters gathered and gradients
    unreduced until the last micro-batch: the peak holds the whole stage unsharded."""
    layers = list(range(len(llama8b.layers)))
    flat = stage_memory(llama8b, layers, ParallelConfig(dp=8, zero="fsdp"), 1)
    piped = stage_memory(llama8b, layers, ParallelConfig(dp=8, pp=2, zero="fsdp"), 1)
    P = llama8b.params
    assert piped.weights == pytest.approx(flat.weights) and piped.optimizer == pytest.approx(flat.optimizer)
    assert piped.buffers - flat.buffers > 3 * P  # 2 bytes gathered + 2 - 2/8 unreduced, minus two layers


def test_activation_division(llama8b):
    layers = list(range(len(llama8b.layers)))
    act = lambda **kw: stage_memory(llama8b, layers, ParallelConfig(**kw), 1).activations
    a1 = act()
    a_tp = act(tp=4)
    a_sp = act(tp=4, sp=True)
    assert a_sp == pytest.approx(a1 / 4, rel=1e-6)   # SP shards the replicated part too
    assert a1 / 4 < a_tp < a1                         # TP alone leaves norms/residuals whole
    assert act(cp=2) == pytest.approx(a1 / 2, rel=1e-6)
    assert act(recompute="full") < act(recompute="selective") <= a1
    assert act(loss="fused") < a1                     # no logits kept


def test_pipeline_inflight_drives_memory(llama8b, h100):
    e1 = _est(llama8b, h100, "dp=4,pp=4,tp=4,schedule=1f1b,sp=on")
    eg = _est(llama8b, h100, "dp=4,pp=4,tp=4,schedule=gpipe,sp=on")
    m = e1.microbatches
    assert [x.inflight for x in e1.memory] == [min(4 - r, m) for r in range(4)]
    assert all(x.inflight == m for x in eg.memory)
    assert eg.memory[0].activations > e1.memory[0].activations
    assert 0 < e1.bubble_frac < 0.5


def test_zero_bubble_beats_1f1b(llama8b, h100):
    a = _est(llama8b, h100, "dp=8,pp=8,schedule=1f1b,zero=zero1", gb=64)
    b = _est(llama8b, h100, "dp=8,pp=8,schedule=zb-h1,zero=zero1", gb=64)
    assert b.step_s < a.step_s


def test_shortfall_and_bad_batch(llama8b, h100):
    e = _est(llama8b, h100, "dp=64,zero=ddp,mbs=8", gb=512)
    rank, over = e.shortfall()
    assert not e.fits and over > 0
    with pytest.raises(PlanError, match="divisible"):
        _est(llama8b, h100, "dp=64", gb=100)


def test_config_parse_errors():
    for bad in ("dp=0", "tp=two", "pp=2,pp=2", "schedule=foo", "vpp=2", "sp=on", "foo=1", "dp2"):
        with pytest.raises(PlanError) as e:
            ParallelConfig.parse(bad)
        assert "\n" not in str(e.value)
    c = ParallelConfig.parse("dp=2,pp=2,tp=2,schedule=interleaved-1f1b,vpp=2,sp=on,zero=fsdp")
    assert ParallelConfig.parse(c.to_str()) == c


def test_ddp_reducer_all_reduces_per_bucket():
    """DDP / ZeRO-1 without PP or TP run DDP's reducer: the gradient all-reduce is priced per
    25 MiB bucket (32M fp32 parameters: 5 buckets), not per layer unit as under TP."""
    import math

    from cost_models import comm
    from planner.sharding import DDP_BUCKET_BYTES

    g = load_graph("benchmarks/fidelity_llama.toml", batch=1, seq_len=64)
    c = parse_cluster("local-cpu:2")
    c.cores_per_node = 2  # no spare core for the communication thread: nothing overlaps, all is exposed
    e = _est(g, c, "dp=2,zero=ddp,mbs=4,dtype=fp32", gb=8)
    nbytes = sum(layer.params for layer in g.layers) * 4
    n = math.ceil(nbytes / DDP_BUCKET_BYTES)
    assert n == 5
    one = comm.collective_time("all_reduce", nbytes / n, c, comm.Mesh(dp=2), "dp").seconds
    assert e.breakdown["dp_comm"] == pytest.approx(n * one, rel=1e-9)
    t = _est(g, c, "dp=1,tp=2,sp=on,mbs=8,dtype=fp32", gb=8)
    assert t.breakdown["dp_comm"] == 0.0


def test_dtensor_dispatch_priced_per_sharded_module_on_cpu():
    """Under TP on a CPU cluster every DTensor-sharded module adds its kind's figure per
    micro-batch (a Llama block: q, k, v, o, gate, up, down at the linears' figure, and with SP its
    two norms at the norms'): the defaults without a profile, the profile's measured figures where
    it has them, a calibration's over both; not without TP, not on GPUs."""
    from cost_models.cpu_runtime import CPU_DTENSOR_MODULE_S, CPU_DTENSOR_NORM_S
    from cost_models.dtensor_dispatch import dtensor_dispatch_s, sp_norms, tp_linears

    def tp_modules(layer, cfg):  # every DTensor module: the sharded linears and the SP norms
        return tp_linears(layer, cfg) + sp_norms(layer, cfg)

    g = load_graph("benchmarks/fidelity_llama.toml", batch=1, seq_len=64)
    block = next(l for l in g.layers if l.name == "layers.0")
    cpu, gpu = parse_cluster("local-cpu:2"), parse_cluster("dgx-h100:1")
    assert tp_modules(block, ParallelConfig.parse("tp=2,sp=off")) == 7
    assert tp_modules(block, ParallelConfig.parse("tp=2,sp=on")) == 9
    assert tp_modules(block, ParallelConfig.parse("dp=2")) == 0
    tp_sp = ParallelConfig.parse("tp=2,sp=on")
    assert (tp_linears(block, tp_sp), sp_norms(block, tp_sp)) == (7, 2)
    f, b = dtensor_dispatch_s(block, cpu, tp_sp)
    assert f + b == pytest.approx(7 * CPU_DTENSOR_MODULE_S + 2 * CPU_DTENSOR_NORM_S) and b == pytest.approx(2 * f)
    assert CPU_DTENSOR_NORM_S < CPU_DTENSOR_MODULE_S  # a norm issues no collective
    assert dtensor_dispatch_s(block, gpu, tp_sp) == (0.0, 0.0)
    measured = ProfileDB(cluster_fingerprint=cpu.fingerprint(), backend="gloo", world=2,
                         runtime={"dtensor_module_s": 2e-3, "dtensor_norm_s": 1e-3})
    assert sum(dtensor_dispatch_s(block, cpu, tp_sp, measured)) == pytest.approx(7 * 2e-3 + 2 * 1e-3)
    measured.calibration = {"dtensor_module_s": 3e-3}
    assert sum(dtensor_dispatch_s(block, cpu, tp_sp, measured)) == pytest.approx(7 * 3e-3 + 2 * 1e-3)
    with_dt = _est(g, cpu, "tp=2,sp=on,mbs=4,dtype=fp32", gb=8)  # 2 micro-batches
    free = ProfileDB(cluster_fingerprint=cpu.fingerprint(), backend="gloo", world=2,
                     runtime={"dtensor_module_s": 0.0, "dtensor_norm_s": 0.0})
    without = _est(g, cpu, "tp=2,sp=on,mbs=4,dtype=fp32", gb=8, profile=free)
    linears = sum(tp_linears(l, with_dt.config) for l in g.layers)
    norms = sum(sp_norms(l, with_dt.config) for l in g.layers)
    assert with_dt.breakdown["compute"] - without.breakdown["compute"] == pytest.approx(
        2 * (linears * CPU_DTENSOR_MODULE_S + norms * CPU_DTENSOR_NORM_S), rel=1e-6)


def test_calibrated_latency_is_not_added_to_cpu_tensor_parallel_collectives():
    """A calibration's per-call latency stands for what a blocking collective costs between
    compute beyond back to back; on CPU clusters DTensor's figure prices that for TP's collectives,
    so the latency lands on the others (DP's here) only; on GPUs on TP's too."""
    g = load_graph("benchmarks/fidelity_llama.toml", batch=1, seq_len=64)
    cpu, gpu = parse_cluster("local-cpu:2"), parse_cluster("dgx-h100:1")
    lat = {"comm_latency_s": 1e-3}
    for layout in ("tp=2,sp=on,mbs=8,dtype=fp32", "tp=2,sp=off,mbs=8,dtype=fp32"):
        plain, late = (_est(g, cpu, layout, gb=8, profile=with_calibration(None, c, cpu)) for c in ({}, lat))
        assert plain.breakdown["tp_comm"] > 0 and late.breakdown["tp_comm"] == pytest.approx(plain.breakdown["tp_comm"])
    plain, late = (_est(g, cpu, "dp=2,mbs=4,zero=zero1,dtype=fp32", gb=8, profile=with_calibration(None, c, cpu))
                   for c in ({}, lat))
    assert late.breakdown["dp_comm"] > plain.breakdown["dp_comm"] + 1e-3
    plain, late = (_est(g, gpu, "tp=2,sp=on,mbs=8", gb=8, profile=with_calibration(None, c, gpu)) for c in ({}, lat))
    assert late.breakdown["tp_comm"] > plain.breakdown["tp_comm"] + 1e-3


def test_tp_shared_core_wait_is_left_to_a_dtensor_figure_measured_on_the_clusters_ranks():
    """With 4 ranks on 2 cores a blocking collective waits for descheduled peers
    (``shared_cores.sync_wait_s``). DTensor's figure measured on the cluster's own ranks holds that
    wait for TP's collectives, which then leave it out; with the default figure (one rank per core)
    or one measured on other ranks they keep it."""
    from cost_models.shared_cores import sync_wait_s

    g = load_graph("benchmarks/fidelity_llama.toml", batch=1, seq_len=64)
    c = dataclasses.replace(parse_cluster("local-cpu:4"), cores_per_node=2)
    runtime = {"dtensor_module_s": 1.15e-3}
    own = ProfileDB(cluster_fingerprint=c.fingerprint(), backend="gloo", world=4, runtime=runtime)
    other = ProfileDB(cluster_fingerprint=c.fingerprint(), backend="gloo", world=2, runtime=runtime)
    layout = "dp=2,tp=2,sp=on,mbs=4,zero=zero1,dtype=fp32"  # one micro-batch
    waits, kept, default = (_est(g, c, layout, gb=8, profile=p) for p in (own, other, None))
    rows = sum(sum(1 for l in layer.linears if l.role == "row") for layer in g.layers)
    calls = 2 * 2 * rows  # a reduce-scatter and an all-gather each, forward and backward
    wait = sync_wait_s(2, 4)
    assert wait > 0 and kept.breakdown["tp_comm"] - waits.breakdown["tp_comm"] == pytest.approx(calls * wait, rel=1e-6)
    assert default.breakdown["tp_comm"] == pytest.approx(kept.breakdown["tp_comm"])
    # DP's calls keep their wait: against a core per rank, a whole number (>= 1) of waits more
    unshared = _est(g, dataclasses.replace(c, cores_per_node=4), layout, gb=8, profile=own)
    extra = (waits.breakdown["dp_comm"] - unshared.breakdown["dp_comm"]) / wait
    assert extra >= 1 - 1e-9 and extra == pytest.approx(round(extra), abs=1e-6)
    assert unshared.breakdown["tp_comm"] == pytest.approx(waits.breakdown["tp_comm"])


def test_calibrated_overlap_hides_dp_traffic_only_beside_a_spare_core():
    """With every core running a rank, gradient traffic has no core to run on beside the backward
    and is not hidden: a calibration's fitted overlap efficiency does not hide it there either, as
    it does where a core is spare."""
    g = load_graph("benchmarks/fidelity_llama.toml", batch=1, seq_len=64)
    full = dataclasses.replace(parse_cluster("local-cpu:2"), cores_per_node=2)  # 2 ranks on 2 cores: none spare
    spare = dataclasses.replace(full, cores_per_node=4)

    def dp_comm(cluster, overlap: float) -> float:
        e = _est(g, cluster, "dp=2,mbs=4,zero=ddp,dtype=fp32", gb=8,
                 profile=with_calibration(None, {"overlap": overlap}, cluster))
        return e.breakdown["dp_comm"]

    assert dp_comm(full, 0.9) == pytest.approx(dp_comm(full, 0.0)) and dp_comm(full, 0.0) > 0
    assert dp_comm(spare, 0.9) < dp_comm(spare, 0.0)


@pytest.mark.parametrize("change", [dict(loss="fused"), dict(attention="eager")])
def test_shared_layer_costs_are_not_reused_across_kernels(llama8b, h100, change):
    """Per-layer costs built for one configuration are not reused for another whose attention or
    loss kernel differs (``LayerCosts.key``): the estimate equals the one priced on its own."""
    from cost_models.layer_costs import LayerCosts

    a = ParallelConfig.parse("dp=64,zero=fsdp,dtype=bf16,attention=flash,loss=eager")
    b = a.replace(**change)
    part = Partition.even(len(llama8b.layers), 1, "none")
    alone = estimate(llama8b, h100, b, part, 256)
    shared = estimate(llama8b, h100, b, part, 256, costs=LayerCosts(llama8b, h100, a, None))
    assert shared.step_s == pytest.approx(alone.step_s, rel=1e-12)
    assert alone.step_s != pytest.approx(estimate(llama8b, h100, a, part, 256).step_s, rel=1e-6)
