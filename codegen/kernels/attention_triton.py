"""The Triton flash-attention kernels and their launchers (forward; delta, dK/dV and dQ backward),
as ``codegen/kernels/attention.py`` describes them (layouts, masks, offsets, packed documents).
Launch configurations are fixed per head dim (no autotune); ``interpreting()`` is the CPU
interpreter (``TRITON_INTERPRET=1``), where bf16 dots are upcast (its bf16 ``tl.dot`` is wrong).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

try:  # Triton is optional: without it only the torch fallback exists.
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = tl = None
    HAS_TRITON = False

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_blocks(block_m: int, block_n: int, head_dim: int) -> None:
    """One-line errors for configurations the GPU would reject (the interpreter would not)."""
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b}: block sizes must be powers of two >= 16")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} unsupported; supported: {SUPPORTED_HEAD_DIMS}")


def _fwd_config(d: int, dtype: torch.dtype) -> dict:
    """Fixed launch configuration (blocks, warps, stages) for the forward kernel."""
    if interpreting():
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
    if d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)


def _bwd_config(d: int, dtype: torch.dtype) -> dict:
    if interpreting():
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4 if d <= 64 else 8, num_stages=2)


# --------------------------------------------------------------------------- kernels
if HAS_TRITON:

    @triton.jit
    def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, lo, hi, Sk, q_offset, kv_offset, qk_scale, dstart,
                   MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                   PREC: tl.constexpr, DOC: tl.constexpr):
        """Online-softmax sweep over key blocks [lo, hi); scores in base 2. With DOC (and MASK),
        a row sees only keys at or after its document's first position ``dstart``."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                         mask=offs_n[None, :] < Sk, other=0.0)          # [D, BLOCK_N]
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=offs_n[:, None] < Sk, other=0.0)           # [BLOCK_N, D]
            if DOT_F32:
                kt = kt.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, kt, input_precision=PREC) * qk_scale
            if MASK:
                keep = offs_n[None, :] < Sk
                if CAUSAL:
                    keep = keep & (offs_m[:, None] + q_offset >= offs_n[None, :] + kv_offset)
                if DOC:
                    keep = keep & (offs_n[None, :] + kv_offset >= dstart[:, None])
                s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # fully masked so far
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attn_fwd_kernel(Q, K, V, O, LSE, DS,
                         stride_qb, stride_qh, stride_qm, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_ob, stride_oh, stride_om, stride_od,
                         H, GROUP, Sq, Sk, q_offset, kv_offset, qk_scale,
                         CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                         HAS_DOC: tl.constexpr):
        """One program = BLOCK_M query rows of one (batch, head). qk_scale = sm_scale*log2(e).
        HAS_DOC: DS [B, Sq] int32 holds each row's document start (global key position)."""
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                    + offs_d[None, :] * stride_qd, mask=offs_m[:, None] < Sq, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        # Key blocks split in two: [0, full_end) is visible to every row of this block (no
        # mask), [full_end, hi) needs the causal / ragged-length mask.
        if CAUSAL:
            hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + q_offset - kv_offset, 0))
            full_end = tl.minimum(tl.maximum(start_m + q_offset - kv_offset + 1, 0), Sk)
        else:
            hi = Sk
            full_end = Sk
        full_end = (full_end // BLOCK_N) * BLOCK_N
        if HAS_DOC:  # key blocks before the block's first document start are skipped; all masked
            dstart = tl.load(DS + b * Sq + offs_m, mask=offs_m < Sq, other=1073741824)
            lo = tl.minimum((tl.maximum(tl.min(dstart, 0) - kv_offset, 0) // BLOCK_N) * BLOCK_N, hi)
            acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd,
                                       stride_vn, stride_vd, offs_m, offs_d, lo, hi, Sk,
                                       q_offset, kv_offset, qk_scale, dstart, True, CAUSAL, BLOCK_N, DOT_F32, PREC,
                                       True)
        else:
            acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd,
                                       stride_vn, stride_vd, offs_m, offs_d, 0, full_end, Sk,
                                       q_offset, kv_offset, qk_scale, offs_m, False, CAUSAL, BLOCK_N, DOT_F32,
                                       PREC, False)
            acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_kd,
                                       stride_vn, stride_vd, offs_m, offs_d, full_end, hi, Sk,
                                       q_offset, kv_offset, qk_scale, offs_m, True, CAUSAL, BLOCK_N, DOT_F32,
                                       PREC, False)
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        row_ok = offs_m < Sq
        tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om
                 + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + bh * Sq + offs_m, lse, mask=row_ok)

    @triton.jit
    def _bwd_delta_kernel(O, DO, DLSE, DELTA, stride_ob, stride_oh, stride_om,
                          stride_db, stride_dh, stride_dm, H, Sq,
                          HAS_DLSE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta = rowsum(dO * O) - dlse, fp32 [B, H, Sq] (last dim of O/dO contiguous)."""
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        ok = offs_m < Sq
        o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
                    mask=ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm + offs_d[None, :],
                     mask=ok[:, None], other=0.0).to(tl.float32)
        delta = tl.sum(o * do, 1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + bh * Sq + offs_m, mask=ok, other=0.0)
        tl.store(DELTA + bh * Sq + offs_m, delta, mask=ok)

    @triton.jit
    def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qm, stride_qd,
                    stride_dm, stride_dd, offs_n, offs_d, lo, hi, Sq, q_offset, kv_offset, qk_scale,
                    MASK: tl.constexpr, BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr,
                    PREC: tl.constexpr, DOC: tl.constexpr):
        """Accumulate dK, dV of one key block over query blocks [lo, hi) of one query head;
        with DOC, only the rows whose document starts at or before each key."""
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Sq
            qt = tl.load(q_base + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qm,
                         mask=row_ok[None, :], other=0.0)                 # [D, BLOCK_M]
            do = tl.load(do_base + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
                         mask=row_ok[:, None], other=0.0)                 # [BLOCK_M, D]
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
            if DOT_F32:
                qt = qt.to(tl.float32)
                do = do.to(tl.float32)
            pt = tl.math.exp2(tl.dot(k, qt, input_precision=PREC) * qk_scale - lse[None, :])
            if MASK:
                pt = tl.where(offs_m[None, :] + q_offset >= offs_n[:, None] + kv_offset, pt, 0.0)
            if DOC:
                dstart = tl.load(ds_base + offs_m, mask=row_ok, other=1073741824)
                pt = tl.where(offs_n[:, None] + kv_offset >= dstart[None, :], pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PREC)
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DS,
                              stride_qb, stride_qh, stride_qm, stride_qd,
                              stride_kb, stride_kh, stride_kn, stride_kd,
                              stride_vb, stride_vh, stride_vn, stride_vd,
                              stride_db, stride_dh, stride_dm, stride_dd,
                              H, KVH, GROUP, Sq, Sk, q_offset, kv_offset, qk_scale, sm_scale,
                              CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                              HAS_DOC: tl.constexpr):
        """One program = BLOCK_N keys of one (batch, KV head); loops over the GROUP query
        heads sharing it, so dK/dV are reduced in registers (deterministic, no atomics).
        DK/DV are contiguous [B, KVH, Sk, D]."""
        start_n = tl.program_id(0) * BLOCK_N
        bkv = tl.program_id(1)
        b = bkv // KVH
        kvh = bkv % KVH
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_D)
        col_ok = offs_n < Sk
        k = tl.load(K + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn
                    + offs_d[None, :] * stride_kd, mask=col_ok[:, None], other=0.0)
        v = tl.load(V + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn
                    + offs_d[None, :] * stride_vd, mask=col_ok[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        dk = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_D], tl.float32)
        # Query blocks [lo, full) straddle the diagonal (masked); [full, Sq) see all keys.
        if CAUSAL:
            lo = tl.maximum(start_n + kv_offset - q_offset, 0)
            lo = tl.minimum((lo // BLOCK_M) * BLOCK_M, Sq)
            full = tl.maximum(start_n + BLOCK_N - 1 + kv_offset - q_offset, lo)
            full = tl.minimum(tl.cdiv(full, BLOCK_M) * BLOCK_M, Sq)
        else:
            lo = 0
            full = 0
        for g in range(GROUP):
            h = kvh * GROUP + g
            q_base = Q + b * stride_qb + h * stride_qh
            do_base = DO + b * stride_db + h * stride_dh
            lse_base = LSE + (b * H + h) * Sq
            delta_base = DELTA + (b * H + h) * Sq
            ds_base = DS + b * Sq
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qm,
                                 stride_qd, stride_dm, stride_dd, offs_n, offs_d, lo, full, Sq,
                                 q_offset, kv_offset, qk_scale, True, BLOCK_M, DOT_F32, PREC, HAS_DOC)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qm,
                                 stride_qd, stride_dm, stride_dd, offs_n, offs_d, full, Sq, Sq,
                                 q_offset, kv_offset, qk_scale, False, BLOCK_M, DOT_F32, PREC, HAS_DOC)
        out_off = bkv * Sk * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :]
        tl.store(DK + out_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])

    @triton.jit
    def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                  offs_m, offs_d, lo, hi, Sk, q_offset, kv_offset, qk_scale, dstart,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                  PREC: tl.constexpr, DOC: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < Sk
            kt = tl.load(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn,
                         mask=col_ok[None, :], other=0.0)                # [D, BLOCK_N]
            vt = tl.load(v_base + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn,
                         mask=col_ok[None, :], other=0.0)                # [D, BLOCK_N]
            if DOT_F32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            p = tl.math.exp2(tl.dot(q, kt, input_precision=PREC) * qk_scale - lse[:, None])
            if MASK:
                keep = col_ok[None, :]
                if CAUSAL:
                    keep = keep & (offs_m[:, None] + q_offset >= offs_n[None, :] + kv_offset)
                if DOC:
                    keep = keep & (offs_n[None, :] + kv_offset >= dstart[:, None])
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, vt, input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PREC)
        return dq

    @triton.jit
    def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DS,
                            stride_qb, stride_qh, stride_qm, stride_qd,
                            stride_kb, stride_kh, stride_kn, stride_kd,
                            stride_vb, stride_vh, stride_vn, stride_vd,
                            stride_db, stride_dh, stride_dm, stride_dd,
                            H, GROUP, Sq, Sk, q_offset, kv_offset, qk_scale, sm_scale,
                            CAUSAL: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                            HAS_DOC: tl.constexpr):
        """One program = BLOCK_M query rows of one (batch, head). DQ contiguous [B, H, Sq, D]."""
        start_m = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // GROUP
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_D)
        row_ok = offs_m < Sq
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dm
                     + offs_d[None, :] * stride_dd, mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + bh * Sq + offs_m, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
        delta = tl.load(DELTA + bh * Sq + offs_m, mask=row_ok, other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh
        if CAUSAL:
            hi = tl.minimum(Sk, tl.maximum(start_m + BLOCK_M + q_offset - kv_offset, 0))
            full_end = tl.minimum(tl.maximum(start_m + q_offset - kv_offset + 1, 0), Sk)
        else:
            hi = Sk
            full_end = Sk
        full_end = (full_end // BLOCK_N) * BLOCK_N
        dq = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
        if HAS_DOC:  # as the forward: key blocks before the rows' documents skipped, all masked
            dstart = tl.load(DS + b * Sq + offs_m, mask=row_ok, other=1073741824)
            lo = tl.minimum((tl.maximum(tl.min(dstart, 0) - kv_offset, 0) // BLOCK_N) * BLOCK_N, hi)
            dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, offs_m, offs_d, lo, hi, Sk, q_offset, kv_offset, qk_scale, dstart,
                           True, CAUSAL, BLOCK_N, DOT_F32, PREC, True)
        else:
            dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, offs_m, offs_d, 0, full_end, Sk, q_offset, kv_offset, qk_scale, offs_m,
                           False, CAUSAL, BLOCK_N, DOT_F32, PREC, False)
            dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                           stride_vd, offs_m, offs_d, full_end, hi, Sk, q_offset, kv_offset, qk_scale, offs_m,
                           True, CAUSAL, BLOCK_N, DOT_F32, PREC, False)
        tl.store(DQ + bh * Sq * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, PREC): upcast dot operands under the interpreter for bf16 (its bf16 dot is
    wrong); IEEE fp32 dots for fp32 inputs (no TF32 surprise on GPU)."""
    return interpreting() and dtype == torch.bfloat16, "ieee" if dtype == torch.float32 else "tf32"


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, S, D]")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k.shape[1]}")


