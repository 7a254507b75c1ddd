"""Flash attention (FA2-style) in Triton, with a plain-torch fallback.

Layouts and units
-----------------
* ``q``: [B, H, Sq, D]; ``k``, ``v``: [B, KVH, Sk, D] with ``H % KVH == 0`` (GQA/MQA from
  the head ratio: query head ``h`` reads KV head ``h // (H // KVH)``). Any strides.
* dtypes: fp16 / bf16 (GPU), fp32 (tests, fallback). Accumulation is always fp32.
* Returns ``out`` [B, H, Sq, D] (q.dtype, contiguous) and ``lse`` [B, H, Sq] fp32, the
  *natural-log* log-sum-exp of the scaled scores; ``-inf`` for fully masked rows (whose
  output is 0).
* Causal mask: query ``i`` sees key ``j`` iff ``i + q_offset >= j + kv_offset``. With
  offsets one kernel serves local causal attention, a ring step, a zigzag chunk, and
  bottom-right-aligned Sq != Sk (``q_offset = Sk - Sq``).
* Packed documents (``doc_start`` [B, Sq] int, causal only): query ``i`` also needs
  ``j + kv_offset >= doc_start[b, i]``, its document's first global position, so no query
  sees another document. The forward and dQ kernels skip the key blocks before the query
  block's first document start; the dK/dV kernel masks (it does not skip).

Ops (``torch.library.custom_op``, namespace ``autopar``)
-------------------------------------------------------
* ``autopar::flash_attn_fwd(q, k, v, causal, sm_scale, q_offset, kv_offset, impl) -> (out, lse)``
* ``autopar::flash_attn_bwd(dout, q, k, v, out, lse, dlse, causal, sm_scale, q_offset,
  kv_offset, impl) -> (dq, dk, dv)``; ``dk``/``dv`` per KV head (reduced over the query heads
  of a group inside the kernel, no atomics). ``out``/``lse`` may be the *merged global*
  result of a ring (the backward only needs P = exp(S - lse) and delta = rowsum(dO * O)).
  ``dlse`` (optional, [B, H, Sq] fp32) is the gradient of ``lse``: it enters as
  ``delta - dlse``, so the LSE output is differentiable too.
* ``autopar::attn_merge(out1, lse1, out2, lse2) -> (out, lse)``: stable merge of two partial
  results over disjoint key sets (handles ``-inf``), differentiable in all four inputs.

``impl``: ``"triton"`` forces the Triton kernels (on CPU only under ``TRITON_INTERPRET=1``),
``"torch"`` the fallback, ``"auto"`` (default) picks Triton on CUDA and torch elsewhere; the
environment variable ``AUTOPAR_KERNEL_IMPL`` overrides ``"auto"``. :func:`resolved_impl`
names the choice; the runtime (``codegen/runtime/kernels.py``) runs a local call that neither
chose explicitly on torch's own fused SDPA kernel where Triton does not run.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from codegen.kernels.attention_torch import flash_attn_bwd_torch, flash_attn_fwd_torch
from codegen.kernels.attention_triton import (HAS_TRITON, SUPPORTED_HEAD_DIMS, check_shapes, flash_attn_bwd_triton,
                                              flash_attn_fwd_triton, interpreting)

__all__ = ["SUPPORTED_HEAD_DIMS", "attn_merge", "flash_attention", "flash_attn_bwd", "flash_attn_fwd", "resolved_impl",
           "use_triton"]


def resolved_impl(impl: str) -> str:
    """``impl`` with ``"auto"`` replaced by ``AUTOPAR_KERNEL_IMPL`` when that is set."""
    return os.environ.get("AUTOPAR_KERNEL_IMPL", "auto") if impl == "auto" else impl


def use_triton(impl: str, device: torch.device) -> bool:
    """Resolve ``impl`` ("auto" | "triton" | "torch") for a tensor on ``device``."""
    impl = resolved_impl(impl)
    if impl == "torch":
        return False
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("impl='triton' requested but triton is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError("impl='triton' on CPU needs TRITON_INTERPRET=1 set before importing triton")
        return True
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return HAS_TRITON and device.type == "cuda"


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("autopar::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float,
                   q_offset: int = 0, kv_offset: int = 0, impl: str = "auto",
                   doc_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    if use_triton(impl, q.device):
        return flash_attn_fwd_triton(q, k, v, causal, sm_scale, q_offset, kv_offset, doc_start=doc_start)
    check_shapes(q, k, v)
    return flash_attn_fwd_torch(q, k, v, causal, sm_scale, q_offset, kv_offset, doc_start)


@flash_attn_fwd.register_fake
def _(q, k, v, causal, sm_scale, q_offset=0, kv_offset=0, impl="auto", doc_start=None):
    B, H, Sq, D = q.shape
    return q.new_empty((B, H, Sq, D)), q.new_empty((B, H, Sq), dtype=torch.float32)


@torch.library.custom_op("autopar::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dlse: Optional[Tensor], causal: bool, sm_scale: float, q_offset: int = 0,
                   kv_offset: int = 0, impl: str = "auto",
                   doc_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    if use_triton(impl, q.device):
        return flash_attn_bwd_triton(dout, q, k, v, out, lse, dlse, causal, sm_scale, q_offset, kv_offset,
                                     doc_start=doc_start)
    return flash_attn_bwd_torch(dout, q, k, v, out, lse, dlse, causal, sm_scale, q_offset, kv_offset, doc_start)


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, causal, sm_scale, q_offset=0, kv_offset=0, impl="auto", doc_start=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, causal, sm_scale, q_offset, kv_offset, impl, doc_start = inputs
    ctx.save_for_backward(q, k, v, *output, doc_start)
    ctx.args = (causal, sm_scale, q_offset, kv_offset, impl)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, doc_start = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = flash_attn_bwd(dout, q, k, v, out, lse, dlse, *ctx.args, doc_start=doc_start)
    return dq, dk, dv, None, None, None, None, None, None


flash_attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def _merge_weights(lse1: Tensor, lse2: Tensor):
    """lse = logaddexp(lse1, lse2) and w_i = exp(lse_i - lse) (0 where lse is -inf)."""
    m = torch.maximum(lse1, lse2)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)
    lse = m_safe + torch.log(torch.exp(lse1 - m_safe) + torch.exp(lse2 - m_safe))
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0)
    return lse, torch.exp(lse1 - lse_safe), torch.exp(lse2 - lse_safe)


def _ct(t: Tensor) -> torch.dtype:
    """Compute dtype of the merge: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


