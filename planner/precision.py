"""The precision rules a plan's ``dtype`` stands for (leaf contract: imports nothing of autopar).

The memory model (cost_models/memory.py), the time model (cost_models/estimate.py,
cost_models/dp_cost.py) and the runtime (codegen/runtime/precision.py) read these, so what a bf16
plan budgets is what the program holds and sends.
"""
from __future__ import annotations

DTYPES = ("bf16", "fp16", "fp32")  # a plan's compute dtype
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}  # bytes per element of each compute dtype


def default_dtype(backend: str) -> str:
    """The compute dtype of a plan whose request names none, by the cluster's ``backend``: bf16 on
    GPUs (nccl), fp32 on CPU ranks (gloo), whose matmuls run no faster in bf16. The profiler
    times layers in it too (cost_models/profiler.py), so a profile prices the plans it is for."""
    return "fp32" if backend == "gloo" else "bf16"


def mixed_precision(dtype: str) -> bool:
    """Whether a plan of compute ``dtype`` trains in mixed precision, as the runtime runs it
    (codegen/runtime/precision.py, FSDP2's ``MixedPrecisionPolicy`` on every layout): fp32
    parameters (the master weights the optimizer steps), gradients and optimizer states; the
    forward and backward on ``dtype`` copies of the parameters gathered per unit; gradients
    reduced and accumulated in fp32 (``GRAD_REDUCE_BYTES``); the loss in fp32."""
    return dtype != "fp32"


GRAD_REDUCE_BYTES = 4  # gradients are reduced and accumulated in fp32 under every dtype
MASTER_BYTES = 4       # the parameters the optimizer steps (fp32 master weights), per element
