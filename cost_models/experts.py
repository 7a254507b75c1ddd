"""Expert parallelism priced: the token all-to-alls of one MoE layer and the groups they cross.

Under ``ep`` > 1 (``planner.plan.ParallelConfig.ep``; the runtime is
``codegen/runtime/expert_parallel.py``), each MoE layer, per micro-batch and rank:

1. exchanges the tokens per expert with its EP group (an all-to-all of ``experts`` int64
   counts) and copies the received counts to the host, which waits for the device
   (``HOST_SYNC_S``: one device-to-host copy draining the stream); the dispatch follows it with
   no compute between, so on shared CPU cores it pays no scheduler wait (``comm.collective_time``'s
   ``chained``);
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
``tokens x top_k x ep / experts x imbalance`` rows (``cost_models.moe_layer.expert_rows``), which is what
makes expert parallelism pay on GPUs: larger per-expert GEMMs run nearer peak
(``cost_models/gpu_layer.py``'s wave-quantised GEMM model).

How an engine runs the layer (grouped GEMMs, fused permute, what it keeps: ``Engine.moe_*``)
is ``cost_models/moe_layer.py``; here, its communication: the all-to-all of an EP group
spanning nodes is NCCL's (``comm.py``'s hierarchical all-to-all) unless the engine
deduplicates by node (DeepEP's normal kernels, Megatron-Core ``--moe-token-dispatcher-type
flex``; DeepSeek-V3 §3.2.2): a token bound for several experts on one node crosses the
network once, to the GPU of its own local index there, and is forwarded over NVLink, both
phases pipelined (:func:`node_dedup_seconds`). Under the engine's 1F1B all-to-all overlap
(``Engine.ep_overlap``; Megatron-Core ``--overlap-moe-expert-parallel-comm``; off in
autopar's runtime) the dispatch and combine of one micro-batch run while another
micro-batch computes the same layer. A layer's forward and the other micro-batch's backward
are each cut into attention (with the rest of the block), dispatch, experts and combine
(:class:`ComputeChunks`), and each all-to-all runs beside one compute chunk of the other pass:
forward attention beside the backward's combine, forward dispatch beside backward experts,
forward experts beside the backward's dispatch, forward combine beside backward attention;
each adds what its partner does not hide, and at least the share of its time the
dispatcher's SMs take from that compute (``cost_models.engines.paired_exposed_s``). Where the
layer time is not split (a profiled layer), the layer's all-to-alls pair with all of its
compute. The passes that have no partner run their all-to-alls exposed: the schedule's
warm-up forwards and the cool-down backwards that match them (:func:`unpaired_passes`,
Megatron-Core's ``get_pp_rank_microbatches`` with the overlap's extra warm-up micro-batch; on
the first pipeline rank of an interleaved pipeline ``2 (pp - 1) + (vpp - 1) pp + 1`` of its
``m vpp`` chunk passes: 39 of 512 for pp 8, vpp 4, m 128). Each such pass adds what the overlap
had hidden of its chunk's all-to-alls (``ExpertComm.alone`` - ``fwd`` - ``bwd`` per layer), on
the critical path: the first rank's warm-up is the pipeline's fill and its cool-down the
drain (:func:`unpaired_ep_s`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models import comm as comm_mod
from cost_models.cluster import Cluster
from cost_models.model_states import dp_group
from cost_models.engines import DEFAULT_ENGINE, Engine, paired_exposed_s
from planner.graph import Layer, ModelGraph, MoEDims
from planner.plan import ParallelConfig
from planner.precision import DTYPE_BYTES

HOST_SYNC_S = 30e-6     # one device-to-host copy of the received counts (stream drained) per layer and pass
COUNT_BYTES = 8         # int64 tokens-per-expert counts


def ep_mesh(cfg: ParallelConfig) -> comm_mod.Mesh:
    """The experts' mesh as a ``comm.Mesh``: the EP group is its ``cp`` dimension, the experts'
    data-parallel group (``model_states.dp_group``) its ``dp`` dimension. Under EP that is
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


