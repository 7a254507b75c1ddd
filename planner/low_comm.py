"""Low-communication data parallelism as a plan option: ``ParallelConfig.low_comm``.

A contract (imports only planner.errors). Written ``"GxH:dtype"`` or ``"GxH:dtype:lr:momentum"``
(e.g. ``"2x16:bf16"``): the data-parallel replicas (dp) are cut into ``G`` groups of ``dp / G``
consecutive replicas (with ``pp`` outermost and ranks filling cluster groups in order, a group of
replicas lies in one region); inside a group replicas reduce gradients every step as the plan's
DP sharding says; across groups nothing moves for ``H`` inner steps, then the groups exchange
pseudo-gradients in ``dtype`` and step an outer SGD with Nesterov momentum (``lr``, ``momentum``:
DiLoCo's 0.7 and 0.9 by default). The runtime: ``codegen/runtime/outer_loop.py``; the price:
``cost_models.wan_cost.outer_step_s``.

THIS CHANGES THE OPTIMISATION: the groups drift apart for H steps and meet at an outer
optimizer's step; the loss curve is not that of synchronous training (H = 1, lr = 1, momentum
= 0 and a plain-SGD inner optimizer excepted). Plans and reports say so (:data:`CAVEAT`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from planner.errors import PlanError

OUTER_DTYPES = ("fp32", "bf16", "int8")  # the pseudo-gradients on the wire
WIRE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}  # per element (int8: + one fp32 scale per tensor)
CAVEAT = ("low-communication DP changes the optimisation (an outer Nesterov step on pseudo-gradients every "
          "H steps): not equal to synchronous training")
_FORM = re.compile(r"(\d+)x(\d+):([a-z0-9]+)(?::([0-9.eE+-]+):([0-9.eE+-]+))?")


@dataclass(frozen=True)
class LowComm:
    """G groups of replicas, H inner steps per exchange, the wire dtype, the outer SGD's lr and momentum."""
    groups: int
    every: int
    dtype: str = "bf16"
    lr: float = 0.7
    momentum: float = 0.9

    def to_str(self) -> str:
        tail = "" if (self.lr, self.momentum) == (0.7, 0.9) else f":{self.lr:g}:{self.momentum:g}"
        return f"{self.groups}x{self.every}:{self.dtype}{tail}"


def parse_low_comm(text: str) -> LowComm | None:
    """``""`` -> None (synchronous DP); ``"GxH:dtype[:lr:momentum]"`` -> LowComm; else one-line PlanError."""
    if text == "":
        return None
    m = _FORM.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise PlanError(f"low_comm={text!r}: write GROUPSxSTEPS:DTYPE, e.g. 2x16:bf16 (optionally :LR:MOMENTUM)")
    g, h, dtype = int(m.group(1)), int(m.group(2)), m.group(3)
    if g < 2 or h < 1:
        raise PlanError(f"low_comm={text!r}: needs at least 2 groups and 1 inner step per exchange")
    if dtype not in OUTER_DTYPES:
        raise PlanError(f"low_comm={text!r}: the wire dtype must be one of {', '.join(OUTER_DTYPES)}")
    try:
        lr, mom = (float(m.group(4)), float(m.group(5))) if m.group(4) else (0.7, 0.9)
    except ValueError:
        raise PlanError(f"low_comm={text!r}: lr and momentum must be numbers, e.g. 2x16:bf16:0.7:0.9") from None
    if not (lr > 0 and 0 <= mom < 1):
        raise PlanError(f"low_comm={text!r}: the outer lr must be > 0 and the momentum in [0, 1)")
    return LowComm(g, h, dtype, lr, mom)


def low_comm_problem(text: str, dp: int, ep: int = 1) -> str | None:
    """Why ``low_comm`` cannot run with these degrees (None: it can)."""
    low = parse_low_comm(text)
    if low is None:
        return None
    if dp % low.groups:
        return f"low_comm={text}: {low.groups} groups must divide dp={dp}: pick dp a multiple of the groups"
    if ep > 1:
        return f"low_comm={text}: routed experts split over ep={ep} are not run with an outer loop: use ep=1"
    return None


def inner_dp(dp: int, text: str) -> int:
    """The replicas that reduce gradients every step: ``dp / G`` under low_comm, else ``dp``."""
    low = parse_low_comm(text)
    return dp if low is None else dp // low.groups
