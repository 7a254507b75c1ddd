"""What one layer does on one rank, before any timing: the attention core's FLOPs and the share of
them packed documents leave, a linear's GEMM shape as the runtime shards it, a routed expert's
GEMMs, the tokens of the captured GEMMs, the per-rank share of a layer's work under tp / sp / cp;
and ``LayerTime``, the one record every layer-time model returns. The CPU roofline
(``cost_models.compute``) and the GPU kernel model (``cost_models.gpu_layer``) both read these.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cost_models.cluster import Cluster
from cost_models.documents import busiest_share
from cost_models.fallback_attention import fallback_work, pinned_cores
from cost_models.moe_layer import expert_rows
from planner.graph import OUT_SPLIT_ROLES, Layer, Linear, ModelGraph, MoEDims
from planner.plan import ParallelConfig


@dataclass
class LayerTime:
    """One layer, one micro-batch, one rank (seconds): forward, backward, and what per-op
    recompute (``selective-op``) re-runs of the forward."""
    fwd_s: float
    bwd_s: float
    source: str  # "profile" | "roofline"
    op_recompute_s: float = 0.0
    # the routed experts' GEMMs within fwd_s / bwd_s (GPU kernel model; 0 where not split out):
    # what an engine's 1F1B all-to-all overlap pairs with the other micro-batch's communication
    experts_fwd_s: float = 0.0
    experts_bwd_s: float = 0.0
    # the MoE layer's forward compute (the routed GEMMs, and an engine's fused permute / unpermute):
    # what Megatron-Core's ``--recompute-modules moe`` runs again
    moe_fwd_s: float = 0.0


def fused_loss_layer(layer: Layer, cfg: ParallelConfig) -> bool:
    """Whether ``layer`` runs autopar's fused linear + cross-entropy under ``cfg`` (``loss=fused``
    on the head or loss layer: its logits never reach memory; codegen/kernels/fused_loss.py)."""
    return cfg.loss == "fused" and bool(layer.vocab) and layer.kind in ("head", "loss")


def attn_core_flops(layer: Layer, batch: int) -> float:
    """Forward FLOPs of Q K^T and P V for ``batch`` sequences (full square, no causal halving):
    the capture's figure, one document filling each sequence."""
    a = layer.attention
    if a is None:
        return 0.0
    return 4.0 * batch * a.heads * a.seq_len * a.kv_len * a.head_dim


def attention_share(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None,
                    fallback: Cluster | None = None) -> float:
    """The share of :func:`attn_core_flops` that ``layer``'s attention core really does with the graph's
    packed documents; 1.0 without them, for a non-causal core (a vision encoder's) and for an eager
    kernel under ``cfg`` (it computes every score, then masks). Under ``cfg``: the busiest rank's share
    of the layout (``cost_models.documents.busiest_share``: the step waits for it; ``fallback``: the CPU
    cluster whose plain-torch kernel runs it, documents or not, its blocks and calls over cp 1's per
    rank, ``cost_models.fallback_attention.fallback_work``); without: the useful work (model FLOPs)."""
    if fallback is not None and cfg is not None:
        mix = graph.documents if document_masked(layer, graph, cfg) else None
        return fallback_work(mix, graph.seq_len, cfg.dp, cfg.cp, cfg.ulysses, cfg.mbs, pinned_cores(fallback, cfg))
    if not document_masked(layer, graph, cfg):
        return 1.0
    if cfg is None:
        return graph.documents.attention_share
    return busiest_share(graph.documents, cfg.dp, cfg.cp, cfg.ulysses, cfg.mbs)


def full_square(layer: Layer, graph: ModelGraph, cfg: ParallelConfig) -> bool:
    """Whether ``layer``'s causal attention core computes the whole S x S square under ``cfg``: SDPA
    handed packed documents' boolean mask (``attention=eager`` without CP,
    ``codegen.runtime.documents.EagerAttention``) skips no block, causal or not. Measured on this
    project's 2-core CPU (torch 2.13, 16 heads of 64, 4K tokens): the masked call took 2.1x the
    ``is_causal`` call's forward and 1.95x its forward + backward."""
    a = layer.attention
    return (a is not None and a.causal and graph.documents is not None and cfg.attention == "eager"
            and cfg.cp == 1)


def document_masked(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None) -> bool:
    """Whether ``layer``'s attention core skips the work its packed documents' masks leave out
    (:func:`attention_share`): a causal core, with documents, not an eager kernel under ``cfg``."""
    a = layer.attention
    return (a is not None and a.causal and graph.documents is not None
            and (cfg is None or cfg.attention != "eager"))


def document_kv_len(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None) -> float:
    """Keys a query's attention kernel sees at most with packed documents: the token-weighted
    mean document length (``DocumentMix.mean_tokens``); infinite without (:func:`document_masked`)."""
    return graph.documents.mean_tokens if document_masked(layer, graph, cfg) else math.inf


def model_flops_per_seq(graph: ModelGraph) -> float:
    """Forward + backward FLOPs of one sequence as MFU counts them: the capture's (full-square
    attention), with packed documents the attention cores at their real, document-masked
    work (``attention_share`` of forward and backward; the backward of Q K^T and P V is
    twice their forward)."""
    saved = sum(3.0 * attn_core_flops(l, graph.batch) * (1.0 - attention_share(l, graph)) for l in graph.layers)
    return graph.flops_per_seq() - saved / graph.batch


def shard_factor(layer: Layer, cfg: ParallelConfig) -> float:
    """Fraction of a layer's per-token work one rank does under tp / sp / cp."""
    f = layer.tp_flops_frac
    rest_div = cfg.seq_shards
    return (f / cfg.tp + (1.0 - f) / rest_div) / cfg.cp


def gemm_shape(lin: Linear, tokens: float, tp: int, sp: bool = False) -> tuple[float, float, float]:
    """(M, N, K) of a linear's forward GEMM on one tp rank, as the runtime shards it: a
    TP-split linear by its features; one TP leaves whole (a router, a MoE layer's shared
    experts) runs on the rank's sequence shard under sequence parallel."""
    n, k = lin.out_features, lin.in_features
    if tp > 1 and lin.role in OUT_SPLIT_ROLES:
        n = n / tp
    elif tp > 1 and lin.role == "row":
        k = k / tp
    elif tp > 1 and sp:
        tokens = tokens / tp
    return tokens, n, k


def captured_tokens(layer: Layer, graph: ModelGraph) -> float:
    """Tokens of the layer's GEMMs at capture: its matmul FLOPs (all but the attention core)
    over 2 x sum(in x out) of its linears, plus 3 x 2 x top_k x hidden x expert_ffn per token
    for routed experts."""
    per_token = 2.0 * sum(l.in_features * l.out_features for l in layer.linears)
    if layer.moe is not None:
        per_token += 6.0 * layer.moe.top_k * graph.hidden * layer.moe.expert_ffn
    if not per_token:
        return 0.0
    return max(layer.fwd_flops - attn_core_flops(layer, graph.batch), 0.0) / per_token


def expert_gemms(moe: MoEDims, tokens: float, hidden: int, ep: int = 1) -> list[tuple[float, float, float]]:
    """(M, N, K) of one local routed expert's forward GEMMs (gate, up: hidden -> expert_ffn;
    down: back) on the busiest rank when each of the ``ep`` ranks of an expert-parallel group
    routes ``tokens`` tokens ``top_k`` ways (``cost_models.moe_layer.expert_rows``)."""
    rows = expert_rows(moe, tokens, ep)
    return [(rows, moe.expert_ffn, hidden), (rows, moe.expert_ffn, hidden), (rows, hidden, moe.expert_ffn)]
