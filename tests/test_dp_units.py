"""The data-parallel wrapper's units (cost_models/dp_units.py): each block and one stage root, as
codegen/runtime/data_parallel.py wraps them; the estimate's per-unit FSDP collectives and CPU
wrapper work count those, not the graph's layers."""
import dataclasses

import pytest

from cost_models.cluster import parse_cluster
from cost_models.cpu_runtime import wrapper_unit_s
from cost_models.dp_cost import fsdp_units_priced
from cost_models.dp_units import stage_unit_params, stage_units
from cost_models.estimate import estimate
from cost_models.memory import LayerTable
from cost_models.profile_db import FSDP_UNIT, ProfileDB
from cost_models.shared_cores import sync_wait_s
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Partition
from planner.search.stage_split import even_split

MOE = "benchmarks/fidelity_moe.toml"  # embed, 4 blocks, norm, head


def _units(spec: str, layout: str, pp: int) -> list[int]:
    g = load_graph(spec, batch=1, seq_len=64)
    cfg = ParallelConfig.parse(layout + ",dtype=fp32")
    t = LayerTable(g, cfg)
    return [stage_units(g, t, cfg, lo, hi) for lo, hi in even_split(g, pp).bounds]


def test_blocks_and_one_stage_root():
    assert _units(MOE, "dp=4,zero=fsdp", 1) == [5]          # 4 blocks + the root (embed, norm, head together)
    assert _units(MOE, "dp=4,zero=ddp", 1) == [5]           # replicate wraps the same modules
    assert _units("llama-tiny", "pp=2,zero=fsdp", 2) == [3, 3]
    g = load_graph("llama-tiny", batch=1, seq_len=64)
    cfg = ParallelConfig.parse("pp=3,zero=fsdp,dtype=fp32")
    t = LayerTable(g, cfg)
    # a middle stage of blocks only has no root parameters: no unit of its own
    assert [stage_units(g, t, cfg, lo, hi) for lo, hi in ((0, 1), (1, 4), (4, 7))] == [1, 3, 2]


def test_fsdp_step_pays_each_unit_once():
    """moe-fid dp4 fsdp on 4 ranks sharing 2 cores (no overlap): the DP traffic is 5 units x (two
    all-gathers + one reduce-scatter) per micro-batch at the profile's constant call time plus the
    per-call wait, and the wrapper's work 5 x its per-unit figure: 7 (the graph's layers) before, and
    without EP the routed experts (in their blocks' units) 3 units more of their own."""
    g = load_graph(MOE, batch=1, seq_len=64)
    c = parse_cluster("local-cpu:4")
    c = dataclasses.replace(c, cores_per_node=2)
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=4)
    call = 2e-3
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for nbytes in (1 << 10, 1 << 26):
            db.add_collective(kind, 4, "intra", nbytes, call)
    cfg = ParallelConfig.parse("dp=4,mbs=2,zero=fsdp,dtype=fp32")
    e = estimate(g, c, cfg, Partition(bounds=[(0, len(g.layers))], recompute=["none"]), 8, profile=db)
    per_call = call + sync_wait_s(2, 4)
    assert e.breakdown["dp_comm"] == pytest.approx(5 * 3 * per_call)
    wf, wb = wrapper_unit_s(c, cfg, db)
    assert e.breakdown["runtime"] == pytest.approx(5 * (wf + wb))


def test_unit_sizes_are_each_block_and_the_root_with_experts_on_their_own_under_ep():
    g = load_graph(MOE, batch=1, seq_len=64)
    for layout, experts_apart in (("dp=2,zero=fsdp", False), ("dp=2,ep=2,zero=fsdp", True)):
        cfg = ParallelConfig.parse(layout + ",dtype=fp32")
        t = LayerTable(g, cfg)
        sizes = stage_unit_params(g, t, cfg, 0, len(g.layers))
        ex = stage_unit_params(g, t, cfg, 0, len(g.layers), experts=True)
        assert len(sizes) == stage_units(g, t, cfg, 0, len(g.layers)) == 5 and len(ex) == 3  # 3 MoE layers
        held = sum(t.params) - (sum(t.experts) if experts_apart else 0.0)
        assert sum(sizes) == pytest.approx(held)                     # every parameter in one unit
        assert sizes[-1] == pytest.approx(sum(t.params[i] for i in (0, 5, 6)))  # the root: embed, norm, head


