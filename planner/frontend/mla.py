"""Attention whose value heads are narrower than its query/key heads, as a fused kernel runs it.

Multi-head latent attention (DeepSeek-V2/V3, MLA) attends with query/key heads of
``qk_nope + qk_rope`` = 192 features but value heads of 128. On the GPU, SDPA's
memory-efficient kernel (and FlashAttention-3) take the two sizes as they are, and
transformers pads the values to the query size for FlashAttention-2; on the capture's fake
CPU tensors SDPA has no fused kernel for unequal sizes and falls back to its math path,
which materialises and saves the ``heads x seq x seq`` scores (11 GiB per DeepSeek-V3 block
at 4096 tokens) and hides the attention from the capture (no attention op: no
``AttentionDims``, the block's hidden size guessed wrong).

:class:`EqualHeadAttention`, active only inside ``planner.frontend.trace.capture_fx``, runs
such a call as the fused kernel it stands for: values zero-padded to the query head size,
the output cut back. The softmax scale is the query's either way (SDPA's default reads the
query head size), so the result is unchanged; the FLOPs counted are those of the padded
kernel, as transformers' FlashAttention-2 path runs it.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class EqualHeadAttention(TorchFunctionMode):
    """A torch-function mode: ``F.scaled_dot_product_attention(q, k, v, ...)`` with
    ``v.shape[-1] < q.shape[-1]`` runs on values padded to ``q.shape[-1]`` (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            if v.shape[-1] < q.shape[-1]:
                v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
                return func(q, k, v, *args[3:], **kwargs)[..., :args[2].shape[-1]]
        return func(*args, **kwargs)

