"""What per-op selective checkpointing (recompute ``selective-op``) keeps and recomputes.

The runtime's rule (``codegen/runtime/recompute.py``, ``OpSavePolicy``; torchtitan's "op"
mode of selective activation checkpointing): in each forward of a block, the outputs of the
1st, 3rd, 5th ... matmul are kept, and those of the attention kernel (output and
log-sum-exp); everything else - the other matmuls, norms, activations, rotary, residual
adds - is recomputed in backward from them and the block's input. Only the repeated blocks
are checkpointed; other layers keep everything.

Priced from the graph, per layer, at the captured batch and dtype:

- kept bytes (:func:`op_saved_bytes`): the block input, plus each kept linear's output
  (``tokens x out_features``; ``layer.linears`` is in call order), plus the attention output
  (``tokens x heads x head_dim``) and its log-sum-exp (fp32, ``tokens x heads``), plus, for
  routed experts, half their matmul outputs (``tokens x top_k x (2 F + H) / 2``: three
  matmuls per expert, every other one kept). Never more than the layer keeps without
  recompute. Split like ``Layer.act_bytes``: outputs of column / vocab linears and of the
  attention are divided by tp, the rest (block input, row outputs) by tp only under
  sequence parallel.
- recompute time (``cost_models/compute.py``): on GPUs, the unkept linears' forward GEMMs,
  half the routed experts' and every memory-bound kernel of the forward (norms,
  activations, rotary, residual adds), from the kernel model; attention is kept. Where
  there is no kernel breakdown (CPU roofline, profiled layers), the forward FLOPs outside
  the kept matmuls and the attention core, as a share of the forward time
  (``compute.op_recompute_share``).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.graph import BLOCK_KINDS, OUT_SPLIT_ROLES, Layer, ModelGraph

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


def kept_linears(layer: Layer) -> list:
    """The linears whose outputs the per-op policy keeps: the 1st, 3rd, ... called."""
    return layer.linears[0::2]


def op_saved_bytes(layer: Layer, graph: ModelGraph) -> OpSaved:
    """What ``layer`` keeps for backward under ``selective-op`` (see the module docstring)."""
    tokens = graph.batch * graph.seq_len
    e = graph.dtype_bytes
    tp_part, rest = 0.0, float(layer.input_bytes)
    for lin in kept_linears(layer):
        out = tokens * lin.out_features * e
        if lin.role in OUT_SPLIT_ROLES:
            tp_part += out
        else:
            rest += out
    a = layer.attention
    if a is not None:
        tp_part += tokens * a.heads * (a.head_dim * e + LSE_BYTES)
    if layer.moe is not None:
        m = layer.moe
        rest += tokens * m.top_k * (2 * m.expert_ffn + graph.hidden) * e / 2
    # never more than the layer keeps without recompute, part by part
    return OpSaved(tp_part=min(tp_part, layer.act_bytes_tp), rest=min(rest, layer.act_bytes - layer.act_bytes_tp))