@dataclass(frozen=True)
class ExpertComm:
    """One MoE layer, one micro-batch, one rank (seconds): forward (count exchange, host sync,
    dispatch, combine) and backward (both all-to-alls reversed), and where the figures came
    from."""
    fwd: float
    bwd: float
    source: str
    alone: float = 0.0  # forward + backward when the passes have no partner to hide behind (the overlap's
    #                     warm-up / cool-down); fwd + bwd without the overlap
    alone_fwd: float = 0.0  # the forward's part of ``alone``


@dataclass(frozen=True)
class ComputeChunks:
    """One layer's compute for one micro-batch (seconds) as the 1F1B all-to-all overlap cuts
    it: the routed experts' GEMMs, and the rest of the block (attention, norms, router)."""
    fwd: float
    bwd: float
    experts_fwd: float = 0.0
    experts_bwd: float = 0.0

    def pairs(self, dispatch_f: float, combine_f: float, dispatch_b: float, combine_b: float) -> list[tuple[float, float]]:
        """(all-to-all, the compute it runs beside) for each chunk (module docstring); without
        the experts split out, all the layer's all-to-alls beside all of its compute."""
        if self.experts_fwd <= 0 and self.experts_bwd <= 0:
            return [(dispatch_f + combine_f + dispatch_b + combine_b, self.fwd + self.bwd)]
        attn_f, attn_b = self.fwd - self.experts_fwd, self.bwd - self.experts_bwd
        return [(combine_b, attn_f), (dispatch_f, self.experts_bwd), (dispatch_b, self.experts_fwd),
                (combine_f, attn_b)]


def expert_comm(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, profile=None,
                window: ComputeChunks | None = None, engine: Engine = DEFAULT_ENGINE) -> ExpertComm:
    """The all-to-all time of ``layer`` under ``cfg.ep`` (zero without experts or EP) that the
    step waits for: all of it, or under the engine's 1F1B overlap (``Engine.ep_overlap``) what
    the other micro-batch's compute ``window`` (module docstring) does not hide."""
    m = layer.moe
    if m is None or cfg.ep == 1:
        return ExpertComm(0.0, 0.0, "none")
    mesh = ep_mesh(cfg)
    nbytes = alltoall_bytes(m, graph, cfg)
    lay = comm_mod.group_layout(cluster, mesh, "cp")
    if engine.ep_node_dedup and lay.link == "mixed":
        one, source = node_dedup_seconds(m, nbytes, lay, cluster), "model"
        after = one
    else:
        rows = comm_mod.collective_time("all_to_all", nbytes, cluster, mesh, "cp", profile)
        one, source = rows.seconds, rows.source
        # the dispatch follows the count exchange with no compute between: its peers are running
        after = comm_mod.collective_time("all_to_all", nbytes, cluster, mesh, "cp", profile, chained=True).seconds
    counts = comm_mod.collective_time("all_to_all", m.experts * COUNT_BYTES, cluster, mesh, "cp", profile)
    sync = HOST_SYNC_S if cluster.backend != "gloo" else 0.0  # gloo's counts are already on the host
    fwd, bwd = after + one + counts.seconds + sync, 2 * one
    alone = fwd + bwd
    if engine.ep_overlap:
        chunks = (window or ComputeChunks(0.0, 0.0)).pairs(after + counts.seconds + sync, one, one, one)
        exposed = paired_exposed_s(chunks, engine.ep_comm_sms / cluster.device.sms if cluster.device.sms else 0.0)
        fwd, bwd = (fwd * exposed / (fwd + bwd), bwd * exposed / (fwd + bwd)) if fwd + bwd else (0.0, 0.0)
    return ExpertComm(fwd=fwd, bwd=bwd, source=source, alone=alone, alone_fwd=alone - 2 * one)


