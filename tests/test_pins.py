"""Pinning the search (``autopar plan --fix``): parsing, the search keeping to the pins, the
shortfall when nothing pinned fits, the CLI, evaluate and the report."""
from __future__ import annotations

import json
import os

import pytest

from cost_models.cluster import parse_cluster
from planner.entry.cli import main
from planner.errors import AutoparError
from planner.frontend.load import load_graph
from planner.search.pins import Pins
from planner.plan import ParallelConfig, Plan
from planner.search.planning import plan_model

ARGS = ["--model", "gpt-small", "--seq-len", "64", "--cluster", "local-cpu:4", "--global-batch", "8"]


@pytest.fixture(scope="module")
def small():
    return load_graph("gpt-small", batch=1, seq_len=64), parse_cluster("local-cpu:4")


@pytest.fixture(scope="module")
def unpinned(small):
    g, c = small
    return plan_model(g, c, 8, spec="gpt-small", cluster_spec="local-cpu:4")[0]


# ---------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text,canonical", [
    ("tp=8,pp=1", "pp=1,tp=8"),
    (" tp <= 4 ", "tp<=4"),
    ("tp>=2,tp<=4,zero=fsdp,sp=on", "tp>=2,tp<=4,zero=fsdp,sp=on"),
    ("mbs==2,schedule=zb-h1,recompute=none,sp=false", "mbs=2,schedule=zb-h1,recompute=none,sp=off"),
    ("", ""),
])
def test_parse_good(text, canonical):
    pins = Pins.parse(text)
    assert pins.to_str() == canonical and Pins.parse(pins.to_str()) == pins
    assert bool(pins) == bool(canonical)


def test_allows_and_violations():
    pins = Pins.parse("tp<=4,pp=1,zero=fsdp,sp=on")
    assert pins.allows("tp", 4) and not pins.allows("tp", 8) and pins.allows("dp", 64)
    assert pins.allows("sp", True) and not pins.allows("sp", False)
    cfg = ParallelConfig.parse("dp=2,pp=2,tp=8,zero=ddp")
    assert pins.violations(cfg) == ["pp=1 (the configuration has pp=2)", "tp<=4 (the configuration has tp=8)",
                                    "zero=fsdp (the configuration has zero=ddp)",
                                    "sp=on (the configuration has sp=off)"]
    assert pins.admits(ParallelConfig.parse("dp=4,tp=2,zero=fsdp,sp=on"))
    # a schedule pin is moot without a pipeline, a zero pin without data parallelism
    assert Pins.parse("schedule=gpipe,zero=fsdp").admits(ParallelConfig.parse("tp=8"))


@pytest.mark.parametrize("text,says", [
    ("tq=4", "unknown --fix key 'tq'"),
    ("tp<4", "bad --fix operator '<'"),
    ("tp!=4", "bad --fix operator '!='"),
    ("tp 4", "bad --fix item"),
    ("tp=abc", "tp takes a positive integer"),
    ("tp=2.5", "tp takes a positive integer"),
    ("tp=0", "tp takes a positive integer"),
    ("tp>=8,tp<=2", "contradicts the earlier tp pin"),
    ("tp=2,tp=4", "contradicts the earlier tp pin"),
    ("zero=zero3", "choose one of ddp, zero1, zero2, fsdp"),
    ("zero<=fsdp", "zero can only be pinned with ="),
    ("zero=fsdp,zero=ddp", "contradict"),
    ("sp=on,tp=1", "sp=on needs tp > 1"),
    ("vpp=2,schedule=1f1b", "needs schedule=interleaved-1f1b"),
])
def test_parse_bad_is_one_line_naming_problem_and_fix(text, says):
    with pytest.raises(AutoparError) as e:
        Pins.parse(text)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and (":" in msg)


