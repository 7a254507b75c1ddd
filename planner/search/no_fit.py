"""The search's one-line error when no layout is left (planner/search/space.py)."""
from __future__ import annotations

import math

from cost_models.cluster import Cluster
from planner.search.candidates import Rejections
from planner.search.pins import Pins

GiB = 2**30


def nothing_fits(model: str, cluster: Cluster, pins: Pins, rej: Rejections, leanest: tuple[float, bool]) -> str:
    """Why no layout of ``model`` is left: the least memory per device a layout needs (``leanest``:
    bytes, and whether priced exactly or a floor) against the device's (when memory is what rejected
    them; with the request's options that ruled layouts out, ``Rejections.requested``, besides), else
    three reasons, those options first; with pins, which ones."""
    what = f"layout with {pins.to_str()}" if pins else "configuration"
    where = f"{model} on {cluster.name} ({cluster.world} devices)"
    need, exact = leanest
    if need < math.inf:
        cap = cluster.memory_bytes
        knobs = ["loosen --fix"] * bool(pins) + ["add devices"] + [k for key, k in (
            ("zero", "use FSDP/ZeRO"), ("recompute", "full recompute"), ("cp", "context parallel (longer sequences)"))
            if key not in pins.keys()]
        return (f"no {what} fits {where}: the best needs {'' if exact else 'at least '}{need / GiB:.1f} GiB per "
                f"device, {cap / GiB:.1f} GiB available (smallest shortfall {(need - cap) / GiB:.1f} GiB); "
                + ", ".join(knobs[:-1]) + " or " + knobs[-1]
                + "".join(f"; besides, {r}" for r in rej.counts if r in rej.requested))
    # the request's own options first (what the user may drop), then in the order the search met them
    ranked = sorted(rej.counts, key=lambda r: r not in rej.requested)
    reasons = "; ".join(ranked[:3]) or "the pins leave no configuration"
    return f"no valid {what} for {where}: {reasons}" + ("; loosen --fix" if pins else "")
