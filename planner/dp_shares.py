"""Data-parallel shares: how many of each micro-batch's sequences every dp rank takes (``ParallelConfig.dp_shares``).

A contract (imports only planner.errors). On a pool of mixed devices the dp replicas need not
take equal rows: a replica on an H100 can take three times the rows of one on an A100 and both
finish together. Written as runs ``SxN`` joined by ``+``, in dp-rank order: ``"2x32+6x32"``
says dp ranks 0-31 take 2 sequences of each micro-batch and ranks 32-63 take 6 (``"3+1"``: a
count of 1 may be left out). ``""``: every rank takes ``mbs``.

The shares add up to ``dp * mbs`` (``mbs`` is their mean), so the micro-batch count
``m = global_batch / (dp * mbs)`` is that of equal shares: only rows move between replicas, and
every replica runs the same m forwards and backwards (the collectives of FSDP and the gradient
reduction pair up as with equal shares). Rank d takes the global batch's rows
``[m * (s_0 + .. + s_{d-1}), m * (s_0 + .. + s_d))``, ``s_d`` of them per micro-batch.

This does not change the optimisation: the runtime divides each rank's summed token loss by
the global batch's target count (``codegen/runtime/train.py``'s ``TokenLoss``), so the gradient
is the single-process mean over the global batch whichever rows each rank holds.
"""
from __future__ import annotations

import re
from typing import Sequence

from planner.errors import PlanError

_RUN = re.compile(r"(\d+)(?:x(\d+))?")


def parse_shares(text: str) -> tuple[int, ...]:
    """``""`` -> ``()``; ``"2x32+6x32"`` -> 32 twos then 32 sixes; else one-line PlanError."""
    if text == "":
        return ()
    out: list[int] = []
    for run in text.split("+") if isinstance(text, str) else [""]:
        if (m := _RUN.fullmatch(run)) is None:
            raise PlanError(f"dp_shares={text!r}: write runs SHARExRANKS joined by '+', e.g. 2x32+6x32 "
                            f"(32 dp ranks take 2 sequences per micro-batch, the next 32 take 6)")
        share, count = int(m.group(1)), int(m.group(2) or 1)
        if share < 1 or count < 1:
            raise PlanError(f"dp_shares={text!r}: every dp rank takes at least 1 sequence per micro-batch")
        out += [share] * count
    return tuple(out)


def shares_text(shares: Sequence[int]) -> str:
    """The written form of per-rank ``shares`` (runs of equal neighbours); ``""`` when all are equal."""
    if len(set(shares)) <= 1:
        return ""
    runs: list[list[int]] = []
    for s in shares:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return "+".join(f"{s}x{n}" if n > 1 else str(s) for s, n in runs)


def shares_problem(text: str, dp: int, mbs: int, pp: int = 1, ep: int = 1, low_comm: str = "") -> str | None:
    """Why ``text`` is not a share of ``dp`` ranks averaging ``mbs`` that the runtime runs on a
    layout of ``pp`` stages, expert degree ``ep`` and ``low_comm`` (one line with the fix), or None."""
    try:
        shares = parse_shares(text)
    except PlanError as e:
        return str(e)
    if not shares:
        return None
    if len(shares) != dp:
        return f"dp_shares={text!r} names {len(shares)} dp ranks; the layout has dp={dp}: give one share per rank"
    if sum(shares) != dp * mbs:
        return (f"dp_shares={text!r} adds up to {sum(shares)} sequences per micro-batch; dp * mbs = {dp * mbs}: "
                f"the shares redistribute the rows of equal micro-batches (mbs is their mean)")
    if len(set(shares)) == 1:
        return f"dp_shares={text!r} is equal for every rank: leave it out (mbs={mbs} says the same)"
    return layout_problem(pp, ep, low_comm)


def layout_problem(pp: int, ep: int = 1, low_comm: str = "") -> str | None:
    """Why a layout of ``pp`` stages, expert degree ``ep`` and ``low_comm`` cannot run unequal shares, or None."""
    if pp > 1:
        return (f"dp_shares with pp={pp}: every replica of a pipeline spans all its stages' ranks (pp is the mesh's "
                f"outermost dimension), so replicas do not differ in speed; use pp=1 or leave dp_shares out")
    if ep > 1 or low_comm:
        what = f"ep={ep}" if ep > 1 else f"low_comm={low_comm}"
        return f"dp_shares with {what}: autopar's runtime does not run unequal shares there; leave dp_shares out"
    return None


def rank_rows(shares: Sequence[int], rank: int, m: int) -> slice:
    """The rows of the global batch dp rank ``rank`` takes over ``m`` micro-batches (module docstring)."""
    first = m * sum(shares[:rank])
    return slice(first, first + m * shares[rank])
