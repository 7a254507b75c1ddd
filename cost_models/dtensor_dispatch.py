"""DTensor's own work under tensor parallelism on CPUs: what each sharded module costs per
micro-batch beyond its arithmetic (sharding propagation, wrapping and unwrapping local
tensors, the conversions' autograd nodes). On GPUs it runs ahead of the kernels and is free.

The vocabulary-parallel embedding's backward works on the rank's own rows
(codegen/runtime/tensor_parallel.py ``VocabParallelEmbedding``), as the profiler's local shard
does (cost_models/profiler.py), so its arithmetic is in the layer times and nothing is added here.
Not priced: an embedding class with its own forward (Gemma's scaled lookup) keeps torch's
``RowwiseParallel``, whose backward builds the whole table's gradient on every tp rank (gpt-small's
tied embedding, head and loss, dp2 x tp2 on 4 CPU ranks: 1876 ms a forward + backward that way,
1558 ms with the local lookup, 2026-12-03, load 4.8-6.1).
"""
from __future__ import annotations

from cost_models.cluster import Cluster
from cost_models.cpu_runtime import figure
from planner.graph import TP_SPLIT_ROLES, Layer
from planner.plan import ParallelConfig


def tp_modules(layer: Layer, cfg: ParallelConfig) -> int:
    """Modules of ``layer`` that tensor parallelism turns into DTensor modules: its sharded
    linears and vocabulary embeddings, and with sequence parallel its norms (0 without TP)."""
    if cfg.tp == 1:
        return 0
    n = sum(1 for l in layer.linears if l.role in TP_SPLIT_ROLES)
    n += sum(1 for o in layer.ops if o.kind == "embedding" and o.tp_style == "vocab")
    return n + (sum(1 for o in layer.ops if o.kind == "norm") if cfg.sp else 0)


def dtensor_dispatch_s(layer: Layer, cluster: Cluster, cfg: ParallelConfig, profile=None) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of DTensor dispatch in ``layer`` under TP on
    a CPU cluster: the per-module figure (``cost_models.cpu_runtime``'s ``dtensor_module_s``: a
    calibration's, else the profile's measured one, else ``CPU_DTENSOR_MODULE_S``) per sharded
    module (:func:`tp_modules`), a third in the forward; nothing on GPUs, where it runs ahead of
    the kernels. ``compute.layer_time`` scales it by a calibration's ``compute_scale`` with the
    layer time (a CPU roofline calibration stores the scaled figure as ``dtensor_module_s``)."""
    if cluster.backend != "gloo":
        return 0.0, 0.0
    s = tp_modules(layer, cfg) * figure("dtensor_module_s", profile)
    return s / 3, 2 * s / 3
