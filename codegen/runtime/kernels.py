"""The plan's kernels in the runtime: flash attention and the fused linear + cross-entropy loss.

``ParallelConfig.attention`` / ``ParallelConfig.loss`` name the kernels; this module
turns them into runtime behaviour (``codegen.kernels`` holds the kernels themselves):

- ``attention == "flash"``: :class:`FlashAttention` (``codegen.kernels.attention.flash_attention``,
  ``impl="auto"``: Triton on CUDA, the exact fp32 torch fallback on CPU) is the attention
  implementation the runtime installs on each block (``codegen/runtime/attention.py``).
  Head dims the kernel does not support go to the fallback (SDPA). Under context
  parallelism the ring's per-step partial attention uses :func:`ring_block_attention` (the
  kernel per contiguous (query chunk, key chunk) pair with q/kv offsets, merged with
  ``attn_merge``), see ``context_parallel.RingAttention``.
- ``loss == "fused"``: the last stage never computes logits. Its forward gets the
  micro-batch ``labels`` and returns :func:`linear_loss` = the SUMMED token cross-entropy
  from the head's input hidden states and the head weight via ``fused_linear_cross_entropy``
  (the runtime's loss function then divides by the global token count, as for logits).
  Under tensor parallelism the head weight is a vocabulary-sharded DTensor: the local shard
  and the tp group drive the vocabulary-parallel variant; sequence-parallel hidden states
  are all-gathered first (as the head's ``ColwiseParallel(input_layouts=Shard(1))`` does).
  The loss is computed inside the stage module's forward so FSDP / replicate see the
  head weight used within their forward hooks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from codegen.kernels.attention import SUPPORTED_HEAD_DIMS, attn_merge, flash_attention, resolved_impl, use_triton
from codegen.runtime.documents import Documents, EagerAttention

IGNORE_INDEX = -100


# ------------------------------------------------------------------ attention

class FlashAttention:
    """Attention implementation ``fn(q, k, v, *, causal, scale=None)`` on ``flash_attention``.

    ``documents`` (``documents.Documents``): the current micro-batch's packed documents, whose
    ``doc_start`` the kernel masks by (causal calls); ``fallback`` handles head dims the kernel
    does not support (default: SDPA, with the same document mask). Where the Triton kernels do
    not run (CPU) and no implementation was forced (``impl`` / ``AUTOPAR_KERNEL_IMPL`` "auto"), a
    call without documents is torch's own fused SDPA kernel (flash on CPU: nothing of S x S kept,
    six to seven times the plain-torch fallback's speed); the fallback
    (``codegen/kernels/attention_torch.py``) still serves documents and ring steps, which need
    its offsets, masks and log-sum-exp."""

    def __init__(self, fallback: Optional[Callable] = None, impl: str = "auto",
                 documents: Optional[Documents] = None):
        self.fallback = fallback or EagerAttention(documents)
        self.impl = impl
        self.documents = documents

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
            return self.fallback(q, k, v, causal=causal, scale=scale)
        ds = self.documents.doc_start if self.documents is not None and causal else None
        if ds is not None:
            self.documents.used += 1
        elif resolved_impl(self.impl) == "auto" and not use_triton(self.impl, q.device):  # CPU: torch's fused kernel
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                  enable_gqa=k.shape[1] != q.shape[1])
        # Top-left aligned causal mask (query i sees keys j <= i), as SDPA's is_causal.
        out, _ = flash_attention(q, k, v, causal=causal, sm_scale=scale, impl=self.impl,
                                 doc_start=None if ds is None else ds.to(q.device))
        return out


def _runs(pos: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions: [(start index, length, first position)]."""
    p = pos.tolist()
    out, a = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            out.append((a, i - a, p[a]))
            a = i
    return out


def ring_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                         kv_pos: torch.Tensor, impl: str = "auto", scale: Optional[float] = None,
                         q_doc: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q [B,H,Sq,D] at global positions ``q_pos`` to one K/V block at
    ``kv_pos`` -> (out [B,H,Sq,D] fp32, lse [B,H,Sq] fp32 natural log; -inf if nothing visible).

    The positions are cut into contiguous runs (zigzag: two chunks per rank); each
    (query run, key run) pair is one ``flash_attention`` call with ``q_offset`` /
    ``kv_offset`` = the runs' first global positions. Pairs no query can see are skipped,
    pairs entirely visible run non-causal, and a query run's partials over the key runs
    are merged with ``attn_merge``. ``q_doc`` [B, Sq] (packed documents): each query's
    document start, a global position; the kernels mask (and skip) by it."""
    q_runs, kv_runs = _runs(q_pos), _runs(kv_pos)
    outs, lses = [], []
    for qa, qn, qp in q_runs:
        qs = q[:, :, qa:qa + qn]
        o = l = None
        for ka, kn, kp in kv_runs:
            if kp > qp + qn - 1:          # every key after every query: invisible
                continue
            causal = kp + kn - 1 > qp or q_doc is not None  # some key masked: the causal path
            ds = None if q_doc is None else q_doc[:, qa:qa + qn].contiguous()
            ob, lb = flash_attention(qs, k[:, :, ka:ka + kn], v[:, :, ka:ka + kn], causal=causal,
                                     sm_scale=scale, q_offset=qp, kv_offset=kp, impl=impl, doc_start=ds)
            if o is None:
                o, l = ob, lb
            else:
                o, l = attn_merge(o, l, ob, lb)
        if o is None:  # nothing visible: weight 0 when merged
            o = q.new_zeros(qs.shape)
            l = torch.full(qs.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        outs.append(o)
        lses.append(l)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    return out.float(), lse


# ------------------------------------------------------------------ loss

def _gather_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    """Full-sequence local tensor from the head input: a sequence-sharded DTensor or a plain
    tensor (replicated, or a Shard(1) local piece when ``tp_mesh`` is given for SP)."""
    if isinstance(x, DTensor):
        if any(not p.is_replicate() for p in x.placements):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        return x.to_local()
    if tp_mesh is not None:
        return DTensor.from_local(x, tp_mesh, [Shard(1)]).redistribute(tp_mesh, [Replicate()]).to_local()
    return x


def linear_loss(weight: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, *, sp: bool = False,
                impl: str = "auto") -> torch.Tensor:
    """SUMMED cross-entropy of ``x @ weight.T`` against ``labels`` without logits (fp32 scalar).

    ``x`` [B, S, H] (or its sequence shard under SP), ``labels`` [B, S], ``weight`` the head's
    [V, H]. A vocabulary-sharded weight (DTensor ``Shard(0)`` over the tp mesh) uses the
    vocabulary-parallel fused loss over the tp group with the local shard."""
    from codegen.kernels.fused_loss import fused_linear_cross_entropy
    w = weight
    group = None
    if isinstance(w, DTensor):
        mesh = w.device_mesh
        if mesh.ndim != 1 or w.placements[0] != Shard(0):
            raise ValueError(f"fused loss: head weight placements {w.placements} on a {mesh.ndim}-d mesh; "
                             "expected a vocabulary shard Shard(0) on the tp mesh")
        x = _gather_sequence(x, mesh if sp else None)
        group = mesh.get_group()
        w = w.to_local()
    elif isinstance(x, DTensor):
        x = _gather_sequence(x, None)
    h = x.reshape(-1, x.shape[-1])
    return fused_linear_cross_entropy(h, w, labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum",
                                      group=group, impl=impl)


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SUMMED token cross-entropy of ``logits`` [.., V] against ``labels`` (fp32); vocabulary-
    sharded DTensor logits are handled by ``loss_parallel`` (the runtime's ``loss_context``)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
