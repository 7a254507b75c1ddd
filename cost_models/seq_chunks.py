"""Sequence chunks (Seq1F1B / TeraPipe): what one chunk of a micro-batch costs in time and memory.

A micro-batch's sequence of S tokens is cut into k chunks of S/k tokens that go through the
pipeline as units (``planner/schedule_ir.py``: chunk j's forward after chunk j-1's, its backward
before). Under causal attention chunk j's queries attend to the keys/values of chunks 0..j:

- time (:func:`chunk_seconds`): the token-linear work (GEMMs, norms, elementwise, the loss)
  is ``1/k`` of the micro-batch's; the attention core's work is proportional to the causal area
  of the chunk's rows, ``(2j + 1) / k^2`` of the whole sequence's (the k rows' shares sum to 1).
  So the chunk times sum to the micro-batch's: chunking costs no compute in this model (smaller
  GEMMs are assumed as efficient; kernel launches per chunk are not charged);
- memory (:func:`per_unit`, :func:`kv_store_bytes`): a unit in flight holds ``1/k`` of a
  micro-batch's activations, and back-propagates with ``1/k`` of its working set; besides, every sequence with a chunk in flight keeps the
  keys/values of its forwarded chunks in the step's KV store (read by the later chunks,
  given their gradients by the later chunks' backwards) - at most ``(k-1)/k`` of the
  sequence's K and V per attention layer of the rank, counted for each sequence in flight.

The per-chunk attention part comes from the layer costs' attention core (``LayerCost.core``:
forward; the backward's is twice it, flash attention's backward).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from cost_models.cluster import Cluster
from cost_models.layer_costs import LayerCosts
from cost_models.memory import ChunkMemory
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition
from planner.precision import DTYPE_BYTES

SEARCHED = (1, 2, 4)  # the chunk counts the search tries (a config may name any k dividing the sequence)
ATTN_BWD_OVER_FWD = 2.0  # the attention core's backward over its forward (flash attention: ~2.5 matmuls of 1)


def chunk_share(j: int, k: int, attn_frac: float) -> float:
    """Share of a micro-batch's time that chunk ``j`` of ``k`` takes when ``attn_frac`` of that
    time is causal attention (module docstring): ``(1 - a)/k + a (2j + 1)/k^2``."""
    return (1.0 - attn_frac) / k + attn_frac * (2 * j + 1) / (k * k)


def chunk_seconds(total: float, attn: float, j: int, k: int) -> float:
    """Seconds of chunk ``j`` of ``k`` of a pass taking ``total`` seconds on a whole micro-batch,
    ``attn`` of them the attention core."""
    return chunk_share(j, k, min(1.0, attn / total) if total > 0 else 0.0) * total


def stage_attention_s(graph: ModelGraph, partition: Partition, costs: LayerCosts) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of the attention cores per virtual stage, one micro-batch
    (``LayerCost.core``; the backward ``ATTN_BWD_OVER_FWD`` times it)."""
    fwd = [sum(costs.get(graph.layers[i]).core for i in range(lo, hi)) for lo, hi in partition.bounds]
    return fwd, [ATTN_BWD_OVER_FWD * x for x in fwd]


def kv_store_bytes(graph: ModelGraph, cfg: ParallelConfig, layers: Sequence[int]) -> float:
    """Bytes of the KV store one sequence (one micro-batch of ``cfg.mbs`` sequences) keeps on a
    rank holding ``layers`` while its chunks are in flight: ``(k-1)/k`` of its keys and values
    per attention layer, the heads split over tp (0 with k = 1)."""
    k = cfg.seq_chunks
    if k == 1:
        return 0.0
    per_token = 0.0
    for i in layers:
        a = graph.layers[i].attention
        if a is not None:
            per_token += 2 * a.kv_heads * a.head_dim / min(cfg.tp, a.kv_heads)
    return per_token * graph.seq_len * cfg.mbs / cfg.cp * DTYPE_BYTES[cfg.dtype] * (k - 1) / k


def per_unit(mem: ChunkMemory, k: int) -> ChunkMemory:
    """A stage's memory per (stage, chunk) unit: the per-micro-batch parts (activations, their
    host copies, the back-propagation overshoot and working set - the loss's logits among them)
    ``1/k`` of a micro-batch's; states and the weight-gradient working set unchanged."""
    if k == 1:
        return mem
    return replace(mem, act=mem.act / k, peak=mem.peak / k, work=mem.work / k, host=mem.host / k)


def searched_chunks(cluster: Cluster) -> tuple[int, ...]:
    """The chunk counts the search tries on ``cluster``: :data:`SEARCHED` on GPU clusters; only
    whole sequences on CPU (gloo) clusters, where a chunk's fixed costs (one more pipeline unit:
    its p2p messages, schedule actions and Python dispatch) dominate and are not priced per
    chunk here (llama-tiny, pp2, 4 x 256 tokens on local-cpu:2: 0.146 s measured whole, 0.344 s
    in 4 chunks, where this model predicts 0.227 and 0.213 s). A config may still name
    ``seq_chunks``."""
    return SEARCHED if cluster.backend != "gloo" else (1,)