@pytest.mark.parametrize("text,says", [
    ("tp=3", "tp=3 does not divide the 8 devices of dgx-h100: pin a divisor of 8 (1, 2, 4, 8)"),
    ("tp>=16", "no divisor of the 8 devices"),
    ("tp=4,pp=4", "pp=4 x tp=4 = 16 does not divide the 8 devices"),
    ("tp=4,pp>=4", "satisfies the pins together"),
])
def test_pins_must_fit_the_world(text, says):
    with pytest.raises(AutoparError) as e:
        Pins.parse(text).check_world(8, "dgx-h100")
    assert says in str(e.value)
    assert Pins.parse("tp<=4,pp=2").check_world(8).to_str() == "pp=2,tp<=4"


# ---------------------------------------------------------------------- the search

def test_search_honours_equality_and_bounds(small, unpinned):
    g, c = small
    # a bound that rules out the unpinned pick: which pick that is depends on this machine's
    # measured speeds (the top layouts of gpt-small on local-cpu:4 lie within 2%)
    pp = unpinned.config.pp
    fix, ok = (f"pp<={pp // 2}", lambda v: v <= pp // 2) if pp > 1 else ("pp>=2", lambda v: v >= 2)
    plan, res = plan_model(g, c, 8, spec="gpt-small", cluster_spec="local-cpu:4", fix=fix)
    assert ok(plan.config.pp) and plan.config != unpinned.config
    assert plan.search["fix"] == fix and "fix" not in unpinned.search
    assert all(ok(ParallelConfig.parse(a["config"]).pp) for a in plan.alternatives)
    assert res.considered < unpinned.search["considered"]
    pins = Pins.parse("dp=2,tp=2,pp=1,zero=fsdp,mbs=2")  # dp=2: with dp1 (two processes) the zero pin is moot
    plan, res = plan_model(g, c, 8, spec="gpt-small", cluster_spec="local-cpu:4", fix=pins)
    cfg = plan.config
    assert (cfg.tp, cfg.pp, cfg.zero, cfg.mbs) == (2, 1, "fsdp", 2) and pins.admits(cfg)
    assert all(pins.admits(a.config) for a in res.alternatives)


def test_pinned_recompute_holds_on_every_stage():
    """With recompute pinned the stage ILP may not pick another policy per stage. llama3-70b at
    8192 tokens on 24 H100s (pp6 x tp4; bf16 compute copies of fp32 masters, held from the first
    forward to the last backward under a pipeline) fits only with recompute on the first stages:
    free, the ILP picks it; pinned to none, every stage keeps none (and so the layout does not fit)."""
    from planner.plan import ParallelConfig
    from planner.search.stage_split import best_partition

    g = load_graph("llama3-70b", batch=1, seq_len=8192)
    c = parse_cluster("dgx-h100:3")
    cfg = ParallelConfig(pp=6, tp=4, sp=True, schedule="1f1b", recompute="none", dtype="bf16")
    free, _ = best_partition(g, c, cfg, 16)
    assert set(free.recompute) != {"none"}
    pinned, info = best_partition(g, c, cfg, 16, uniform_recompute=True)
    assert set(pinned.recompute) == {"none"} and info["status"] == "infeasible"
    # and through the search: free, that layout plans with recompute; pinned to none, nothing fits
    plan, _ = plan_model(g, c, 16, spec="llama3-70b", cluster_spec="dgx-h100:3", fix="pp=6,tp=4")
    assert plan.config.pp == 6 and {s["recompute"] for s in plan.stages} != {"none"}
    with pytest.raises(AutoparError, match="no layout with pp=6,tp=4,recompute=none fits"):
        plan_model(g, c, 16, spec="llama3-70b", cluster_spec="dgx-h100:3", fix="pp=6,tp=4,recompute=none")


def test_unfittable_pin_names_the_shortfall():
    """llama3-8b replicated (ddp) on each of 8 H100s needs ~138 GiB: the error names the pins,
    what the leanest pinned layout needs and what the device has; freeing zero fits."""
    g = load_graph("llama3-8b", batch=1, seq_len=4096)
    h100 = parse_cluster("dgx-h100:1")
    with pytest.raises(AutoparError) as e:
        plan_model(g, h100, 64, spec="llama3-8b", cluster_spec="dgx-h100:1", fix="tp=1,pp=1,zero=ddp")
    msg = str(e.value)
    assert msg.startswith("no layout with pp=1,tp=1,zero=ddp fits llama3-8b on dgx-h100 (8 devices): the best needs ")
    need = float(msg.split("the best needs ")[1].split(" GiB per device")[0])
    assert need > 100 and "79.6 GiB available" in msg and "loosen --fix" in msg and "FSDP" not in msg
    plan, _ = plan_model(g, h100, 64, spec="llama3-8b", cluster_spec="dgx-h100:1", fix="tp=1,pp=1")
    assert (plan.config.tp, plan.config.pp) == (1, 1) and plan.config.zero != "ddp"


# ---------------------------------------------------------------------- CLI, evaluate, report

def test_cli_plan_fix_end_to_end(tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert main(["plan", *ARGS, "--fix", "tp<=2,zero=zero1", "-o", out]) == 0
    printed = capsys.readouterr()
    plan = Plan.load(out)
    assert plan.search["fix"] == "tp<=2,zero=zero1" and plan.config.tp <= 2
    assert plan.config.zero == "zero1" or plan.config.dp * plan.config.cp == 1
    assert "pinned: tp<=2,zero=zero1" in printed.out and "with tp<=2,zero=zero1 pinned" in printed.err
    assert main(["plan", *ARGS, "--fix", "tp<4", "-o", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad --fix operator '<'") and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "bad.json")


def test_cli_evaluate_checks_the_config_against_pins(capsys):
    assert main(["evaluate", *ARGS, "--config", "dp=4", "--fix", "tp>=2,pp=1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fix"] == {"pp=1": True, "tp>=2": False}
    assert main(["evaluate", *ARGS, "--config", "dp=4", "--fix", "tp>=2,pp=1"]) == 0
    assert "tp>=2 VIOLATED (tp=1)" in capsys.readouterr().out
    assert main(["evaluate", *ARGS, "--config", "dp=4"]) == 0
    assert "evaluate prices this configuration as given" in capsys.readouterr().out


def test_report_shows_the_pins(small, tmp_path, capsys):
    g, c = small
    plan, _ = plan_model(g, c, 8, spec="gpt-small", cluster_spec="local-cpu:4", fix="tp<=2,pp=1")
    path = str(tmp_path / "plan.json")
    plan.save(path)
    html, md = str(tmp_path / "r.html"), str(tmp_path / "r.md")
    assert main(["report", path, "-o", html, "--md", md, "--text"]) == 0
    assert 'id="sum-fix" data-value="pp=1,tp&lt;=2"' in open(html).read()
    assert "| pinned (--fix) | pp=1,tp<=2 (the search kept to these" in open(md).read()
    assert "pinned (--fix)" in capsys.readouterr().out
    unpinned = Plan.from_dict(dict(json.loads(plan.to_json()), search={}))
    from planner.report.render import build_report, render_markdown
    assert "pinned" not in render_markdown(build_report(unpinned, layers=False))


def test_lower_bounds_on_vpp_and_mbs_reach_past_the_defaults(small):
    """A lower bound alone opens the range above it: vpp>=8 tries interleaving with 8 or more
    virtual stages per rank (not the default 2 and 4, which it excludes), mbs>=16 tries 32."""
    from planner.plan import ModelFacts
    from planner.search.candidates import schedule_choices

    pins = Pins.parse("vpp>=8")
    assert [v for _, v in schedule_choices(2, 8, ModelFacts(units=32), pins)] == list(range(8, 17))
    assert schedule_choices(2, 8, ModelFacts(units=12), pins) == []  # 2 x 8 virtual stages need 16 stage groups
    g, c = small
    # one micro-batch of 64 costs least here (no pipeline, per-micro-batch op costs): reachable now
    plan, _ = plan_model(g, c, 64, spec="gpt-small", cluster_spec="local-cpu:4", fix="dp=1,pp=1,mbs>=16")
    assert plan.config.mbs == 64
