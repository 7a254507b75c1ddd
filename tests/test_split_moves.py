"""One-group moves of a stage split off the busiest rank (planner/search/split_moves.py)."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.pipeline import simulate
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig
from planner.search.split_moves import moves_apply, rank_busy, with_split_moves
from planner.search.stage_split import even_split, split_and_estimate

DGX = parse_cluster("dgx-h100:1")


@pytest.fixture(scope="module")
def llama8b():
    return load_graph("llama3-8b", batch=1, seq_len=4096)


def _even(g, **kw):
    cfg = ParallelConfig(mbs=1, dtype="bf16", **kw).validate()
    return estimate(g, DGX, cfg, even_split(g, cfg.pp * cfg.vpp), 32)


def test_the_same_heavy_stage_costs_less_early_in_1f1b():
    """The premise: with the same stage times, a slow stage before the others' fill and drain makes a
    shorter 1F1B step than the same stage last (what the ILP's linear model cannot tell apart)."""
    early = simulate("1f1b", 4, 16, [1.0, 1.1, 1.0, 1.0], [2.0, 2.2, 2.0, 2.0]).step_s
    late = simulate("1f1b", 4, 16, [1.0, 1.0, 1.0, 1.1], [2.0, 2.0, 2.0, 2.2]).step_s
    assert early < late


def test_moves_take_groups_off_a_heavy_last_stage(llama8b):
    """Llama-3 8B (a 128K-vocabulary head on the last stage), pp8 on one DGX: the moves find a split
    at least 5% faster than the even one, taking groups off its busiest rank; it still fits."""
    e = _even(llama8b, pp=8, zero="zero1")
    busy = rank_busy(e)
    src = max(range(8), key=busy.__getitem__)
    moved, info = with_split_moves(llama8b, DGX, e, None, None, {})
    assert moved.fits and moved.step_s < 0.95 * e.step_s
    size = [hi - lo for lo, hi in moved.partition.bounds]
    before = [hi - lo for lo, hi in e.partition.bounds]
    assert size[src] < before[src] and sum(size) == sum(before)
    assert info["split_moves"].startswith("layers per stage " + "/".join(map(str, before)))


def test_split_and_estimate_is_never_slower_than_either_split_moved(llama8b):
    """split_and_estimate moves groups on both the ILP's and the even split and keeps the faster."""
    e = _even(llama8b, pp=8, zero="zero1")
    from_even, _ = with_split_moves(llama8b, DGX, e, None, None, {})
    best, _ = split_and_estimate(llama8b, DGX, e.config, 32)
    assert best.fits and best.step_s <= from_even.step_s * (1 + 1e-9)


def test_layouts_the_moves_leave_alone(llama8b):
    """No moves without a pipeline or with two stages per rank (interleaved); a busy time per rank
    of a pipeline the moves apply to."""
    for kw in (dict(dp=8), dict(pp=4, vpp=2, schedule="interleaved-1f1b", dp=2)):
        e = _even(llama8b, **kw)
        assert not moves_apply(e)
        assert with_split_moves(llama8b, DGX, e, None, None, {"k": 1}) == (e, {"k": 1})
    e = _even(llama8b, pp=4, dp=2, zero="fsdp")
    assert moves_apply(e)
    assert len(rank_busy(e)) == 4 and min(rank_busy(e)) > 0


def test_the_plan_and_its_report_say_how_the_split_moved(llama8b):
    """A plan whose best split moved records it (``search.split``) and the report's stage section says it."""
    from html import escape

    from planner.report.data import build_report
    from planner.report.render import render_html
    from planner.search.planning import plan_model

    plan, res = plan_model(llama8b, DGX, 32, spec="llama3-8b", cluster_spec="dgx-h100:1",
                           fix="pp=8,dp=1,tp=1,cp=1,schedule=1f1b,zero=zero1,mbs=1")
    assert "moved off the busiest rank" in res.split_note and plan.search["split"] == res.split_note
    assert "Stage split: " + escape(res.split_note) in render_html(build_report(plan, layers=False))
