"""User-facing errors: one line naming the problem and the fix.

Every bad input raises an ``AutoparError``, a ``PlanError`` (a malformed configuration or plan
file) or ``cost_models.cluster.ClusterError``; all are ``ValueError`` s. The CLI prints ``error: <message>``
and exits with status 2, with a traceback only under ``--debug``.
"""
from __future__ import annotations


def first_line(e: BaseException, limit: int = 200) -> str:
    """``e`` as ``Type: the first line of its message`` (at most ``limit`` characters of it)."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:limit]}" if msg else type(e).__name__


class AutoparError(ValueError):
    """A bad input, a failed capture or an infeasible request; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class PlanError(ValueError):
    """A malformed configuration or plan file; one line naming the problem and the fix."""
