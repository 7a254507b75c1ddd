"""User-facing errors: one line naming the problem and the fix.

Every bad input raises an ``AutoparError``, a ``PlanError`` (a malformed configuration or plan
file) or ``cost_models.cluster.ClusterError``; all are ``ValueError`` s. The CLI prints ``error: <message>``
and exits with status 2, with a traceback only under ``--debug``.
"""
from __future__ import annotations


class AutoparError(ValueError):
    """A bad input, a failed capture or an infeasible request; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class PlanError(ValueError):
    """A malformed configuration or plan file; one line naming the problem and the fix."""
