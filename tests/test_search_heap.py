"""planner/search/heap.py: the heap alive before a search is frozen only during it, also on an
error, and a caller's own freeze is left as it is."""
from __future__ import annotations

import gc

import pytest

from planner.search.heap import frozen_heap


def test_frozen_during_the_block_and_put_back_after_it_even_on_an_error():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError):
        with frozen_heap():
            raise ValueError("a search that fails")
    assert gc.get_freeze_count() == 0


def test_a_callers_freeze_is_not_undone():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        # unfreezing would empty the permanent generation; frozen objects that die meanwhile leave
        # it one by one (CI saw 1562169 -> 1562167), so "still frozen" is the count staying near
        assert frozen > 1000 and gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()


def test_young_collections_rarer_during_the_block_and_the_threshold_restored():
    from planner.search.heap import YOUNG_THRESHOLD

    before = gc.get_threshold()
    with pytest.raises(ValueError):
        with frozen_heap():
            assert gc.get_threshold()[0] == max(before[0], YOUNG_THRESHOLD)
            assert gc.get_threshold()[1:] == before[1:]
            raise ValueError("a search that fails")
    assert gc.get_threshold() == before
    gc.set_threshold(10 * YOUNG_THRESHOLD, *before[1:])  # a caller's higher threshold is kept, then restored
    try:
        with frozen_heap():
            assert gc.get_threshold()[0] == 10 * YOUNG_THRESHOLD
        assert gc.get_threshold()[0] == 10 * YOUNG_THRESHOLD
    finally:
        gc.set_threshold(*before)
