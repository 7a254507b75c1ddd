"""Ranks sharing CPU cores: a pipeline's idle ranks leave their cores to the busy ones."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.pipeline import simulate
from cost_models.shared_cores import BASE_SLICE_S, compute_concurrency, core_speedup, sync_wait_s
from planner.plan import ParallelConfig
from planner.search.stage_split import even_split


@dataclass
class Span:
    start: float
    end: float


def test_concurrency_is_compute_weighted():
    assert compute_concurrency([Span(0, 1), Span(0, 1)]) == pytest.approx(2.0)
    assert compute_concurrency([Span(0, 1), Span(1, 2)]) == pytest.approx(1.0)
    # 2 busy for 1 s, then 1 busy for 2 s: (4 + 2) / (2 + 2)
    assert compute_concurrency([Span(0, 1), Span(0, 3)]) == pytest.approx(1.5)
    assert compute_concurrency([]) == 1.0


def test_speedup_vanishes_with_a_core_per_rank():
    assert core_speedup(4, 4, 1.0) == 1.0
    assert core_speedup(0, 8, 1.0) == 1.0
    assert core_speedup(2, 4, 4.0) == 1.0          # all busy: as the layer times assume
    assert core_speedup(2, 4, 2.0) == pytest.approx(2.0)
    assert core_speedup(2, 4, 1.0) == pytest.approx(2.0)  # one rank cannot use more than a core
    assert core_speedup(2, 4, 3.0) == pytest.approx(4 / 3)


def test_pipeline_concurrency_follows_the_bubble():
    few = compute_concurrency(simulate("1f1b", 4, 4, 1.0, 2.0).events)
    many = compute_concurrency(simulate("1f1b", 4, 64, 1.0, 2.0).events)
    assert 1.0 < few < many < 4.0


def test_a_pipeline_on_shared_cores_is_priced_faster_and_lockstep_layouts_are_not():
    from planner.frontend.load import load_graph

    g = load_graph("gpt-tiny", batch=1)
    shared = parse_cluster("local-cpu:4")
    shared.cores_per_node = 2
    own = parse_cluster("local-cpu:4")
    own.cores_per_node = 4
    pp = ParallelConfig(pp=4, mbs=1, schedule="1f1b", dtype="fp32")
    part = even_split(g, 4, "none")
    a = estimate(g, shared, pp, part, 4)
    b = estimate(g, own, pp, part, 4)
    assert a.breakdown["compute"] < 0.9 * b.breakdown["compute"]
    assert a.breakdown["p2p"] + a.breakdown["bubble"] > b.breakdown["p2p"] + b.breakdown["bubble"]  # sync waits
    dp = ParallelConfig(dp=4, mbs=1, dtype="fp32")
    one = even_split(g, 1, "none")
    a, b = estimate(g, shared, dp, one, 4), estimate(g, own, dp, one, 4)
    assert a.breakdown["compute"] == pytest.approx(b.breakdown["compute"])  # lockstep: as profiled
    assert a.breakdown["dp_comm"] > b.breakdown["dp_comm"]  # no core to hide the all-reduce behind


def test_sync_wait_is_one_scheduler_slice_on_shared_cores():
    assert sync_wait_s(2, 4) == pytest.approx(BASE_SLICE_S * 2)
    assert sync_wait_s(8, 16) == pytest.approx(BASE_SLICE_S * 4)
    assert sync_wait_s(4, 4) == 0.0 and sync_wait_s(0, 4) == 0.0


def test_fewer_processes_than_profiled_get_faster_collectives():
    """A profile of local-cpu:4 on 2 cores timed every collective with 4 processes sharing them; a
    dp2 layout (2 processes, a core each) moves the same call's data in half the time, dp4 in the
    same; the call's latency floor (its smallest message's time) does not shrink."""
    from dataclasses import replace

    from cost_models.comm import collective_time
    from cost_models.profile_db import ProfileDB
    from cost_models.shared_cores import profiled_comm_factor

    four = replace(parse_cluster("local-cpu:4"), cores_per_node=2)
    two = replace(four, devices_per_node=2)
    assert profiled_comm_factor(four, 4) == 1.0
    assert profiled_comm_factor(two, 4) == pytest.approx(0.5)
    assert profiled_comm_factor(replace(two, cores_per_node=4), 4) == 1.0   # a core each when profiled too
    assert profiled_comm_factor(parse_cluster("dgx-h100:1"), 8) == 1.0      # not a local CPU cluster
    db = ProfileDB(cluster_fingerprint=four.fingerprint(), backend="gloo", world=4)
    floor = 2e-4
    db.add_collective("all_reduce", 2, "intra", 1024, floor)
    for nbytes in (2**20, 2**24):
        db.add_collective("all_reduce", 2, "intra", nbytes, nbytes * 1e-9)
    t4 = collective_time("all_reduce", 2**22, four, {"dp": 2, "pp": 2}, "dp", db)
    t2 = collective_time("all_reduce", 2**22, two, {"dp": 2}, "dp", db)
    assert t4.source == t2.source == "profile"
    # dp4's call also waits for a descheduled peer (sync_wait_s); dp2 has a core per process
    assert t2.seconds == pytest.approx(floor + (t4.seconds - sync_wait_s(2, 4) - floor) / 2)
    assert t2.seconds == pytest.approx(floor + (2**22 * 1e-9 - floor) / 2)
    small = collective_time("all_reduce", 512, two, {"dp": 2}, "dp", db)
    assert small.seconds == pytest.approx(floor)  # a latency-bound call: no faster with a core each


def test_zero1_owners_send_their_parameters_in_buckets():
    """ZeRO-1's broadcasts: one per bucket of an owner's parameters (never one per parameter),
    a parameter larger than the bucket alone; the cost model counts the same calls."""
    from planner.sharding import DDP_BUCKET_BYTES as B, zero1_broadcasts, zero1_buckets

    assert zero1_buckets([[10, 20, 30], [5]]) == [[[0, 1, 2]], [[0]]]
    assert zero1_buckets([[10, B, 5, B + 1]]) == [[[0], [1], [2], [3]]]
    assert zero1_buckets([[B // 2, B // 2, 1]]) == [[[0, 1], [2]]]
    assert zero1_buckets([[]]) == [[]]
    assert zero1_broadcasts(4 * 32e6, 2) == 2 * 3      # 64 MB per owner: 3 buckets of 25 MiB
    assert zero1_broadcasts(2e6, 4) == 4               # small: one call per owner
