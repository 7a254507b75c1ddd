"""The flash-attention kernels' plain-torch fallback: exact fp32 math, chunked over queries.

Same contract as the Triton kernels of ``codegen/kernels/attention.py`` (layouts, offsets,
natural-log LSE, ``-inf`` rows), including packed documents: ``doc_start`` [B, Sq] (int)
gives, per query, the global position of the first key it may see (its document's first
token), so query ``i`` sees key ``j`` iff ``doc_start[b, i] <= j + kv_offset <= i + q_offset``.

Like the kernels, it skips work no query may see: each chunk of ``CHUNK`` query rows of each
batch row, one row at a time (:func:`row_calls`), attends only the keys from that row's
earliest document start in the chunk to the chunk's last query (causal), so a causal call
does about half the S x S work and packed short documents about the sum of their squared
lengths (plus a chunk per document), never back to another row's document start.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

CHUNK = 128  # query rows per step: bounds the score buffer to chunk x Sk, and the keys skipped


def row_calls(batch: int, rows: slice, sk: int, causal: bool, q_offset: int, kv_offset: int,
              doc_start: Optional[Tensor]) -> list[tuple[slice, slice]]:
    """(batch row, keys) of each score block the query chunk ``rows`` computes: one per batch row
    that sees a key, its keys from its own earliest document start in the chunk (packed
    documents) to the chunk's last query (causal). One row at a time keeps the score buffer
    at ``CHUNK x Sk`` per head (four rows of 2,048 keys at once ran 1.25x slower than one by
    one: out of cache). ``cost_models.fallback_attention`` prices exactly these blocks."""
    hi = min(sk, max(0, rows.stop + q_offset - kv_offset)) if causal else sk
    if doc_start is None:
        los = [0] * batch
    else:
        los = (doc_start[:, rows].min(dim=1).values - kv_offset).clamp(0, hi).tolist()
    return [(slice(b, b + 1), slice(lo, hi)) for b, lo in enumerate(los) if lo < hi]


def _scores(q5: Tensor, k: Tensor, bs: slice, rows: slice, keys: slice, causal: bool, sm_scale: float,
            q_offset: int, kv_offset: int, doc_start: Optional[Tensor]) -> Tensor:
    """fp32 scores [b, KVH, G, rows, keys] of batch rows ``bs`` with the causal and document
    masks applied as -inf."""
    k = k[bs, :, keys]
    s = torch.matmul(q5[bs, :, :, rows].float(), k.float().unsqueeze(2).transpose(-1, -2)) * sm_scale
    kj = torch.arange(keys.start, keys.stop, device=q5.device)[None, :] + kv_offset
    if causal:
        qi = torch.arange(rows.start, rows.stop, device=q5.device)[:, None] + q_offset
        s = s.masked_fill(qi < kj, float("-inf"))
    if doc_start is not None:  # [b, rows, keys] -> broadcast over the kv heads and their groups
        before = kj[None] < doc_start[bs, rows, None].to(kj.device)
        s = s.masked_fill(before[:, None, None], float("-inf"))
    return s


def flash_attn_fwd_torch(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float, q_offset: int = 0,
                         kv_offset: int = 0, doc_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out [B, H, Sq, D] q.dtype, lse [B, H, Sq] fp32)."""
    B, H, Sq, D = q.shape
    KVH = k.shape[1]
    q5 = q.view(B, KVH, H // KVH, Sq, D) if q.is_contiguous() else q.reshape(B, KVH, H // KVH, Sq, D)
    out = torch.zeros((B, H, Sq, D), dtype=q.dtype, device=q.device)            # 0 where nothing is visible
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    o5, l4 = out.view(B, KVH, H // KVH, Sq, D), lse.view(B, KVH, H // KVH, Sq)
    for r0 in range(0, Sq, CHUNK):
        rows = slice(r0, min(Sq, r0 + CHUNK))
        for bs, keys in row_calls(B, rows, k.shape[2], causal, q_offset, kv_offset, doc_start):
            s = _scores(q5, k, bs, rows, keys, causal, sm_scale, q_offset, kv_offset, doc_start)
            m = torch.logsumexp(s, dim=-1)                               # -inf if all masked
            p = torch.exp(s - m.masked_fill(m == float("-inf"), 0.0).unsqueeze(-1))
            o5[bs, :, :, rows] = torch.matmul(p, v[bs, :, keys].float().unsqueeze(2)).to(q.dtype)
            l4[bs, :, :, rows] = m
    return out, lse


def flash_attn_bwd_torch(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         dlse: Optional[Tensor], causal: bool, sm_scale: float, q_offset: int = 0,
                         kv_offset: int = 0, doc_start: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the input dtypes; ``dlse`` (optional) is the gradient of ``lse``."""
    B, H, Sq, D = q.shape
    KVH, G = k.shape[1], H // k.shape[1]
    q5 = q.reshape(B, KVH, G, Sq, D)
    do5 = dout.reshape(B, KVH, G, Sq, D).float()
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta5 = delta.reshape(B, KVH, G, Sq)
    lse5 = lse.float().reshape(B, KVH, G, Sq)
    lse5 = lse5.masked_fill(lse5 == float("-inf"), float("inf"))
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    dq = torch.zeros((B, H, Sq, D), dtype=q.dtype, device=q.device)              # 0 where nothing is visible
    dk = torch.zeros((B, KVH, k.shape[2], D), dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    dq5 = dq.view(B, KVH, G, Sq, D)
    for r0 in range(0, Sq, CHUNK):
        rows = slice(r0, min(Sq, r0 + CHUNK))
        for bs, keys in row_calls(B, rows, k.shape[2], causal, q_offset, kv_offset, doc_start):
            s = _scores(q5, k, bs, rows, keys, causal, sm_scale, q_offset, kv_offset, doc_start)
            p = torch.exp(s - lse5[bs, ..., rows, None])
            do = do5[bs, :, :, rows]
            dv[bs, :, keys] += torch.matmul(p.transpose(-1, -2), do).sum(2)
            ds = p * (torch.matmul(do, vf[bs, ..., keys, :].transpose(-1, -2)) - delta5[bs, ..., rows, None])
            dq5[bs, :, :, rows] = (torch.matmul(ds, kf[bs, ..., keys, :]) * sm_scale).to(q.dtype)
            dk[bs, :, keys] += (torch.matmul(ds.transpose(-1, -2), q5[bs, :, :, rows].float()) * sm_scale).sum(2)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
