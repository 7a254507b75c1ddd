"""How an engine runs a mixture-of-experts layer: its grouped GEMMs, its dispatcher's
memory-bound passes, and what it keeps for backward.

Routing: each rank routes ``tokens`` (its micro-batch's tokens after CP and sequence-parallel
cuts) ``top_k`` ways; with its ``experts / ep`` local experts it multiplies
:func:`rank_rows` rows, :func:`expert_rows` per local expert (``imbalance``: the busiest rank's
load over the mean, under EP). The communication is ``cost_models/experts.py``.

The engine's MoE layer (its switches ``moe_grouped_gemm``, ``moe_fused_permute``,
``ep_node_dedup``, ``ep_overlap``: cost_models/engines.py): plans are priced as autopar's runtime runs the
layer (``codegen/runtime/layers.py``: one GEMM per local expert, eager permute and combine, what
the capture saved); published runs as their engine ran it:

- **grouped GEMM** (Megatron-Core ``--moe-grouped-gemm``; torchtitan's grouped matmul): the
  local experts' GEMMs are one kernel, so the waves of 128 x 128 output tiles are counted over
  all of them, each expert's rows rounded up to whole tiles (:func:`grouped_gemm_seconds`):
  efficiency rises with the rows each local expert gets, ``tokens x top_k x ep / experts``;
- **fused permute / unpermute** (Megatron-Core ``--moe-permute-fusion``): the dispatcher's
  memory-bound work is its passes over the rows (:func:`dispatch_bytes`), not the eager
  kernels the capture saw, and its layer keeps per routed row the expert input, the first
  GEMM's output and the activation (recomputed under Megatron's ``--recompute-modules moe_act``:
  ``Engine.recompute_modules``) and its routing probability, which Megatron-Core applies inside
  the fused weighted SwiGLU (:func:`routed_saved_bytes`);
- **node-deduplicated dispatch** and the **1F1B all-to-all overlap** (``Engine.ep_overlap``)
  change the communication: ``cost_models/experts.py``.

Every figure above is a count of bytes or tiles of the shapes involved; no coefficient is
fitted here (the GEMM and HBM efficiencies are ``cost_models/gpu_kernels.py``'s).
"""
from __future__ import annotations

import math
from dataclasses import replace

from cost_models import gpu_kernels as gk
from planner.graph import MoEDims


def expert_rows(moe: MoEDims, tokens: float, ep: int) -> float:
    """Rows each local expert of the busiest rank multiplies per micro-batch: ``tokens`` routed
    ``top_k`` ways over ``experts``, from the ``ep`` ranks of the group; ``imbalance`` applies
    only under EP (without it each rank runs every expert on its own tokens)."""
    return tokens * moe.top_k * ep / moe.experts * (moe.imbalance if ep > 1 else 1.0)


def held_imbalance(moe: MoEDims, layers: int) -> MoEDims:
    """``moe`` with the load factor of the routed rows the busiest rank *keeps* over ``layers``
    MoE layers (those its pipeline stage holds, each for its micro-batches in flight), where
    ``imbalance`` is the busiest rank's load in one layer (the step waits on it layer by layer).

    Each layer has its own router, and which experts a rank holds is an arbitrary index, so the
    rank that is busiest in one layer is, in expectation, no busier than the mean in another.
    With rank loads independent across layers and normally spread (a rank's excess in one layer
    of spread ``s``, the busiest of the ``ep`` ranks ``s x z`` over the mean, ``z`` the expected
    maximum of ``ep`` standard normals), the busiest rank's excess summed over ``L`` layers is
    ``s x z x sqrt(L)``: per layer ``(imbalance - 1) / sqrt(L)`` (``z`` cancels). A hot expert is
    taken to stay hot over one step's micro-batches (no averaging over them), and one layer's
    backward working set is priced at this averaged load too (it holds that layer's excess,
    ``(imbalance - 1) x (1 - 1 / sqrt(L))`` of one layer's rows more)."""
    if moe.imbalance <= 1.0 or layers <= 1:
        return moe
    return replace(moe, imbalance=1.0 + (moe.imbalance - 1.0) / math.sqrt(layers))


