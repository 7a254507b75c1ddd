"""Per-layer seconds of one micro-batch on one rank (forward, backward, TP / CP / EP
communication, what each recompute policy re-runs), cached per layer signature, and the one
per-layer stage-time rule (:func:`layer_pass_times`) the estimator (cost_models/estimate.py),
the ILP's inputs (planner/search/stage_split.py) and the search's floors share. The
communication terms are described in cost_models/estimate.py's docstring.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm as comm_mod
from cost_models.cluster import Cluster
from cost_models.compute import layer_time
from cost_models.layer_work import LayerTime, attention_share, attn_core_flops, document_masked
from cost_models.cpu_runtime import ep_dispatch_s, lockstep_wait_s
from cost_models.dtensor_dispatch import prices_tp_shared_wait, prices_tp_sync, vocab_embeddings
from cost_models.context_parallel import cp_comm
from cost_models.documents import ring_hiding
from cost_models.engines import DEFAULT_ENGINE, Engine, exposed_s
from cost_models.experts import ComputeChunks, expert_comm
from cost_models.memory import LayerTable, held_layers, layer_activation
from cost_models.offload import copy_seconds, exposed_copy_s
from cost_models.op_recompute import checkpointed
from cost_models.shared_cores import ranks_cluster
from planner.graph import Layer, ModelGraph
from planner.plan import ParallelConfig
from planner.precision import DTYPE_BYTES


def act_bytes_io(layer: Layer, graph: ModelGraph, cfg: ParallelConfig) -> float:
    """Bytes of one micro-batch's hidden activation at this layer's input, per cp rank."""
    return layer.input_bytes * cfg.mbs / graph.batch * DTYPE_BYTES[cfg.dtype] / graph.dtype_bytes / cfg.cp


@dataclass(frozen=True)
class LayerCost:
    """One layer, one micro-batch, one rank (seconds): forward and backward compute, TP
    communication (forward + backward), CP's exposed ring exchange (forward + backward), the
    attention core's forward, what ``selective`` re-runs on the engine (``sel_rc``), what
    ``selective-op`` recomputes of the forward compute (``LayerTime.op_recompute_s``), the
    host-link copy of what the layer saves (``offload``, repeated blocks only), and where the
    compute and communication figures came from."""
    fwd: float
    bwd: float
    tp: float
    cp: float
    core: float
    op_rc: float
    source: str
    comm_source: str
    ep_fwd: float = 0.0    # expert all-to-alls (cost_models/experts.py): forward, backward
    ep_bwd: float = 0.0
    host: float = 0.0      # a repeated block's saved activations over the host link, one way (offload)
    ep_unpaired: float = 0.0  # what one micro-batch's forward + backward adds when the engine's 1F1B
    #                           all-to-all overlap has no partner pass for them (experts.unpaired_ep_s)
    sel_rc: float = 0.0    # what ``selective`` re-runs in the backward as the engine runs it (selective_recompute_s)

    @property
    def fwd_pass(self) -> float:
        """The forward pass on the stage: compute, half the TP communication, a third of CP's
        exposed exchange (the backward exchanges twice), the expert all-to-alls."""
        return self.fwd + self.tp / 2 + self.cp / 3 + self.ep_fwd

    @property
    def bwd_pass(self) -> float:
        """The backward pass without recompute: compute and the rest of the communication."""
        return self.bwd + self.tp / 2 + 2 * self.cp / 3 + self.ep_bwd


class LayerCosts:
    """Per-layer forward/backward seconds incl. TP/CP communication, cached by signature."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig, profile,
                 tables: dict[tuple, LayerTable] | None = None, engine: Engine = DEFAULT_ENGINE) -> None:
        self.g, self.cfg, self.profile, self.engine = graph, cfg, profile, engine
        self.base, self.c = cluster, ranks_cluster(cluster, cfg)  # the ranks cfg runs (shared_cores.py)
        self.mesh = comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, tp=cfg.tp)
        # what DTensor's figure already prices of TP's collectives (their cost between compute; on shared
        # cores their wait too, where the profile measured the figure on these ranks)
        self.tp_sync = dict(sync_priced=prices_tp_sync(self.c), wait_priced=prices_tp_shared_wait(self.c, profile))
        self.cache: dict[str, LayerCost] = {}
        self.pass_cache: dict[tuple[str, str], PassTimes] = {}  # (signature, recompute policy) -> pass_times
        self.tables = tables if tables is not None else {}  # memory figures: may be shared by several (the search)

    @staticmethod
    def key(cfg: ParallelConfig) -> tuple:
        """What the per-layer seconds depend on: configurations with the same key share them."""
        return (cfg.tp, cfg.cp, cfg.ulysses, cfg.ep, cfg.mbs, cfg.sp, cfg.dtype, cfg.world, cfg.threads, cfg.fp8,
                cfg.compile, cfg.attention, cfg.loss)

    def table(self, cfg: ParallelConfig) -> LayerTable:
        """Per-layer memory figures for cfg (they depend on tp, cp, ep, sp, mbs, dtype, kernels,
        whether a pipeline holds tied copies and, under a MoE imbalance, the MoE layers a rank
        holds: ``cost_models.memory.held_layers``)."""
        key = (cfg.tp, cfg.cp, cfg.ep, cfg.sp, cfg.mbs, cfg.dtype, cfg.attention, cfg.loss, cfg.pp > 1,
               cfg.compile, self.engine, held_layers(self.g, cfg))
        t = self.tables.get(key)
        if t is None:
            t = self.tables[key] = LayerTable(self.g, cfg, self.engine)
        return t

    def host_copy_s(self, layer: Layer) -> float:
        """Seconds to move what ``layer`` saves for its backward (one micro-batch, no recompute)
        over the host link one way, for the blocks ``offload`` moves; 0 for other layers."""
        if not checkpointed(layer):
            return 0.0
        return copy_seconds(layer_activation(layer, self.g, self.cfg, "none", self.engine), self.c)

    def pass_times(self, layer: Layer, policy: str) -> "PassTimes":
        """:func:`layer_pass_times` of the layer's :meth:`get` under ``policy`` (cached by signature)."""
        key = (layer.signature, policy)
        hit = self.pass_cache.get(key)
        if hit is None:
            hit = self.pass_cache[key] = layer_pass_times(self.get(layer), policy)
        return hit

    def get(self, layer: Layer) -> "LayerCost":
        """The layer's seconds for one micro-batch under the config (cached by signature)."""
        hit = self.cache.get(layer.signature)
        if hit is not None:
            return hit
        g, cfg = self.g, self.cfg
        lt: LayerTime = layer_time(layer, g, self.c, cfg, self.profile, self.engine, profiled_on=self.base)
        tp_s, csrc = 0.0, "model"
        if cfg.tp > 1:
            n_red = sum(1 for l in layer.linears if l.role == "row")
            n_red += vocab_embeddings(layer)
            nbytes = act_bytes_io(layer, g, cfg)
            if n_red and nbytes:
                sync = self.tp_sync
                if cfg.sp:
                    rs = comm_mod.collective_time("reduce_scatter", nbytes, self.c, self.mesh, "tp", self.profile,
                                                  **sync)
                    ag = comm_mod.collective_time("all_gather", nbytes * fp8_gather_share(layer, cfg, self.engine),
                                                  self.c, self.mesh, "tp", self.profile, **sync)
                    one, csrc = rs.seconds + ag.seconds, rs.source
                else:
                    ar = comm_mod.collective_time("all_reduce", nbytes, self.c, self.mesh, "tp", self.profile, **sync)
                    one, csrc = ar.seconds, ar.source
                tp_s = 2 * n_red * one  # forward and backward
                if self.engine.tp_overlap:  # chunked beside the GEMMs; the first ring step waits
                    tp_s = exposed_s(tp_s, lt.fwd_s + lt.bwd_s, tp_s / cfg.tp)
                tp_s += lockstep_wait_s(lt.fwd_s + lt.bwd_s, self.c, cfg, self.profile)  # CPU ranks' spread
        core_s = 0.0
        cp_s = 0.0
        a = layer.attention
        if a is not None:
            peak = self.c.peak_flops(self.c.compute_dtype(cfg.dtype))
            core = attn_core_flops(layer, cfg.mbs) * (0.5 if a.causal else 1.0) * attention_share(layer, g, cfg)
            core_s = core / (cfg.tp * cfg.cp) / peak
            if cfg.cp > 1:  # ring, Ulysses or both (cost_models/context_parallel.py)
                hide = ring_hiding(g.documents, cfg.cp, cfg.ulysses) if document_masked(layer, g, cfg) else 1.0
                cpc = cp_comm(a, cfg, self.c, core_s, self.profile, hide)
                cp_s, csrc = cpc.exposed, cpc.source
        window = ComputeChunks(lt.fwd_s, lt.bwd_s, lt.experts_fwd_s, lt.experts_bwd_s)
        ex = expert_comm(layer, g, self.c, cfg, self.profile, window=window, engine=self.engine)
        if ex.fwd:
            csrc = ex.source
        dis_f, dis_b = ep_dispatch_s(layer, self.c, cfg, self.profile)  # the CPU dispatch's own work
        out = LayerCost(fwd=lt.fwd_s, bwd=lt.bwd_s, tp=tp_s, cp=cp_s, core=core_s, op_rc=lt.op_recompute_s,
                        source=lt.source, comm_source=csrc, ep_fwd=ex.fwd + dis_f, ep_bwd=ex.bwd + dis_b,
                        host=self.host_copy_s(layer), ep_unpaired=max(0.0, ex.alone - ex.fwd - ex.bwd),
                        sel_rc=selective_recompute_s(self.engine, core_s, lt.moe_fwd_s, ex.alone_fwd + dis_f))
        self.cache[layer.signature] = out
        return out


