"""Per-rank memory of one pipeline stage, by category, in bytes.

peak(stage) = weights + gradients + optimizer states            (model states)
            + activations x micro-batches in flight             (schedule-dependent)
            + transient buffers (unsharded FSDP layers or replicate's parameter copy,
              the backward gradient working set, the recompute working set)
            + framework reserve

Model states, per parameter held by this rank (``P`` = stage parameters / tp for
the TP-sharded part), AdamW:

| dtype            | weights | grads | master | Adam m, v |
|------------------|---------|-------|--------|-----------|
| bf16/fp16 mixed  | 2       | 2     | 4      | 4 + 4     |   (16 bytes, Megatron's accounting)
| fp32             | 4       | 4     | -      | 4 + 4     |   (16 bytes)

DP sharding, as the runtime (codegen/runtime/data_parallel.py) holds it at the peak:

| zero              | at rest (weights, grads, optimizer)  | buffers during the step                 |
|-------------------|--------------------------------------|-----------------------------------------|
| ddp               | P w, P g, P o                        | P w: ``replicate``'s unsharded copy     |
| zero1             | P w, P g, P o / dp                   | P w (``replicate`` too)                 |
| zero2, pp = 1     | P w / dp, P g / dp, P o / dp         | P w: every layer stays gathered from    |
|                   |                                      | forward to backward                     |
| fsdp, pp = 1      | P w / dp, P g / dp, P o / dp         | 2 units' unsharded weights + grads (a   |
|                   |                                      | unit: the layer, or one module of a     |
|                   |                                      | very large block, ``fsdp_units``)       |
| zero2/fsdp, pp > 1| P w / dp, P g / dp, P o / dp         | P (w + g - g / dp): torch's pipeline    |
|                   |                                      | stages keep parameters gathered and     |
|                   |                                      | gradients unreduced until the last      |
|                   |                                      | micro-batch (sharded grads come later)  |

(with dp = 1 nothing is copied or gathered). In backward, the largest layer's fresh
weight gradient coexists with the accumulated one, and the gradients of its
activations with the activations (one layer's worth: the working set).

Activations per micro-batch come from the ModelGraph's saved-for-backward bytes
(captured at ``graph.batch`` sequences), rescaled to ``mbs`` sequences and to the
compute dtype, then divided:
- ``act_bytes_tp`` by tp; the rest by tp only with sequence parallel;
- everything by cp (each rank holds S/cp tokens);
- selective recompute drops ``act_bytes_attn_core``; full recompute keeps only each
  layer's input (``input_bytes``) plus, transiently, one layer's full activations;
  per-op recompute (``selective-op``) keeps what ``cost_models/op_recompute.py`` counts,
  with the same transient;
- under expert parallelism with an expected imbalance (``MoEDims.imbalance``), the busiest
  rank's extra routed rows (:func:`routed_excess_bytes`);
- the fused linear+cross-entropy kernel drops the head's vocabulary-sized tensors
  (logits, log-probabilities): the head keeps only its input.
In-flight micro-batches per stage come from the pipeline simulator (1F1B holds
``pp - s`` on stage s, GPipe all ``m``).

Framework reserve: ``RESERVE_GPU`` on GPUs (CUDA context, NCCL buffers, allocator
fragmentation) and ``RESERVE_CPU`` for local CPU processes (interpreter + torch).
Measured tensor peaks (torch's allocator stats, live-tensor tracking) do not see
the reserve, so comparisons use ``tensors`` (the total without it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cost_models.op_recompute import checkpointed, op_saved_bytes
from planner.graph import TP_SPLIT_ROLES, Layer, ModelGraph
from planner.plan import FSDP_MODULE_SHARE, RECOMPUTE, SHARDED_PARAMS, ZERO, ParallelConfig, fsdp_per_module

GiB = 2**30
RESERVE_GPU = 2.0 * GiB       # CUDA context (~0.5 GiB) + NCCL buffers + fragmentation
RESERVE_CPU = 0.0             # live tensors only; process overhead is not tensor memory

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class StageMemory:
    """Bytes on one rank of a stage."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    reserve: float
    inflight: int

    @property
    def tensors(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def total(self) -> float:
        return self.tensors + self.reserve

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        return d


def layer_experts(layer: Layer, hidden: int) -> int:
    """Routed-expert parameters of ``layer`` (0 without experts)."""
    return layer.moe.expert_params(hidden) if layer.moe is not None else 0


def layer_token_local(layer: Layer, cfg: ParallelConfig, hidden: int) -> float:
    """Parameters of ``layer``'s MoE part (router, shared experts, and the routed experts when
    they are not split by EP) that every tp rank holds whole and runs on its own sequence
    shard (``planner.feasibility.ep_problem``): their gradients are summed over tp once per step
    (0 without TP or a MoE layer)."""
    m = layer.moe
    if m is None or cfg.tp == 1:
        return 0.0
    part = sum(o.params for o in layer.ops if o.name == m.part)
    return max(0.0, part - (layer_experts(layer, hidden) if cfg.ep > 1 else 0))


def layer_params_local(layer: Layer, tp: int, pp: int = 1, ep: int = 1, hidden: int = 0) -> float:
    """Parameters of ``layer`` held by one tp rank (TP-sharded ops divided, the rest replicated),
    of its routed experts ``1 / ep`` (``hidden``: the model's, to count them). Under pipeline
    parallelism (``pp > 1``) a layer sharing a parameter with an earlier layer (a tied head)
    holds its own copy of it (sharded like the layer's own ops)."""
    experts = layer_experts(layer, hidden)
    sharded = sum(o.params for o in layer.ops if o.tp_style != "replicated")
    sharded = min(sharded, layer.params - experts)
    tied = layer.tied_params if pp > 1 else 0
    tied_div = tp if any(o.tp_style != "replicated" for o in layer.ops) else 1
    return sharded / tp + (layer.params - experts - sharded) + experts / ep + tied / tied_div


def layer_activation(layer: Layer, graph: ModelGraph, cfg: ParallelConfig, recompute: str) -> float:
    """Saved-for-backward bytes of ``layer`` for one micro-batch on one rank."""
    scale = cfg.mbs / graph.batch * DTYPE_BYTES[cfg.dtype] / graph.dtype_bytes
    if recompute == "full":
        return layer.input_bytes * scale / cfg.cp / cfg.seq_shards
    if recompute == "selective-op" and checkpointed(layer):
        kept = op_saved_bytes(layer, graph)
        return (kept.tp_part / cfg.tp + kept.rest / cfg.seq_shards) * scale / cfg.cp
    tp_part = layer.act_bytes_tp
    rest = layer.act_bytes - tp_part
    if cfg.loss == "fused" and layer.vocab and layer.kind in ("head", "loss"):
        tp_part = 0.0  # no logits / log-probabilities kept
        rest = max(rest, layer.input_bytes)
    if recompute == "selective":
        tp_part -= min(layer.act_bytes_attn_core, tp_part)
    if cfg.attention == "eager" and layer.attention is not None:
        a = layer.attention  # scores + probabilities (+ dropout mask) of an unfused attention
        tp_part += 2 * graph.batch * a.heads * a.seq_len * a.kv_len * graph.dtype_bytes  # / cp below, once
    rest += routed_excess_bytes(layer, graph, cfg)
    return (tp_part / cfg.tp + rest / cfg.seq_shards) * scale / cfg.cp


def routed_excess_bytes(layer: Layer, graph: ModelGraph, cfg: ParallelConfig) -> float:
    """Activations the busiest expert-parallel rank keeps beyond the balanced load the capture
    measured, for the captured batch at the captured dtype: its routed rows are ``imbalance``
    times the mean (``MoEDims.imbalance``, only under ep > 1), and each row keeps its input
    (hidden) and the gate, up, activation and product outputs (4 x expert_ffn) of a SwiGLU
    expert."""
    m = layer.moe
    if m is None or cfg.ep == 1 or m.imbalance <= 1.0:
        return 0.0
    rows = graph.batch * graph.seq_len * m.top_k
    return (m.imbalance - 1.0) * rows * (graph.hidden + 4 * m.expert_ffn) * graph.dtype_bytes


class LayerTable:
    """Per-layer figures memory needs for one (graph, config), computed once: parameters per
    tp rank and activation bytes per micro-batch under each recompute policy. The search
    prices thousands of stage splits of one configuration; this keeps that linear."""

    def __init__(self, graph: ModelGraph, cfg: ParallelConfig) -> None:
        rows: dict[tuple, tuple] = {}  # a repeated block has its representative's figures: computed once

        def row(l: Layer) -> tuple:
            key = (l.repeat_of or l.name, l.tied_params, l.moe.imbalance if l.moe else None)
            if key not in rows:
                rows[key] = (layer_params_local(l, cfg.tp, cfg.pp, cfg.ep, graph.hidden),
                             layer_experts(l, graph.hidden) / cfg.ep,       # part of params
                             layer_token_local(l, cfg, graph.hidden),       # part of params
                             fsdp_units(l, cfg, graph.hidden),
                             {p: layer_activation(l, graph, cfg, p) for p in RECOMPUTE})
            return rows[key]

        table = [row(l) for l in graph.layers]
        self.params, self.experts, self.token_local = ([r[i] for r in table] for i in range(3))
        self.units = [r[3] for r in table]
        self.unit = [max(u) for u in self.units]
        self.act = {p: [r[4][p] for r in table] for p in RECOMPUTE}


def per_param_bytes(cfg: ParallelConfig, experts: bool = False) -> dict[str, float]:
    """Bytes per parameter a rank holds (``weights``, ``grads``, ``optimizer`` at rest,
    ``buffers`` held through the step) under ``cfg``'s dtype and DP sharding (the table in
    the module docstring), plus the unsharded ``weights_full`` / ``grads_full``; for routed
    experts (``experts``) the sharding group is the experts' data-parallel group
    (:func:`dp_group`)."""
    dp = dp_group(cfg, experts)
    w, g, o = (4.0, 4.0, 8.0) if cfg.dtype == "fp32" else (2.0, 2.0, 12.0)
    if cfg.zero not in ZERO:
        raise ValueError(f"data-parallel sharding {cfg.zero!r}: use {', '.join(ZERO)}")
    f = {"weights_full": w, "grads_full": g, "weights": w, "grads": g, "optimizer": o, "buffers": 0.0}
    if dp == 1:
        return f
    if cfg.zero not in SHARDED_PARAMS:  # ddp, zero1
        f["buffers"] = w  # runtime DP is FSDP2's replicate: an unsharded parameter copy
        if cfg.zero == "zero1":
            f["optimizer"] = o / dp
        return f
    f.update(weights=w / dp, grads=g / dp, optimizer=o / dp)
    if cfg.pp > 1:
        # gathered parameters, and unreduced gradients until the last micro-batch's
        # reduce-scatter (their sharded result, counted in grads, comes after the peak)
        f["buffers"] = w + g - g / dp
    elif cfg.zero == "zero2":
        f["buffers"] = w  # reshard_after_forward=False: every layer gathered from forward to backward
    return f


def fsdp_units(layer: Layer, cfg: ParallelConfig, hidden: int) -> list[float]:
    """Parameters (per rank, unsharded) of each unit FSDP / ZeRO-2 (``SHARDED_PARAMS``) shards
    ``layer`` into: the layer itself, or, for a block the runtime shards module by module
    (``planner.plan.fsdp_per_module``), its linears and routed-expert stacks holding
    ``FSDP_MODULE_SHARE`` of it or more, plus the rest."""
    total = layer_params_local(layer, cfg.tp, cfg.pp, cfg.ep, hidden)
    if not fsdp_per_module(total):
        return [total]
    parts = [l.in_features * l.out_features / (cfg.tp if l.role in TP_SPLIT_ROLES else 1) for l in layer.linears]
    parts.append(layer_experts(layer, hidden) / cfg.ep)
    big = [p for p in parts if p >= FSDP_MODULE_SHARE * total]
    return big + [max(0.0, total - sum(big))]


def dp_group(cfg: ParallelConfig, experts: bool = False) -> int:
    """Ranks holding the same parameters and reducing their gradients: dp x cp (CP ranks hold
    the same weights); for routed experts under expert parallelism the experts' own group,
    dp x cp x tp / ep (``ParallelConfig.expert_mesh``: the tp ranks route tokens of their own)."""
    if experts and cfg.ep > 1:
        return cfg.expert_mesh[0]
    return cfg.dp * cfg.cp


def stage_memory(graph: ModelGraph, layers: list[int], cfg: ParallelConfig, inflight: float,
                 recompute: str | None = None, device_is_gpu: bool = True,
                 table: LayerTable | None = None) -> StageMemory:
    """Peak memory of one rank holding ``layers`` (indices into graph.layers; for interleaved
    schedules pass all chunks of the rank) with ``inflight`` micro-batches of activations;
    ``recompute`` defaults to the config's; ``table`` caches per-layer figures."""
    recompute = recompute or cfg.recompute
    t = table or LayerTable(graph, cfg)
    P = sum(t.params[i] for i in layers)
    Pe = sum(t.experts[i] for i in layers)  # routed experts: sharded over their own dp group
    dp = cfg.dp * cfg.cp  # CP ranks hold the same weights and reduce gradients with DP
    f, fe = per_param_bytes(cfg), per_param_bytes(cfg, experts=True)
    w, g = f["weights_full"], f["grads_full"]
    big = max((t.params[i] for i in layers), default=0.0)
    if cfg.zero == "fsdp" and cfg.pp == 1 and dp > 1:
        unit = max((t.unit[i] for i in layers), default=0.0)  # the largest FSDP unit (the layer, or one module)
        buffers = 2 * unit * (w + g)  # 2 units unsharded (one computing, one prefetched), with their grads
    else:
        # backward working set: a layer's incoming weight gradient lives beside the accumulated
        # p.grad before it is added in (the largest layer sets it)
        buffers = big * g
    buffers += (P - Pe) * f["buffers"] + Pe * fe["buffers"]
    weights, grads, opt = ((P - Pe) * f[k] + Pe * fe[k] for k in ("weights", "grads", "optimizer"))
    act = sum(t.act[recompute][i] for i in layers) * inflight
    if layers:
        # Back-propagating through layer j materialises gradients the size of its activations
        # (twice that under full recompute, which re-materialises the activations too), while
        # the layers after j in the stage have already released that micro-batch's
        # activations: the peak is the worst j.
        mult = 2.0 if recompute in ("full", "selective-op") else 1.0
        held, best = 0.0, (-1.0, 0.0)
        for i in layers:
            held += t.act[recompute][i]
            work = mult * t.act["none"][i]
            if held + work >= best[0]:
                best = (held + work, work)
        total = sum(t.act[recompute][i] for i in layers)
        if inflight >= 1:
            act -= total - (best[0] - best[1])  # the back-propagated micro-batch holds only up to j
        buffers += best[1]
    return StageMemory(weights=weights, grads=grads, optimizer=opt, activations=act, buffers=buffers,
                       reserve=RESERVE_GPU if device_is_gpu else RESERVE_CPU, inflight=inflight)
