"""Mixed devices (a cluster whose groups hold different GPUs): stages sized to each group's speed
(cost_models/wan.py slowdowns, the stage-split ILP's per-stage speeds), memory held to the
smallest device, and the plan saying which stage sits on which device."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.wan_cost import stage_capacity, stage_devices, stage_slowdowns
from planner.plan import ParallelConfig
from planner.search.partition import solve_partition
from planner.search.partition_problem import PartitionProblem
from planner.search.stage_split import even_split, speed_split

MIXED = parse_cluster("mixed-a100-h100")  # 4 DGX A100 then 4 DGX H100


def test_pipeline_ranks_on_their_devices():
    cfg = ParallelConfig(dp=32, pp=2)
    slow = stage_slowdowns(MIXED, cfg)
    assert slow[0] == pytest.approx(989 / 312) and slow[1] == 1.0
    assert stage_devices(MIXED, cfg) == ["a100-pod: A100-SXM4-80GB", "h100-pod: H100-SXM5-80GB"]
    # one pipeline rank over both pods runs at the A100's pace
    assert stage_slowdowns(MIXED, ParallelConfig(dp=64)) == pytest.approx([989 / 312])
    assert stage_capacity(MIXED, cfg) == pytest.approx(79.6 * 2**30)
    assert stage_slowdowns(parse_cluster("dgx-h100:2"), cfg) == [1.0, 1.0]


def test_ilp_gives_the_slow_stage_fewer_layers():
    L = 12
    layer = dict(fwd=[{"none": 1.0}] * L, bwd=[{"none": 2.0}] * L, act=[{"none": 1.0}] * L, static=[1.0] * L,
                 out_p2p=[0.0] * L, classes=["b"] * L, pp=2, v=1, m=8, schedule="1f1b", inflight=[2.0, 1.0],
                 capacity=float("inf"), policies=("none",))
    even = solve_partition(PartitionProblem(**layer), time_limit=5)
    slow = solve_partition(PartitionProblem(**layer, slow=[3.0, 1.0]), time_limit=5)
    assert [hi - lo for lo, hi in even.partition.bounds] == [6, 6]
    assert [hi - lo for lo, hi in slow.partition.bounds] == [3, 9]
    with pytest.raises(ValueError, match="slow"):
        PartitionProblem(**layer, slow=[0.0, 1.0])


def test_speed_split_beats_even_split_on_mixed_pool():
    from planner.frontend.load import load_graph

    g = load_graph("llama3-8b", batch=1, seq_len=None)
    cfg = ParallelConfig(dp=32, pp=2, zero="fsdp")
    fast, even = speed_split(g, MIXED, cfg), even_split(g, 2)
    assert fast.bounds[0][1] < even.bounds[0][1]  # the A100 stage holds fewer layers
    e_fast, e_even = estimate(g, MIXED, cfg, fast, 256), estimate(g, MIXED, cfg, even, 256)
    assert e_fast.fits and e_fast.step_s < 0.7 * e_even.step_s
    assert e_fast.devices == ["a100-pod: A100-SXM4-80GB", "h100-pod: H100-SXM5-80GB"]
    # the compute of the A100 stage costs 989/312 what it costs on the reference H100
    assert e_even.stage_fwd_s[0] > 2.5 * e_even.stage_fwd_s[1]