def selective_recompute_s(engine: Engine, core_s: float, moe_fwd_s: float, moe_comm_fwd_s: float) -> float:
    """What ``recompute=selective`` re-runs in one layer's backward, one micro-batch, on
    ``engine`` (``Engine.selective_modules``): the attention core's forward (``core_attn``:
    autopar's runtime, Megatron-Core's default) and the whole MoE layer's forward (``moe``: its
    routed GEMMs and dispatcher kernels, ``moe_fwd_s``, and its forward all-to-alls, exposed,
    ``moe_comm_fwd_s``). ``layernorm`` and ``moe_act`` re-run memory-bound
    kernels that are not priced here (their saved bytes are: cost_models/memory.py)."""
    mods = engine.selective_modules
    return (core_s if "core_attn" in mods else 0.0) + (moe_fwd_s + moe_comm_fwd_s if "moe" in mods else 0.0)


def fp8_gather_share(layer: Layer, cfg: ParallelConfig, engine: Engine) -> float:
    """Bytes a sequence-parallel all-gather of ``layer`` moves over those of the compute dtype:
    float8's 1 byte per element for a block's float8 linears on an engine that gathers them in
    float8 (``Engine.fp8_tp_all_gather``), else 1.0."""
    if cfg.fp8 == "none" or not engine.fp8_tp_all_gather or layer.kind != "transformer_block":
        return 1.0
    return 1.0 / DTYPE_BYTES[cfg.dtype]