def unpaired_passes(pp: int, vpp: int, m: int, rank: int) -> int:
    """Chunk forwards pipeline rank ``rank`` runs with no backward beside it under the 1F1B
    all-to-all overlap (as many backwards run alone in the cool-down), of its ``m vpp``:
    Megatron-Core's warm-up (``get_pp_rank_microbatches``: ``2 (pp - rank - 1) + (vpp - 1) pp``
    interleaved, ``pp - rank - 1`` otherwise) plus the one extra micro-batch the overlap
    schedules first so that every paired forward and backward are independent; without a
    pipeline, the first micro-batch's forward (``combined_1f1b_schedule_for_no_pipelining``)."""
    if pp == 1:
        return min(1, m)
    warm = 2 * (pp - rank - 1) + (vpp - 1) * pp if vpp > 1 else pp - rank - 1
    return min(warm + 1, m * vpp)


def overlap_inflight(inflight: list[int], cfg: ParallelConfig, engine: Engine, m: int) -> list[int]:
    """The (chunk, micro-batch) pairs each pipeline rank holds under the engine's 1F1B all-to-all
    overlap: one more than its schedule's (``inflight``), the extra micro-batch the overlap runs
    forward before pairing (:func:`unpaired_passes`; without a pipeline the next micro-batch's
    forward beside the backward), at most all ``m vpp``; unchanged without the overlap or EP."""
    if not (engine.ep_overlap and cfg.ep > 1):
        return list(inflight)
    return [min(c + 1, m * cfg.vpp) for c in inflight]


def unpaired_ep_s(pp: int, vpp: int, m: int, stage_unpaired: list[float], on_rank: list[list[int]]) -> float:
    """Seconds the passes without a partner add to the step under the 1F1B all-to-all overlap
    (module docstring): on the rank where it is largest, :func:`unpaired_passes` times what one
    micro-batch's forward + backward of an average chunk of the rank adds alone
    (``stage_unpaired[j]``: ``ExpertComm.alone - fwd - bwd`` summed over virtual stage j's layers)."""
    return max((unpaired_passes(pp, vpp, m, r) * sum(stage_unpaired[j] for j in js) / len(js)
                for r, js in enumerate(on_rank) if js), default=0.0)


def remote_nodes(moe: MoEDims, ep: int, per_node: int) -> float:
    """Expected nodes other than its own a token's ``top_k`` experts sit on, the ``experts``
    spread evenly over the ``ep / per_node`` nodes of the group and chosen uniformly (the
    balanced load): each other node holds ``experts * per_node / ep`` of them and is missed
    with probability C(experts - those, k) / C(experts, k)."""
    nodes = max(1, ep // max(per_node, 1))
    on_node = moe.experts // nodes
    miss = math.comb(moe.experts - on_node, moe.top_k) / math.comb(moe.experts, moe.top_k)
    return (nodes - 1) * (1.0 - miss)


def node_dedup_seconds(moe: MoEDims, nbytes: float, lay: comm_mod.GroupLayout, cluster: Cluster) -> float:
    """One node-deduplicated dispatch (or combine) of a ``nbytes`` per-rank buffer over an EP
    group spanning ``lay.nodes`` nodes: each token crosses the network once per remote node it
    needs (:func:`remote_nodes`), then every copy is forwarded inside its node over NVLink; the
    two phases are pipelined (DeepEP), so the slower one sets the time."""
    n_remote = remote_nodes(moe, lay.size, lay.per_node)
    token_bytes = nbytes / moe.top_k  # one token's hidden state (times the imbalance)
    net = token_bytes * n_remote * lay.nodes / (lay.nodes - 1)  # link_time charges (k-1)/k of it
    inter = comm_mod.link_time("all_to_all", net, lay.nodes, cluster, "inter")
    intra = comm_mod.link_time("all_to_all", nbytes, lay.per_node, cluster, "intra")
    return max(inter, intra)


