"""Fused linear + cross-entropy (Triton, with a token-chunked torch fallback).

``loss = cross_entropy(x @ weight.T, target)`` without ever holding the [N x V] logits:

* forward: a Triton kernel tiles (tokens x vocabulary), recomputes each logit block from
  ``x`` and ``weight`` (fp32 accumulation over the hidden dim) and keeps an online
  log-sum-exp per token; programs split the vocabulary for parallelism and their partial
  LSEs are combined with ``logsumexp``. Only ``lse`` [N] and the target logit [N] leave it.
* backward: recomputes logit blocks for a chunk of tokens and writes the logit gradient
  ``G = grad_lse * softmax + grad_tgt * onehot`` for that chunk only (a transient
  ``chunk x V`` buffer, sized by ``bwd_chunk_bytes``), then ``dX = G @ W`` and
  ``dW += G^T @ X`` as dense matmuls; deterministic (no atomics). dW accumulates in fp32
  across chunks.

Layouts / dtypes: ``x`` [N, H], ``weight`` [V, H] (or this rank's vocab shard [V/tp, H]),
``target`` [N] int64, ``ignore_index`` marks tokens without a loss. fp16/bf16 on GPU, fp32
in tests; LSE and target logits are fp32, natural log.

Ops (namespace ``autopar``):
* ``linear_ce_fwd(x, weight, target, vocab_start, ignore_index, impl) -> (lse, tgt)``: per
  shard, ``lse`` = logsumexp over the shard's logits, ``tgt`` = the target's logit if the
  target lies in ``[vocab_start, vocab_start + V_shard)``, else 0. Differentiable.
* ``linear_ce_bwd(x, weight, target, lse, grad_lse, grad_tgt, vocab_start, ignore_index, impl)
  -> (dx_partial, dw)`` with ``G = grad_lse * exp(z - lse) + grad_tgt * onehot(target)``.

Vocab parallel (``group`` given): the wrapper combines the shards' LSE (all-reduce MAX +
SUM of exp) and target logits (SUM) over the group, and all-reduces dX (SUM) in the
backward; dW stays local. ``impl`` as in :mod:`codegen.kernels.attention`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .attention import HAS_TRITON, interpreting, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl


def _config() -> dict:
    if interpreting():
        return dict(BLOCK_T=64, BLOCK_V=128, BLOCK_H=64, num_warps=4, num_stages=1)
    return dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3)


def check_blocks(cfg: dict) -> None:
    for name in ("BLOCK_T", "BLOCK_V", "BLOCK_H"):
        b = cfg[name]
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b}: block sizes must be powers of two >= 16")


# --------------------------------------------------------------------------- kernels
if HAS_TRITON:

    @triton.jit
    def _logits_block(X, W, offs_t, offs_v, N, Hd, Vs, stride_xn, stride_xh, stride_wv, stride_wh,
                      BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                      DOT_F32: tl.constexpr, PREC: tl.constexpr):
        """z[t, v] = sum_h x[t, h] * w[v, h] for one (token block, vocab block), fp32."""
        z = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for h0 in range(0, Hd, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(X + offs_t[:, None] * stride_xn + offs_h[None, :] * stride_xh,
                        mask=(offs_t[:, None] < N) & (offs_h[None, :] < Hd), other=0.0)
            wt = tl.load(W + offs_v[None, :] * stride_wv + offs_h[:, None] * stride_wh,
                         mask=(offs_v[None, :] < Vs) & (offs_h[:, None] < Hd), other=0.0)
            if DOT_F32:
                x = x.to(tl.float32)
                wt = wt.to(tl.float32)
            z = tl.dot(x, wt, z, input_precision=PREC)
        return z

    @triton.jit
    def _ce_fwd_kernel(X, W, T, LSE_P, TGT_P, N, Hd, Vs, vocab_start, ignore_index, v_per_split,
                       stride_xn, stride_xh, stride_wv, stride_wh,
                       BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                       DOT_F32: tl.constexpr, PREC: tl.constexpr):
        """Program (i, s): tokens [i*BLOCK_T, +BLOCK_T) x vocab [s*v_per_split, +v_per_split).
        Writes the partial natural-log LSE and target logit to LSE_P/TGT_P [n_split, N]."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        split = tl.program_id(1)
        tgt = tl.load(T + offs_t, mask=offs_t < N, other=ignore_index)
        t_local = tgt - vocab_start                      # -1: no target in this shard
        t_local = tl.where((tgt == ignore_index) | (t_local < 0) | (t_local >= Vs), -1, t_local)
        m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_T], tl.float32)
        t_logit = tl.zeros([BLOCK_T], tl.float32)
        v_lo = split * v_per_split
        v_hi = tl.minimum(Vs, v_lo + v_per_split)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            z = _logits_block(X, W, offs_t, offs_v, N, Hd, Vs, stride_xn, stride_xh, stride_wv,
                              stride_wh, BLOCK_T, BLOCK_V, BLOCK_H, DOT_F32, PREC)
            z = tl.where(offs_v[None, :] < Vs, z, float("-inf"))
            t_logit += tl.sum(tl.where(offs_v[None, :] == t_local[:, None], z, 0.0), 1)
            z2 = z * 1.4426950408889634                               # base 2
            m_new = tl.maximum(m_i, tl.max(z2, 1))
            l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(z2 - m_new[:, None]), 1)
            m_i = m_new
        lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE_P + split * N + offs_t, lse, mask=offs_t < N)
        tl.store(TGT_P + split * N + offs_t, t_logit, mask=offs_t < N)

    @triton.jit
    def _ce_grad_logits_kernel(X, W, T, LSE, GA, GB, G, N, Hd, Vs, vocab_start, ignore_index,
                               stride_xn, stride_xh, stride_wv, stride_wh,
                               BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                               DOT_F32: tl.constexpr, PREC: tl.constexpr):
        """G[t, v] = GA[t] * exp(z[t, v] - LSE[t]) + GB[t] * [v == target_t - vocab_start]
        for one (token block, vocab block); G is a contiguous [N, Vs] chunk buffer."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        row_ok = offs_t < N
        z = _logits_block(X, W, offs_t, offs_v, N, Hd, Vs, stride_xn, stride_xh, stride_wv,
                          stride_wh, BLOCK_T, BLOCK_V, BLOCK_H, DOT_F32, PREC)
        lse = tl.load(LSE + offs_t, mask=row_ok, other=0.0)
        ga = tl.load(GA + offs_t, mask=row_ok, other=0.0)
        gb = tl.load(GB + offs_t, mask=row_ok, other=0.0)
        tgt = tl.load(T + offs_t, mask=row_ok, other=ignore_index)
        t_local = tgt - vocab_start                      # -1: no target in this shard
        t_local = tl.where((tgt == ignore_index) | (t_local < 0) | (t_local >= Vs), -1, t_local)
        g = ga[:, None] * tl.math.exp2((z - lse[:, None]) * 1.4426950408889634)
        g += tl.where(offs_v[None, :] == t_local[:, None], gb[:, None], 0.0)
        tl.store(G + offs_t[:, None] * Vs + offs_v[None, :], g.to(G.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_v[None, :] < Vs))


def _flags(dtype: torch.dtype):
    return interpreting() and dtype == torch.bfloat16, "ieee" if dtype == torch.float32 else "tf32"


def linear_ce_fwd_triton(x: Tensor, weight: Tensor, target: Tensor, vocab_start: int,
                         ignore_index: int, cfg: Optional[dict] = None):
    """Returns (lse [N] fp32, target logit [N] fp32) for this vocab shard."""
    cfg = dict(cfg or _config())
    check_blocks(cfg)
    N, Hd = x.shape
    Vs = weight.shape[0]
    n_tblk, n_vblk = triton.cdiv(N, cfg["BLOCK_T"]), triton.cdiv(Vs, cfg["BLOCK_V"])
    if interpreting():
        want = 2 * n_tblk                          # exercise the split combine in tests
    else:
        want = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    n_split = max(1, min(n_vblk, triton.cdiv(want, n_tblk)))
    v_per_split = triton.cdiv(n_vblk, n_split) * cfg["BLOCK_V"]
    n_split = triton.cdiv(Vs, v_per_split)
    lse_p = torch.empty((n_split, N), dtype=torch.float32, device=x.device)
    tgt_p = torch.empty_like(lse_p)
    dot_f32, prec = _flags(x.dtype)
    _ce_fwd_kernel[(n_tblk, n_split)](x, weight, target, lse_p, tgt_p, N, Hd, Vs, vocab_start,
                                      ignore_index, v_per_split, *x.stride(), *weight.stride(),
                                      DOT_F32=dot_f32, PREC=prec, **cfg)
    if n_split == 1:
        return lse_p.view(N), tgt_p.view(N)
    return torch.logsumexp(lse_p, dim=0), tgt_p.sum(0)


def linear_ce_bwd_triton(x, weight, target, lse, grad_lse, grad_tgt, vocab_start, ignore_index,
                         cfg: Optional[dict] = None, bwd_chunk_bytes: Optional[int] = None):
    """Returns (dx [N, H] x.dtype, dw [Vs, H] weight.dtype); logit-gradient chunks of at most
    ``bwd_chunk_bytes`` (default 1 GiB on GPU, 4 MiB under the interpreter)."""
    cfg = dict(cfg or _config())
    check_blocks(cfg)
    N, Hd = x.shape
    Vs = weight.shape[0]
    if bwd_chunk_bytes is None:
        bwd_chunk_bytes = (4 << 20) if interpreting() else (1 << 30)
    chunk = max(cfg["BLOCK_T"], bwd_chunk_bytes // (Vs * x.element_size()) // cfg["BLOCK_T"] * cfg["BLOCK_T"])
    chunk = min(chunk, N)
    g_buf = torch.empty((chunk, Vs), dtype=x.dtype, device=x.device)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    single = chunk >= N
    dw = None if single else torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    ga, gb = grad_lse.float().contiguous(), grad_tgt.float().contiguous()
    lse = lse.float().contiguous()
    dot_f32, prec = _flags(x.dtype)
    for r0 in range(0, N, chunk):
        r1 = min(N, r0 + chunk)
        xc, g = x[r0:r1], g_buf[: r1 - r0]
        grid = (triton.cdiv(r1 - r0, cfg["BLOCK_T"]), triton.cdiv(Vs, cfg["BLOCK_V"]))
        _ce_grad_logits_kernel[grid](xc, weight, target[r0:r1], lse[r0:r1], ga[r0:r1], gb[r0:r1], g,
                                     r1 - r0, Hd, Vs, vocab_start, ignore_index, *xc.stride(),
                                     *weight.stride(), DOT_F32=dot_f32, PREC=prec, **cfg)
        torch.mm(g, weight, out=dx[r0:r1])
        if single:
            return dx, torch.mm(g.t(), xc).to(weight.dtype)
        dw += torch.mm(g.t(), xc).float()
    return dx, dw.to(weight.dtype)


# --------------------------------------------------------------------------- torch fallback
_FALLBACK_CHUNK_ELEMS = 1 << 24  # fp32 logits per token chunk (64 MiB)


def _rows(N: int, Vs: int):
    step = max(1, _FALLBACK_CHUNK_ELEMS // max(Vs, 1))
    return [slice(r0, min(N, r0 + step)) for r0 in range(0, N, step)]


def _local_target(target: Tensor, Vs: int, vocab_start: int, ignore_index: int):
    t = target - vocab_start
    hit = (target != ignore_index) & (t >= 0) & (t < Vs)
    return t.clamp(0, max(Vs - 1, 0)), hit


def linear_ce_fwd_torch(x, weight, target, vocab_start, ignore_index):
    N, Vs = x.shape[0], weight.shape[0]
    lse = torch.empty(N, dtype=torch.float32, device=x.device)
    tgt = torch.empty(N, dtype=torch.float32, device=x.device)
    t, hit = _local_target(target, Vs, vocab_start, ignore_index)
    w = weight.float()
    for r in _rows(N, Vs):
        z = x[r].float() @ w.t()
        lse[r] = torch.logsumexp(z, dim=-1)
        tgt[r] = torch.where(hit[r], z.gather(1, t[r, None]).squeeze(1), 0.0)
    return lse, tgt


def linear_ce_bwd_torch(x, weight, target, lse, grad_lse, grad_tgt, vocab_start, ignore_index):
    N, Vs = x.shape[0], weight.shape[0]
    t, hit = _local_target(target, Vs, vocab_start, ignore_index)
    w = weight.float()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    for r in _rows(N, Vs):
        xc = x[r].float()
        g = grad_lse[r].float()[:, None] * torch.exp(xc @ w.t() - lse[r].float()[:, None])
        g.scatter_add_(1, t[r, None], torch.where(hit[r], grad_tgt[r].float(), 0.0)[:, None])
        dx[r] = (g @ w).to(x.dtype)
        dw += g.t() @ xc
    return dx, dw.to(weight.dtype)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("autopar::linear_ce_fwd", mutates_args=())
def linear_ce_fwd(x: Tensor, weight: Tensor, target: Tensor, vocab_start: int = 0,
                  ignore_index: int = -100, impl: str = "auto") -> tuple[Tensor, Tensor]:
    if use_triton(impl, x.device):
        return linear_ce_fwd_triton(x, weight, target, vocab_start, ignore_index)
    return linear_ce_fwd_torch(x, weight, target, vocab_start, ignore_index)


@linear_ce_fwd.register_fake
def _(x, weight, target, vocab_start=0, ignore_index=-100, impl="auto"):
    n = x.shape[0]
    return x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


@torch.library.custom_op("autopar::linear_ce_bwd", mutates_args=())
def linear_ce_bwd(x: Tensor, weight: Tensor, target: Tensor, lse: Tensor, grad_lse: Tensor,
                  grad_tgt: Tensor, vocab_start: int = 0, ignore_index: int = -100,
                  impl: str = "auto") -> tuple[Tensor, Tensor]:
    if use_triton(impl, x.device):
        return linear_ce_bwd_triton(x, weight, target, lse, grad_lse, grad_tgt, vocab_start, ignore_index)
    return linear_ce_bwd_torch(x, weight, target, lse, grad_lse, grad_tgt, vocab_start, ignore_index)


@linear_ce_bwd.register_fake
def _(x, weight, target, lse, grad_lse, grad_tgt, vocab_start=0, ignore_index=-100, impl="auto"):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _fwd_setup(ctx, inputs, output):
    x, weight, target, vocab_start, ignore_index, impl = inputs
    ctx.save_for_backward(x, weight, target, output[0])
    ctx.args = (vocab_start, ignore_index, impl)


def _fwd_backward(ctx, grad_lse, grad_tgt):
    x, weight, target, lse = ctx.saved_tensors
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    grad_tgt = torch.zeros_like(lse) if grad_tgt is None else grad_tgt
    dx, dw = linear_ce_bwd(x, weight, target, lse, grad_lse, grad_tgt, *ctx.args)
    return dx, dw, None, None, None, None


linear_ce_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# --------------------------------------------------------------------------- vocab parallel glue
class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient: dX partials of the shards."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _LogSumExpOverGroup(torch.autograd.Function):
    """Global LSE from the shards' LSEs; the gradient stays local (loss is replicated)."""

    @staticmethod
    def forward(ctx, lse, group):
        m = lse.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.exp(lse - m)
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        out = m + torch.log(s)
        ctx.save_for_backward(lse, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        lse, out = ctx.saved_tensors
        return grad * torch.exp(lse - out), None


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --------------------------------------------------------------------------- public wrapper
def fused_linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, *, ignore_index: int = -100,
                               reduction: str = "mean", group=None, impl: str = "auto") -> Tensor:
    """Cross-entropy of ``x @ weight.T`` against ``target`` without materialising logits.

    x [N, H]; weight [V, H], or with ``group`` (the tp ProcessGroup) this rank's shard
    [V/tp, H] starting at ``rank_in_group * V_shard``; target [N] int64 (same on all ranks).
    reduction: "mean" (over non-ignored tokens; 0 if there are none), "sum" or "none"
    ([N] fp32, 0 at ignored tokens). Returns fp32. Differentiable in x and weight."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or target.shape != x.shape[:1]:
        raise ValueError(f"expected x [N,H], weight [V,H], target [N]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(target.shape)}")
    vocab_start = 0
    if group is not None:
        vocab_start = dist.get_rank(group) * weight.shape[0]
        x = _CopyToGroup.apply(x, group)
    lse, tgt = linear_ce_fwd(x, weight, target, vocab_start, ignore_index, impl)
    if group is not None:
        lse = _LogSumExpOverGroup.apply(lse, group)
        tgt = _SumOverGroup.apply(tgt, group)
    valid = target != ignore_index
    loss = torch.where(valid, lse - tgt, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)