def _doc_arg(doc_start: Optional[Tensor], like: Tensor) -> Tensor:
    """The kernels' DS argument: ``doc_start`` as contiguous int32, or any tensor (unused)."""
    return doc_start.to(torch.int32).contiguous() if doc_start is not None else like


def flash_attn_fwd_triton(q: Tensor, k: Tensor, v: Tensor, causal: bool, sm_scale: float,
                          q_offset: int = 0, kv_offset: int = 0,
                          block_m: Optional[int] = None, block_n: Optional[int] = None,
                          doc_start: Optional[Tensor] = None):
    """Launch the forward kernel; returns (out [B,H,Sq,D] q.dtype, lse [B,H,Sq] fp32)."""
    check_shapes(q, k, v)
    B, H, Sq, D = q.shape
    KVH, Sk = k.shape[1], k.shape[2]
    cfg = _fwd_config(D, q.dtype)
    cfg["BLOCK_M"] = block_m or cfg["BLOCK_M"]
    cfg["BLOCK_N"] = block_n or cfg["BLOCK_N"]
    check_blocks(cfg["BLOCK_M"], cfg["BLOCK_N"], D)
    out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    dot_f32, prec = _dot_flags(q.dtype)
    grid = (triton.cdiv(Sq, cfg["BLOCK_M"]), B * H)
    _attn_fwd_kernel[grid](q, k, v, out, lse, _doc_arg(doc_start, lse), *q.stride(), *k.stride(), *v.stride(),
                           *out.stride(), H, H // KVH, Sq, Sk, q_offset, kv_offset, sm_scale * LOG2E,
                           CAUSAL=causal, HEAD_D=D, DOT_F32=dot_f32, PREC=prec, HAS_DOC=doc_start is not None,
                           **cfg)
    return out, lse


