"""DTensor's own work under tensor parallelism on CPUs: what each sharded module costs per
micro-batch beyond its arithmetic (sharding propagation, wrapping and unwrapping local
tensors, the conversions' autograd nodes), and the whole-table gradient of a vocabulary-parallel
embedding's backward. On GPUs the first runs ahead of the kernels and is free; the second is
unmeasured there (0).

The vocabulary-parallel embedding: DTensor's sharding rule for ``embedding_dense_backward`` (torch
2.13, ``torch/distributed/tensor/_ops/_embedding_ops.py``) has no strategy that yields the weight
gradient sharded by rows (only by columns, or partial), so every tp rank builds the gradient of the
WHOLE table (a zero-filled [vocab, hidden] tensor and the index-add into it) and copies its own
vocab/tp rows out of it, where the profiler's local shard (cost_models/profile_runtime.py) works on its
vocab/tp rows alone. Seen in a torch.profiler trace of gpt-small dp2 tp2 sp on local-cpu:4 (quiet
box): every rank fills a [50257, 768] tensor each micro-batch and copies a [25129, 768] one.
Priced per element of the whole table (:func:`vocab_table_elements`) at a figure the profiler
measures (``cost_models.profile_runtime``; cost_models/cpu_runtime.py ``vocab_grad_s``).
"""
from __future__ import annotations

from cost_models.cluster import Cluster
from planner.graph import TP_SPLIT_ROLES, Layer
from planner.plan import ParallelConfig

# DTensor tensor parallelism on a CPU adds its own dispatch (sharding propagation, wrapping and
# unwrapping of local tensors, autograd nodes of the conversions) to every module it shards:
# 1.15 ms per sharded module per micro-batch, forward and backward together, measured with
# torch 2.13 on a 2-core Xeon (2 gloo ranks, 16 column + row linear pairs of 32 x 64 on 16
# tokens: 45.2 ms fwd+bwd under ColwiseParallel / RowwiseParallel, 0.84 ms as plain local
# shards, 7.7 ms of that the 32 all-reduces alone). A third of it in the forward.
CPU_DTENSOR_MODULE_S = 1.15e-3
# The vocabulary-parallel embedding's backward on DTensor over the rank's local shard, per element of
# the whole table and micro-batch, tp 2 groups of gloo ranks on the 2-core Xeon, torch 2.13, [4, 64]
# ids: 4 ranks, load average 2-6, [50257, 768] +137 / +170 / +118 ms, [32000, 1024] +105 ms (these
# four with the forward's output all-reduce in them): 3.5 / 4.4 / 3.1 / 3.2e-9 s; the profiler's own
# measurement (cost_models/profile_runtime.py, [16384, 512]) 5.3e-9 (2 ranks, load 5), 8.1e-9 (4 ranks,
# load 5), 4.6e-9 s (4 ranks, other jobs paused): the median of the seven.
CPU_DTENSOR_VOCAB_EL_S = 4.4e-9


def tp_modules(layer: Layer, cfg: ParallelConfig) -> int:
    """Modules of ``layer`` that tensor parallelism turns into DTensor modules: its sharded
    linears and vocabulary embeddings, and with sequence parallel its norms (0 without TP)."""
    if cfg.tp == 1:
        return 0
    n = sum(1 for l in layer.linears if l.role in TP_SPLIT_ROLES)
    n += sum(1 for o in layer.ops if o.kind == "embedding" and o.tp_style == "vocab")
    return n + (sum(1 for o in layer.ops if o.kind == "norm") if cfg.sp else 0)


def dtensor_dispatch_s(layer: Layer, cluster: Cluster, cfg: ParallelConfig,
                       cal: dict[str, float] | None = None) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of DTensor dispatch in ``layer`` under TP on
    a CPU cluster (``CPU_DTENSOR_MODULE_S`` per sharded module, :func:`tp_modules`); nothing
    on GPUs, where it runs ahead of the kernels. ``compute_scale`` (calibration) scales it
    with the layer time; a CPU roofline calibration stores the scaled figure as
    ``dtensor_module_s``."""
    if cluster.backend != "gloo":
        return 0.0, 0.0
    s = tp_modules(layer, cfg) * (cal or {}).get("dtensor_module_s", CPU_DTENSOR_MODULE_S)
    return s / 3, 2 * s / 3


def vocab_table_elements(layer: Layer, cfg: ParallelConfig) -> int:
    """Elements of the whole tables of ``layer``'s vocabulary-parallel embeddings, whose gradient
    DTensor builds whole on every tp rank (module docstring); 0 without TP."""
    if cfg.tp == 1:
        return 0
    return sum(o.params for o in layer.ops if o.kind == "embedding" and o.tp_style == "vocab")
