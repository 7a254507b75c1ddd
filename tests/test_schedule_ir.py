"""The schedule IR (planner/schedule_ir.py), its checks (schedule_check.py) and file form (schedule_file.py).

The built-ins are compared action by action with the orders torch's own schedule classes build
(where the IR's order is the one torch's class runs), every built-in passes the checks, the
files round-trip, and a fuzz test feeds broken files: each is refused in one line.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from planner.schedule_check import check, peak_activations
from planner.schedule_file import parse, parse_csv, parse_json, to_csv, to_json
from planner.schedule_ir import BUILTINS, Action, Overlap, Schedule, ScheduleError, builtin

S = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_actions(order) -> list[list[str]]:
    return [[str(a) if a.sub_actions is None else f"({';'.join(map(str, a.sub_actions))})OVERLAP_F_B"
             for a in order[r] if a is not None] for r in sorted(order)]


def _torch_order(cls, p: int, m: int, n_stages: int, stage_rank) -> list[list[str]]:
    """pipeline_order of torch's class for rank 0's view (every rank computes all ranks' orders)."""
    stages = [SimpleNamespace(num_stages=n_stages, group_size=p, group_rank=0, stage_index=s, submod=None)
              for s in range(n_stages) if stage_rank[s] == 0]
    return _torch_actions(cls(stages, n_microbatches=m).pipeline_order)


def _ours(s: Schedule) -> list[list[str]]:
    return [[str(x) for x in steps] for steps in s.ranks]


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 4), (8, 16, 2)])
def test_interleaved_is_torchs_order(p, m, v):
    s = builtin("interleaved-1f1b", p, m, v)
    assert _ours(s) == _torch_order(S.ScheduleInterleaved1F1B, p, m, p * v, s.stage_rank)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_zb_h1_is_torchs_order_when_m_at_least_p(p, m):
    s = builtin("zb-h1", p, m)
    assert _ours(s) == _torch_order(S.ScheduleInterleavedZeroBubble, p, m, p, s.stage_rank)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 6), (3, 6), (4, 8), (4, 10), (8, 16)])
def test_dualpipev_is_torchs_order(p, m):
    s = builtin("dualpipev", p, m)
    assert _ours(s) == _torch_order(S.ScheduleDualPipeV, p, m, 2 * p, s.stage_rank)
    assert any(isinstance(x, Overlap) for x in s.ranks[0])


@pytest.mark.parametrize("name", list(BUILTINS))
@pytest.mark.parametrize("p,m", [(1, 1), (1, 3), (2, 4), (3, 6), (4, 8), (4, 4), (8, 16)])
def test_builtins_pass_the_checks(name, p, m):
    for v in ((1, 2) if name == "interleaved-1f1b" else (1,)):
        if name == "dualpipev" and m < 2 * p:
            with pytest.raises(ScheduleError, match="at least"):
                builtin(name, p, m, v)
            continue
        s = check(builtin(name, p, m, v))
        assert s.n_stages == p * (2 if name == "dualpipev" else v)
        assert parse(to_csv(s), "csv") == _same_name(s, "custom")
        assert parse(to_json(s), "json") == s


def _same_name(s: Schedule, name: str) -> Schedule:
    return Schedule(name, s.n_microbatches, s.stage_rank, s.ranks)


def test_peak_activations_of_1f1b_and_gpipe():
    assert peak_activations(builtin("1f1b", 4, 8), [1.0] * 4) == [4, 3, 2, 1]
    assert peak_activations(builtin("gpipe", 4, 8), [1.0] * 4) == [8] * 4
    with pytest.raises(ScheduleError, match="rank 0 holds 8.00 GiB"):
        check(builtin("gpipe", 4, 8), [2.0**30] * 4, 5 * 2.0**30)
    check(builtin("1f1b", 4, 8), [2.0**30] * 4, 5 * 2.0**30)


@pytest.mark.parametrize("text,word", [
    ("0F0,0B0\n1B0,1F0\n", "deadlock - rank 0 waits forever at 0B0 for 1B/I0"),
    ("0F0,0B0,0B0\n1F0,1B0\n", "runs 0B0 twice"),
    ("0F0\n1F0,1B0\n", "no complete backward; add 0B0"),
    ("0F0,0I0\n1F0,1B0\n", "add 0W0"),
    ("0F0,0W0,0I0\n1F0,1B0\n", "waits forever at 0W0"),
    ("0F0,0B0,1F1\n1F0,1B0\n", "rank 1 holds no stage"),
    ("0F0,0X0\n", "is not an action"),
    ("", "empty"),
    ("0F1,0B1\n", "micro-batch 0 has no forward"),
])
def test_bad_csv_one_line(text, word):
    with pytest.raises(ScheduleError, match=word) as e:
        parse(text, "csv")
    assert "\n" not in str(e.value)


def test_json_form_and_its_errors():
    s = builtin("1f1b", 2, 2)
    assert parse_json(to_json(s)) == s
    for text, word in (("{", "not JSON"), ('{"ranks": 3}', "expected an object"),
                       ('{"ranks": [["0F0"]], "version": 2}', "version 2"),
                       ('{"ranks": [["0F0", 5]]}', "not an action string"),
                       ('{"ranks": [["0F0", "0B0"]], "stage_ranks": [1]}', "placed on rank 1"),
                       ('{"ranks": [["0F0", "0B0"]], "microbatches": 0}', "at least one"),
                       ('{"ranks": [["0F0", "0B0", "1F0"], ["1B0"]], "stage_ranks": [0, 1]}',
                        "rank 0 runs 1F0, but stage 1 lives on rank 1")):
        with pytest.raises(ScheduleError, match=word):
            parse(text, "json")


def test_overlap_cells():
    s = parse_csv("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n")
    assert s.ranks[0][2] == Overlap(Action("F", 0, 2), Action("B", 0, 0))
    check(s)
    with pytest.raises(ScheduleError, match="must overlap a forward with a backward"):
        parse_csv("(0B0;0F1)OVERLAP_F_B\n")


_CELLS = st.one_of(st.from_regex(r"[0-3][FBIWX][0-3]", fullmatch=True), st.sampled_from(["", " ", "(0F1;1B0)OVERLAP_F_B",
                                                                                          "(", "1F", "F0", "0F0;"]))


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.lists(_CELLS, max_size=8), max_size=4), drop=st.integers(0, 40),
       fmt=st.sampled_from(["csv", "json"]))
def test_fuzz_bad_schedules_one_line(rows, drop, fmt):
    """Random (mostly broken) files, and valid schedules with one action dropped: either a
    schedule that checks, or one ScheduleError of one line."""
    good = _ours(builtin("1f1b", 2, 3))
    flat = [(r, i) for r, row in enumerate(good) for i in range(len(row))]
    r, i = flat[drop % len(flat)]
    for cand in (rows, [row[:i] + row[i + 1:] if k == r else row for k, row in enumerate(good)]):
        text = ("\n".join(",".join(row) for row in cand) if fmt == "csv"
                else to_json_rows(cand))
        try:
            s = parse(text, fmt)
        except ScheduleError as e:
            msg = str(e)
            assert msg and "\n" not in msg and len(msg) < 300
        else:
            assert s.n_stages >= 1 and all(s.ranks)


def to_json_rows(rows) -> str:
    import json
    return json.dumps({"ranks": rows})
