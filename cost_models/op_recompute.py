"""What per-op selective checkpointing (recompute ``selective-op``) keeps and recomputes.

The runtime's rule (``codegen/runtime/recompute.py``, ``OpSavePolicy``; torchtitan's "op"
mode of selective activation checkpointing): in each forward of a block, the outputs of the
1st, 3rd, 5th ... matmul are kept, and those of the attention kernel (output and
log-sum-exp); everything else - the other matmuls, norms, activations, rotary, residual
adds - is recomputed in backward from them and the block's input. Only the repeated blocks
are checkpointed; other layers keep everything.

Priced from the graph, per layer, at the captured batch and dtype:

- which matmuls are kept: ``planner.graph.keeps_matmul`` over the captured forward's matmul
  calls (``Layer.matmuls``: the ATen ``MATMUL_OPS`` the runtime's policy counts, each with the
  Linear that ran it; routed experts' matmuls are bare). Graphs captured without them fall back
  to every other Linear and half the routed experts' matmuls.
- kept bytes (:func:`op_saved_bytes`): the block input, plus each kept matmul's output, plus
  the attention output (``tokens x heads x head_dim``) and its log-sum-exp (fp32,
  ``tokens x heads``). Never more than the layer keeps without
  recompute. Split like ``Layer.act_bytes``: outputs of column / vocab linears and of the
  attention are divided by tp, the rest (block input, row outputs) by tp only under
  sequence parallel.
- recompute time (``cost_models/compute.py``; ``cost_models/gpu_layer.py``): on GPUs, the unkept linears' forward GEMMs,
  half the routed experts' and every memory-bound kernel of the forward (norms,
  activations, rotary, residual adds), from the kernel model; attention is kept. Where
  there is no kernel breakdown (CPU roofline, profiled layers), the forward FLOPs outside
  the kept matmuls and the attention core, as a share of the forward time
  (``compute.op_recompute_share``).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.graph import BLOCK_KINDS, OUT_SPLIT_ROLES, Layer, Linear, Matmul, ModelGraph, keeps_matmul

LSE_BYTES = 4  # the attention kernels keep their log-sum-exp in fp32


@dataclass(frozen=True)
class OpSaved:
    """Bytes a block keeps under ``selective-op`` for the captured batch at the captured dtype:
    ``tp_part`` divided by tp, ``rest`` by tp only with sequence parallel."""
    tp_part: float
    rest: float


def checkpointed(layer: Layer) -> bool:
    """Whether the runtime checkpoints ``layer`` per op (the repeated blocks only)."""
    return layer.kind in BLOCK_KINDS


def kept_matmuls(layer: Layer) -> list[Matmul]:
    """The captured forward matmuls whose outputs the per-op policy keeps
    (``planner.graph.keeps_matmul`` over ``Layer.matmuls``, the runtime's own count)."""
    return [mm for k, mm in enumerate(layer.matmuls) if keeps_matmul(k)]


def kept_linears(layer: Layer) -> list[Linear]:
    """The linears whose outputs the per-op policy keeps: those running a kept matmul (a graph
    captured without its matmul calls: every other linear called, the 1st, 3rd, ...)."""
    if not layer.matmuls:
        return [lin for k, lin in enumerate(layer.linears) if keeps_matmul(k)]
    names = {mm.linear for mm in kept_matmuls(layer)}
    return [lin for lin in layer.linears if lin.name in names]


def routed_unkept_share(layer: Layer) -> float:
    """Share of the routed experts' matmuls (the bare ones, outside every Linear) the per-op
    policy recomputes; one half for a graph captured without its matmul calls."""
    bare = [k for k, mm in enumerate(layer.matmuls) if not mm.linear]
    return sum(not keeps_matmul(k) for k in bare) / len(bare) if bare else 0.5


def kept_flops(layer: Layer, graph: ModelGraph) -> float:
    """Forward FLOPs of the kept matmuls for the captured batch (attention aside)."""
    if layer.matmuls:
        return sum(mm.flops for mm in kept_matmuls(layer))
    tokens = graph.batch * graph.seq_len
    kept = sum(2.0 * tokens * lin.in_features * lin.out_features for lin in kept_linears(layer))
    if layer.moe is not None:
        m = layer.moe
        kept += 3 * 2.0 * tokens * m.top_k * graph.hidden * m.expert_ffn * (1 - routed_unkept_share(layer))
    return kept


def op_saved_bytes(layer: Layer, graph: ModelGraph) -> OpSaved:
    """What ``layer`` keeps for backward under ``selective-op`` (see the module docstring)."""
    tokens = graph.batch * graph.seq_len
    e = graph.dtype_bytes
    tp_part, rest = 0.0, float(layer.input_bytes)
    roles = {lin.name: lin.role for lin in layer.linears}
    if layer.matmuls:
        outs = [(mm.out_elems * e, roles.get(mm.linear, "replicated")) for mm in kept_matmuls(layer)]
    else:
        outs = [(tokens * lin.out_features * e, lin.role) for lin in kept_linears(layer)]
        if layer.moe is not None:
            m = layer.moe
            outs.append((tokens * m.top_k * (2 * m.expert_ffn + graph.hidden) * e * (1 - routed_unkept_share(layer)),
                         "replicated"))
    for nbytes, role in outs:
        if role in OUT_SPLIT_ROLES:
            tp_part += nbytes
        else:
            rest += nbytes
    a = layer.attention
    if a is not None:
        tp_part += tokens * a.heads * (a.head_dim * e + LSE_BYTES)
    # never more than the layer keeps without recompute, part by part
    return OpSaved(tp_part=min(tp_part, layer.act_bytes_tp), rest=min(rest, layer.act_bytes - layer.act_bytes_tp))
