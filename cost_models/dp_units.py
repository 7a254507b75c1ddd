"""The units the runtime's data-parallel wrapper wraps on one pipeline stage, counted once for
every price that is paid per unit: the estimate's per-unit gradient / parameter collectives
(cost_models/dp_cost.py ``dp_comm``) and the CPU wrapper's own work per unit
(``cost_models.cpu_runtime.wrapper_unit_s``, in the stage times and the sequence chunks).

codegen/runtime/data_parallel.py ``apply_dp`` wraps, on each stage module, every repeated block
(``planner.graph.BLOCK_KINDS``; under FSDP / ZeRO-2 a very large block module by module,
``cost_models.memory.fsdp_units``) and then the stage module itself. The stage module's unit
holds every other layer of the stage (embedding, final norm, head, ...): one all-gather, one
reduce-scatter (or one all-reduce under ``replicate``) for all of them together, not one per
layer. A stage module without parameters of its own (a middle pipeline stage of blocks only)
issues no collective (FSDP2 builds no parameter group for it), so it is not counted.

Measured (torch 2.13, gloo, local-cpu:4 on 2 cores, moe-fid dp4 ep4 fsdp, torch.profiler of rank
0 over 6 steps): 10 ``gloo:all_gather`` and 5 FSDP reduce-scatters per step: the root and the 4
blocks, 5 units, where counting every graph layer as a unit priced 7 (embed, 4 blocks, norm, head).
"""
from __future__ import annotations

from cost_models.memory import LayerTable
from planner.graph import BLOCK_KINDS, ModelGraph
from planner.plan import ParallelConfig
from planner.sharding import SHARDED_PARAMS


def stage_units(graph: ModelGraph, table: LayerTable, cfg: ParallelConfig, lo: int, hi: int) -> int:
    """Units the wrapper wraps on the stage of layers ``[lo, hi)`` (module docstring): each block
    layer's FSDP units (``table.units[i]``) when ``cfg.zero`` shards parameters (FSDP / ZeRO-2
    shard a very large block module by module), else one per block; plus one for the stage
    module itself when a non-block layer of the stage holds parameters (``table.params[i]`` > 0,
    per rank)."""
    per_module = cfg.zero in SHARDED_PARAMS
    kinds = [graph.layers[i].kind in BLOCK_KINDS for i in range(lo, hi)]
    blocks = sum(len(table.units[i]) if per_module else 1 for i, block in zip(range(lo, hi), kinds) if block)
    root = any(table.params[i] > 0 for i, block in zip(range(lo, hi), kinds) if not block)
    return blocks + int(root)


def stage_wrapper_s(graph: ModelGraph, table: LayerTable, cfg: ParallelConfig, lo: int, hi: int,
                    unit_s: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) seconds of the data-parallel wrapper's work on the stage of layers
    ``lo:hi``: ``unit_s`` per wrapped unit (``cost_models.cpu_runtime.wrapper_unit_s``) times
    :func:`stage_units`; the units are not counted where a unit costs nothing (GPUs)."""
    wf, wb = unit_s
    if not (wf or wb):
        return 0.0, 0.0
    units = stage_units(graph, table, cfg, lo, hi)
    return units * wf, units * wb


def stage_unit_params(graph: ModelGraph, table: LayerTable, cfg: ParallelConfig, lo: int, hi: int,
                      experts: bool = False) -> list[float]:
    """Parameters (per rank, before data-parallel sharding) of each unit :func:`stage_units`
    counts on the stage of layers ``[lo, hi)``, blocks first, then the stage module's; under EP
    without the routed experts, which are units of their own (``experts``: those units alone, one
    per MoE layer; ``codegen/runtime/data_parallel.py`` ``shard_experts``)."""
    if experts:
        return [table.experts[i] for i in range(lo, hi) if table.experts[i]]
    own = cfg.ep > 1  # the routed experts are their own units
    sizes: list[float] = []
    for i in range(lo, hi):
        if graph.layers[i].kind not in BLOCK_KINDS:
            continue
        if cfg.zero not in SHARDED_PARAMS or len(table.units[i]) == 1:
            sizes.append(table.params[i] - (table.experts[i] if own else 0.0))
            continue
        parts = list(table.units[i])  # module by module (memory.fsdp_units): the experts' stack a part of
        if own and table.experts[i]:   # its own when large enough, else in the rest (the last part)
            if table.experts[i] in parts:
                parts.remove(table.experts[i])
            else:
                parts[-1] -= table.experts[i]
        sizes += [p for p in parts if p > 0]
    root = sum(table.params[i] for i in range(lo, hi) if graph.layers[i].kind not in BLOCK_KINDS)
    return sizes + ([root] if root > 0 else [])
