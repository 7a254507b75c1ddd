"""The primitives the runtime and every model it runs are built on: attention and expert routing.

Attention. Every attention of autopar's reference models goes through a :class:`SelfAttention`
module's ``attn_impl`` (``None``: :func:`sdpa_attention`); the runtime installs its kernels (flash
attention, ring attention for context parallelism, selective recompute) by setting that attribute
on the model's own modules, so two models in one process never see each other's choice and nothing
process-wide is patched. Other models' attention reaches the same implementations through their
adapters (``codegen/runtime/adapters``).

Layouts (no units; shapes only) of an :data:`AttentionImpl` ``fn(q, k, v, *, causal, scale=None)``:
- ``q``: ``[B, H, S, D]``; ``k``, ``v``: ``[B, Hkv, Skv, D]`` with ``H % Hkv == 0``
  (grouped-query attention when ``Hkv < H``; query head ``h`` reads kv head
  ``h // (H // Hkv)``, the ``repeat_interleave`` convention).
- ``out``: ``[B, H, S, D]``.
- ``causal=True`` masks top-left aligned: query ``i`` sees keys ``j <= i`` (as SDPA's
  ``is_causal``). ``scale`` is the softmax scale, ``1/sqrt(D)`` when None.

:class:`SelfAttention` reshapes with the LOCAL head count (``view(B, S, -1, D)``) so a
tensor-parallel runtime may shard ``q_proj``/``k_proj``/``v_proj`` by output features
(heads) and ``o_proj`` by input features without changing the forward.

Routing. :func:`run_routed` sends tokens through their chosen experts (the zoo's MoE layer and
transformers' experts, through ``codegen/runtime/adapters/hf_experts.py``, both route through it);
:func:`grouped_swiglu` runs each expert's SwiGLU on its contiguous rows.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import AutoparError

AttentionImpl = Callable[..., torch.Tensor]
"""``fn(q, k, v, *, causal: bool, scale: float | None = None) -> out`` with the layouts above."""

_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                   scale: Optional[float] = None) -> torch.Tensor:
    """Default implementation: ``torch.nn.functional.scaled_dot_product_attention``.

    Uses ``enable_gqa=True`` (torch >= 2.5); on older torch, k/v heads are repeated.
    """
    if k.shape[1] != q.shape[1]:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scale: Optional[float] = None) -> torch.Tensor:
    """Explicit softmax(QK^T * scale) V in float32; slow, for tests and debugging."""
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s, skv = q.shape[-2], k.shape[-2]
        mask = torch.ones(s, skv, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ vf).to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              impl: Optional[AttentionImpl] = None) -> torch.Tensor:
    """Attention through ``impl`` (default :func:`sdpa_attention`), layouts checked."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AutoparError(f"attention expects 4-d [B, H, S, D] tensors, got q {tuple(q.shape)}, "
                           f"k {tuple(k.shape)}; reshape before calling")
    if q.shape[1] % k.shape[1] != 0:
        raise AutoparError(f"attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads; "
                           "shard q and k/v heads consistently")
    return (impl or sdpa_attention)(q, k, v, causal=causal)


# --------------------------------------------------------------------------- RoPE

def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for rotary embeddings, computed in float32 from integer ``positions``.

    ``positions``: ``[S]`` or ``[B, S]`` token indices (global indices under context
    parallelism). Returns cos, sin broadcastable against ``[B, H, S, head_dim]``:
    ``[1, 1, S, D]`` or ``[B, 1, S, D]``. Frequencies ``theta ** (-2i / D)``,
    rotate-half convention (first and second half of the head dim paired).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [.., S, D/2]
    emb = torch.cat((angles, angles), dim=-1)
    emb = emb[None, None] if positions.dim() == 1 else emb[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, S, D] by the angles in cos/sin (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def patchify(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """Images [B, C, H, W] -> patches [B, (H/p)*(W/p), C*p*p], in row-major order (a ViT's input)."""
    b, c, h, w = pixel_values.shape
    x = pixel_values.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


# --------------------------------------------------------------------------- module

class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``.

    ``rope_theta`` set -> rotary position embeddings from ``positions`` (default
    ``arange(S)``); ``None`` -> no positional term (learned positions live elsewhere).
    Input and output ``[B, S, hidden]``.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, bias: bool, causal: bool,
                 rope_theta: Optional[float] = None):
        super().__init__()
        self.head_dim = hidden // heads
        self.causal = causal
        self.rope_theta = rope_theta
        kv_dim = kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=bias)
        self.attn_impl: Optional[AttentionImpl] = None  # set by the runtime on this instance

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, d).transpose(1, 2)
        if self.rope_theta is not None:
            if positions is None:
                positions = torch.arange(s, device=x.device)
            cos, sin = rope_cos_sin(positions, d, self.rope_theta, q.dtype)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        out = attention(q, k, v, causal=self.causal, impl=self.attn_impl)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


# --------------------------------------------------------------------------- routing

def grouped_swiglu(x: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert on its contiguous rows of ``x`` [sum(counts), hidden]."""
    # split / unbind, not x[a:b] / w[e]: their backward is one concatenation / stack, where each
    # slice's or index's would write a full-size gradient (experts^2 x weights of traffic); an
    # expert without rows still runs (0 rows): its weights get zero gradients
    outs = [(F.silu(rows @ g) * (rows @ u)) @ d
            for rows, g, u, d in zip(x.split(counts), w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0))]
    return torch.cat(outs)


def run_routed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: int, run: Callable,
               static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``x`` [T, hidden] through their chosen experts ``ids`` [T, k], weighted by
    ``weights`` [T, k]: the (token, choice) pairs sorted by expert, ``run(rows, split)`` on the
    contiguous rows of each (``split[e]`` rows for expert e), each output times its weight and
    added back onto its token. ``static`` (capture on fake tensors, where counts do not exist):
    the balanced load, ``ceil(T k / experts)`` rows each. Returns (output [T, hidden], tokens
    per expert [experts]). """
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // ids.shape[-1]
    rows = x[token]
    counts = torch.zeros(experts, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    if static:
        per = math.ceil(rows.shape[0] / experts)
        split = [per] * experts
        rows = F.pad(rows, (0, 0, 0, per * experts - rows.shape[0]))
    else:
        split = counts.tolist()
    out = run(rows, split)[:token.shape[0]]
    out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype)), counts
