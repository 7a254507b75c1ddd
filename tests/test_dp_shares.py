"""Data-parallel shares proportional to device speed (planner/dp_shares.py, cost_models/speed_shares.py).

The runtime's parity with unequal shares is in tests/dist_worker.py (``dp2-fsdp-shares``,
``dp2-ddp-shares``: every model's loss and gradients against one process on the global batch).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from planner.dp_shares import parse_shares, rank_rows, shares_problem, shares_text
from planner.errors import PlanError
from planner.plan import ParallelConfig


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
