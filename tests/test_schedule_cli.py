"""A user's schedule file through the CLI: `autopar evaluate --schedule FILE -o plan.json` checks it
(one line naming the first problem), prices it, writes it into the plan, the report draws its
order and the emitted program carries it (tests/test_runtime_parity.py runs such schedules)."""
from __future__ import annotations

import json

import pytest

from codegen.emit import emit
from planner.entry.cli import main
from planner.plan import Plan
from planner.report.data import simulate_step
from planner.schedule_file import parse_json

MINE = "0F0,0F1,0F2,0I0,0F3,0B1,0W0,0I2,0B3,0W2\n1F0,1I0,1F1,1B1,1W0,1F2,1I2,1F3,1B3,1W2\n"
ARGS = ["evaluate", "--model", "llama-tiny", "--cluster", "local-cpu:2", "--global-batch", "4", "--no-calibrate"]


def test_evaluate_writes_a_plan_that_runs_the_file(tmp_path, capsys):
    f = tmp_path / "mine.csv"
    f.write_text(MINE)
    out = tmp_path / "plan.json"
    assert main(ARGS + ["--config", "pp=2,dtype=fp32", "--schedule", str(f), "-o", str(out)]) == 0
    plan = Plan.load(str(out))
    assert plan.config.schedule == "custom" and plan.schedule_ir is not None
    assert [[str(a) for a in r] for r in plan.schedule_ir.ranks] == [row.split(",") for row in MINE.split()]
    tl = simulate_step(plan)  # the report's timeline: every action of the file, in its order
    assert sorted((e.kind, e.stage, e.mb) for e in tl.result.events) == sorted(
        (a.kind, a.stage, a.mb) for r in range(2) for a in plan.schedule_ir.actions(r))
    assert tl.result.step_s == pytest.approx(plan.estimate["breakdown"]["compute"] + plan.estimate["breakdown"]["p2p"]
                                             + plan.estimate["breakdown"]["bubble"], rel=1e-3)
    text = emit(plan)
    ns = {"plan_schedule": lambda t: parse_json(t)}
    exec(text[text.index("SCHEDULE = plan_schedule("):text.index("# ---- end of the plan")], ns)  # noqa: S102
    assert ns["SCHEDULE"] == plan.schedule_ir


@pytest.mark.parametrize("text,config,word", [
    ("0F0,0B0\n1B0,1F0\n", "pp=2", "deadlock - rank 0 waits forever at 0B0"),
    ("0F0,0B0,0B0\n1F0,1B0\n", "pp=2", "runs 0B0 twice"),
    (MINE, "pp=2,dp=2", "4 micro-batches; this layout has pp=2, 2 stages (pp x vpp) and 2 micro-batches"),
    (MINE.replace("1F3,1B3,1W2", "1F3,1B3"), "pp=2", "add 1W2"),
])
def test_bad_schedule_files_one_line(tmp_path, capsys, text, config, word):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    world = "4" if "dp=2" in config else "2"
    args = [a if a != "local-cpu:2" else f"local-cpu:{world}" for a in ARGS]
    assert main(args + ["--config", config, "--schedule", str(f)]) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("[autopar]")]
    assert len(err) == 1 and word in err[0], err


def test_plan_file_schedule_ir_is_checked(tmp_path):
    f = tmp_path / "mine.csv"
    f.write_text(MINE)
    out = tmp_path / "plan.json"
    assert main(ARGS + ["--config", "pp=2", "--schedule", str(f), "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    d["pipeline"]["schedule_ir"]["ranks"][1] = d["pipeline"]["schedule_ir"]["ranks"][1][:-1]
    with pytest.raises(ValueError, match="add 1W2"):
        Plan.from_dict(d)
    d["pipeline"].pop("schedule_ir")
    with pytest.raises(ValueError, match="goes with schedule=custom"):
        Plan.from_dict(d)


PLAN = ["plan", "--model", "llama-tiny", "--cluster", "local-cpu:2", "--no-calibrate"]


def test_plan_for_a_schedule_file(tmp_path):
    """`autopar plan --schedule FILE`: the layouts with the file's pp and micro-batches, priced
    running it; the plan carries the file's order and says so in its search record."""
    f = tmp_path / "mine.csv"
    f.write_text(MINE)
    out = tmp_path / "plan.json"
    assert main(PLAN + ["--global-batch", "4", "--schedule", str(f), "-o", str(out)]) == 0
    plan = Plan.load(str(out))
    assert (plan.config.pp, plan.config.schedule, plan.batch["microbatches"]) == (2, "custom", 4)
    assert [[str(a) for a in r] for r in plan.schedule_ir.ranks] == [row.split(",") for row in MINE.split()]
    assert "mine.csv" in plan.search["schedule"] and all("custom" in a["label"] for a in plan.alternatives)
    assert [s["rank"] for s in plan.stages] == [0, 1]


@pytest.mark.parametrize("extra,word", [
    (["--global-batch", "6"], "--global-batch must be 4 x dp x mbs for a dp that divides 1"),
    (["--global-batch", "4", "--fix", "pp=1"], "excludes"),
])
def test_plan_schedule_shape_mismatch_one_line(tmp_path, capsys, extra, word):
    f = tmp_path / "mine.csv"
    f.write_text(MINE)
    assert main(PLAN + extra + ["--schedule", str(f)]) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("[autopar]")]
    assert len(err) == 1 and word in err[0], err
