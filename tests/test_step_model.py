"""One step-time model: the simulator, its closed form, the ILP's linear objective and the
search's floors all come from cost_models/pipeline.py, and stand in the documented order.

- ``throughput_floor <= simulate <= estimate_step`` and ``throughput_floor <= linear_step <=
  estimate_step`` for any stage times (``linear_step`` is the ILP's objective: an approximation
  of the simulator bounded by the same floor and ceiling); all equal on uniform stages.
- The ILP's own objective at its split is ``linear_step`` of that split's stage times, and the
  simulator's step time on that split lies within the same bounds.
- zb-h1's B / W split is ``split_backward`` everywhere (the simulator's default, the closed form,
  the ILP's ``wgrad_frac``).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.pipeline import (WGRAD_FRAC, ScheduleError, estimate_step, linear_step, simulate, split_backward,
                                  throughput_floor)
from planner.search.partition import PartitionProblem, solve_partition

REL = 1e-9


@st.composite
def pipelines(draw, uniform=False):
    sched = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]))
    p = draw(st.integers(2, 4))
    v = draw(st.integers(2, 3)) if sched == "interleaved-1f1b" else 1
    m = draw(st.integers(1, 3)) * p if sched == "interleaved-1f1b" else draw(st.integers(1, 9))
    S = p * v
    times = st.floats(0.05, 3.0)
    if uniform:
        f, b = draw(times), draw(times)
        return sched, p, m, v, [f] * S, [b] * S
    return sched, p, m, v, draw(st.lists(times, min_size=S, max_size=S)), draw(st.lists(times, min_size=S, max_size=S))


@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_simulator_and_linear_form_share_floor_and_ceiling(case):
    sched, p, m, v, F, B = case
    try:
        sim = simulate(sched, p, m, F, B, v=v).step_s
    except ScheduleError:
        return
    lo, hi = throughput_floor(p, m, F, B), estimate_step(sched, p, m, F, B, v=v)
    lin = linear_step(sched, p, m, v, F, B)
    assert lo <= sim * (1 + REL) and sim <= hi * (1 + REL)
    assert lo <= lin * (1 + REL) and lin <= hi * (1 + REL)


@settings(max_examples=100, deadline=None)
@given(pipelines(uniform=True))
def test_all_forms_agree_on_uniform_stages(case):
    sched, p, m, v, F, B = case
    if sched == "zb-h1" and m < p:
        return
    try:
        sim = simulate(sched, p, m, F, B, v=v).step_s
    except ScheduleError:
        return
    assert linear_step(sched, p, m, v, F, B) == pytest.approx(sim, rel=1e-9)
    assert estimate_step(sched, p, m, F, B, v=v) == pytest.approx(sim, rel=1e-9)


def test_zb_h1_backward_split_is_one_rule():
    b, w = split_backward(2.0)
    assert (b, w) == (2.0 * (1 - WGRAD_FRAC), 2.0 * WGRAD_FRAC)
    explicit = simulate("zb-h1", 3, 6, [1.0] * 3, [b] * 3, wgrad=[w] * 3).step_s
    assert simulate("zb-h1", 3, 6, [1.0] * 3, [2.0] * 3).step_s == pytest.approx(explicit, rel=1e-12)
    assert PartitionProblem([{"none": 1.0}] * 3, [{"none": 2.0}] * 3, [{"none": 0.0}] * 3, [0.0] * 3, [0.0] * 3,
                            ["a"] * 3, 3, 1, 6, "zb-h1", [1.0] * 3, float("inf"),
                            policies=("none",)).wgrad_frac == WGRAD_FRAC


@pytest.mark.parametrize("seed", range(12))
def test_ilp_objective_is_the_linear_form_and_brackets_the_simulator(seed):
    rng = random.Random(seed)
    sched = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"][seed % 4]
    pp, v = rng.choice([2, 3]), (2 if sched == "interleaved-1f1b" else 1)
    m, L = pp * rng.choice([1, 2, 3]), rng.randint(pp * v + 1, 12)
    fwd = [rng.uniform(0.2, 2.0) for _ in range(L)]
    pr = PartitionProblem([{"none": f} for f in fwd], [{"none": 2 * f * rng.uniform(0.8, 1.2)} for f in fwd],
                          [{"none": 1.0}] * L, [1.0] * L, [0.0] * L, [f"l{i}" for i in range(L)], pp, v, m, sched,
                          [1.0] * (pp * v), float("inf"), policies=("none",))
    res = solve_partition(pr, time_limit=20)
    F = [sum(pr.fwd[i]["none"] for i in range(*b)) for b in res.partition.bounds]
    B = [sum(pr.bwd[i]["none"] for i in range(*b)) for b in res.partition.bounds]
    assert res.ilp_objective_s == res.ilp_objective_s, "the ILP's own split (not the warm start's)"
    assert res.ilp_objective_s == pytest.approx(res.objective_s, rel=1e-5)  # the solver's objective is the linear form
    sim = simulate(sched, pp, m, F, B, v=v).step_s
    lo, hi = throughput_floor(pp, m, F, B), estimate_step(sched, pp, m, F, B, v=v)
    assert lo <= sim * (1 + REL) <= hi * (1 + 2 * REL) and lo <= res.objective_s * (1 + REL) <= hi * (1 + 2 * REL)
