"""The busiest-rank floor (planner/search/rank_floor.py) is a floor: no dealing of whole groups to
the ranks has a busiest rank below it, and no priced pipeline (closed form or simulated, every
schedule, interleaving, sequence chunks, recompute) is faster than it; and it prunes only where
it may (one device type, each rank on its own device)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.layer_costs import LayerCosts
from planner.feasibility import microbatches
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig
from planner.search.rank_floor import RankFloors, applies, busiest_share
from planner.search.stage_split import even_split


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=7), st.integers(1, 3))
def test_no_dealing_of_the_groups_beats_the_share(groups, ranks):
    best = min(max(sum(g for g, r in zip(groups, deal) if r == k) for k in range(ranks))
               for deal in itertools.product(range(ranks), repeat=len(groups)))
    share = busiest_share(groups, ranks)
    assert share <= best + 1e-9
    assert share >= sum(groups) / ranks


def test_whole_blocks_are_what_balance_misses():
    assert busiest_share([1.0] * 80, 64) == 2.0          # 80 equal blocks on 64 ranks: someone holds two
    assert busiest_share([1.0] * 80, 16) == 5.0          # divides evenly: the average
    assert busiest_share([0.1, 3.0, 1.0, 1.0], 2) == 3.0  # one big group: its rank holds it whole
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        busiest_share([1.0], 0)


GPU = parse_cluster("dgx-h100:4")
GRAPH = load_graph("llama3-8b", batch=1, seq_len=4096)  # 32 blocks + embeddings, norm, head: 35 groups


@pytest.mark.parametrize("pp,schedule,vpp,chunks", [
    (16, "1f1b", 1, 1), (32, "1f1b", 1, 1), (16, "interleaved-1f1b", 2, 1), (8, "zb-h1", 1, 1),
    (16, "dualpipev", 2, 1), (32, "1f1b", 1, 4), (16, "gpipe", 1, 2), (4, "1f1b", 1, 1)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_no_priced_pipeline_beats_the_floor(pp, schedule, vpp, chunks, recompute):
    cfg = ParallelConfig(dp=32 // pp, pp=pp, tp=1, mbs=1, schedule=schedule, vpp=vpp, zero="fsdp",
                         recompute=recompute, seq_chunks=chunks, dtype="bf16")
    gb = 64
    costs = LayerCosts(GRAPH, GPU, cfg, None)
    floor = RankFloors(GRAPH, GPU).step_floor(costs, recompute, pp, microbatches(cfg, gb))
    assert floor > 0
    part = even_split(GRAPH, pp * vpp, recompute)
    for fast in (True, False):
        e = estimate(GRAPH, GPU, cfg, part, gb, fast=fast, costs=costs)
        assert floor <= e.step_s * (1 + 1e-9), (fast, floor, e.step_s)


def test_the_floor_stays_out_where_ranks_are_not_alike():
    assert applies(GPU)
    for spec in ("mixed-a100-h100:2", "local-cpu:4"):
        c = parse_cluster(spec)
        assert not applies(c)
        cfg = ParallelConfig(dp=1, pp=2, tp=1, mbs=1, dtype="fp32")
        assert RankFloors(GRAPH, c).step_floor(LayerCosts(GRAPH, c, cfg, None), "none", 2, 8) == 0.0
