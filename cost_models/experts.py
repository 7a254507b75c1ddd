"""Expert parallelism priced: the token all-to-alls of one MoE layer and the groups they cross.

Under ``ep`` > 1 (``planner.plan.ParallelConfig.ep``; the runtime is
``codegen/runtime/expert_parallel.py``), each MoE layer, per micro-batch and rank:

1. exchanges the tokens per expert with its EP group (an all-to-all of ``experts`` int64
   counts) and copies the received counts to the host, which waits for the device
   (``HOST_SYNC_S``: one device-to-host copy draining the stream);
2. **dispatch**: sends each routed (token, choice) row to the rank holding its expert and
   **combine**: sends the expert outputs back; each an all-to-all whose per-rank buffer is

       B = tokens x top_k x hidden x bytes x imbalance,   tokens = mbs x seq / cp (/ tp with SP)

   of which ``(ep - 1) / ep`` leaves the rank (``cost_models/comm.py``'s all-to-all:
   ``(n-1)/n x B / bw`` per link phase). ``imbalance`` (``MoEDims.imbalance``, the planner's
   ``--moe-imbalance``, default 1.0) is the busiest rank's tokens over the mean: the
   collective ends when it does. Megatron-Core's and torchtitan's token dispatchers move
   exactly these rows (DeepSeek-V3 §3.2.2 sizes its dispatch the same way);
3. the backward runs both all-to-alls again, reversed (the gradients of dispatch and
   combine); full recompute re-runs the forward's pair; per-op recompute keeps their
   outputs (``codegen/runtime/recompute.py`` saves all-to-all outputs), so it does not.

The EP group is ``ep`` consecutive ranks of the flattened dp x cp x tp ranks of a stage
(``planner.feasibility.expert_groups``; tp inner, so it takes a node's tp ranks first): on the
mesh ``[pp, dp*cp*tp/ep, ep]`` it is the last dimension, which :func:`ep_mesh` gives as
the ``cp`` dimension of a ``comm.Mesh`` so the link classes (intra-node, across nodes,
hierarchical) follow from ``comm.group_layout``. The experts' data-parallel group (who
reduce the experts' gradients) is the second dimension (``dp`` of the same mesh).

Grouped GEMMs: each rank runs ``experts / ep`` local experts, each on
``tokens x top_k x ep / experts x imbalance`` rows (:func:`expert_rows`), which is what
makes expert parallelism pay on GPUs: larger per-expert GEMMs run nearer peak
(``cost_models/compute.py``'s wave-quantised GEMM model).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm as comm_mod
from cost_models.cluster import Cluster
from cost_models.memory import DTYPE_BYTES, dp_group
from planner.graph import Layer, ModelGraph, MoEDims
from planner.plan import ParallelConfig

HOST_SYNC_S = 30e-6     # one device-to-host copy of the received counts (stream drained) per layer and pass
COUNT_BYTES = 8         # int64 tokens-per-expert counts


def ep_mesh(cfg: ParallelConfig) -> comm_mod.Mesh:
    """The experts' mesh as a ``comm.Mesh``: the EP group is its ``cp`` dimension, the experts'
    data-parallel group (``memory.dp_group``) its ``dp`` dimension. Under EP that is
    ``[pp, dp*cp*tp/ep, ep]`` (the EP group the innermost ranks, tp ones first); without it
    the experts are replicated over tp like the rest of the block: ``[pp, dp*cp, 1, tp]``."""
    if cfg.ep == 1:
        return comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp * cfg.cp, cp=1, tp=cfg.tp)
    return comm_mod.Mesh(pp=cfg.pp, dp=dp_group(cfg, experts=True), cp=cfg.ep, tp=1)


def rank_tokens(graph: ModelGraph, cfg: ParallelConfig) -> float:
    """Tokens one rank routes per micro-batch: mbs x seq / cp (/ tp under sequence parallel)."""
    return cfg.mbs * graph.seq_len / cfg.cp / cfg.seq_shards


def alltoall_bytes(moe: MoEDims, graph: ModelGraph, cfg: ParallelConfig) -> float:
    """Per-rank buffer of one dispatch (or combine) all-to-all, bytes (module docstring)."""
    return rank_tokens(graph, cfg) * moe.top_k * graph.hidden * DTYPE_BYTES[cfg.dtype] * moe.imbalance


def expert_rows(moe: MoEDims, tokens: float, ep: int) -> float:
    """Rows each local expert of the busiest rank multiplies per micro-batch: ``tokens`` routed
    ``top_k`` ways over ``experts``, from the ``ep`` ranks of the group; ``imbalance`` applies
    only under EP (without it each rank runs every expert on its own tokens)."""
    return tokens * moe.top_k * ep / moe.experts * (moe.imbalance if ep > 1 else 1.0)


@dataclass(frozen=True)
class ExpertComm:
    """One MoE layer, one micro-batch, one rank (seconds): forward (count exchange, host sync,
    dispatch, combine) and backward (both all-to-alls reversed), and where the figures came
    from."""
    fwd: float
    bwd: float
    source: str


def expert_comm(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, profile=None) -> ExpertComm:
    """The all-to-all time of ``layer`` under ``cfg.ep`` (zero without experts or EP)."""
    if layer.moe is None or cfg.ep == 1:
        return ExpertComm(0.0, 0.0, "none")
    mesh = ep_mesh(cfg)
    rows = comm_mod.collective_time("all_to_all", alltoall_bytes(layer.moe, graph, cfg), cluster, mesh, "cp", profile)
    counts = comm_mod.collective_time("all_to_all", layer.moe.experts * COUNT_BYTES, cluster, mesh, "cp", profile)
    sync = HOST_SYNC_S if cluster.backend != "gloo" else 0.0  # gloo's counts are already on the host
    return ExpertComm(fwd=2 * rows.seconds + counts.seconds + sync, bwd=2 * rows.seconds, source=rows.source)
