"""The search's data-parallel shares: on a pool of mixed devices, a layout's dp replicas may take
rows in proportion to their device's speed (``cost_models/speed_shares.py``, ``planner/dp_shares.py``).

Every variant the fast pass prices whose layout allows shares (``pp = 1``, each replica inside
one cluster group) is priced once more with them; the faster of the two that fits stays, so the
shares are chosen where they win.
"""
from __future__ import annotations

from typing import Union

from cost_models.cluster import Cluster
from cost_models.estimate import Estimate, estimate
from cost_models.speed_shares import speed_shares
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition

Miss = tuple  # the fast pass's (pp rank, bytes over, bytes needed) where a variant does not fit


def with_speed_shares(graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, found: Union[Estimate, Miss],
                      global_batch: int, profile=None) -> Union[Estimate, Miss]:
    """``found`` (the fast pass's estimate of ``cfg``, or its miss) or ``cfg`` with speed shares
    where those fit and are faster, or fit where equal shares do not (closed form, even split)."""
    text = speed_shares(cluster, cfg)
    if not text:
        return found
    shared = estimate(graph, cluster, cfg.replace(dp_shares=text), Partition.even(len(graph.layers), 1, cfg.recompute),
                      global_batch, profile=profile, fast=True)
    if not shared.fits:
        return found
    return shared if isinstance(found, tuple) or shared.step_s < found.step_s else found