def test_module_by_module_units_leave_the_experts_out_under_ep(monkeypatch):
    """Blocks FSDP shards module by module (here every block: the threshold lowered to 1 parameter)
    hold the routed experts in their own unit under EP: the blocks' units sum to the parameters
    less the experts (moe-fid's stacks, 33-66% of a block, are always a part of their own)."""
    from planner import sharding

    monkeypatch.setattr(sharding, "FSDP_UNIT_PARAMS", 1)
    g = load_graph(MOE, batch=1, seq_len=64)
    for layout in ("dp=2,ep=2,zero=fsdp", "dp=2,ep=8,zero=fsdp"):
        cfg = ParallelConfig.parse(layout + ",dtype=fp32")
        t = LayerTable(g, cfg)
        moe = [i for i in range(len(g.layers)) if t.experts[i]]
        assert all(len(t.units[i]) > 1 and t.experts[i] in t.units[i] for i in moe)
        sizes = stage_unit_params(g, t, cfg, 0, len(g.layers))
        assert sum(sizes) == pytest.approx(sum(t.params) - sum(t.experts)) and min(sizes) > 0


def _fsdp_profile(world: int, curve: dict[int, float]) -> ProfileDB:
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=world)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for nbytes in (1 << 10, 1 << 28):
            db.add_collective(kind, world, "intra", nbytes, 1e-3)
    for nbytes, seconds in curve.items():
        db.add_collective(FSDP_UNIT, world, "intra", nbytes, seconds)
    db.runtime = {"fsdp_unit_s": 1e-3, "fsdp_reduce_unit_s": 1e-3}
    return db


def test_fsdp_prices_each_unit_at_the_profiled_unit_time_by_its_size():
    """gpt-small dp2 fsdp on 2 ranks: with FSDP2 units profiled by size (a curve steeper than linear,
    as measured on gloo), the DP traffic of a micro-batch is each unit (12 blocks of 7.1 M
    parameters, the root of 39.4 M) at its own size's time less the wrapper's fixed 2 ms already in
    the stage times (the root, 5.5x a block's parameters, over 5x a block's time). Without the
    samples, the collectives price it (two all-gathers and a reduce-scatter of 1 ms per unit)."""
    g = load_graph("gpt-small", batch=1, seq_len=64)
    c = parse_cluster("local-cpu:2")
    curve = {1 << 16: 4e-3, 1 << 24: 60e-3, 1 << 26: 400e-3}
    cfg = ParallelConfig.parse("dp=2,mbs=4,zero=fsdp,dtype=fp32")
    part = Partition(bounds=[(0, len(g.layers))], recompute=["none"])
    t = LayerTable(g, cfg)
    sizes = stage_unit_params(g, t, cfg, 0, len(g.layers))
    assert len(sizes) == 13 and sizes[-1] > 5 * sizes[0]
    db = _fsdp_profile(2, curve)
    assert fsdp_units_priced(c, cfg, db) and not fsdp_units_priced(c, cfg, _fsdp_profile(2, {}))
    assert not fsdp_units_priced(c, cfg, None) and not fsdp_units_priced(c, cfg.replace(dtype="bf16"), db)
    e = estimate(g, c, cfg, part, 8, profile=db)
    from cost_models.comm import fsdp_units_time

    def fsdp_unit_time(nbytes, *rest, **kw):
        return fsdp_units_time([nbytes], *rest, **kw)

    flat = {"pp": 1, "dp": 2, "cp": 1, "tp": 1}
    want = sum(fsdp_unit_time(p * 4, c, flat, "dp", db) - 2e-3 for p in sizes)
    assert want == pytest.approx(fsdp_units_time([p * 4 for p in sizes], c, flat, "dp", db, less=2e-3))
    assert e.breakdown["dp_comm"] == pytest.approx(want)
    assert fsdp_unit_time(sizes[-1] * 4, c, flat, "dp", db) > 5 * fsdp_unit_time(sizes[0] * 4, c, flat, "dp", db)
    plain = estimate(g, c, cfg, part, 8, profile=_fsdp_profile(2, {}))
    assert plain.breakdown["dp_comm"] == pytest.approx(13 * 3 * 1e-3, rel=0.05)
    # mixed precision gathers bf16 copies, which the fp32 units do not measure: the collectives price it
    bf16 = estimate(g, c, cfg.replace(dtype="bf16"), part, 8, profile=db)
    assert bf16.breakdown["dp_comm"] < 0.1 * e.breakdown["dp_comm"]


