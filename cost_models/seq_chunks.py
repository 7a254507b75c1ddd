"""Sequence chunks (Seq1F1B / TeraPipe): what one chunk of a micro-batch costs in time and memory.

A micro-batch's sequence of S tokens is cut into k chunks of S/k tokens that go through the
pipeline as units (``planner/schedule_ir.py``: chunk j's forward after chunk j-1's, its backward
before). Under causal attention chunk j's queries attend to the keys/values of chunks 0..j:

- time (:func:`chunk_seconds`): the token-linear work (GEMMs, norms, elementwise, the loss)
  is ``1/k`` of the micro-batch's; the attention core's work is proportional to the causal area
  of the chunk's rows, ``(2j + 1) / k^2`` of the whole sequence's (the k rows' shares sum to 1);
  but every chunk pays a layer's *fixed* part whole: what a call costs whatever its tokens
  (reading the weights, accumulating their gradients, dispatching the ops; :func:`stage_chunk_parts`).
  That part is measured: the profiler times each layer on one chunk's tokens too
  (:func:`chunk_lengths`), and the line ``t(n) = t0 + c n`` through the chunk's and the whole
  sequence's times gives ``t0 = (k t(S/k) - t(S)) / (k - 1)``, so k chunks cost ``k t(S/k)`` as
  measured (``ProfileDB.layer_fixed_share``; 0 on the roofline, which is linear in tokens). The
  chunk's own attention at S/k tokens is smaller than its share of the sequence's, so ``t0``
  leans low where attention is a large part. Besides, every call pays the data-parallel
  wrapper's per-unit work (cost_models/cpu_runtime.py);
- memory (:func:`per_unit`, :func:`kv_store_bytes`): a unit in flight holds ``1/k`` of a
  micro-batch's activations, and back-propagates with ``1/k`` of its working set; besides, every sequence with a chunk in flight keeps the
  keys/values of its forwarded chunks in the step's KV store (read by the later chunks,
  given their gradients by the later chunks' backwards) - at most ``(k-1)/k`` of the
  sequence's K and V per attention layer of the rank, counted for each sequence in flight.

The per-chunk attention part comes from the layer costs' attention core (``LayerCost.core``:
forward; the backward's is twice it, flash attention's backward).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from cost_models.cluster import Cluster
from cost_models.profile_db import calibration
from cost_models.cpu_runtime import wrapper_unit_s
from cost_models.dp_units import stage_wrapper_s
from cost_models.layer_costs import LayerCosts
from cost_models.memory import ChunkMemory
from cost_models.mp_casts import stage_mp_casts
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition
from planner.precision import DTYPE_BYTES

SEARCHED = (1, 2, 4)  # the chunk counts the search tries (a config may name any k dividing the sequence)
ATTN_BWD_OVER_FWD = 2.0  # the attention core's backward over its forward (flash attention: ~2.5 matmuls of 1)


def chunk_share(j: int, k: int, attn_frac: float) -> float:
    """Share of a micro-batch's time that chunk ``j`` of ``k`` takes when ``attn_frac`` of that
    time is causal attention (module docstring): ``(1 - a)/k + a (2j + 1)/k^2``."""
    return (1.0 - attn_frac) / k + attn_frac * (2 * j + 1) / (k * k)


def chunk_seconds(total: float, attn: float, j: int, k: int, fixed: float = 0.0) -> float:
    """Seconds of chunk ``j`` of ``k`` of a pass taking ``total`` seconds on a whole micro-batch,
    ``attn`` of them the attention core and ``fixed`` the part every call pays whole (module
    docstring): ``fixed + chunk_share(j, k, attn / rest) rest`` with ``rest = total - fixed``."""
    fixed = min(max(fixed, 0.0), total)
    rest = total - fixed
    return fixed + chunk_share(j, k, min(1.0, attn / rest) if rest > 0 else 0.0) * rest


@dataclass(frozen=True)
class ChunkParts:
    """Per virtual stage, one micro-batch: the attention cores' seconds (forward, backward) and
    the fixed seconds every chunk pays whole (forward, backward): what :func:`chunk_seconds` takes."""
    attn_fwd: list[float]
    attn_bwd: list[float]
    fixed_fwd: list[float]
    fixed_bwd: list[float]

    def scaled(self, x: float) -> "ChunkParts":
        """Every part times ``x`` (the stages' compute sped up by ``1 / x``)."""
        return ChunkParts(*([v * x for v in vals] for vals in (self.attn_fwd, self.attn_bwd, self.fixed_fwd,
                                                                 self.fixed_bwd)))


def stage_chunk_parts(graph: ModelGraph, partition: Partition, costs: LayerCosts, cfg: ParallelConfig,
                      m: int) -> ChunkParts:
    """Per virtual stage, one micro-batch: the attention cores (``LayerCost.core``; the backward
    ``ATTN_BWD_OVER_FWD`` times it) and the fixed part of every layer's pass (its profiled
    ``ProfileDB.layer_fixed_share`` of the priced time, 0 without a profile) plus the
    data-parallel wrapper's per-unit work (``cost_models.cpu_runtime.wrapper_unit_s``) on each unit it
    wraps (``cost_models.dp_units.stage_wrapper_s``), and FSDP2's mixed-precision copies every call
    pays (``cost_models.mp_casts``: ``cfg`` with ``m`` micro-batches per step), for ``cfg`` (``costs`` may
    have been built for another configuration of the same ``LayerCosts.key``: another zero, pp or chunk
    count)."""
    prof = costs.profile
    unit_s = wrapper_unit_s(costs.c, cfg, prof)
    cal = calibration(prof)
    out, shares = ChunkParts([], [], [], []), {}  # the profiled fixed shares, once per layer signature
    for lo, hi in partition.bounds:
        af = ff = fb = 0.0
        for layer in graph.layers[lo:hi]:
            c = costs.get(layer)
            if prof is None or c.source != "profile":
                sf, sb = 0.0, 0.0
            else:
                if layer.signature not in shares:
                    shares[layer.signature] = prof.layer_fixed_share(layer.signature, cfg.mbs, graph.seq_len, cfg.tp,
                                                                     cfg.cp, cfg.seq_chunks)
                sf, sb = shares[layer.signature]
            af, ff, fb = af + c.core, ff + sf * c.fwd, fb + sb * c.bwd
        wf, wb = stage_wrapper_s(graph, costs.table(cfg), cfg, lo, hi, unit_s)  # the wrapper's work
        mp = stage_mp_casts(graph, cfg, lo, hi, m, costs.c, cal, costs.engine)  # every call's copies
        ff, fb = ff + wf + mp.per_call_fwd, fb + wb + mp.per_call_bwd
        out.attn_fwd.append(af)
        out.attn_bwd.append(ATTN_BWD_OVER_FWD * af)
        out.fixed_fwd.append(ff)
        out.fixed_bwd.append(fb)
    return out


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


def chunk_lengths(seq_len: int) -> list[int]:
    """The chunk lengths (tokens) the profiler times each layer at, besides the whole sequence:
    ``seq_len / k`` for every searched k > 1 that divides it (``ProfileDB.layer_fixed_share``)."""
    return [seq_len // k for k in SEARCHED if k > 1 and seq_len % k == 0]


def searched_chunks(cluster: Cluster) -> tuple[int, ...]:
    """The chunk counts the search tries on ``cluster``: :data:`SEARCHED` on GPU clusters; only
    whole sequences on CPU (gloo) clusters. There every chunk pays the layers' fixed part whole
    (:func:`chunk_seconds`), which only a profile measures (the roofline has none): priced on a
    profile, llama-fid pp4 on local-cpu:4 (8 x 64 tokens) predicts 0.99 / 1.28 / 2.19 s whole / in
    2 / in 4 chunks and measures 1.00 / 1.34 / 2.32 s (``benchmarks/schedule_fidelity.py``), and
    llama-tiny pp2 (4 x 256 tokens, local-cpu:2, roofline and the wrapper's per-call work) 0.062 /
    0.150 s whole / in 4 chunks against 0.146 / 0.344 s measured: chunks lose on these CPUs, and
    without a profile the search could not tell where they would not. A config may still name
    ``seq_chunks``."""
    return SEARCHED if cluster.backend != "gloo" else (1,)
