"""The search's time-floor pruning is exact: the pruned and the unpruned search (``prune=False``:
every variant priced) fully solve the same variants and return the same plan, on one datacenter,
two regions joined by a WAN (where a generated schedule's variant is also solved) and mixed devices."""
from __future__ import annotations

import math

import pytest

from cost_models.cluster import parse_cluster
from planner.frontend.load import load_graph
from planner.search.incumbents import Incumbents
from planner.search.space import search

CASES = [  # (model, seq, cluster, global batch)
    ("llama3-8b", 4096, "dgx-h100:2", 64),
    pytest.param("llama3-8b", 8192, "two-region-h100:1", 32, marks=pytest.mark.slow),
    pytest.param("llama3-8b", 4096, "mixed-a100-h100:2", 64, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model,seq,cluster,gb", CASES)
def test_pruned_search_solves_what_the_unpruned_one_does(model, seq, cluster, gb):
    g, c = load_graph(model, batch=1, seq_len=seq), parse_cluster(cluster)
    pruned, full = search(g, c, gb), search(g, c, gb, prune=False)
    assert full.estimated > pruned.estimated  # the bounds did prune something
    assert set(pruned.partition_info) == set(full.partition_info)
    assert pruned.best.config == full.best.config
    assert pruned.best.step_s == full.best.step_s


def test_thresholds_keep_the_best_few_and_the_best_protected_beyond_them():
    inc = Incumbents(keep=2)
    assert inc.threshold(False) == math.inf
    inc.add(3.0, False)
    inc.add(5.0, True)
    assert inc.threshold(False) == 5.0          # the 2nd best so far
    assert inc.threshold(True) == math.inf      # only one protected: the best protected beyond the 2 may be next
    inc.add(1.0, True)
    inc.add(2.0, True)
    assert inc.threshold(False) == 2.0
    assert inc.threshold(True) == 5.0           # 3 protected (1, 2, 5): a 4th above 5 is neither
    assert Incumbents(keep=2, prune=False).threshold(False) == math.inf