def test_step_sync_counts_the_loss_and_the_gradient_norm_all_reduces():
    """The step's scalar all-reduces, priced from a profile where every all-reduce costs 1 s
    (4 gloo ranks on 4 cores: no shared-core waits): one process none; DDP the loss's only; FSDP
    the loss's and the norm's over dp; FSDP + TP the norm's over dp twice (the replicated and the
    TP-sharded gradients) and over tp; sequence parallel adds the flat reduction of the gradients
    it leaves partial over tp; a pipeline adds the norm's over pp."""
    from cost_models.dp_cost import step_sync_s

    cluster = dataclasses.replace(parse_cluster("local-cpu:4"), cores_per_node=4)
    db = ProfileDB(cluster_fingerprint=cluster.fingerprint(), backend="gloo", world=4)
    for n in (2, 4):
        for nbytes in (1, 2**20):
            db.add_collective("all_reduce", n, "intra", nbytes, 1.0)

    def calls(**kw) -> float:
        return step_sync_s(cluster, ParallelConfig(**kw), db, set())

    assert calls(dp=1) == 0.0
    assert calls(dp=4, zero="ddp") == pytest.approx(1.0)
    assert calls(dp=4, zero="fsdp") == pytest.approx(2.0)
    assert calls(dp=2, tp=2, zero="fsdp", sp=True) == pytest.approx(5.0)
    assert calls(tp=2, sp=False) == pytest.approx(2.0) and calls(tp=2, sp=True) == pytest.approx(3.0)
    assert calls(dp=2, pp=2, zero="ddp") == pytest.approx(2.0)


def test_tp_collectives_wait_a_measured_share_of_the_compute_on_cpu_ranks():
    """CPU ranks arrive apart at every blocking TP collective: each TP layer's tp_comm grows by
    the profile's lockstep_wait_frac of its compute; nothing without TP, on GPUs, or at 0."""
    from cost_models.cluster import parse_cluster
    from cost_models.cpu_runtime import DEFAULTS, lockstep_wait_s
    from cost_models.layer_costs import LayerCosts
    from cost_models.profile_db import ProfileDB
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig

    cpu, gpu = parse_cluster("local-cpu:2"), parse_cluster("dgx-h100:1")
    tp2, tp1 = ParallelConfig(tp=2, sp=True, dtype="fp32").validate(), ParallelConfig(dtype="fp32").validate()
    assert lockstep_wait_s(2.0, cpu, tp2) == pytest.approx(2.0 * DEFAULTS["lockstep_wait_frac"])
    assert lockstep_wait_s(2.0, cpu, tp1) == 0.0 and lockstep_wait_s(2.0, gpu, tp2) == 0.0
    g = load_graph("gpt-tiny", batch=1)
    block = next(l for l in g.layers if any(x.role == "row" for x in l.linears))

    def block_cost(frac: float):
        prof = ProfileDB(cpu.fingerprint(), "gloo", 2)
        prof.runtime = {"lockstep_wait_frac": frac}
        assert lockstep_wait_s(1.0, cpu, tp2, prof) == pytest.approx(frac)
        return LayerCosts(g, cpu, tp2, prof).get(block)

    none, some = block_cost(0.0), block_cost(0.3)
    assert none.tp > 0 and none.fwd == pytest.approx(some.fwd) and none.bwd == pytest.approx(some.bwd)
    assert some.tp - none.tp == pytest.approx(0.3 * (none.fwd + none.bwd))
