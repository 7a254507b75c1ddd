"""The search's own bookkeeping: what it prices under which key."""
from __future__ import annotations

from cost_models.cluster import parse_cluster
from planner.frontend.load import load_graph
from planner.feasibility import sp_problem
from planner.search.candidates import batch_of, facts_of
from planner.search.pins import Pins
from planner.search.space import search


def test_tp_without_sequence_parallel_is_priced_when_the_sequence_does_not_split() -> None:
    """seq_len 33 cannot be split over tp=2, so TP plans run without sequence parallel. The
    layer-cost cache was once filled under "sp possible" and read back under "tp > 1", a
    KeyError for exactly these tuples."""
    graph = load_graph("llama-tiny", seq_len=33)
    assert sp_problem(2, 1, facts_of(graph), batch_of(graph, 1)) is not None
    # one sequence per step on 2 processes: dp2, pp2 (one micro-batch) and cp2 (33 tokens) cannot
    # run; one process with both cores' threads could, which tp>=2 leaves out: tp=2 is the only
    # layout left, and the search must price it
    res = search(graph, parse_cluster("local-cpu:2"), 1, pins=Pins.parse("tp>=2"))
    assert res.best.config.tp == 2 and not res.best.config.sp and res.best.step_s > 0
