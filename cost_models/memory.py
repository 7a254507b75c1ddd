"""Per-rank memory of one pipeline stage, by category, in bytes.

peak(stage) = weights + gradients + optimizer states            (model states)
            + activations x micro-batches in flight             (schedule-dependent)
            + transient buffers (unsharded FSDP layers or replicate's parameter copy,
              the backward gradient working set, the recompute working set)
            + framework reserve

Model states per parameter (weights, gradients, AdamW states, the DP wrapper's buffers) under
each DP sharding mode and engine: cost_models/model_states.py (:func:`per_param_bytes`). In
backward, the largest layer's fresh weight gradient coexists with the accumulated one, and the
gradients of its activations with the activations (one layer's worth: the working set).

Activations per micro-batch come from the ModelGraph's saved-for-backward bytes
(captured at ``graph.batch`` sequences), rescaled to ``mbs`` sequences and to the
compute dtype, then divided:
- ``act_bytes_tp`` by tp; the rest by tp only with sequence parallel;
- everything by cp (each rank holds S/cp tokens);
- selective recompute drops ``act_bytes_attn_core`` (on an engine with Megatron-Core's
  ``--recompute-modules``, ``Engine.recompute_modules``: what those drop; ``moe``: the MoE layer
  keeps only its input); full recompute keeps only each
  layer's input (``input_bytes``) plus, transiently, one layer's full activations;
  per-op recompute (``selective-op``) keeps what ``cost_models/op_recompute.py`` counts,
  with the same transient;
- under expert parallelism with an expected imbalance (``MoEDims.imbalance``), the busiest
  rank's extra routed rows (:func:`routed_excess_bytes`), averaged over the MoE layers a rank
  holds, whose routers are independent (:func:`held_moe`);
- the fused linear+cross-entropy kernel drops the head's vocabulary-sized tensors
  (logits, log-probabilities): the head keeps only its input.
In-flight micro-batches per stage come from the pipeline simulator (1F1B holds
``pp - s`` on stage s, GPipe all ``m``).

Framework reserve (:func:`framework_reserve`, the one place it is chosen): ``RESERVE_GPU`` on
GPUs (CUDA context, NCCL buffers, allocator fragmentation); on CPUs ``RESERVE_CPU``, or the
calibrated ``mem_reserve_gib`` + ``mem_reserve_frac`` x tensor bytes (``autopar calibrate``:
peak RSS includes the interpreter and torch). Measured tensor peaks (torch's allocator stats,
live-tensor tracking) do not see the reserve, so comparisons use ``tensors`` (the total without it).

One rank's peak (:func:`rank_memory`, the rule the estimate, the ILP and the search floor share)
is composed from per-chunk figures (:func:`chunk_memory`, a :class:`ChunkMemory`): model states and
the DP buffers every chunk holds; each chunk's activations times its in-flight micro-batches;
plus, once per rank, the largest back-propagation overshoot of a chunk (its working set at the
worst layer beyond what the back-propagated micro-batch still holds) and the largest layer's
weight-gradient working set (or, FSDP without a pipeline, its two unsharded units). A chunk
composed of two runs of layers has ``peak = max(first.peak - second.act, second.peak)``: the
ILP (planner/search/stage_split.py) prices splits with that identity, so its memory of any
split equals this rule's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

from cost_models.engines import DEFAULT_ENGINE, UNFUSED_ATTENTION, Engine, fuses_elementwise
from cost_models.fused_elementwise import block_saved
from cost_models.layer_work import fused_loss_layer
from cost_models.model_states import dp_group, per_param_bytes
from cost_models.moe_layer import held_imbalance, routed_saved_bytes
from cost_models.op_recompute import checkpointed, op_saved_bytes
from planner.graph import TP_SPLIT_ROLES, Layer, MoEDims, ModelGraph
from planner.plan import RECOMPUTE, ParallelConfig
from planner.sharding import FSDP_MODULE_SHARE, dp_wrapper, fsdp_per_module, reshard_after_forward
from planner.precision import DTYPE_BYTES, GRAD_REDUCE_BYTES, mixed_precision

GiB = 2**30
RESERVE_GPU = 2.0 * GiB       # CUDA context (~0.5 GiB) + NCCL buffers + fragmentation
RESERVE_CPU = 0.0             # live tensors only; process overhead is not tensor memory



@dataclass(frozen=True)
class StageMemory:
    """Bytes on one rank of a stage (frozen: the search shares one per distinct rank)."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    reserve: float
    inflight: int
    host: float = 0.0   # pinned host memory of offloaded activations (not in ``total``: not device memory)

    @property
    def tensors(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def total(self) -> float:
        return self.tensors + self.reserve

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total"] = self.total
        if not self.host:
            d.pop("host")
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


def layer_activation(layer: Layer, graph: ModelGraph, cfg: ParallelConfig, recompute: str,
                     engine: Engine = DEFAULT_ENGINE) -> float:
    """Saved-for-backward bytes of ``layer`` for one micro-batch on one rank, as ``engine`` runs it."""
    scale = cfg.mbs / graph.batch * DTYPE_BYTES[cfg.dtype] / graph.dtype_bytes
    if recompute == "full":
        return layer.input_bytes * scale / cfg.cp / cfg.seq_shards
    if recompute == "offload" and checkpointed(layer):
        return 0.0  # a block's saved tensors wait in host memory (cost_models/offload.py)
    if recompute == "selective-op" and checkpointed(layer):
        kept = op_saved_bytes(layer, graph)
        return (kept.tp_part / cfg.tp + kept.rest / cfg.seq_shards) * scale / cfg.cp
    m = held_moe(layer, graph, cfg)
    dropped = set(engine.recompute_modules) if recompute == "selective" else set()
    tokens = graph.batch * graph.seq_len
    tp_part = layer.act_bytes_tp
    rest = layer.act_bytes - tp_part
    blk = block_saved(layer, graph, graph.dtype_bytes, "layernorm" in dropped) if fuses_elementwise(engine, cfg) else None
    if blk is not None:  # fused norms / rope / activation: what they keep (cost_models/fused_elementwise.py)
        moe_part = min(m.act_bytes, rest) if m is not None else 0.0
        tp_part, rest = blk[0] * tokens, blk[1] * tokens + moe_part
    if fused_loss_layer(layer, cfg):
        tp_part = 0.0  # no logits / log-probabilities kept
        rest = max(rest, layer.input_bytes)
    if recompute == "selective" and blk is None:
        tp_part -= min(layer.act_bytes_attn_core, tp_part)
    if engine.attention_kernel_of(cfg.attention, cfg.cp) == UNFUSED_ATTENTION and layer.attention is not None \
            and recompute != "selective":
        a = layer.attention  # scores + probabilities (+ dropout mask) of an unfused attention
        tp_part += 2 * graph.batch * a.heads * a.seq_len * a.kv_len * graph.dtype_bytes  # / cp below, once
    if m is not None and engine.moe_fused_permute:  # the engine's MoE layer keeps its own tensors
        kept = tokens * graph.hidden * graph.dtype_bytes if "moe" in dropped else \
            routed_saved_bytes(m, tokens, graph.hidden, graph.dtype_bytes, cfg.ep, "moe_act" in dropped,
                               "layernorm" in dropped)  # recomputed whole, the layer keeps its input only
        rest += kept - min(m.act_bytes, rest)
    else:
        rest += routed_excess_bytes(layer, graph, cfg)
    return (tp_part / cfg.tp + rest / cfg.seq_shards) * scale / cfg.cp


def held_moe(layer: Layer, graph: ModelGraph, cfg: ParallelConfig) -> MoEDims | None:
    """``layer``'s MoE dimensions with the load its busiest rank keeps over the MoE layers one
    rank holds (:func:`held_layers`): ``moe_layer.held_imbalance``."""
    if layer.moe is None or layer.moe.imbalance <= 1.0 or cfg.ep == 1:
        return layer.moe  # nothing to average (and no scan of the graph's layers per call)
    return held_imbalance(layer.moe, held_layers(graph, cfg))


def held_layers(graph: ModelGraph, cfg: ParallelConfig) -> int:
    """The MoE layers one rank holds, over which its kept excess rows average (``held_imbalance``'s
    ``L``): ``graph``'s MoE layers over ``cfg.pp``, rounded down, at least one; one where there is
    nothing to average (no expert parallelism, no layer with an imbalance). Per-layer memory
    figures depend on it (``cost_models.layer_costs.LayerCosts.table`` keys them by it)."""
    if cfg.ep == 1 or not any(l.moe is not None and l.moe.imbalance > 1.0 for l in graph.layers):
        return 1
    return max(1, sum(l.moe is not None for l in graph.layers) // cfg.pp)


def routed_excess_bytes(layer: Layer, graph: ModelGraph, cfg: ParallelConfig) -> float:
    """Activations the busiest expert-parallel rank keeps beyond the balanced load the capture
    measured, for the captured batch at the captured dtype: its routed rows are ``imbalance``
    times the mean (``MoEDims.imbalance``, only under ep > 1), and each row keeps its input
    (hidden) and the gate, up, activation and product outputs (4 x expert_ffn) of a SwiGLU
    expert."""
    m = held_moe(layer, graph, cfg)
    if m is None or cfg.ep == 1 or m.imbalance <= 1.0:
        return 0.0
    rows = graph.batch * graph.seq_len * m.top_k
    return (m.imbalance - 1.0) * rows * (graph.hidden + 4 * m.expert_ffn) * graph.dtype_bytes


class LayerTable:
    """Per-layer figures memory needs for one (graph, config), computed once: parameters per
    tp rank and activation bytes per micro-batch under each recompute policy. The search
    prices thousands of stage splits of one configuration; this keeps that linear."""

    def __init__(self, graph: ModelGraph, cfg: ParallelConfig, engine: Engine = DEFAULT_ENGINE) -> None:
        rows: dict[tuple, tuple] = {}  # a repeated block has its representative's figures: computed once

        def row_key(l: Layer) -> tuple:
            return l.repeat_of or l.name, l.tied_params, l.moe.imbalance if l.moe else None

        def row(l: Layer) -> tuple:
            key = row_key(l)
            if key not in rows:
                rows[key] = (layer_params_local(l, cfg.tp, cfg.pp, cfg.ep, graph.hidden),
                             layer_experts(l, graph.hidden) / cfg.ep,       # part of params
                             layer_token_local(l, cfg, graph.hidden),       # part of params
                             fsdp_units(l, cfg, graph.hidden),
                             {p: layer_activation(l, graph, cfg, p, engine) for p in RECOMPUTE})
            return rows[key]

        self.engine = engine  # the states it holds (model_states.per_param_bytes) and what it keeps

        table = [row(l) for l in graph.layers]
        ids = {k: n for n, k in enumerate(rows)}
        # which distinct row each layer has: chunks of the same rows have the same figures
        self.row_of = tuple(ids[row_key(l)] for l in graph.layers)
        self.params, self.experts, self.token_local = ([r[i] for r in table] for i in range(3))
        self.units = [r[3] for r in table]
        self.unit = [max(u) for u in self.units]
        self.act = {p: [r[4][p] for r in table] for p in RECOMPUTE}
        # parameters of the blocks' dense linears (per tp rank): what float8 training casts
        self.fp8_params = [p - e if l.kind == "transformer_block" else 0.0
                           for p, e, l in zip(self.params, self.experts, graph.layers)]
        # chunk_memory's results over these figures: ``chunks[chunk_ids[(rule id, the chunk's rows, policy)]]``
        # (a search prices chunks of the same repeated blocks under many schedules and splits; frozen)
        self.rule_ids: dict[tuple, int] = {}  # what a MemoryRule adds to the table (MemoryRule.id) -> a small id
        self.chunk_ids: dict[tuple, int] = {}
        self.rows_of: dict[range | tuple, int] = {}  # layers -> the id of their rows (row_ids), see chunk_id
        self.row_ids: dict[tuple, int] = {}
        self.chunks: list[ChunkMemory] = []
        self.chunk_sums: dict[tuple, tuple[float, ...]] = {}  # (rows, policy) -> _chunk_sums, shared by the rules
        self.transients: dict[int, list[float]] = {}  # rule id -> MemoryRule.transient
        self.split_ids: dict[tuple, tuple[int, ...]] = {}  # (rule id, bounds, policies) -> chunk ids (pipeline_memory.split_ids)
        # a rank's memory per (its chunks' ids, in-flight micro-batches, reserve): see pipeline_memory
        self.rank_memo: dict[tuple, StageMemory] = {}
        self.rules: dict[tuple, MemoryRule] = {}  # rule_of's key -> the rule (the search asks per variant)


def fsdp_units(layer: Layer, cfg: ParallelConfig, hidden: int) -> list[float]:
    """Parameters (per rank, unsharded) of each unit FSDP / ZeRO-2 (``SHARDED_PARAMS``) shards
    ``layer`` into: the layer itself, or, for a block the runtime shards module by module
    (``planner.sharding.fsdp_per_module``), its linears and routed-expert stacks holding
    ``FSDP_MODULE_SHARE`` of it or more, plus the rest."""
    total = layer_params_local(layer, cfg.tp, cfg.pp, cfg.ep, hidden)
    if not fsdp_per_module(total):
        return [total]
    parts = [l.in_features * l.out_features / (cfg.tp if l.role in TP_SPLIT_ROLES else 1) for l in layer.linears]
    parts.append(layer_experts(layer, hidden) / cfg.ep)
    big = [p for p in parts if p >= FSDP_MODULE_SHARE * total]
    return big + [max(0.0, total - sum(big))]


@dataclass(frozen=True)
class Reserve:
    """Framework memory beside the tensors: ``fixed`` bytes plus ``frac`` x the tensor bytes."""
    fixed: float
    frac: float = 0.0

    def of(self, tensors: float) -> float:
        """Bytes reserved beside ``tensors`` bytes of tensors."""
        return self.fixed + self.frac * tensors

    def tensor_room(self, capacity: float) -> float:
        """The most tensor bytes that fit ``capacity`` bytes with this reserve beside them."""
        return (capacity - self.fixed) / (1.0 + self.frac)


def framework_reserve(device_is_gpu: bool, cal: Mapping[str, float] | None = None) -> Reserve:
    """The reserve of one process (module docstring): ``RESERVE_GPU`` on GPUs; on CPUs the
    calibrated ``mem_reserve_gib`` / ``mem_reserve_frac`` (``cal``: a profile's fitted
    coefficients) when fitted, else ``RESERVE_CPU``."""
    cal = cal or {}
    if device_is_gpu:
        return Reserve(RESERVE_GPU)
    if "mem_reserve_gib" in cal or "mem_reserve_frac" in cal:
        return Reserve(cal.get("mem_reserve_gib", 0.0) * GiB, cal.get("mem_reserve_frac", 0.0))
    return Reserve(RESERVE_CPU)


@dataclass(frozen=True)
class ChunkMemory:
    """A run of consecutive layers of one chunk under one recompute policy, bytes per rank:
    ``weights``, ``grads``, ``optimizer`` at rest and ``pinned`` (DP buffers held through the
    step) are held once; ``act`` is kept per in-flight micro-batch; ``peak`` is the worst
    back-propagation overshoot, ``max_j (held(j) + work(j)) - act`` >= 0 (back-propagating
    through layer j holds the activations up to j plus a working set ``work(j)``), ``work``
    that working set at the worst j; ``transient`` the largest layer's weight-gradient working
    set (FSDP without a pipeline: two unsharded units)."""
    weights: float
    grads: float
    optimizer: float
    pinned: float
    act: float
    peak: float
    work: float
    transient: float
    host: float = 0.0  # offloaded activations in pinned host memory, per in-flight micro-batch

    @property
    def states(self) -> float:
        """Bytes held once, whatever the schedule: model states and pinned DP buffers."""
        return self.weights + self.grads + self.optimizer + self.pinned


class MemoryRule:
    """Per-layer memory figures of one (graph, config): what :func:`chunk_memory` sums."""

    def __init__(self, graph: ModelGraph, cfg: ParallelConfig, table: LayerTable | None = None,
                 replicas: int = 1) -> None:
        self.t = table or LayerTable(graph, cfg)
        self.f, self.fe = (per_param_bytes(cfg, e, replicas, self.t.engine) for e in (False, True))
        cast = GRAD_REDUCE_BYTES if mixed_precision(cfg.dtype) else 0.0  # a unit's gradient cast to fp32
        dp = dp_group(cfg)
        self.units = dp_wrapper(cfg.zero, cfg.pp, cfg.tp, dp, cfg.dtype) == "fully_shard" and reshard_after_forward(
            cfg.zero, cfg.pp, dp)
        self.cast = cast
        # everything chunk_memory reads beyond the table: equal keys over one table, equal figures
        key = (tuple(self.f.items()), tuple(self.fe.items()), self.units, cast)
        self.id = self.t.rule_ids.setdefault(key, len(self.t.rule_ids))

    @property
    def transient(self) -> list[float]:
        """Per layer, the weight-gradient working set (bytes; computed when a chunk is first priced,
        once per rule id over the table: the id's key holds everything it reads)."""
        if self.id not in self.t.transients:
            w, g = self.f["weights_full"], self.f["grads_full"]
            # units: 2 unsharded (one computing, one prefetched), with their grads (measured under bf16: the
            # fp32 reduce-scatter input of the last unit takes the place of a prefetched unit); else a layer's
            # incoming weight gradient lives beside the accumulated p.grad before it is added in
            self.t.transients[self.id] = [2 * u * (w + g) for u in self.t.unit] if self.units else [
                p * (g + self.cast) for p in self.t.params]
        return self.t.transients[self.id]

    def work(self, i: int, policy: str) -> float:
        """Back-propagating through layer ``i`` materialises gradients the size of its
        activations (twice that when the policy re-materialises them: full, selective-op, or
        reloads them from the host: offload)."""
        return (2.0 if policy in ("full", "selective-op", "offload") else 1.0) * self.t.act["none"][i]


def chunk_memory(rule: MemoryRule, layers: Sequence[int], policy: str) -> ChunkMemory:
    """The figures of ``layers`` (consecutive indices into graph.layers) under ``policy``; computed
    once per (rule, the layers' distinct rows, policy) over one table (:func:`chunk_id`)."""
    return rule.t.chunks[chunk_id(rule, layers, policy)]


def chunk_id(rule: MemoryRule, layers: Sequence[int], policy: str) -> int:
    """Where :func:`chunk_memory`'s figures of ``layers`` under ``policy`` sit in ``rule.t.chunks``
    (computed on first use): equal ids, equal figures."""
    t, span = rule.t, layers if isinstance(layers, range) else tuple(layers)
    rows = t.rows_of.get(span)
    if rows is None:  # the layers' rows as a small id, once per table (the keys below hash it often)
        rows = t.rows_of[span] = t.row_ids.setdefault(tuple(t.row_of[i] for i in layers), len(t.row_ids))
    key = (rule.id, rows, policy)
    n = t.chunk_ids.get(key)
    if n is None:
        n = t.chunk_ids[key] = len(t.chunks)
        t.chunks.append(_chunk_memory(rule, layers, policy, rows))
    return n


def _chunk_memory(rule: MemoryRule, layers: Sequence[int], policy: str, rows: tuple) -> ChunkMemory:
    """:func:`chunk_memory`'s figures: the rule's bytes per parameter times the layers' sums
    (:func:`_chunk_sums`, the same for every rule over the table: kept per (rows, policy))."""
    t, f, fe = rule.t, rule.f, rule.fe
    sums = t.chunk_sums.get((rows, policy))
    if sums is None:
        sums = t.chunk_sums[(rows, policy)] = _chunk_sums(rule, layers, policy)
    P, Pe, held, peak, work, host = sums  # Pe: routed experts, sharded over their own dp group
    weights, grads, opt, pinned = ((P - Pe) * f[k] + Pe * fe[k] for k in ("weights", "grads", "optimizer", "buffers"))
    tr, run = rule.transient, isinstance(layers, range) and layers.step == 1  # a run: max of a slice (exact)
    return ChunkMemory(weights=weights, grads=grads, optimizer=opt, pinned=pinned, act=held, peak=peak, work=work,
                       transient=max(tr[layers.start:layers.stop] if run else [tr[i] for i in layers], default=0.0),
                       host=host)


def _chunk_sums(rule: MemoryRule, layers: Sequence[int], policy: str) -> tuple[float, ...]:
    """(parameters, routed-expert parameters, activations held, back-propagation overshoot, its
    working set, offloaded bytes) of ``layers`` under ``policy``: read from the table alone
    (``MemoryRule.work`` reads only the table's activations)."""
    t = rule.t
    P = sum(t.params[i] for i in layers)
    Pe = sum(t.experts[i] for i in layers)
    act = t.act[policy]
    held, best, work = 0.0, -1.0, 0.0
    for i in layers:  # the worst layer j (the later one on ties)
        held += act[i]
        w = rule.work(i, policy)
        if held + w >= best:
            best, work = held + w, w
    host = sum(t.act["none"][i] - act[i] for i in layers) if policy == "offload" else 0.0
    return P, Pe, held, max(0.0, best - held) if layers else 0.0, work, host


def overshoot(chunk: ChunkMemory, inflight: float) -> float:
    """Bytes a chunk adds at its rank's peak beyond ``inflight`` x its activations and its
    states: its back-propagation overshoot, with the back-propagated micro-batch counted
    whole when fewer than one is in flight on average (an interleaved rank's chunk)."""
    return chunk.peak + max(0.0, 1.0 - inflight) * chunk.act


def rank_memory(chunks: Sequence[ChunkMemory], inflight: Sequence[float], reserve: Reserve) -> StageMemory:
    """Peak bytes of one rank holding ``chunks`` (its virtual stages), ``inflight[c]`` micro-batches
    of chunk c's activations held (module docstring): states of all chunks, their activations,
    the largest overshoot (one micro-batch is back-propagated at a time) and the largest weight-
    gradient working set, and the reserve."""
    if not chunks:
        return StageMemory(0.0, 0.0, 0.0, 0.0, 0.0, reserve.of(0.0), 0)
    c = max(range(len(chunks)), key=lambda k: (overshoot(chunks[k], inflight[k]), k))
    over = overshoot(chunks[c], inflight[c])
    act = sum(x.act * n for x, n in zip(chunks, inflight)) + over - chunks[c].work
    buffers = sum(x.pinned for x in chunks) + max(x.transient for x in chunks) + chunks[c].work
    states = [sum(x.weights for x in chunks), sum(x.grads for x in chunks), sum(x.optimizer for x in chunks)]
    return StageMemory(*states, activations=act, buffers=buffers, reserve=reserve.of(sum(states) + act + buffers),
                       inflight=sum(inflight), host=sum(x.host * n for x, n in zip(chunks, inflight)))


def stage_memory(graph: ModelGraph, layers: list[int], cfg: ParallelConfig, inflight: float,
                 recompute: str | None = None, device_is_gpu: bool = True,
                 table: LayerTable | None = None) -> StageMemory:
    """Peak memory of one rank holding the one chunk ``layers`` (indices into graph.layers) with
    ``inflight`` micro-batches of activations (:func:`rank_memory`; an interleaved rank's chunks:
    :func:`chunk_memory` each); ``recompute`` defaults to the config's; ``table`` caches per-layer
    figures."""
    rule = MemoryRule(graph, cfg, table)
    return rank_memory([chunk_memory(rule, layers, recompute or cfg.recompute)], [inflight],
                       framework_reserve(device_is_gpu))


def memory_floor(graph: ModelGraph, cfg: ParallelConfig, table: LayerTable | None = None) -> float:
    """Tensor bytes no variant of ``cfg``'s degrees (any DP sharding, recompute, schedule, split)
    goes below on its fullest rank: the model states FSDP leaves (:func:`chunk_memory` of every
    layer under ``zero=fsdp``) over ``pp`` ranks on average, plus the smallest layer's activations
    under full recompute (a rank holds at least one layer and one micro-batch). The search's
    memory floor (planner/search/space.py), a lower bound of :func:`rank_memory`."""
    rule = MemoryRule(graph, cfg.replace(zero="fsdp"), table)
    whole = chunk_memory(rule, range(len(graph.layers)), "full")
    return (whole.weights + whole.grads + whole.optimizer) / cfg.pp + min(rule.t.act["full"])
