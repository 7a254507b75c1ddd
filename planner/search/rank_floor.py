"""The busiest pipeline rank's work when whole stage groups are dealt to the ranks: a time floor
that sees what perfect balance does not.

A pipeline stage holds whole stage groups (``ModelGraph.stage_groups``: one transformer block,
the embeddings, the head), so ``pp`` ranks can only be as balanced as the groups allow: Llama-3
70B's 80 blocks on 64 ranks leave some rank two blocks, not the 1.3 of an even share. Whatever
the split, schedule, interleaving (a rank's ``v`` stages are still whole groups) or sequence
chunks (each chunk pays at least its share), every micro-batch passes the busiest rank once, so
a step takes at least ``m`` times that rank's forward + backward (``cost_models.pipeline``: each
closed form is ``m M + ...`` with ``M`` the busiest rank; a simulated step is at least any rank's
busy time).

The bound needs every rank to run a group in the same time: one device type, each rank on its
own device. On mixed devices a faster rank takes more groups, and CPU ranks sharing a node's
cores run faster while others idle (``cost_models.shared_cores``); there it is not used
(:func:`applies`).
"""
from __future__ import annotations

from typing import Sequence

from cost_models.cluster import Cluster
from cost_models.layer_costs import LayerCosts
from planner.graph import ModelGraph


def applies(cluster: Cluster) -> bool:
    """Whether :func:`busiest_share` bounds a pipeline on ``cluster`` (module docstring)."""
    return not cluster.mixed and cluster.cores_per_node == 0


def busiest_share(group_s: Sequence[float], ranks: int) -> float:
    """Seconds the busiest of ``ranks`` ranks holds at least, whatever whole groups of
    ``group_s`` (seconds each) it is dealt: for each ``j``, some rank holds at least
    ``c = ceil(j / ranks)`` of the ``j`` largest groups, so at least the sum of the smallest ``c``
    of them (for one ``c`` the smallest such ``j``, ``(c - 1) ranks + 1``, gives the most); and at
    least the average ``sum / ranks``."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    g = sorted(group_s, reverse=True)
    best = sum(g) / ranks
    for c in range(1, -(-len(g) // ranks) + 1):
        j = (c - 1) * ranks + 1
        best = max(best, sum(g[j - c:j]))
    return best


def group_seconds(graph: ModelGraph, costs: LayerCosts, policy: str) -> list[float]:
    """One micro-batch's forward + backward seconds of each stage group (``graph.stage_groups()``)
    under recompute ``policy``, by the estimator's per-layer rule (``LayerCosts.pass_times``, a
    function of the layer's signature: each signature priced once)."""
    per = {sig: t.fwd + t.bwd for sig, t in _by_signature(graph, costs, policy).items()}
    return [sum(per[graph.layers[i].signature] for i in range(lo, hi)) for lo, hi in graph.stage_groups()]


def _by_signature(graph: ModelGraph, costs: LayerCosts, policy: str) -> dict:
    out = {}
    for layer in graph.layers:
        if layer.signature not in out:
            out[layer.signature] = costs.pass_times(layer, policy)
    return out


class RankFloors:
    """One search's per-rank time figures: per (layer costs, recompute policy) the stage groups'
    seconds, per pp their :func:`busiest_share`, each computed once."""

    def __init__(self, graph: ModelGraph, cluster: Cluster):
        self.graph, self.on = graph, applies(cluster)
        self._groups: dict[tuple, list[float]] = {}
        self._shares: dict[tuple, float] = {}

    def groups(self, costs: LayerCosts, policy: str) -> list[float]:
        """:func:`group_seconds` of ``costs`` under ``policy`` (kept)."""
        key = (LayerCosts.key(costs.cfg), policy)
        if key not in self._groups:
            self._groups[key] = group_seconds(self.graph, costs, policy)
        return self._groups[key]

    def step_floor(self, costs: LayerCosts, policy: str, pp: int, m: int) -> float:
        """Seconds a step of ``m`` micro-batches on ``pp`` ranks takes at least (module docstring);
        0 where the bound does not apply."""
        if not self.on:
            return 0.0
        key = (LayerCosts.key(costs.cfg), policy, pp)
        if key not in self._shares:
            self._shares[key] = busiest_share(self.groups(costs, policy), pp)
        return m * self._shares[key]