@dataclass(frozen=True)
class PassTimes:
    """One layer, one micro-batch, under a recompute policy (seconds): what the pipeline runs
    forward and backward (exposed TP / CP communication included), their compute parts, and
    the recompute the backward carries."""
    fwd: float
    bwd: float
    compute_fwd: float
    compute_bwd: float
    recompute: float
    offload: float = 0.0   # the host copies' exposed part, forward + backward (``offload``)


def recompute_seconds(c: LayerCost, policy: str) -> float:
    """What ``policy`` re-runs in the backward of one layer and micro-batch: the whole forward
    (communication included) for ``full``; for ``selective-op`` its unkept compute
    (``op_rc``) and the forward TP communication at the same share of the forward (the
    collectives feeding unkept outputs run again); for ``selective`` what the engine's selective
    recompute re-runs (``sel_rc``: :func:`selective_recompute_s`); nothing for ``none``."""
    if policy == "full":
        return c.fwd_pass
    if policy == "selective-op":
        return c.op_rc * (1 + c.tp / 2 / c.fwd) if c.fwd > 0 else 0.0
    return c.sel_rc if policy == "selective" else 0.0


def layer_pass_times(c: LayerCost, policy: str) -> PassTimes:
    """The one per-layer stage-time rule the estimator and the ILP (planner/search/space.py) share,
    from ``LayerCosts.get``'s figures: TP communication split evenly between forward and
    backward, CP's exposed part 1:2 (the backward exchanges twice), the expert all-to-alls
    where they run, and the recompute (:func:`recompute_seconds`) added to the backward; under
    ``offload`` the host copies' part beyond the layer's own compute, each way
    (``cost_models/offload.py``)."""
    if policy == "offload":
        out, back = exposed_copy_s(c.host, c.fwd), exposed_copy_s(c.host, c.bwd)
        return PassTimes(fwd=c.fwd_pass + out, bwd=c.bwd_pass + back, compute_fwd=c.fwd, compute_bwd=c.bwd,
                         recompute=0.0, offload=out + back)
    extra = recompute_seconds(c, policy)
    return PassTimes(fwd=c.fwd_pass, bwd=c.bwd_pass + extra,
                     compute_fwd=c.fwd, compute_bwd=c.bwd + extra, recompute=extra)
