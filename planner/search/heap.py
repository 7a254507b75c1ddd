"""The search's one use of the cyclic garbage collector's settings: while a search runs, the objects
alive before it (the traced model, torch's and autopar's modules: some 360,000 for Llama-3 70B) are
left out of the collector's passes (``gc.freeze``, Python >= 3.7), and put back when it ends; and the
youngest generation is collected every ``YOUNG_THRESHOLD`` net allocations instead of CPython's 700
(the default restored after), since the search makes millions of short-lived containers that
reference counting frees: a fresh process's Llama-3 70B two-region search spent 60-80 ms of its
1.11-1.14 s CPU in young collections (1.03-1.06 s with them rarer; 0.89-0.91 s warm instead of 0.95).

Why: the search allocates enough long-lived objects (its caches, estimates, rejections) that
CPython starts full collections, and each one walks the whole heap (about 0.2 s on the shared
2-core box; 0.65 s of a 3.0 s Llama-3 70B two-region search went to them). Reference counting
still frees what the search drops, and the collector still runs over the search's own objects;
only cycles among the objects alive before it wait until it ends.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

YOUNG_THRESHOLD = 50_000  # net container allocations between young collections during a search


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave the objects alive now out of the collector's passes for the block (``gc.freeze``), and
    put them back after it (``gc.unfreeze``), also on an error. Where objects are frozen already (a
    caller's own ``gc.freeze``), they stay so: unfreezing would undo the caller's. The youngest
    generation's threshold is raised to ``YOUNG_THRESHOLD`` for the block (never lowered) and
    restored after."""
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], YOUNG_THRESHOLD), *threshold[1:])
    freeze = not gc.get_freeze_count()
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        gc.set_threshold(*threshold)
