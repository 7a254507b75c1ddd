"""Data-parallel shares proportional to device speed (planner/dp_shares.py, cost_models/speed_shares.py).

The runtime's parity with unequal shares is in tests/dist_worker.py (``dp2-fsdp-shares``,
``dp2-ddp-shares``: every model's loss and gradients against one process on the global batch).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.speed_shares import group_view, replica_groups, speed_shares
from planner.dp_shares import parse_shares, rank_rows, shares_problem, shares_text
from planner.errors import PlanError
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Partition
from planner.search.space import search


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=40))
def test_written_form_reads_back(shares):
    text = shares_text(shares)
    assert parse_shares(text) == (tuple(shares) if len(set(shares)) > 1 else ())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=16), st.integers(1, 5))
def test_rank_rows_tile_the_global_batch(shares, m):
    rows = [rank_rows(shares, d, m) for d in range(len(shares))]
    assert rows[0].start == 0 and rows[-1].stop == m * sum(shares)
    assert all(a.stop == b.start for a, b in zip(rows, rows[1:]))
    assert [r.stop - r.start for r in rows] == [m * s for s in shares]


@pytest.mark.parametrize("text,dp,mbs,kw,words", [
    ("1+3", 3, 2, {}, "names 2 dp ranks"),
    ("1+4", 2, 2, {}, "adds up to 5"),
    ("2+2", 2, 2, {}, "equal for every rank"),
    ("0+4", 2, 2, {}, "at least 1 sequence"),
    ("2y3", 2, 2, {}, "write runs SHARExRANKS"),
    ("1+3", 2, 2, {"pp": 2}, "use pp=1"),
    ("1+3", 2, 2, {"ep": 2}, "ep=2"),
    ("1+3", 2, 2, {"low_comm": "2x4:bf16"}, "low_comm"),
])
def test_bad_shares_one_line_each(text, dp, mbs, kw, words):
    why = shares_problem(text, dp, mbs, **kw)
    assert words in why and "\n" not in why
    with pytest.raises(PlanError, match="dp_shares"):
        ParallelConfig(dp=dp, mbs=mbs, dp_shares=text, **kw).validate()


def test_config_carries_shares():
    cfg = ParallelConfig(dp=4, mbs=2, zero="fsdp", dp_shares="1x2+3x2").validate()
    assert cfg.rank_mbs == (1, 1, 3, 3)
    assert ParallelConfig(dp=4, mbs=2).rank_mbs == (2, 2, 2, 2)
    assert shares_problem("2x3+6", 4, 3) is None  # 2 + 2 + 2 + 6 = 4 x 3
    assert "shares1x2+3x2" in cfg.label()
    assert ParallelConfig.parse(cfg.to_str()) == cfg
    assert "dp_shares" not in ParallelConfig(dp=4).to_str()  # quiet when unset: old plans read and write as before


# ---- pricing and choosing shares on a pool of mixed devices (cost_models/speed_shares.py) ----

MIXED = parse_cluster("mixed-a100-h100")  # 32 A100 (312 TFLOP/s bf16) then 32 H100 (989)


def test_shares_follow_device_speed():
    assert speed_shares(MIXED, ParallelConfig(dp=64, mbs=4)) == "2x32+6x32"
    assert speed_shares(MIXED, ParallelConfig(dp=64, mbs=1)) == ""  # one row each: nothing to move
    assert speed_shares(MIXED, ParallelConfig(dp=32, pp=2, mbs=4)) == ""  # replicas span both pods' stages
    assert speed_shares(MIXED, ParallelConfig(dp=32, ep=2, mbs=4)) == ""  # the runtime does not run them there
    assert speed_shares(parse_cluster("dgx-h100:4"), ParallelConfig(dp=32, mbs=4)) == ""  # one device type
    assert replica_groups(MIXED, ParallelConfig(dp=8, tp=8)) == (0,) * 4 + (1,) * 4


@pytest.mark.parametrize("mbs", [2, 3, 5, 8])
def test_water_filling_is_optimal(mbs):
    """No single row moved between two ranks lowers the slowest rank's rows over speed."""
    cfg = ParallelConfig(dp=8, tp=8, mbs=mbs)
    shares = list(parse_shares(speed_shares(MIXED, cfg)) or (mbs,) * 8)
    speed = [312 if g == 0 else 989 for g in replica_groups(MIXED, cfg)]
    worst = max(s / v for s, v in zip(shares, speed))
    assert sum(shares) == 8 * mbs and min(shares) >= 1
    for i in range(8):
        for j in range(8):
            if i != j and shares[i] > 1:
                moved = shares.copy()
                moved[i] -= 1
                moved[j] += 1
                assert max(s / v for s, v in zip(moved, speed)) >= worst - 1e-12


