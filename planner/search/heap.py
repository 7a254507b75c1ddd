"""The search's one use of the cyclic garbage collector's settings: while a search runs, the objects
alive before it (the traced model, torch's and autopar's modules: some 360,000 for Llama-3 70B) are
left out of the collector's passes (``gc.freeze``, Python >= 3.7), and put back when it ends.

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


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Leave the objects alive now out of the collector's passes for the block (``gc.freeze``), and
    put them back after it (``gc.unfreeze``), also on an error. Where objects are frozen already (a
    caller's own ``gc.freeze``), nothing is changed: unfreezing would undo the caller's."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
