"""Pipeline schedule simulator: exact bubbles, memory, dependencies, closed form."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.pipeline import (
    SCHEDULES, ScheduleError, estimate_step, schedule_orders, simulate, simulate_orders,
)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 4), (4, 8), (8, 3), (8, 32), (16, 64)])
def test_1f1b_uniform_bubble_is_exact(p: int, m: int) -> None:
    f, b = 0.37, 0.74
    r = simulate("1f1b", p, m, [f] * p, [b] * p)
    assert r.step_s == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert r.bubble_frac == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert r.peak_inflight[0] == min(p, m)
    assert r.peak_inflight == [min(p - i, m) for i in range(p)]


@pytest.mark.parametrize("p,m", [(2, 5), (4, 8), (8, 3)])
def test_gpipe_same_makespan_more_memory(p: int, m: int) -> None:
    f, b = 1.0, 2.0
    g = simulate("gpipe", p, m, f, b)
    assert g.step_s == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert g.peak_inflight == [m] * p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 3), (8, 16, 2)])
def test_interleaved_divides_bubble_by_v(p: int, m: int, v: int) -> None:
    f, b = 1.0, 2.0
    r = simulate("interleaved-1f1b", p, m, [f / v] * (p * v), [b / v] * (p * v), v=v)
    bubble_time = r.step_s - m * (f + b)
    assert bubble_time == pytest.approx((p - 1) * (f + b) / v, rel=1e-9)
    plain = simulate("1f1b", p, m, f, b)
    assert r.step_s < plain.step_s
    # chunk-microbatches held on rank 0 exceed the plain 1F1B count; distinct mbs <= m
    assert r.peak_inflight_chunks[0] > plain.peak_inflight[0]
    assert all(x <= m for x in r.peak_inflight)
    assert all(c >= x for c, x in zip(r.peak_inflight_chunks, r.peak_inflight))



@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 3), (4, 16, 3), (4, 8, 2)])
def test_heavy_last_virtual_stage_paces_every_microbatch(p: int, m: int, v: int) -> None:
    """A head (and its loss) on the last virtual stage, worth d more than a block stage per
    micro-batch, makes the last rank the busiest: every one of the m micro-batches waits for it,
    so the interleaved step grows by m x d over the uniform (m v + p - 1)(f + b), not by d or
    by the d / v a bubble term would charge."""
    f, b, n = 1.0, 2.0, p * v
    uniform = simulate("interleaved-1f1b", p, m, f, b, v=v).step_s
    assert uniform == pytest.approx((m * v + p - 1) * (f + b), rel=1e-12)
    fh, bh = [f] * n, [b] * n
    fh[-1], bh[-1] = 1.5 * f, 1.5 * b  # d = 0.5 (f + b) per micro-batch on the last stage
    heavy = simulate("interleaved-1f1b", p, m, fh, bh, v=v).step_s
    assert heavy - uniform == pytest.approx(m * 0.5 * (f + b), rel=1e-9)

def test_interleaved_needs_m_multiple_of_p() -> None:
    with pytest.raises(ScheduleError, match="divisible"):
        simulate("interleaved-1f1b", 4, 6, 1.0, 2.0, v=2)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (8, 8), (8, 20), (3, 2)])
def test_zb_h1_beats_1f1b_with_same_activation_peak(p: int, m: int) -> None:
    f, b = 1.0, 2.0
    one = simulate("1f1b", p, m, f, b)
    zb = simulate("zb-h1", p, m, f, b)  # B = W = 1
    assert zb.step_s < one.step_s
    assert zb.peak_inflight == one.peak_inflight
    # activations held from F to W never exceed rank 0's 1F1B peak on any rank
    for r in range(p):
        held = peak = 0
        for e in sorted((e for e in zb.events if e.rank == r), key=lambda e: e.start):
            held += {"F": 1, "I": 0, "W": -1}[e.kind]
            peak = max(peak, held)
        assert peak <= min(p, m)


def test_zb_h1_matches_paper_bubble_when_w_le_f() -> None:
    p, m, f, b, w = 4, 12, 1.0, 1.2, 0.8
    zb = simulate("zb-h1", p, m, f, b, wgrad=w)
    assert zb.step_s == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w), rel=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_single_stage_has_no_bubble(schedule: str) -> None:
    v = 2 if schedule == "interleaved-1f1b" else 1
    r = simulate(schedule, 1, 5, [1.0] * v, [2.0] * v, v=v)
    assert r.bubble_frac == pytest.approx(0.0, abs=1e-12)
    assert r.step_s == pytest.approx(5 * 3.0 * v)


def test_p2p_delays_the_step() -> None:
    a = simulate("1f1b", 4, 8, 1.0, 2.0)
    b = simulate("1f1b", 4, 8, 1.0, 2.0, p2p=0.1)
    assert b.step_s >= a.step_s + 2 * 3 * 0.1 - 1e-12  # at least the fill and drain hops


def test_bad_inputs_raise_one_line() -> None:
    with pytest.raises(ScheduleError, match="unknown pipeline schedule"):
        simulate("2f2b", 2, 2, 1.0, 1.0)
    with pytest.raises(ScheduleError, match="expected 4"):
        simulate("1f1b", 4, 4, [1.0] * 3, [1.0] * 4)
    with pytest.raises(ScheduleError, match="interleaved"):
        simulate("1f1b", 2, 2, 1.0, 1.0, v=2)
    with pytest.raises(ScheduleError, match="wgrad"):
        simulate("1f1b", 2, 2, 1.0, 1.0, wgrad=1.0)


def test_deadlocking_order_is_detected() -> None:
    # rank 0 runs B(0) before F(0): B needs the last stage's B, which needs F(0) of stage 0
    orders = [[(1, 0, 0), (0, 0, 0)], [(0, 1, 0), (1, 1, 0)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_orders(orders, 1, 1.0, 2.0)
    ok = simulate_orders([[(0, 0, 0), (1, 0, 0)], [(0, 1, 0), (1, 1, 0)]], 1, 1.0, 2.0)
    assert ok.step_s == pytest.approx(6.0)
    with pytest.raises(ScheduleError, match="twice"):
        simulate_orders([[(0, 0, 0), (0, 0, 0)], [(0, 1, 0), (1, 1, 0)]], 1, 1.0, 2.0)


def _check_events(schedule: str, p: int, m: int, v: int, res, p2p: float) -> None:
    ev = res.events
    n_stages = p * v
    kinds = ("F", "I", "W") if schedule == "zb-h1" else ("F", "B")
    assert {e.kind for e in ev} == set(kinds)
    by_key = {}
    for e in ev:
        key = ("B" if e.kind == "I" else e.kind, e.stage, e.mb)
        assert key not in by_key, f"{key} ran twice"
        by_key[key] = e
        assert e.rank == e.stage % p and e.chunk == e.stage // p
        assert e.end >= e.start
    assert len(by_key) == len(kinds) * n_stages * m
    assert [(e.start, e.rank) for e in ev] == sorted((e.start, e.rank) for e in ev)
    for r in range(p):
        mine = sorted((e for e in ev if e.rank == r), key=lambda e: (e.start, e.end))
        for a, b in zip(mine, mine[1:]):
            assert b.start >= a.end - 1e-9, "two operations overlap on one rank"
    eps = 1e-9
    for (kind, s, mb), e in by_key.items():
        if kind == "F" and s > 0:
            d = by_key[("F", s - 1, mb)]
            assert e.start >= d.end + (p2p if d.rank != e.rank else 0) - eps
        if kind == "B":
            d = by_key[("B", s + 1, mb)] if s < n_stages - 1 else by_key[("F", s, mb)]
            assert e.start >= d.end + (p2p if d.rank != e.rank else 0) - eps
        if kind == "W":
            assert e.start >= by_key[("B", s, mb)].end - eps
    assert max(e.end for e in ev) == pytest.approx(res.step_s)
    busy = [sum(e.end - e.start for e in ev if e.rank == r) for r in range(p)]
    assert busy == pytest.approx(res.busy_s)


times = st.floats(min_value=0.01, max_value=5.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=120, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 8), m=st.integers(1, 16), v=st.integers(1, 3),
       data=st.data(), p2p=st.sampled_from([0.0, 0.05, 0.5]))
def test_random_schedules_respect_dependencies(schedule: str, p: int, m: int, v: int, data, p2p: float) -> None:
    if schedule != "interleaved-1f1b":
        v = 1
    else:
        m = p * max(1, m // p)
    n = p * v
    f = data.draw(st.lists(times, min_size=n, max_size=n))
    b = data.draw(st.lists(times, min_size=n, max_size=n))
    w = data.draw(st.lists(times, min_size=n, max_size=n)) if schedule == "zb-h1" else None
    res = simulate(schedule, p, m, f, b, wgrad=w, p2p=p2p, v=v)
    _check_events(schedule, p, m, v, res, p2p)
    bound = estimate_step(schedule, p, m, f, b, wgrad=w, p2p=p2p, v=v)
    assert bound >= res.step_s * (1 - 1e-12)
    assert 0.0 <= res.bubble_frac < 1.0


@settings(max_examples=80, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 8), m=st.integers(1, 16), v=st.integers(1, 3),
       f=times, b=times, w=times)
def test_closed_form_is_exact_for_uniform_stages(schedule: str, p: int, m: int, v: int, f: float, b: float,
                                                 w: float) -> None:
    if schedule != "interleaved-1f1b":
        v = 1
    else:
        m = p * max(1, m // p)
    wgrad = w if schedule == "zb-h1" else None
    sim = simulate(schedule, p, m, f, b, wgrad=wgrad, v=v).step_s
    assert estimate_step(schedule, p, m, f, b, wgrad=wgrad, v=v) == pytest.approx(sim, rel=1e-9)


def test_orders_hold_every_operation_once() -> None:
    for schedule in SCHEDULES:
        v = 2 if schedule == "interleaved-1f1b" else 1
        orders = schedule_orders(schedule, 4, 8, v)
        ops = [op for o in orders for op in o]
        assert len(ops) == len(set(ops)) == (3 if schedule == "zb-h1" else 2) * 4 * v * 8


def test_large_pipeline_is_fast() -> None:
    simulate("1f1b", 64, 512, 1.0, 2.0)  # compiles and caches the order
    best = min(_timed(lambda: simulate("1f1b", 64, 512, [1.0] * 64, [2.0] * 64)) for _ in range(3))
    assert best < 0.1  # ~25 ms on a 2-core CI box; generous for load
    assert _timed(lambda: estimate_step("1f1b", 64, 512, 1.0, 2.0)) < 1e-3


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_ir_schedules_price_like_the_builtins() -> None:
    """A built-in written out as a file (torch's CSV form) and read back prices the same."""
    from planner.schedule_file import parse, to_csv
    from planner.schedule_ir import builtin
    from cost_models.pipeline import simulate_schedule
    f, b = [1.0, 1.5, 0.8, 1.2], [2.0, 2.5, 1.9, 2.2]
    for name in ("gpipe", "1f1b", "zb-h1"):
        s = parse(to_csv(builtin(name, 4, 8)), "csv")
        w = [0.4 * x for x in b]
        ref = simulate(name, 4, 8, f, [x - y for x, y in zip(b, w)], wgrad=w, p2p=0.05) if name == "zb-h1" \
            else simulate(name, 4, 8, f, b, p2p=0.05)
        assert simulate_schedule(s, f, b, wgrad=w, p2p=0.05).step_s == pytest.approx(ref.step_s, rel=1e-12)


def test_dualpipev_is_priced_on_its_v_placement() -> None:
    p, m = 4, 16
    f, b = [1.0] * (2 * p), [2.0] * (2 * p)
    dv = simulate("dualpipev", p, m, f, b, v=2)
    ev = dv.events
    assert {(e.stage, e.rank) for e in ev} == {(s, s if s < p else 2 * p - 1 - s) for s in range(2 * p)}
    assert {e.kind for e in ev} == {"F", "B", "I", "W"}
    for r in range(p):  # one action at a time per rank, all work done
        mine = sorted((e for e in ev if e.rank == r), key=lambda e: e.start)
        assert all(y.start >= x.end - 1e-9 for x, y in zip(mine, mine[1:]))
    # the same work as interleaved-1f1b over 2 chunks per rank, with a smaller bubble
    il = simulate("interleaved-1f1b", p, m, f, b, v=2)
    assert dv.busy_s == pytest.approx(il.busy_s)
    assert dv.step_s < il.step_s
    assert estimate_step("dualpipev", p, m, f, b, v=2) >= dv.step_s - 1e-9
