"""One-group moves of a stage split off the busiest rank (planner/search/split_moves.py)."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.pipeline import simulate
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig
from planner.search.split_moves import moves_apply, rank_busy, split_note, with_split_moves
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
    """Llama-3 8B (a 128K-vocabulary head on the last stage, its busiest rank on the even split),
    pp8 on one DGX: the moves find a split at least 5% faster, taking groups off that rank; it fits."""
    e = _even(llama8b, pp=8, zero="zero1")
    busy = rank_busy(e)
    assert max(range(8), key=busy.__getitem__) == 7
    moved, moves = with_split_moves(llama8b, DGX, e, None, None)
    assert moves >= 1 and moved.fits and moved.step_s < 0.95 * e.step_s
    size = [hi - lo for lo, hi in moved.partition.bounds]
    before = [hi - lo for lo, hi in e.partition.bounds]
    assert size[7] < before[7] and sum(size) == sum(before)
    note = split_note(e, moved, moves, "the even split")
    assert note.startswith(f"layers per stage {'/'.join(map(str, before))} (the even split) -> "
                           f"{'/'.join(map(str, size))}: {moves} stage group")
    assert split_note(e, e, 0, "the even split") == ""


def test_split_and_estimate_moves_the_ilp_split_too(llama8b):
    """split_and_estimate moves groups on the ILP's split as well as on the even one and keeps the
    faster; the ILP's split moved is faster than the ILP's split as solved."""
    from planner.search.stage_split import best_partition

    e = _even(llama8b, pp=8, zero="zero1")
    part, _ = best_partition(llama8b, DGX, e.config, 32)
    ilp = estimate(llama8b, DGX, e.config, part, 32)
    ilp_moved, moves = with_split_moves(llama8b, DGX, ilp, None, None)
    assert moves >= 1 and ilp_moved.step_s < ilp.step_s
    from_even, _ = with_split_moves(llama8b, DGX, e, None, None)
    best, info = split_and_estimate(llama8b, DGX, e.config, 32)
    assert best.fits and best.step_s <= min(from_even.step_s, ilp_moved.step_s) * (1 + 1e-9)
    sizes = "/".join(str(hi - lo) for lo, hi in best.partition.bounds)
    assert info["split_moves"].split(" -> ")[1].startswith(sizes + ":")


def test_layouts_the_moves_leave_alone(llama8b):
    """No moves without a pipeline or with two stages per rank (interleaved); a busy time per rank
    of a pipeline the moves apply to."""
    for kw in (dict(dp=8), dict(pp=4, vpp=2, schedule="interleaved-1f1b", dp=2)):
        e = _even(llama8b, **kw)
        assert not moves_apply(e)
        assert with_split_moves(llama8b, DGX, e, None, None) == (e, 0)
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
    sizes = "/".join(str(len(s["layers"])) for s in plan.stages)
    assert res.split_note.split(" -> ")[1].startswith(sizes + ":")  # the split the plan runs
    assert "Stage split: " + escape(res.split_note) in render_html(build_report(plan, layers=False))


@pytest.mark.slow
def test_evaluate_says_how_the_split_moved(tmp_path, capsys):
    """``autopar evaluate`` on the ILP's split prints the moves (as ``autopar plan`` does), gives them
    under ``split`` with ``--json`` and records them in the plan it writes; ``--even-split`` moves nothing."""
    import json

    from planner.entry.cli import main
    from planner.plan import Plan

    args = ["evaluate", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "32", "--seq-len", "4096",
            "--config", "pp=8,dp=1,tp=1,cp=1,schedule=1f1b,zero=zero1,mbs=1,dtype=bf16", "--no-calibrate"]
    out = tmp_path / "plan.json"
    assert main(args + ["-o", str(out)]) == 0
    said = "[autopar] stage split: "
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith(said))[len(said):]
    assert "moved off the busiest rank" in line
    plan = Plan.load(str(out))
    assert plan.search["split"] == line
    assert line.split(" -> ")[1].startswith("/".join(str(len(s["layers"])) for s in plan.stages) + ":")
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["split"] == plan.search["split"]
    assert main(args + ["--json", "--even-split"]) == 0
    assert "split" not in json.loads(capsys.readouterr().out)
