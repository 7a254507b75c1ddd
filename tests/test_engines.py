"""Each engine switch (cost_models/engines.py) prices its overlap: a fully hidden collective
adds nothing, an exposed one adds its time, a partly hidden one the rest."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.engines import (ENGINES, FOREACH_OPT_BYTES_PER_PARAM, FUSED_OPT_BYTES_PER_PARAM, Engine, engine_of,
                                 exposed_s)
from cost_models.estimate import estimate
from cost_models.layer_costs import LayerCosts
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig
from planner.search.stage_split import even_split

PLAIN = Engine("plain", dp_overlap=False)


@pytest.fixture(scope="module")
def graph():
    return load_graph("gpt-small", batch=1, seq_len=1024)


def _est(graph, cfg: ParallelConfig, engine: Engine, cluster: str = "dgx-h100:4", batch: int = 64):
    part = even_split(graph, cfg.pp * cfg.vpp, cfg.recompute)
    return estimate(graph, parse_cluster(cluster), cfg, part, batch, engine=engine)


def test_engines_are_named_and_unknown_ones_refused():
    assert engine_of(None).name == "autopar"
    assert engine_of("megatron-core").tp_overlap
    with pytest.raises(ValueError, match="unknown engine 'megatron'"):
        engine_of("megatron")
    assert all(e.doc for e in ENGINES.values())


def test_tp_overlap_hides_tp_traffic_behind_the_layer_compute_but_its_first_ring_step(graph):
    cfg = ParallelConfig(tp=8, mbs=4, sp=True)
    cl = parse_cluster("dgx-h100")
    block = next(l for l in graph.layers if l.kind == "transformer_block")
    plain = LayerCosts(graph, cl, cfg, None, engine=PLAIN).get(block)
    hidden = LayerCosts(graph, cl, cfg, None, engine=Engine("o", tp_overlap=True)).get(block)
    assert plain.tp > 0
    window = plain.fwd + plain.bwd
    assert hidden.tp == pytest.approx(exposed_s(plain.tp, window, plain.tp / 8))
    if plain.tp <= window:  # fully hidden but for the first step
        assert hidden.tp == pytest.approx(plain.tp / 8)
    else:                   # partly hidden: the rest beyond the window
        assert hidden.tp == pytest.approx(plain.tp - window)


def test_gradient_reduction_exposed_without_dp_overlap_hidden_with_it(graph):
    cfg = ParallelConfig(dp=32, mbs=2)
    exposed = _est(graph, cfg, PLAIN).breakdown["dp_comm"]
    hidden = _est(graph, cfg, Engine("o", dp_overlap=True)).breakdown["dp_comm"]
    assert exposed > 0 and hidden < exposed
    cal_free = _est(graph, ParallelConfig(dp=1, mbs=2), PLAIN, cluster="dgx-h100").breakdown["dp_comm"]
    assert cal_free == 0.0  # no data parallelism: nothing to expose


def test_distributed_optimizer_reduce_scatters_instead_of_all_reducing(graph):
    cfg = ParallelConfig(dp=32, mbs=2, zero="zero1")
    ar = _est(graph, cfg, PLAIN).breakdown["dp_comm"]
    rs = _est(graph, cfg, Engine("o", dp_overlap=False, dist_opt_reduce_scatter=True)).breakdown["dp_comm"]
    assert rs < ar  # reduce-scatter + all-gather move two thirds of all-reduce + all-gather


def test_parameter_gather_overlap_hides_zero1_gather_behind_the_next_forward(graph):
    cfg = ParallelConfig(dp=32, mbs=2, zero="zero1")
    after = _est(graph, cfg, Engine("o", dp_overlap=True)).breakdown["dp_comm"]
    hidden = _est(graph, cfg, Engine("o", dp_overlap=True, param_gather_overlap=True)).breakdown["dp_comm"]
    assert hidden < after


def test_async_p2p_leaves_only_the_fill_and_drain_hops(graph):
    from cost_models.pipeline import simulate

    cfg = ParallelConfig(pp=4, mbs=1, schedule="1f1b")
    plain = _est(graph, cfg, PLAIN, cluster="dgx-h100")
    asyn = _est(graph, cfg, Engine("o", dp_overlap=False, p2p_overlap=True), cluster="dgx-h100")
    hop = asyn.p2p_hop_s
    assert hop > 0
    m = asyn.microbatches
    bare = simulate("1f1b", 4, m, asyn.stage_fwd_s, asyn.stage_bwd_s, p2p=0.0).step_s
    pipe = asyn.step_s - sum(asyn.breakdown.get(k, 0.0) for k in ("dp_comm", "optimizer", "sync"))
    assert pipe == pytest.approx(bare + 2 * 3 * hop)  # the steady state hides every other hop
    assert asyn.step_s < plain.step_s


def test_fused_optimizer_moves_fewer_bytes(graph):
    cfg = ParallelConfig(dp=1, mbs=1)
    foreach = _est(graph, cfg, PLAIN, cluster="dgx-h100").breakdown["optimizer"]
    fused = _est(graph, cfg, Engine("o", fused_optimizer=True), cluster="dgx-h100").breakdown["optimizer"]
    assert fused / foreach == pytest.approx(FUSED_OPT_BYTES_PER_PARAM / FOREACH_OPT_BYTES_PER_PARAM)


def test_default_engine_is_autopar_and_plans_price_on_it(graph):
    cfg = ParallelConfig(dp=8, mbs=2)
    assert _est(graph, cfg, engine_of(None)).step_s == _est(graph, cfg, ENGINES["autopar"]).step_s


def test_unfused_attention_costs_more_than_flash_and_selective_drops_its_scores(graph):
    from cost_models.gpu_layer import gpu_layer_time
    from cost_models.memory import layer_activation

    cl = parse_cluster("dgx-h100")
    block = next(l for l in graph.layers if l.kind == "transformer_block")
    flash, eager = ParallelConfig(mbs=4), ParallelConfig(mbs=4, attention="eager")
    tf, te = gpu_layer_time(block, graph, cl, flash, engine=PLAIN), gpu_layer_time(block, graph, cl, eager, engine=PLAIN)
    assert te.fwd_s > tf.fwd_s and te.bwd_s > tf.bwd_s  # full-square scores written and read in HBM
    kept = layer_activation(block, graph, eager, "none", PLAIN)
    assert kept > layer_activation(block, graph, flash, "none", PLAIN)
    assert layer_activation(block, graph, eager, "selective", PLAIN) <= layer_activation(block, graph, flash, "none", PLAIN)


def test_autopar_eager_attention_is_sdpa_without_cp_and_unfused_blocks_under_it(graph):
    """autopar's runtime runs ``attention=eager`` as SDPA: fused, at ``torch-sdpa``'s measured factors
    on Hopper, no scores kept; under CP its ring's plain-torch blocks are priced and kept unfused."""
    from cost_models.engines import DEFAULT_ENGINE, HOPPER_ATTENTION, UNFUSED_ATTENTION
    from cost_models.gpu_layer import gpu_layer_time
    from cost_models.memory import layer_activation

    cl = parse_cluster("dgx-h100")
    block = next(l for l in graph.layers if l.kind == "transformer_block")
    assert DEFAULT_ENGINE.attention_kernel_of("eager") == "torch-sdpa"
    assert DEFAULT_ENGINE.attention_kernel_of("eager", cp=2) == UNFUSED_ATTENTION
    assert DEFAULT_ENGINE.attention_kernel_of("flash", cp=2) == "autopar-triton"
    flash, eager = ParallelConfig(mbs=4), ParallelConfig(mbs=4, attention="eager")
    assert layer_activation(block, graph, eager, "none") == layer_activation(block, graph, flash, "none")
    sdpa, tri = HOPPER_ATTENTION["torch-sdpa"], HOPPER_ATTENTION["autopar-triton"]
    assert sdpa[1] < tri[1]  # the measured backward: SDPA's faster
    assert gpu_layer_time(block, graph, cl, eager).bwd_s < gpu_layer_time(block, graph, cl, flash).bwd_s
    ring_eager, ring_flash = eager.replace(cp=2, dp=1), flash.replace(cp=2, dp=1)
    assert layer_activation(block, graph, ring_eager, "none") > layer_activation(block, graph, ring_flash, "none")
    plain = gpu_layer_time(block, graph, cl, ring_eager, engine=PLAIN)
    assert gpu_layer_time(block, graph, cl, ring_eager).fwd_s == pytest.approx(plain.fwd_s)


