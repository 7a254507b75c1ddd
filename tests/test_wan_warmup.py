"""1F1B with a deeper warm-up before a WAN cut (planner/search/wan_warmup.py, schedule_ir.deep_warmup),
sequence-chunk hops that keep the WAN's latency whole, and custom schedules in sequence chunks."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.estimate import P2pHops
from planner import schedule_ir as ir
from planner.plan import ParallelConfig
from planner.schedule_check import check

WAN = parse_cluster("two-region-h100")


@pytest.mark.parametrize("k", [1, 4])
def test_deep_warmup_holds_more_before_the_cut_and_checks(k):
    from cost_models.pipeline import simulate, simulate_schedule

    plain, deep = ir.one_f_one_b(8, 16, k), ir.one_f_one_b(8, 16, k, ir.deep_warmup(8, 3, 2))
    assert (plain.name, deep.name) == ("1f1b", "1f1b-deep") and check(deep) is deep
    assert ir.deepened_by(deep) == (2,) * 4 + (0,) * 4 and ir.deepened_by(plain) == (0,) * 8  # (the report's words)
    a = simulate("1f1b", 8, 16, 1.0, 2.0, seq_chunks=k)
    b = simulate_schedule(deep, 1.0, 2.0)
    assert [y - x for x, y in zip(a.peak_inflight_chunks, b.peak_inflight_chunks)] == [2] * 4 + [0] * 4
    hops = [0.01, 0.01, 0.01, 0.8, 0.01, 0.01, 0.01, 0.8]  # a slow boundary after rank 3
    assert simulate_schedule(deep, 1.0, 2.0, p2p=hops).step_s < 0.9 * simulate("1f1b", 8, 16, 1.0, 2.0, p2p=hops,
                                                                              seq_chunks=k).step_s
    with pytest.raises(ir.ScheduleError, match="cut 8 must be a rank"):
        ir.deep_warmup(8, 8, 1)


def test_chunk_hops_keep_the_wan_latency_whole():
    hops = P2pHops([0.004, 0.5, 0.004, 0.5], wan_bw=[0.4], is_wan=[False, True, False])
    assert hops.per_chunk(4) == pytest.approx([0.001, 0.1 + 0.1, 0.001, 0.2])
    assert P2pHops([0.004, 0.004], []).per_chunk(2) == pytest.approx([0.002, 0.002])


def test_relieved_moves_one_group_from_the_fullest_stage():
    from planner.frontend.load import load_graph
    from planner.search.stage_split import even_split
    from planner.search.wan_warmup import relieved

    g = load_graph("llama3-8b", batch=1, seq_len=None)
    part = even_split(g, 4)
    groups = g.stage_groups()
    first = {a: i for i, (a, _) in enumerate(groups)} | {groups[-1][1]: len(groups)}
    count = lambda p: [first[hi] - first[lo] for lo, hi in p.bounds]  # noqa: E731
    moved = relieved(part, groups, 0, [1, 3])
    assert [count(p) for p in moved] == [[count(part)[0] - 1, count(part)[1] + 1] + count(part)[2:],
                                         [count(part)[0] - 1] + count(part)[1:3] + [count(part)[3] + 1]]
    assert all(p.bounds[0][0] == 0 and p.bounds[-1][1] == len(g.layers) for p in moved)


def test_the_search_deepens_1f1b_across_the_wan_within_memory():
    """Llama-3 70B over two regions, pp8 with 4 sequence chunks: the deeper warm-up hides the WAN
    round trip (the plain 1F1B leaves > 10% of the step idle), fits in memory (moving a stage group off
    the full first rank), and the search's WAN floor stays below it."""
    from cost_models.pipeline_memory import inflight_closed
    from cost_models.wan_cost import BalancedPipe, cheapest_wan_hops, deep_allowance, pipeline_wan_floor_s
    from planner.frontend.load import load_graph
    from planner.search.stage_split import split_and_estimate

    g = load_graph("llama3-70b", batch=1, seq_len=None)
    cfg = ParallelConfig(dp=8, pp=8, tp=2, mbs=1, zero="fsdp", sp=True, schedule="1f1b", seq_chunks=4,
                         attention="eager")
    plain, _ = split_and_estimate(g, WAN, cfg, 256)
    deep, info = split_and_estimate(g, WAN, cfg, 256, generate=True)
    assert plain.breakdown["p2p"] > 0.1 * plain.step_s
    assert deep.config.schedule == "custom" and deep.schedule_ir.name == "1f1b-deep" and deep.fits
    assert deep.step_s < 0.9 * plain.step_s and "1f1b-deep" in info["schedule"]
    assert deep.partition.bounds != plain.partition.bounds  # the even split's first rank is too full for it
    m = deep.microbatches
    held = [inflight_closed("1f1b", 8, m, 1, r) + deep_allowance("1f1b", 1) for r in range(8)]
    stage = sum(deep.stage_fwd_s) / 8 + sum(deep.stage_bwd_s) / 8
    floor = pipeline_wan_floor_s(m, 8, BalancedPipe(m * stage, stage, held), cheapest_wan_hops(g, WAN, cfg))
    assert floor <= deep.step_s


