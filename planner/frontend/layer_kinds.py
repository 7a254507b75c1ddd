"""What a captured layer and its parts are: attention, MLP, norm, embedding, head, loss.

Read from the ATen ops a part ran and the modules it holds (capture records both); the
kinds drive how tensor parallelism is priced and which layers are blocks.
"""
from __future__ import annotations

import torch.nn as nn

from codegen.runtime.torch_compat import FUSED_ATTENTION_OPS, LOG_SOFTMAX_OPS, NORM_OPS, SOFTMAX_OPS, op_argument_names
from planner.graph import AttentionDims

ATTN_OPS = FUSED_ATTENTION_OPS | {"flash_attn_fwd"}  # torch's kernels and autopar's own
LOSS_OPS = LOG_SOFTMAX_OPS | {"nll_loss_forward", "nll_loss2d_forward", "cross_entropy_loss", "linear_ce_fwd"}


def part_kind(part, module: nn.Module | None, vocab: int | None) -> tuple[str, str]:
    ops = part.ops
    mods = list(module.modules()) if module is not None else []
    if ops & ATTN_OPS or ops & SOFTMAX_OPS and "bmm" in ops:
        return "attention", "heads"
    if "embedding" in ops:
        return "embedding", "vocab" if module is not None and any(
            isinstance(m, nn.Embedding) and m.num_embeddings == vocab for m in mods) else "replicated"
    if ops & LOSS_OPS and not part.linears:
        return "loss", "vocab"
    if any(callable(getattr(m, "moe_shape", None)) for m in mods):
        return "mlp", "replicated"  # a MoE layer: not tensor-parallel, each tp rank runs its sequence shard
    if len(part.linears) >= 2:
        return "mlp", "col_row"
    if len(part.linears) == 1:
        _, lin = part.linears[0]
        out_f = lin_dims(lin)[1]
        return ("linear", "vocab") if vocab and out_f == vocab else ("linear", "replicated")
    if ops & NORM_OPS or (module is not None and "norm" in type(module).__name__.lower()):
        return "norm", "replicated"
    return "other", "replicated"


def kernel_causal(func, args: tuple, kwargs: dict, module: nn.Module | None) -> bool:
    """Whether an attention kernel call (``ATTN_OPS``) computes causal attention: its own
    ``is_causal`` argument (read by name from the ATen schema: its position differs between the
    kernels), or, when it was handed an explicit mask, the ``is_causal`` attribute of the
    attention module running it (``module``: the part, searched with its submodules).
    transformers passes an explicit causal mask under the capture's fake tensors (its packed-
    sequence check cannot read fake position ids) where a real run passes ``is_causal=True``;
    the attribute is what it builds that mask from and what autopar's runtime runs its
    attention by (codegen/runtime/adapters/hf_stage.py, ``autopar_attention``)."""
    bound = dict(zip(op_argument_names(func), args), **kwargs)
    if bound.get("is_causal"):
        return True
    if bound.get("attn_mask", bound.get("attn_bias")) is None or module is None:
        return False
    return next((m.is_causal for m in module.modules() if isinstance(getattr(m, "is_causal", None), bool)), False)


def lin_dims(m: nn.Module) -> tuple[int, int]:
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    w = m.weight  # HF Conv1D stores [in, out]
    return int(w.shape[0]), int(w.shape[1])


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
                                        and m.weight.dim() == 2)


def layer_kind(name: str, parts: dict[str, tuple[str, str]], first: bool, attn: AttentionDims | None) -> str:
    kinds = {k for k, _ in parts.values()}
    visual = any(w in name.lower() for w in ("vision", "visual", "image", "vit", "patch"))
    if "attention" in kinds:
        return "vision_block" if visual or (attn is not None and not attn.causal and visual) else "transformer_block"
    if "embedding" in kinds:
        return "embedding"
    if visual and first:
        return "vision_embedding"
    if "linear" in kinds and any(s == "vocab" for _, s in parts.values()):
        return "head"
    if "loss" in kinds:
        return "loss"
    if "mlp" in kinds or "linear" in kinds:
        return "projector" if "proj" in name.lower() or "mlp" in kinds else "other"
    if kinds <= {"norm", "other"} and "norm" in kinds:
        return "norm"
    return "other"
