"""Data-parallel rules (leaf contract: imports nothing of autopar but the precision rules): the
sharding modes, how the runtime wraps a stage for each, and when FSDP shards module by module.

codegen/runtime/data_parallel.py applies them; the memory model (cost_models/memory.py), the
time model (cost_models/dp_cost.py) and the CPU runtime terms (cost_models/cpu_runtime.py)
price what they say.
"""
from __future__ import annotations

from planner.precision import mixed_precision

ZERO = ("ddp", "zero1", "zero2", "fsdp")      # DP sharding modes (codegen/runtime/data_parallel.py)
SHARDED_PARAMS = ("zero2", "fsdp")            # the ZERO modes that shard parameters over dp; ddp, zero1 replicate them
DDP_BUCKET_BYTES = 25 * 2**20                  # gradient bucket of DDP's reducer (its default 25 MiB)


def zero1_buckets(owned_bytes: list[list[int]]) -> list[list[list[int]]]:
    """How ZeRO-1's owners send their updated parameters (codegen/runtime/data_parallel.py
    ``ShardedOptimizer``), as indices into each owner's list of parameter sizes (bytes): each
    owner's parameters, in order, packed into buckets of at most ``DDP_BUCKET_BYTES`` (a larger
    parameter is a bucket of its own), one broadcast per bucket. One call per parameter would
    pay a blocking collective's latency (and, on shared CPU cores, a scheduler slice) each."""
    out = []
    for sizes in owned_bytes:
        buckets: list[list[int]] = []
        filled = DDP_BUCKET_BYTES
        for i, b in enumerate(sizes):
            if filled + b > DDP_BUCKET_BYTES:
                buckets.append([])
                filled = 0
            buckets[-1].append(i)
            filled += b
        out.append(buckets)
    return out


def zero1_broadcasts(param_bytes: float, dp_group: int) -> int:
    """Broadcasts per step of :func:`zero1_buckets` for ``param_bytes`` split about evenly over
    ``dp_group`` owners: ``dp_group x ceil(param_bytes / dp_group / DDP_BUCKET_BYTES)``."""
    per_owner = param_bytes / max(dp_group, 1)
    return max(dp_group, 1) * max(1, -(-int(per_owner) // DDP_BUCKET_BYTES))


FSDP_UNIT_PARAMS = 10**9  # a block holding more parameters (per rank, unsharded) is sharded module by module


def fsdp_per_module(block_params: float) -> bool:
    """Whether FSDP shards a block module by module (each module holding at least
    ``FSDP_MODULE_SHARE`` of the block's parameters its own unit, gathered alone) instead of
    as one unit: when the block holds more than ``FSDP_UNIT_PARAMS`` parameters on a rank.
    Gathering a block of 5 billion parameters at once (a 530B dense model's) needs 20 GB
    for it and its gradients, twice with the prefetch; DeepSpeed's ZeRO-3 bounds what it
    holds gathered the same way (``stage3_max_live_parameters``, 1e9 by default). The
    runtime (codegen/runtime/data_parallel.py) and the memory model both ask this."""
    return block_params > FSDP_UNIT_PARAMS


FSDP_MODULE_SHARE = 0.01  # under fsdp_per_module, smaller modules (norms) stay in the block's own unit


def uses_ddp_reducer(zero: str, pp: int, tp: int, dtype: str = "fp32") -> bool:
    """Whether the runtime reduces gradients with DDP's bucketed reducer (replicated parameters,
    no pipeline schedule, plain tensors: no TP, full precision) rather than FSDP2-style
    ``replicate``; the cost model prices the gradient all-reduce per bucket for it
    (codegen/runtime/data_parallel.py). Mixed precision always runs FSDP2's machinery (its
    ``MixedPrecisionPolicy`` casts the parameters per unit and reduces in fp32)."""
    return zero in ("ddp", "zero1") and pp == 1 and tp == 1 and not mixed_precision(dtype)


DP_WRAPPERS = ("none", "ddp-reducer", "replicate", "fully_shard")  # codegen/runtime/data_parallel.py applies each


def dp_wrapper(zero: str, pp: int, tp: int, dp_group: int, dtype: str) -> str:
    """How the runtime wraps a stage for data parallelism (``DP_WRAPPERS``) over ``dp_group``
    (dp x cp) ranks: ``fully_shard`` for the sharding modes (``SHARDED_PARAMS``), DDP's
    reducer where :func:`uses_ddp_reducer`, else FSDP2's ``replicate``. On one rank nothing,
    unless the plan is mixed precision: then ``fully_shard`` on that one rank, which casts each
    unit's parameters for its forward and backward and frees them after (what ``replicate``
    would hold for the whole step)."""
    if dp_group == 1:
        return "fully_shard" if mixed_precision(dtype) else "none"
    if zero in SHARDED_PARAMS:
        return "fully_shard"
    return "ddp-reducer" if uses_ddp_reducer(zero, pp, tp, dtype) else "replicate"


def reshard_after_forward(zero: str, pp: int, dp_group: int) -> bool:
    """Whether ``fully_shard`` frees a unit's gathered (cast) parameters after its forward and
    gathers them again for its backward: under ``fsdp`` (and on one mixed-precision rank)
    without a pipeline; ``zero2`` and pipelines keep them from forward to backward (pipeline
    micro-batches reuse them)."""
    return pp == 1 and (zero == "fsdp" or dp_group == 1)


HIERARCHICAL_WRAPPERS = ("fully_shard", "ddp-reducer")  # the wrappers that run DP across cluster groups hierarchically


def dp_replicas(wrapper: str, dp: int, spanned: int) -> int:
    """Cluster groups a data-parallel group (dp x cp ranks, ``dp`` the plan's dp degree) is
    replicated across, when it spans ``spanned`` cluster groups (regions joined by a WAN; ranks
    fill the groups in order, so each holds ``dp / spanned`` consecutive dp ranks with their cp
    ranks): ``spanned`` when the ``wrapper`` (:func:`dp_wrapper`) runs hierarchically and
    ``spanned`` divides ``dp``, else 1 (flat).
    Hierarchical: ``fully_shard`` over a 2-D (replicate across groups, shard inside one) mesh
    (HSDP: states sharded over the ``dp_group / spanned`` ranks of a group, gradients
    reduce-scattered inside it then all-reduced across); DDP's reducer with a hook that
    reduce-scatters each bucket inside the group, all-reduces the shard across and all-gathers
    it back. FSDP2's ``replicate`` takes only a 1-D mesh: it stays flat. The runtime
    (codegen/runtime/data_parallel.py), the memory model (:func:`shard_ranks`) and the time
    model (cost_models/dp_cost.py) all ask this."""
    if spanned <= 1 or wrapper not in HIERARCHICAL_WRAPPERS or dp % spanned:
        return 1
    return spanned


def shard_ranks(dp_group: int, replicas: int) -> int:
    """Ranks that shard the model states of a data-parallel group of ``dp_group`` ranks
    replicated across ``replicas`` cluster groups (:func:`dp_replicas`): the ranks of one group."""
    return dp_group // replicas


def expert_replicas(ep: int, replicas: int) -> int:
    """Cluster groups the routed experts' data-parallel group is replicated across, given the
    dense group's ``replicas`` (:func:`dp_replicas`): under expert parallelism (``ep`` > 1) the
    runtime shards the experts with FSDP2 over their own 1-D mesh
    (codegen/runtime/data_parallel.py ``shard_experts``), which runs flat: 1; without it they are
    wrapped with their block, as the dense group: ``replicas``."""
    return 1 if ep > 1 else replicas
