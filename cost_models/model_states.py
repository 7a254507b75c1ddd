"""Model states per parameter a rank holds: weights, gradients, AdamW states and the DP wrapper's
buffers, in bytes, under each data-parallel sharding mode and engine (cost_models/memory.py
composes them with activations into a rank's peak).

Model states, per parameter held by this rank (``P`` = stage parameters / tp for
the TP-sharded part), AdamW, as the runtime holds them (``planner.precision.mixed_precision``;
codegen/runtime/precision.py):

| dtype            | weights (master) | grads | Adam m, v | compute copy ``c`` (gathered / cast per unit) |
|------------------|------------------|-------|-----------|-----------------------------------------------|
| bf16/fp16 mixed  | 4                | 4     | 4 + 4     | 2 (gradients reduced and accumulated in fp32) |
| fp32             | 4                | 4     | 4 + 4     | 4                                             |

(16 bytes at rest either way, as torchtitan's FSDP2 mixed precision holds them.) DP sharding, as the runtime
(codegen/runtime/data_parallel.py) holds it at the peak:

| zero              | at rest (weights, grads, optimizer)  | buffers during the step                 |
|-------------------|--------------------------------------|-----------------------------------------|
| ddp               | P w, P g, P o                        | P c: ``replicate``'s unsharded copy     |
| zero1             | P w, P g, P o / dp                   | P c (``replicate`` too)                 |
| zero2, pp = 1     | P w / dp, P g / dp, P o / dp         | P c: every layer stays gathered from    |
|                   |                                      | forward to backward                     |
| fsdp, pp = 1      | P w / dp, P g / dp, P o / dp         | 2 units' unsharded weights + grads (a   |
|                   |                                      | unit: the layer, or one module of a     |
|                   |                                      | very large block, ``fsdp_units``)       |
| zero2/fsdp, pp > 1| P w / dp, P g / dp, P o / dp         | P (c + g - g / dp): torch's pipeline    |
|                   |                                      | stages keep parameters gathered and     |
|                   |                                      | gradients unreduced until the last      |
|                   |                                      | micro-batch (sharded grads come later)  |

With one data-parallel rank nothing is copied or gathered in fp32; in mixed precision the
rank still holds the compute copy (``replicate`` on one rank makes it: P c).

Megatron-Core's distributed optimizer (``Engine.dist_opt_states``, the published runs' engines
with ``--use-distributed-optimizer``) holds ZeRO-1 otherwise: the parameters in the compute
dtype, which the forward and backward read directly (no separate copy), the main gradients in
fp32, and the fp32 master weights and both moments sharded over dp: ``2 + 4 + 12 / dp`` bytes
in bf16, ``4 + 4 + 8 / dp`` in fp32 (Megatron-Core's distributed-optimizer guide, the
"bf16 param, fp32 grads" row).
"""
from __future__ import annotations

from cost_models.engines import DEFAULT_ENGINE, Engine
from planner.low_comm import inner_dp
from planner.plan import ParallelConfig
from planner.precision import DTYPE_BYTES, GRAD_REDUCE_BYTES, MASTER_BYTES
from planner.sharding import ZERO, dp_wrapper, expert_replicas, reshard_after_forward, shard_ranks

ADAM_STATE_BYTES = 8.0  # AdamW's two fp32 moments per parameter


def dp_group(cfg: ParallelConfig, experts: bool = False) -> int:
    """Ranks holding the same parameters and reducing their gradients: dp x cp (CP ranks hold
    the same weights); for routed experts under expert parallelism the experts' own group,
    dp x cp x tp / ep (``ParallelConfig.expert_mesh``: the tp ranks route tokens of their own)."""
    if experts and cfg.ep > 1:
        return cfg.expert_mesh[0]
    return inner_dp(cfg.dp, cfg.low_comm) * cfg.cp  # low-communication DP: the replicas of one group


def per_param_bytes(cfg: ParallelConfig, experts: bool = False, replicas: int = 1,
                    engine: Engine = DEFAULT_ENGINE) -> dict[str, float]:
    """Bytes per parameter a rank holds (``weights``, ``grads``, ``optimizer`` at rest,
    ``buffers`` held through the step) under ``cfg``'s dtype and DP wrapper (the tables in
    the module docstring), plus the unsharded compute copies ``weights_full`` / ``grads_full``
    (a unit gathered, or cast, for its forward and backward); for routed experts
    (``experts``) the sharding group is the experts' data-parallel group (:func:`dp_group`).
    ``replicas``: cluster groups the dense dp group is replicated across (HSDP,
    ``cost_models.wan_cost.hsdp_replicas``): FSDP then shards over one group's ranks
    (``planner.sharding.shard_ranks``). An engine whose ZeRO-1 is Megatron-Core's distributed
    optimizer (``Engine.dist_opt_states``) holds its states instead (module docstring)."""
    dp = dp_group(cfg, experts)
    c = DTYPE_BYTES[cfg.dtype]  # the compute copy: the plan's dtype
    w, g, o = MASTER_BYTES, GRAD_REDUCE_BYTES, ADAM_STATE_BYTES
    if cfg.zero not in ZERO:
        raise ValueError(f"data-parallel sharding {cfg.zero!r}: use {', '.join(ZERO)}")
    f = {"weights_full": c, "grads_full": c, "weights": w, "grads": g, "optimizer": o, "buffers": 0.0}
    if cfg.zero == "zero1" and engine.dist_opt_states:  # compute-dtype parameters, fp32 main grads
        return dict(f, weights=c, grads=g, optimizer=((w if c != w else 0.0) + o) / dp)
    wrapper = dp_wrapper(cfg.zero, cfg.pp, cfg.tp, dp, cfg.dtype)
    if wrapper == "none":
        return f
    if wrapper != "fully_shard":  # ddp, zero1: replicated parameters
        f["buffers"] = c  # replicate's unsharded compute copy, forward to backward
        if cfg.zero == "zero1":
            f["optimizer"] = o / dp
        return f
    dp = shard_ranks(dp, expert_replicas(cfg.ep, replicas) if experts else replicas)
    f.update(weights=w / dp, grads=g / dp, optimizer=o / dp)
    if cfg.pp > 1:
        # gathered parameters, and unreduced gradients (accumulated in fp32) until the last micro-batch's
        # reduce-scatter (their sharded result, counted in grads, comes after the peak)
        f["buffers"] = c + g - g / dp
    elif not reshard_after_forward(cfg.zero, cfg.pp, dp):
        f["buffers"] = c  # zero2: every layer gathered from forward to backward
    return f
