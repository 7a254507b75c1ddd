"""Mixed precision as the plan says it (``ParallelConfig.dtype``; the rule is
``planner.precision.mixed_precision``, which the memory and time models read too).

Under a mixed plan (bf16) every layout runs FSDP2's machinery with one
``MixedPrecisionPolicy``: the parameters stay fp32 (the master weights the optimizer
steps, sharded or replicated as the plan's ``zero`` says), each unit's parameters are cast
(gathered, under FSDP / ZeRO-2) to the compute dtype for its forward and backward, and its
gradients are cast back to fp32 before they are reduced and accumulated. DDP's reducer,
which casts nothing, serves fp32 plans only (``planner.sharding.uses_ddp_reducer``), and a plan
with one data-parallel rank is wrapped too (``replicate`` on one rank: the casts without
communication). The loss is computed in fp32 from the head's compute-dtype logits (the
models' and autopar's losses upcast them); norms run as the model writes them (transformers'
RMSNorm upcasts; torch's layer norm accumulates in fp32).

fp32 plans run exactly as before: no policy, no casts.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from planner.precision import mixed_precision

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # by planner.precision.DTYPES


def compute_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a plan's compute ``dtype`` ("bf16", "fp16", "fp32")."""
    return COMPUTE_DTYPES[dtype]


def mp_policy(dtype: str) -> MixedPrecisionPolicy:
    """The FSDP2 / ``replicate`` policy of a plan's ``dtype``: compute-dtype parameters and fp32
    gradient reduction under mixed precision, no casts at all in fp32."""
    if not mixed_precision(dtype):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(dtype), reduce_dtype=torch.float32)