def test_cli_evaluate_names_and_prices_the_engine(capsys):
    import json

    from planner.entry.cli import main

    args = ["evaluate", "--model", "gpt-small", "--cluster", "dgx-h100:4", "--global-batch", "64", "--seq-len", "1024",
            "--config", "dp=4,tp=8,mbs=2,zero=zero1,sp=on", "--even-split", "--json"]
    assert main(args) == 0
    ours = json.loads(capsys.readouterr().out)
    assert main(args + ["--engine", "megatron-core"]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert (ours["engine"], theirs["engine"]) == ("autopar", "megatron-core")
    assert theirs["step_s"] < ours["step_s"]  # TP and gradient traffic hidden, a fused optimizer
    with pytest.raises(SystemExit):
        main(args + ["--engine", "megatron"])
    assert "invalid choice: 'megatron'" in capsys.readouterr().err


def test_fp8_tp_all_gather_moves_float8_and_casts_before_the_gather(graph):
    """Under float8 linears with sequence-parallel TP, an engine that gathers in float8 moves half
    the bf16 bytes in its all-gathers and casts each column-parallel input on the rank's shard."""
    from cost_models.compute import layer_time
    from cost_models.layer_costs import fp8_gather_share

    block = next(l for l in graph.layers if l.kind == "transformer_block")
    cfg = ParallelConfig(tp=8, mbs=4, sp=True, fp8="tensorwise", compile=True)
    gathers = Engine("g", fp8_tp_all_gather=True)
    assert fp8_gather_share(block, cfg, gathers) == 0.5
    assert fp8_gather_share(block, cfg, PLAIN) == 1.0
    assert fp8_gather_share(block, cfg.replace(fp8="none"), gathers) == 1.0
    head = next(l for l in graph.layers if l.kind == "head")
    assert fp8_gather_share(head, cfg, gathers) == 1.0  # the head stays in the compute dtype
    cl = parse_cluster("dgx-h100")
    assert layer_time(block, graph, cl, cfg, engine=gathers).fwd_s < layer_time(block, graph, cl, cfg, engine=PLAIN).fwd_s
    lc = LayerCosts(graph, cl, cfg, None, engine=gathers).get(block)
    assert lc.tp < LayerCosts(graph, cl, cfg, None, engine=PLAIN).get(block).tp


def test_fa2_attention_is_slower_on_hopper_only(graph):
    """An engine running FlashAttention-2 prices the attention core FA2_HOPPER_SLOWDOWN times the
    FA3-class kernel's on a device with float8 tensor cores; elsewhere FA2 is the kernel."""
    from cost_models.compute import layer_time
    from cost_models.engines import FA2_HOPPER_SLOWDOWN

    block = next(l for l in graph.layers if l.kind == "transformer_block")
    cfg = ParallelConfig(mbs=4)
    fa2 = Engine("fa2", attention_kernel="fa2")
    h100, a100 = parse_cluster("dgx-h100"), parse_cluster("dgx-a100-80g")
    assert layer_time(block, graph, a100, cfg, engine=fa2) == layer_time(block, graph, a100, cfg, engine=PLAIN)
    slow, fast = layer_time(block, graph, h100, cfg, engine=fa2), layer_time(block, graph, h100, cfg, engine=PLAIN)
    without = layer_time(block, graph, h100, cfg.replace(attention="eager"), engine=PLAIN)  # no fused core at all
    assert slow.fwd_s > fast.fwd_s and slow.bwd_s > fast.bwd_s
    assert slow.fwd_s - fast.fwd_s < (FA2_HOPPER_SLOWDOWN - 1) * fast.fwd_s  # only the attention core slows
    assert without.fwd_s != fast.fwd_s


def test_autopar_triton_attention_as_measured_on_hopper(graph):
    """autopar's engine prices its Triton flash kernel as benchmarks/kernels.py measured it on an
    H200: the forward below the fitted curve, the backward above it, by HOPPER_ATTENTION's factors
    on the attention core alone (launch floor included); A100s keep the curve."""
    from cost_models import gpu_kernels as gk
    from cost_models.compute import layer_time
    from cost_models.engines import DEFAULT_ENGINE, HOPPER_ATTENTION

    block = next(l for l in graph.layers if l.kind == "transformer_block")
    cfg = ParallelConfig(mbs=4)
    assert DEFAULT_ENGINE.attention_kernel == "autopar-triton"
    sf, sb = HOPPER_ATTENTION["autopar-triton"]
    h100, a100 = parse_cluster("dgx-h100"), parse_cluster("dgx-a100-80g")
    assert layer_time(block, graph, a100, cfg) == layer_time(block, graph, a100, cfg, engine=PLAIN)
    ours, fa3 = layer_time(block, graph, h100, cfg), layer_time(block, graph, h100, cfg, engine=PLAIN)
    assert ours.fwd_s < fa3.fwd_s and ours.bwd_s > fa3.bwd_s
    launch = gk.GpuCoefficients().launch_s
    core_f = (ours.fwd_s - fa3.fwd_s) / (sf - 1)  # the attention core's forward seconds on the curve
    core_b = (ours.bwd_s - fa3.bwd_s) / (sb - 1)
    assert core_b - launch == pytest.approx(gk.BWD_ATTN_FACTOR * (core_f - launch), rel=1e-6)
    with pytest.raises(ValueError, match="attention_kernel 'fa4'"):
        Engine("x", attention_kernel="fa4")
