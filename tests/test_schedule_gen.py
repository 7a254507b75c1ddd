"""Generated pipeline schedules (planner/search/schedule_gen.py): valid, within the memory
limit, never kept when slower than the built-ins, and considered by the search."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from cost_models.pipeline import simulate, simulate_schedule
from planner.schedule_check import check, peak_activations
from planner.search.schedule_gen import best_schedule, generate

times = st.floats(min_value=0.1, max_value=3.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), mult=st.integers(1, 4), data=st.data(), p2p=st.sampled_from([0.0, 0.05, 0.5]))
def test_generated_schedules_are_valid_and_within_memory(p, mult, data, p2p):
    m = p * mult
    f = data.draw(st.lists(times, min_size=p, max_size=p))
    b = [x * data.draw(st.floats(1.2, 3.0)) for x in f]
    s = generate(f, b, m, p2p=p2p)
    check(s)
    assert peak_activations(s, [1.0] * p) <= [min(p - r, m) for r in range(p)]
    choice = best_schedule(f, b, m, p2p=p2p)
    builtin = min(simulate(n, p, m, f, b, p2p=p2p).step_s for n in ("1f1b", "zb-h1"))
    assert choice.result.step_s <= builtin * (1 + 1e-9)
    if choice.schedule is not None:
        assert simulate_schedule(choice.schedule, f, b, p2p=p2p).step_s < builtin


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 16)])
def test_uniform_stages_match_zero_bubble(p, m):
    """ZB-H1's step, with the first stage's backward whole (torch's runtime runs it whole in its W)."""
    s = generate([1.0] * p, [2.0] * p, m)
    assert not [a for a in s.actions(0) if a.stage == 0 and a.kind in "IW"]
    assert simulate_schedule(s, [1.0] * p, [2.0] * p).step_s == pytest.approx(simulate("zb-h1", p, m, 1.0, 2.0).step_s)


def test_a_tighter_memory_limit_is_kept():
    s = generate([1.0] * 4, [2.0] * 4, 8, limit=[2, 2, 2, 1])
    assert max(peak_activations(s, [1.0] * 4)) == 2
    with pytest.raises(ValueError, match="activation limits"):
        generate([1.0] * 2, [2.0] * 2, 4, limit=[0.5, 1])


def test_the_search_keeps_a_generated_schedule_only_when_faster():
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.stage_split import split_and_estimate
    g = load_graph("llama-tiny", batch=1, seq_len=32)
    for sched in ("1f1b", "zb-h1"):
        cfg = ParallelConfig(pp=4, schedule=sched, dtype="fp32").validate()
        e, info = split_and_estimate(g, parse_cluster("local-cpu:4"), cfg, 8, generate=True)
        if e.config.schedule == "custom":  # generated (or the head as vocabulary passes): faster than the built-in
            assert e.schedule_ir is not None
            assert info["schedule"].startswith("generated") or (
                e.config.vocab_passes and "vocabulary passes" in info["schedule"] and e.schedule_ir.v == 2)
        else:
            assert e.schedule_ir is None and "schedule" not in info
        # a schedule the user pinned (evaluate, --fix schedule=...) is priced as given
        pinned, info = split_and_estimate(g, parse_cluster("local-cpu:4"), cfg, 8)
        assert pinned.config.schedule == sched and pinned.schedule_ir is None and "schedule" not in info


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), data=st.data(), p2p=st.sampled_from([0.0, 0.05, 0.5]))
def test_no_order_beats_the_order_floor(p, m, data, p2p):
    """``order_floor`` bounds every order of a one-stage-per-rank split: the built-ins and the
    generated one all take at least it (what benchmarks/schedule_gen.py measures the room by)."""
    from cost_models.pipeline import order_floor

    f = data.draw(st.lists(times, min_size=p, max_size=p))
    b = [x * data.draw(st.floats(1.2, 3.0)) for x in f]
    floor = order_floor(m, f, b, p2p)
    assert floor >= m * max(x + y for x, y in zip(f, b))
    for name in ("gpipe", "1f1b", "zb-h1"):
        assert simulate(name, p, m, f, b, p2p=p2p).step_s >= floor * (1 - 1e-9), name
    assert simulate_schedule(generate(f, b, m, p2p=p2p), f, b, p2p=p2p).step_s >= floor * (1 - 1e-9)
