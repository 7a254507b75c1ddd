"""Which activation-recompute policies can run under which pipeline schedule.

A contract (imports nothing of ours): the policies (:data:`RECOMPUTE`, run by
``codegen/runtime/recompute.py`` and ``offload.py``) and the one rule pairing them with schedules,
which the configuration's check, the feasibility predicate and the search all call.
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "selective-op", "full", "offload")  # codegen/runtime/recompute.py, offload.py
SPLIT_BACKWARD = ("zb-h1", "dualpipev", "custom")  # schedules that (may) run a block's backward in two passes


def recompute_policies(schedule: str, pp: int) -> tuple[str, ...]:
    """The recompute policies the runtime can run under ``schedule``: all but ``selective-op``
    where the schedule splits the backward (torch's per-op checkpointing frees each saved
    output at the first recompute, and a split backward recomputes the block twice)."""
    if pp > 1 and schedule in SPLIT_BACKWARD:
        return tuple(r for r in RECOMPUTE if r != "selective-op")
    return RECOMPUTE


def recompute_problem(recompute: str, schedule: str, pp: int) -> str | None:
    """Why ``recompute`` cannot run under ``schedule`` (one line with the fix), or None."""
    if recompute in recompute_policies(schedule, pp):
        return None
    return (f"recompute={recompute} with schedule={schedule}: per-op checkpointing cannot be recomputed twice "
            f"by a split backward; use recompute=full or selective, or another schedule")