def test_custom_schedules_in_sequence_chunks_validate_and_run_layouts():
    from codegen.runtime.recipe import pipeline_schedule

    deep = ir.one_f_one_b(2, 8, 2, ir.deep_warmup(2, 0, 1))  # 8 micro-batches in 2 chunks each
    cfg = ParallelConfig(dp=1, pp=2, schedule="custom", seq_chunks=2).validate()
    assert pipeline_schedule(cfg, 8, deep) is deep
    assert "set seq_chunks=2" in ir.layout_problem(deep, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="sequence chunks"):
        pipeline_schedule(cfg.replace(seq_chunks=1), 8, deep)
    assert ir.layout_problem(deep, 2, 1, 8, 2) is None and deep.n_sequences == 8
    from planner.schedule_file import parse, to_json
    assert parse(to_json(deep), "json") == deep  # the plan's file form keeps the chunks


@pytest.fixture(scope="module")
def two_region_plans():
    """Llama-3 70B (256 x 8K) planned on the simulated 2 x 64 H100 and on the same GPUs on one fabric."""
    from benchmarks.multi_region import ideal
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    g = load_graph("llama3-70b", batch=1, seq_len=8192)
    _, res = plan_model(g, WAN, 256, spec="llama3-70b", cluster_spec="two-region-h100")
    _, one = plan_model(g, ideal(WAN), 256, spec="llama3-70b", cluster_spec="two-region-h100")
    return g, res.best, one.best


@pytest.mark.slow
def test_two_region_plan_beats_naive_1f1b(two_region_plans):
    """Issue 30's bar: at least 1.35x faster than its degrees under 1F1B laid naively across the WAN
    (benchmarks/multi_region.py prints the figures)."""
    from benchmarks.multi_region import round_robin
    from planner.search.stage_split import split_and_estimate

    g, best, _ = two_region_plans
    naive_cfg = best.config.replace(schedule="1f1b", vpp=1)
    naive, _ = split_and_estimate(g, round_robin(WAN, naive_cfg.pp), naive_cfg, 256)
    assert naive.step_s >= 1.35 * best.step_s


@pytest.mark.slow
def test_two_region_plan_within_ten_percent_of_one_fabric(two_region_plans):
    """Issue 30's bar: the plan within 10% of the same GPUs on one fabric. Met by a hair
    (18.263 s against 16.604 s, 1.0999x) once a stage group moves off the busiest rank
    (planner/search/split_moves.py); 1.108x on the ILP's split."""
    _, best, one = two_region_plans
    assert best.step_s <= 1.10 * one.step_s, (best.config.label(), best.step_s, one.step_s)


def test_the_rig_benchmark_compares_plain_and_deepened_1f1b():
    """benchmarks/wan_rig_plan.py --variants: on the rig's 200 Mbit/s link (llama-mini dp2 pp2, 16
    sequences) the deepened 1F1B is priced faster than plain 1F1B, and its plan carries the IR the
    runtime runs."""
    from benchmarks.wan_rig_plan import variant_plans

    found = variant_plans("llama-mini", 16, "dp=2,pp=2,tp=1,cp=1", 200.0)
    plans = {name.split(" ")[0]: plan for name, _, plan in found}
    plain, deep = plans["1f1b"], plans["1f1b-deep"]
    assert plain.config.schedule == "1f1b" and deep.schedule_ir.name == "1f1b-deep"
    assert deep.estimate["step_s"] < 0.95 * plain.estimate["step_s"]
    assert ir.deepened_by(deep.schedule_ir)[0] >= 1 and ir.deepened_by(deep.schedule_ir)[1] == 0