def test_shares_price_each_group_on_its_device():
    g = load_graph("llama3-8b", batch=1, seq_len=2048)
    cfg, part = ParallelConfig(dp=64, mbs=2, zero="fsdp"), Partition.even(len(g.layers), 1)
    equal = estimate(g, MIXED, cfg, part, 128)  # every rank at the A100's pace
    shared = estimate(g, MIXED, cfg.replace(dp_shares="1x32+3x32"), part, 128)
    a100 = estimate(g, group_view(MIXED, 0), cfg.replace(mbs=1), part, 64)
    h100 = estimate(g, group_view(MIXED, 1), cfg.replace(mbs=3), part, 192)
    assert shared.step_s == max(a100.step_s, h100.step_s) < 0.6 * equal.step_s
    assert shared.microbatches == equal.microbatches == 1 and shared.global_batch == 128
    assert shared.memory == h100.memory and shared.capacity == h100.capacity  # the fullest device's
    assert "h100-pod: H100-SXM5-80GB, 32 dp ranks taking 3 sequences" in shared.devices[0]
    big = estimate(g, MIXED, ParallelConfig(dp=64, mbs=8, zero="fsdp", dp_shares="1x32+15x32"), part, 512)
    assert not big.fits  # 15 sequences overfill the H100s, whatever the A100s hold


def test_search_chooses_shares_where_they_win():
    g = load_graph("llama3-8b", batch=1, seq_len=2048)
    best = search(g, MIXED, 128).best
    assert best.config.dp_shares and best.config.pp == 1, best.config.label()
    equal = estimate(g, MIXED, best.config.replace(dp_shares=""), best.partition, 128)
    assert best.step_s < 0.75 * equal.step_s
    assert search(g, parse_cluster("dgx-h100:8"), 128).best.config.dp_shares == ""


def test_cli_evaluates_and_reports_shares(tmp_path, capsys):
    """``autopar evaluate --config`` reads the label word; evaluate and the report say what each group takes;
    the plan file keeps the shares."""
    from planner.entry.cli import main
    from planner.plan import Plan

    out, md = tmp_path / "plan.json", tmp_path / "r.md"
    assert main(["evaluate", "--model", "llama3-8b", "--cluster", "mixed-a100-h100", "--global-batch", "128",
                 "--seq-len", "2048", "--config", "dp64 pp1 cp1 tp1 mbs2 fsdp shares1x32+3x32", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "data-parallel shares by device speed" in printed and "taking 3 sequences" in printed
    assert Plan.load(str(out)).config.dp_shares == "1x32+3x32"
    assert main(["report", str(out), "--md", str(md)]) == 0
    assert "h100-pod: H100-SXM5-80GB, 32 dp ranks taking 3 sequences" in md.read_text()
    assert main(["evaluate", "--model", "llama3-8b", "--cluster", "mixed-a100-h100", "--global-batch", "128",
                 "--seq-len", "2048", "--config", "dp32 pp2 cp1 tp1 mbs2 fsdp shares1x16+3x16"]) != 0
    assert "use pp=1 or leave dp_shares out" in capsys.readouterr().err
