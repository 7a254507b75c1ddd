"""Hierarchical DP across cluster groups: the one rule (planner.sharding.dp_replicas), the memory
model's sharding under it and the plan record the runtime reads. The runtime's parity (hierarchical
vs flat, 4 gloo ranks in 2 groups) shares tests/outer_worker.py's launch (tests/test_outer_loop.py)."""
from __future__ import annotations

import pytest

from benchmarks.wan_rig import rig_cluster
from cost_models.model_states import per_param_bytes
from cost_models.wan_cost import dp_spans, hsdp_replicas
from planner.plan import ParallelConfig
from planner.sharding import dp_replicas, shard_ranks


def test_dp_replicas_rule():
    assert dp_replicas("fully_shard", 4, 2) == 2 and dp_replicas("ddp-reducer", 4, 2) == 2
    assert dp_replicas("replicate", 4, 2) == 1  # FSDP2's replicate takes a 1-D mesh: flat
    assert dp_replicas("fully_shard", 3, 2) == 1 and dp_replicas("fully_shard", 4, 1) == 1
    assert shard_ranks(8, 2) == 4


@pytest.mark.parametrize("mbit", [None, 200.0])
def test_rig_spans_and_replicas(mbit):
    """The rig (2 groups of 2 gloo ranks): dp=4 spans both groups; dp=2 x pp=2 keeps dp inside one;
    low-communication DP's replicas of a group lie in one region."""
    cl = rig_cluster(mbit)
    assert dp_spans(cl, ParallelConfig(dp=4, zero="fsdp", dtype="fp32")) == 2
    assert hsdp_replicas(cl, ParallelConfig(dp=4, zero="fsdp", dtype="fp32")) == 2
    assert hsdp_replicas(cl, ParallelConfig(dp=4, zero="ddp", dtype="fp32")) == 2  # DDP's reducer + hook
    assert hsdp_replicas(cl, ParallelConfig(dp=4, zero="ddp", dtype="bf16")) == 1  # replicate: flat
    assert dp_spans(cl, ParallelConfig(dp=2, pp=2, zero="fsdp", dtype="fp32")) == 1
    assert dp_spans(cl, ParallelConfig(dp=4, zero="ddp", dtype="fp32", low_comm="2x4:bf16")) == 1


@pytest.mark.parametrize("zero", ["fsdp", "zero2"])
def test_memory_shards_over_one_group_under_hsdp(zero):
    """FSDP over a 2-D (replicate across 2 groups, shard inside) mesh holds 1/2, not 1/4, of the
    states on dp=4: what the runtime's HSDP build holds (tests/test_outer_loop.py checks the local
    shard of the build against shard_ranks)."""
    cfg = ParallelConfig(dp=4, zero=zero, dtype="fp32")
    flat, hier = per_param_bytes(cfg), per_param_bytes(cfg, replicas=2)
    for k in ("weights", "grads", "optimizer"):
        assert hier[k] == pytest.approx(2 * flat[k])
    ddp = ParallelConfig(dp=4, zero="ddp", dtype="fp32")
    assert per_param_bytes(ddp, replicas=2) == per_param_bytes(ddp)  # replicated states either way


def test_hsdp_pricing_moves_only_the_gradients_across():
    """HSDP as it runs: parameters all-gathered inside a region only, gradients reduce-scattered
    inside it and all-reduced across. On a 1 Mbit/s link the WAN term dominates, so fsdp (two
    all-gathers and a reduce-scatter per micro-batch) costs what zero2 (one all-gather) does; a
    flat all-gather across the link (the pricing before) made fsdp 1.5x zero2's."""
    from cost_models.estimate import estimate
    from planner.frontend.load import load_graph
    from planner.plan import Partition

    g = load_graph("llama-tiny", batch=1)
    part = Partition([(0, len(g.layers))], ["none"])
    cl = rig_cluster(1.0)
    dp = {z: estimate(g, cl, ParallelConfig(dp=4, zero=z, dtype="fp32"), part, 8).breakdown["dp_comm"]
          for z in ("zero2", "fsdp")}
    assert dp["zero2"] > 0.1  # seconds: the link's share of every step
    assert dp["fsdp"] == pytest.approx(dp["zero2"], rel=0.05)