def grouped_gemm_seconds(groups: int, m: float, n: float, k: float, elem_bytes: float, gpu: gk.GpuSpec,
                         co: gk.GpuCoefficients) -> float:
    """One grouped GEMM: ``groups`` GEMMs of (m, n, k) in one kernel. Its tiles are scheduled
    together, so wave quantisation is over all of them, each group's rows padded to whole
    128-row tiles (``gk.TILE``); every group reads its own weights (``k x n``)."""
    if groups <= 0 or m <= 0:
        return 0.0
    stacked = groups * math.ceil(m / gk.TILE) * gk.TILE
    t = gk.gemm_seconds(stacked, n, k, elem_bytes, gpu, co)
    return max(t, gk.memory_seconds(groups * (m * k + k * n + m * n) * elem_bytes, 0, gpu, co))


DISPATCH_KERNELS = (4, 8)  # fused router (scores + top-k), permute, activation, unpermute; twice backward


def rank_rows(moe: MoEDims, tokens: float, ep: int) -> float:
    """Routed rows one rank's local experts multiply per micro-batch (:func:`expert_rows` each)."""
    return expert_rows(moe, tokens, ep) * (moe.experts // ep)


def dispatch_bytes(moe: MoEDims, tokens: float, hidden: int, elem: int, ep: int) -> tuple[float, float]:
    """Forward and backward HBM bytes of a fused dispatcher's memory-bound passes on one rank
    for ``tokens`` routed tokens: the router's fp32 scores and top-k (``experts`` per token,
    read and written), the permute (tokens read, ``top_k`` copies written), the SwiGLU activation
    (two expert_ffn inputs read, one written, per row), the weighted unpermute (rows and
    probabilities read, tokens written) and the shared experts' activation, and under EP the
    sort of the received rows by local expert and its inverse before the combine; the backward
    moves each twice (gradients in, gradients out)."""
    rows = rank_rows(moe, tokens, ep)
    router = 3 * tokens * moe.experts * 4
    permute = (tokens + rows) * hidden * elem
    act = 3 * (rows + tokens * moe.shared_experts) * moe.expert_ffn * elem
    unpermute = (rows + tokens) * hidden * elem + rows * 4
    chunks = 4 * rows * hidden * elem if ep > 1 else 0.0
    fwd = router + permute + act + unpermute + chunks
    return fwd, 2 * fwd


def routed_saved_bytes(moe: MoEDims, tokens: float, hidden: int, elem: int, ep: int, recompute_act: bool,
                       recompute_norm: bool = False) -> float:
    """Bytes a fused MoE layer keeps for backward on one rank for ``tokens`` routed tokens: per
    routed row the expert input (hidden), the first GEMM's output (2 x expert_ffn), the
    activation (expert_ffn, the second GEMM's input; unless recomputed: ``--recompute-modules
    moe_act``) and its fp32 routing probability (Megatron-Core applies the probabilities inside
    the fused weighted SwiGLU, so the combine is an unweighted sum that keeps nothing); per token
    its router input (hidden: the norm's output, unless the norms are recomputed:
    ``--recompute-modules layernorm``), fp32 scores (experts) and top-k indices and weights; the
    shared experts as one SwiGLU per token."""
    rows = rank_rows(moe, tokens, ep)
    per_row = (hidden + (2 if recompute_act else 3) * moe.expert_ffn) * elem + 4
    shared = tokens * moe.shared_experts * moe.expert_ffn * (2 if recompute_act else 3) * elem
    per_token = (0 if recompute_norm else hidden * elem) + moe.experts * 4 + moe.top_k * 12
    return rows * per_row + shared + tokens * per_token
