"""User-facing errors: one line naming the problem and the fix.

Every bad input raises an ``AutoparError`` (or a ``ValueError`` subclass defined by a
leaf contract, which cannot import this module); the CLI prints ``error: <message>``
and exits with status 2, with a traceback only under ``--debug``.
"""
from __future__ import annotations


class AutoparError(ValueError):
    """A bad input, a failed capture or an infeasible request; the message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
