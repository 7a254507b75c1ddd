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


def tp_linears(layer: Layer, cfg: ParallelConfig) -> int:
    """The layer's column / row sharded linears and vocabulary-parallel embeddings under TP."""
    if cfg.tp == 1:
        return 0
    return sum(1 for l in layer.linears if l.role in TP_SPLIT_ROLES) + vocab_embeddings(layer)


def vocab_embeddings(layer: Layer) -> int:
    """The layer's embeddings that tensor parallelism shards over the vocabulary."""
    return sum(1 for o in layer.ops if o.kind == "embedding" and o.tp_style == "vocab")


def sp_norms(layer: Layer, cfg: ParallelConfig) -> int:
    """The layer's norms that sequence parallelism runs as ``SequenceParallel`` DTensor modules."""
    return sum(1 for o in layer.ops if o.kind == "norm") if cfg.tp > 1 and cfg.sp else 0


def prices_tp_sync(cluster: Cluster) -> bool:
    """Whether :func:`dtensor_dispatch_s` prices what TP's blocking collectives cost between compute
    beyond back to back (its linears' figure holds it, ``cost_models.cpu_runtime``), so that no
    calibrated per-call latency is added to them (``comm.collective_time``'s ``sync_priced``): on
    CPU clusters."""
    return cluster.backend == "gloo"


def prices_tp_shared_wait(cluster: Cluster, profile=None) -> bool:
    """Whether DTensor's figure also holds the wait of TP's collectives for peers descheduled on
    shared cores (``shared_cores.sync_wait_s``, which ``comm.collective_time`` then leaves out:
    its ``wait_priced``): where the linears' figure is the profile's own, measured on as many ranks
    as the cluster runs on its cores (its all-reduces waited for their peers as the plan's do; 2.08
    ms per linear at 4 ranks on 2 cores against 1.01 ms at 2, 2026-12-07), not the default, which
    was measured at one rank per core."""
    runtime = getattr(profile, "runtime", None) or {}
    return prices_tp_sync(cluster) and "dtensor_module_s" in runtime and cluster.nodes == 1 and \
        getattr(profile, "world", 0) == cluster.devices_per_node


def dtensor_dispatch_s(layer: Layer, cluster: Cluster, cfg: ParallelConfig, profile=None) -> tuple[float, float]:
    """(forward, backward) seconds per micro-batch of DTensor dispatch in ``layer`` under TP on
    a CPU cluster: per sharded linear (:func:`tp_linears`) ``cost_models.cpu_runtime``'s
    ``dtensor_module_s``, per sequence-parallel norm (:func:`sp_norms`) its ``dtensor_norm_s``
    (each a calibration's, else the profile's measured one, else the default), a third in the
    forward; nothing on GPUs, where it runs ahead of the kernels. ``compute.layer_time`` scales it
    by a calibration's ``compute_scale`` with the layer time (a CPU roofline calibration stores
    the scaled figures as ``dtensor_module_s`` and ``dtensor_norm_s``)."""
    if not prices_tp_sync(cluster):
        return 0.0, 0.0
    s = tp_linears(layer, cfg) * figure("dtensor_module_s", profile) + \
        sp_norms(layer, cfg) * figure("dtensor_norm_s", profile)
    return s / 3, 2 * s / 3