def flash_attn_bwd_triton(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          dlse: Optional[Tensor], causal: bool, sm_scale: float,
                          q_offset: int = 0, kv_offset: int = 0,
                          block_m: Optional[int] = None, block_n: Optional[int] = None,
                          doc_start: Optional[Tensor] = None):
    """Launch delta + dK/dV + dQ kernels; returns (dq, dk, dv), contiguous, input dtypes."""
    check_shapes(q, k, v)
    B, H, Sq, D = q.shape
    KVH, Sk = k.shape[1], k.shape[2]
    cfg = _bwd_config(D, q.dtype)
    cfg["BLOCK_M"] = block_m or cfg["BLOCK_M"]
    cfg["BLOCK_N"] = block_n or cfg["BLOCK_N"]
    check_blocks(cfg["BLOCK_M"], cfg["BLOCK_N"], D)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    out = out if out.stride(-1) == 1 else out.contiguous()
    lse = lse.float().contiguous()
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    dlse_arg = dlse.float().contiguous() if dlse is not None else delta
    _bwd_delta_kernel[(triton.cdiv(Sq, 64), B * H)](
        out, dout, dlse_arg, delta, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), H, Sq,
        HAS_DLSE=dlse is not None, HEAD_D=D, BLOCK_M=64)
    dq = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, KVH, Sk, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, KVH, Sk, D), dtype=v.dtype, device=q.device)
    dot_f32, prec = _dot_flags(q.dtype)
    common = dict(CAUSAL=causal, HEAD_D=D, DOT_F32=dot_f32, PREC=prec, HAS_DOC=doc_start is not None, **cfg)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    ds = _doc_arg(doc_start, delta)
    _attn_bwd_dkdv_kernel[(triton.cdiv(Sk, cfg["BLOCK_N"]), B * KVH)](
        q, k, v, dout, lse, delta, dk, dv, ds, *strides, H, KVH, H // KVH, Sq, Sk,
        q_offset, kv_offset, sm_scale * LOG2E, sm_scale, **common)
    _attn_bwd_dq_kernel[(triton.cdiv(Sq, cfg["BLOCK_M"]), B * H)](
        q, k, v, dout, lse, delta, dq, ds, *strides, H, H // KVH, Sq, Sk,
        q_offset, kv_offset, sm_scale * LOG2E, sm_scale, **common)
    return dq, dk, dv
