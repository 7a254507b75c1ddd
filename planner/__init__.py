"""autopar's public API.

- ``auto_parallelize(model, example_batch, cluster="detect")``: capture, plan, apply
- ``capture(model, example)``: nn.Module + example inputs -> ModelGraph
- ``plan_model(graph, cluster, global_batch, ...)``: search -> Plan
- ``load_plan(path)``: read a plan file

Imports are lazy so the contracts (``planner.graph``, ``planner.plan``) load without torch.
"""
from __future__ import annotations

__all__ = ["auto_parallelize", "capture", "plan_model", "load_plan"]


def __getattr__(name: str):
    if name == "auto_parallelize":
        from planner.entry.api import auto_parallelize
        return auto_parallelize
    if name == "capture":
        from planner.frontend.trace import capture
        return capture
    if name == "plan_model":
        from planner.search.planning import plan_model
        return plan_model
    if name == "load_plan":
        from planner.plan import Plan
        return Plan.load
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