@torch.library.custom_op("autopar::attn_merge", mutates_args=())
def attn_merge(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partial attentions over disjoint key sets. out*: [..., S, D]; lse*: [..., S]
    natural log. Computed in fp32 (fp64 if given); returns (out in out1.dtype, lse fp32)."""
    lse, w1, w2 = _merge_weights(lse1.to(_ct(lse1)), lse2.to(_ct(lse1)))
    ct = _ct(out1)
    out = w1.unsqueeze(-1).to(ct) * out1.to(ct) + w2.unsqueeze(-1).to(ct) * out2.to(ct)
    return out.to(out1.dtype), lse


@attn_merge.register_fake
def _(out1, lse1, out2, lse2):
    return out1.new_empty(out1.shape), lse1.new_empty(lse1.shape, dtype=_ct(lse1))


def _merge_setup(ctx, inputs, output):
    out1, lse1, out2, lse2 = inputs
    ctx.save_for_backward(out1, lse1, out2, lse2, output[0])


def _merge_backward(ctx, dout, dlse):
    # out = sum_j w_j o_j, lse = logaddexp(l_1, l_2), w_j = exp(l_j - lse):
    # d o_j = w_j dout;  d l_j = w_j (dlse + <dout, o_j - out>).
    out1, lse1, out2, lse2, out = ctx.saved_tensors
    ct = _ct(out1)
    _, w1, w2 = _merge_weights(lse1.to(_ct(lse1)), lse2.to(_ct(lse1)))
    w1, w2 = w1.to(ct), w2.to(ct)
    dout = torch.zeros_like(out, dtype=ct) if dout is None else dout.to(ct)
    dlse = torch.zeros_like(w1) if dlse is None else dlse.to(ct)
    o = out.to(ct)
    dl1 = w1 * (dlse + (dout * (out1.to(ct) - o)).sum(-1))
    dl2 = w2 * (dlse + (dout * (out2.to(ct) - o)).sum(-1))
    return ((w1.unsqueeze(-1) * dout).to(out1.dtype), dl1.to(lse1.dtype),
            (w2.unsqueeze(-1) * dout).to(out2.dtype), dl2.to(lse2.dtype))


attn_merge.register_autograd(_merge_backward, setup_context=_merge_setup)


# --------------------------------------------------------------------------- public wrapper
def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                    sm_scale: Optional[float] = None, q_offset: int = 0, kv_offset: int = 0,
                    impl: str = "auto", doc_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Differentiable attention: returns (out [B,H,Sq,D], lse [B,H,Sq] fp32 natural log).

    Gradients flow to q, k, v from both ``out`` and ``lse``. ``sm_scale`` defaults to
    1/sqrt(D). ``doc_start`` [B, Sq] (integers; packed documents, causal only): the global
    position of the first key each query may see. See the module docstring for layouts,
    masking and ``impl``."""
    check_shapes(q, k, v)
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} unsupported; supported: {SUPPORTED_HEAD_DIMS}")
    if doc_start is not None and (not causal or tuple(doc_start.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"doc_start must be [B, Sq] = {[q.shape[0], q.shape[2]]} with causal=True (packed "
                         f"documents), got {list(doc_start.shape)} with causal={causal}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return flash_attn_fwd(q, k, v, bool(causal), float(sm_scale), int(q_offset), int(kv_offset), impl, doc_start)
