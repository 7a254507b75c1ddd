"""A block's norms, rotary embedding and activation as fused kernels (``Engine.fused_elementwise``:
Transformer Engine's fused RMSNorm / LayerNorm, fused RoPE and fused bias-SwiGLU / bias-GeLU in
Megatron-Core), in place of the eager kernels the capture recorded (transformers' and the zoo's
modules, op by op: an eager RMSNorm is a cast, a square, a mean, a rsqrt and two products, each
reading and writing the whole tensor, and autograd keeps several of them).

Per token, at ``e`` bytes per element; ``w`` the norm's width (the hidden size), ``q`` and ``k``
the query and key widths (heads x head_dim, kv_heads x head_dim), ``c`` the widths a dense MLP's
column linears write and ``r`` the width its row linear reads (gated: c = 2r):

| op (``Op.kind``)   | fused kernel              | forward bytes    | backward bytes   | kernels |
|--------------------|---------------------------|------------------|------------------|---------|
| norm               | RMSNorm / LayerNorm       | 2 w e + 4        | 3 w e + 4        | 1 / 2   |
| attention          | RoPE on q and k           | 2 (q + k) e      | 2 (q + k) e      | 2 / 2   |
|   with QK norms    | + RMSNorm on q and k      | + 2 (q + k) e    | + 3 (q + k) e    | + 2 / 4 |
| mlp (dense)        | bias-SwiGLU / bias-GeLU   | (c + r) e        | (2 c + r) e      | 1 / 1   |

(a norm reads its input and writes its output and the fp32 per-row rstd; its backward reads the
output gradient, the input and rstd and writes the input gradient, then reduces the weight
gradient; RoPE reads and writes q and k, its backward the same for their gradients; the
activation reads what the column linears wrote and writes what the row linear reads, its
backward reads the output gradient and the inputs and writes their gradients). The residual
adds (the layer's own op) are one read of two tensors and a write, as the capture counts them;
the attention core is the flash kernel's (cost_models/gpu_layer.py); a MoE part is its engine's
dispatcher (cost_models/moe_layer.py).

What the block keeps for backward (:func:`block_saved`), per token: each norm its input (w e) and
rstd (4); the attention its QKV GEMM's input (the norm's output, w e), the flash kernel's q, k, v
and output (the output is the o_proj GEMM's input: (2 q + 2 k) e, v as wide as k) and its
log-sum-exp (4 per head), and with QK norms their inputs ((q + k) e); RoPE keeps nothing (its
angles are recomputed); a dense MLP its fc1 input (w e), the activation's input (c e) and fc2's
input (r e). Under Megatron-Core's ``--recompute-modules layernorm`` (``Engine.recompute_modules``)
the norms' outputs - the GEMM inputs w e - are dropped and recomputed from the kept norm inputs.
Tensor-parallel parts (heads, FFN width) are divided by tp, hidden-sized ones by tp only with
sequence parallel, as the capture's ``act_bytes_tp`` (``planner.graph.Layer``) splits the capture's.

Only blocks whose ops are all of these kinds are expressed (:func:`block_saved` is None
otherwise and the capture's figures stand); no coefficient is fitted here.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.graph import Layer, ModelGraph, Op, op_linears

ROW_STAT = 4        # fp32 rstd (RMSNorm) per row; LayerNorm keeps the mean too, within the rounding here
LSE = 4             # the flash kernel's fp32 log-sum-exp per (token, head)


@dataclass(frozen=True)
class FusedOp:
    """One op as fused kernels, per token: forward and backward HBM bytes and kernel counts."""
    fwd_bytes: float
    bwd_bytes: float
    fwd_kernels: int
    bwd_kernels: int


def qk_widths(layer: Layer) -> tuple[int, int]:
    """(q, k) widths of the layer's attention: heads x head_dim, kv_heads x head_dim."""
    a = layer.attention
    return a.heads * a.head_dim, a.kv_heads * a.head_dim


def has_qk_norm(op: Op, layer: Layer) -> bool:
    """Whether the attention op holds norms on its queries and keys (parameters beyond its linears'
    weights and biases: Qwen3's, OLMo2's QK norms)."""
    lin = sum(l.in_features * l.out_features + (l.out_features if l.bias else 0)
              for l in op_linears(op, layer.ops, layer.linears))
    return op.params > lin


def dense_widths(op: Op, layer: Layer) -> tuple[int, int] | None:
    """(c, r) of a dense MLP op: the widths its column linears write and its row linear reads;
    None when it is not one column -> row pair (e.g. a MoE part, a lone linear)."""
    lins = op_linears(op, layer.ops, layer.linears)
    col = [l.out_features for l in lins if l.role == "column"]
    row = [l.in_features for l in lins if l.role == "row"]
    return (sum(col), row[0]) if col and len(row) == 1 else None


def fused_op(op: Op, layer: Layer, graph: ModelGraph, elem: int) -> FusedOp | None:
    """``op`` as fused kernels (module docstring), or None where nothing is fused (residual adds,
    embeddings, heads, losses, a MoE part, an attention the capture did not see)."""
    w = graph.hidden
    if op.kind == "norm":
        return FusedOp(2 * w * elem + ROW_STAT, 3 * w * elem + ROW_STAT, 1, 2)
    if op.kind == "attention" and layer.attention is not None:
        q, k = qk_widths(layer)
        f, b, kf, kb = 2 * (q + k) * elem, 2 * (q + k) * elem, 2, 2
        if has_qk_norm(op, layer):
            f, b, kf, kb = f + 2 * (q + k) * elem, b + 3 * (q + k) * elem, kf + 2, kb + 4
        return FusedOp(f, b, kf, kb)
    if op.kind == "mlp" and not (layer.moe is not None and op.name == layer.moe.part):
        cr = dense_widths(op, layer)
        if cr is not None:
            c, r = cr
            return FusedOp((c + r) * elem, (2 * c + r) * elem, 1, 1)
    return None


def block_saved(layer: Layer, graph: ModelGraph, elem: int, recompute_norm: bool) -> tuple[float, float] | None:
    """(tensor-parallel part, the rest) of what ``layer`` keeps per token outside its MoE part with
    fused kernels (module docstring), at ``elem`` bytes per element; None when some op of the
    layer is not one the table covers (then the capture's figures stand)."""
    w = graph.hidden
    gemm_in = 0 if recompute_norm else w * elem  # a norm's output, the next GEMMs' input
    tp_part = rest = 0.0
    for op in layer.ops:
        if layer.moe is not None and op.name == layer.moe.part:
            continue
        if op.kind == "norm":
            rest += w * elem + ROW_STAT
        elif op.kind == "attention" and layer.attention is not None:
            q, k = qk_widths(layer)
            tp_part += (2 * q + 2 * k) * elem + LSE * layer.attention.heads
            tp_part += (q + k) * elem if has_qk_norm(op, layer) else 0
            rest += gemm_in
        elif op.kind == "mlp" and dense_widths(op, layer) is not None:
            c, r = dense_widths(op, layer)
            tp_part += (c + r) * elem
            rest += gemm_in
        elif op.params or any(True for _ in op_linears(op, layer.ops, layer.linears)):
            return None  # an op with weights the table does not know
    return tp_part, rest
