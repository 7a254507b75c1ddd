"""The pipeline simulator's results kept for arguments that repeat: the search prices variants that
differ only in what the pipeline does not see (the DP sharding: ddp, zero1, fsdp) with the same
stage times, and the simulated schedules (sequence chunks, V-shaped) take tens of milliseconds
each (Llama-3 70B on two regions: 31 chunked variants priced, 16 distinct simulations).

:func:`simulated` is :func:`cost_models.pipeline.simulate`, a pure function of its arguments, kept
for the last :data:`MEMO_SIZE` distinct ones (keyed on the values, never on objects); the result is
shared between the estimates that ask for it: read it, never change it. Each search starts with
none kept (:func:`forget`), so no search's time depends on the one before it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from cost_models.pipeline import PipelineResult, SplitCost, simulate

MEMO_SIZE = 64  # results kept (a chunked Llama-3 70B pp8 result holds ~1 MB of events' raw data)


def simulated(schedule: str, p: int, m: int, fwd: Sequence[float] | float, bwd: Sequence[float] | float, *,
              p2p: Sequence[float] | float = 0.0, v: int = 1, seq_chunks: int = 1,
              attn_fwd: Sequence[float] | float = 0.0, attn_bwd: Sequence[float] | float = 0.0,
              fixed_fwd: Sequence[float] | float = 0.0, fixed_bwd: Sequence[float] | float = 0.0,
              split: SplitCost = SplitCost()) -> PipelineResult:
    """``cost_models.pipeline.simulate`` of these arguments (seconds; one per virtual stage or one for
    all), computed once while they stay among the last :data:`MEMO_SIZE` distinct ones."""
    return _simulated(schedule, p, m, _value(fwd), _value(bwd), _value(p2p), v, seq_chunks, _value(attn_fwd),
                      _value(attn_bwd), _value(fixed_fwd), _value(fixed_bwd), split)


def forget() -> None:
    """Drop every kept result (the search calls it first)."""
    _simulated.cache_clear()


def _value(x: Sequence[float] | float) -> tuple[float, ...] | float:
    return tuple(x) if isinstance(x, (list, tuple)) else x


@lru_cache(maxsize=MEMO_SIZE)
def _simulated(schedule: str, p: int, m: int, fwd, bwd, p2p, v: int, k: int, attn_fwd, attn_bwd, fixed_fwd,
               fixed_bwd, split: SplitCost) -> PipelineResult:
    return simulate(schedule, p, m, fwd, bwd, p2p=p2p, v=v, seq_chunks=k, attn_fwd=attn_fwd, attn_bwd=attn_bwd,
                    fixed_fwd=fixed_fwd, fixed_bwd=fixed_bwd, split=split)
