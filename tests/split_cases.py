"""Stage splits the memory tests price (tests/test_fullest_rank.py, tests/test_memory_bound.py)."""
from __future__ import annotations

from planner.plan import Partition


def uneven_split(n_layers: int, stages: int, recompute: str = "none") -> Partition:
    """``n_layers`` over ``stages`` stages of 1, 2, 3, 1, 2, ... layers, the last taking the rest:
    stages that all differ in size, so no two ranks hold the same chunks."""
    bounds, a = [], 0
    for j in range(stages - 1):
        bounds.append((a, a + 1 + j % 3))
        a += 1 + j % 3
    return Partition(bounds + [(a, n_layers)], [recompute] * stages)
