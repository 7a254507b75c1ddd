"""Layer compute time on one rank: measured profile first, a model otherwise.

On GPU clusters the model is the kernel model of cost_models/gpu_kernels.py: every
GEMM of the layer priced at its own (M, N, K) after sharding, the fused attention core
by its kv length, the remaining bytes at HBM bandwidth and a launch floor per kernel
(:func:`gpu_layer_time`). On local CPU clusters it is the roofline below.

Roofline (CPU), per part of a layer (attention, MLP, norm, ...):

    t = max(FLOPs / (peak x EFF_MATMUL), bytes / (bandwidth x EFF_MEMORY))

summed over the layer's parts (a part is either matmul-bound or memory-bound; summing
the per-part maxima charges each its own bound), plus ``CPU_OP_OVERHEAD_S`` per tensor op
eager mode dispatches (``Layer.fwd_ops`` / ``bwd_ops``, per micro-batch whatever its size)
and under TP ``CPU_DTENSOR_MODULE_S`` per DTensor-sharded module (:func:`dtensor_dispatch_s`;
added to profiled layer times too: the profiler runs plain local shards).
Backward takes the backward FLOPs and bytes of the capture. The efficiency factors are defined once, here:

- ``EFF_MEMORY`` (0.70): fraction of memory bandwidth elementwise kernels sustain.
- The peak is the *measured* GEMM throughput of one process on
  a large square matmul (``Cluster.detect``); a layer's skinnier matmuls run below it,
  and 0.70 is an uncalibrated default (a profile replaces the roofline; calibration
  against measured runs is the fidelity issue's job).

Sharding, the way the runtime shards (see codegen/runtime/tensor_parallel.py):
- TP divides the FLOPs and bytes of attention (by heads), MLP (column->row) and the
  vocabulary-parallel head/embedding: the layer's ``tp_flops_frac`` part; norms and
  residual adds stay whole unless sequence parallel splits them along the sequence.
- CP divides everything by cp (each rank holds S/cp tokens); the attention core's
  S x S work is divided by cp as well (ring attention: each rank computes its queries
  against all keys, zigzag keeps it balanced).
- Causal attention does half the S x S work of what the FLOP counter records; the
  time uses the halved figure (model FLOPs for MFU use the full one, as is customary).
- Packed documents (``ModelGraph.documents``, cost_models/documents.py): a causal flash
  attention core does ``attention_share`` of the work of one document filling the row
  (:func:`attention_share`; FLOPs, times, per-op recompute and the model FLOPs of MFU
  alike), and on GPUs its kernel efficiency sees the shorter of the token-weighted mean
  document and the ring block's kv length. An eager (unfused) kernel computes and masks
  every score: its time does not change. Nor does memory (flash activations are linear in
  tokens; eager attention still materialises the masked S x S scores).
- Micro-batch size scales FLOPs and bytes linearly from the captured batch.

Calibration (``profile.calibration``, fitted to measured runs by ``autopar calibrate``,
see cost_models/calibrate.py): ``eff_matmul`` and ``eff_memory`` replace the roofline's
efficiency factors, ``op_overhead_s`` the per-op cost; ``compute_scale`` multiplies every layer time, measured or
roofline (a profiled layer timed alone runs faster than inside a training step that
shares the cores with collectives, the optimizer and the other ranks' Python).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cost_models import gpu_kernels as gk
from cost_models.cluster import Cluster
from cost_models.dtensor_dispatch import dtensor_dispatch_s
from cost_models.documents import busiest_share
from cost_models.fallback_attention import fallback_work, pinned_cores
from cost_models.engines import DEFAULT_ENGINE, FA2_HOPPER_SLOWDOWN, Engine, fuses_elementwise
from cost_models.fused_elementwise import fused_op
from cost_models.moe_layer import DISPATCH_KERNELS, dispatch_bytes, expert_rows, grouped_gemm_seconds
from cost_models.shared_cores import thread_op_s
from cost_models.op_recompute import checkpointed, kept_flops, kept_linears, routed_unkept_share
from planner.graph import OUT_SPLIT_ROLES, Layer, Linear, ModelGraph, MoEDims
from planner.plan import ParallelConfig

EFF_MATMUL_CPU = 0.70
EFF_MEMORY = 0.70
BWD_ATTN_CORE_FACTOR = 2.5  # flash backward = 2.5x its forward FLOPs
# Eager PyTorch on a CPU pays a fixed cost per dispatched op (dispatcher, autograd node,
# allocator) beside its FLOPs and bytes: 6 us, measured with torch 2.13 on a 2-core EPYC as the
# step time a plain single-thread training loop of gpt-mini adds per extra micro-batch (4.4 ms
# for its 654 captured ops: 0.264 s for 8 sequences in one micro-batch, 0.295 s in eight). It
# makes small micro-batches cost what they do; ``compute_scale`` (calibration) scales it too.
CPU_OP_OVERHEAD_S = 6e-6
# A CPU runs packed documents' masked attention and CP's blocks (ring or Ulysses, both RingCompute) through
# the flash kernels' plain-torch fallback (kernels/attention_torch.py, fp32 chunks): each FLOP
# about 3x slower than fused SDPA, which a plain causal call gets (torch 2.13, a 2-core Xeon, one thread, llama-mini's attention
# on a causal row of 2,048 tokens, forward + backward: 895 ms against 308 ms).
CPU_TORCH_ATTENTION_SLOWDOWN = 3.0


@dataclass
class LayerTime:
    """One layer, one micro-batch, one rank (seconds): forward, backward, and what per-op
    recompute (``selective-op``) re-runs of the forward."""
    fwd_s: float
    bwd_s: float
    source: str  # "profile" | "roofline"
    op_recompute_s: float = 0.0
    # the routed experts' GEMMs within fwd_s / bwd_s (GPU kernel model; 0 where not split out):
    # what an engine's 1F1B all-to-all overlap pairs with the other micro-batch's communication
    experts_fwd_s: float = 0.0
    experts_bwd_s: float = 0.0


def attn_core_flops(layer: Layer, batch: int) -> float:
    """Forward FLOPs of Q K^T and P V for ``batch`` sequences (full square, no causal halving):
    the capture's figure, one document filling each sequence."""
    a = layer.attention
    if a is None:
        return 0.0
    return 4.0 * batch * a.heads * a.seq_len * a.kv_len * a.head_dim


def attention_share(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None,
                    fallback: Cluster | None = None) -> float:
    """The share of :func:`attn_core_flops` that ``layer``'s attention core really does with the graph's
    packed documents; 1.0 without them, for a non-causal core (a vision encoder's) and for an eager
    kernel under ``cfg`` (it computes every score, then masks). Under ``cfg``: the busiest rank's share
    of the layout (``cost_models.documents.busiest_share``: the step waits for it; ``fallback``: the CPU
    cluster whose plain-torch kernel runs it, documents or not, its blocks and calls over cp 1's per
    rank, ``cost_models.fallback_attention.fallback_work``); without: the useful work (model FLOPs)."""
    if fallback is not None and cfg is not None:
        mix = graph.documents if document_masked(layer, graph, cfg) else None
        return fallback_work(mix, graph.seq_len, cfg.dp, cfg.cp, cfg.ulysses, cfg.mbs, pinned_cores(fallback, cfg))
    if not document_masked(layer, graph, cfg):
        return 1.0
    if cfg is None:
        return graph.documents.attention_share
    return busiest_share(graph.documents, cfg.dp, cfg.cp, cfg.ulysses, cfg.mbs)


def document_masked(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None) -> bool:
    """Whether ``layer``'s attention core skips the work its packed documents' masks leave out
    (:func:`attention_share`): a causal core, with documents, not an eager kernel under ``cfg``."""
    a = layer.attention
    return (a is not None and a.causal and graph.documents is not None
            and (cfg is None or cfg.attention != "eager"))


def document_kv_len(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None) -> float:
    """Keys a query's attention kernel sees at most with packed documents: the token-weighted
    mean document length (``DocumentMix.mean_tokens``); infinite without (:func:`document_masked`)."""
    return graph.documents.mean_tokens if document_masked(layer, graph, cfg) else math.inf


def model_flops_per_seq(graph: ModelGraph) -> float:
    """Forward + backward FLOPs of one sequence as MFU counts them: the capture's (full-square
    attention), with packed documents the attention cores at their real, document-masked
    work (``attention_share`` of forward and backward; the backward of Q K^T and P V is
    twice their forward)."""
    saved = sum(3.0 * attn_core_flops(l, graph.batch) * (1.0 - attention_share(l, graph)) for l in graph.layers)
    return graph.flops_per_seq() - saved / graph.batch


def _shard_factor(layer: Layer, cfg: ParallelConfig) -> float:
    """Fraction of a layer's per-token work one rank does under tp / sp / cp."""
    f = layer.tp_flops_frac
    rest_div = cfg.seq_shards
    return (f / cfg.tp + (1.0 - f) / rest_div) / cfg.cp


def op_recompute_share(layer: Layer, graph: ModelGraph, cfg: ParallelConfig | None = None) -> float:
    """Share of ``layer``'s forward FLOPs that per-op recompute (``selective-op``) runs again:
    1 - (kept matmul FLOPs + attention-core FLOPs) / forward FLOPs, for the captured batch
    (``op_recompute.kept_flops``); 0 for layers the runtime does not
    checkpoint. Where the layer time has no kernel breakdown (CPU roofline, profiled
    layers) the recompute is this share of the forward time."""
    if not checkpointed(layer) or layer.fwd_flops <= 0:
        return 0.0
    kept = kept_flops(layer, graph)
    a = layer.attention
    fwd = layer.fwd_flops
    if a is not None:
        core, share = attn_core_flops(layer, graph.batch), attention_share(layer, graph, cfg)
        kept += core * (0.5 if a.causal else 1.0) * share
        fwd -= core * 0.5 * (1.0 - share)  # the work packed documents leave out (0 without them)
    return min(1.0, max(0.0, 1.0 - kept / fwd)) if fwd > 0 else 0.0


def calibration(profile) -> dict[str, float]:
    """The fitted coefficients of a ProfileDB (``{}`` without a profile or a calibration)."""
    return getattr(profile, "calibration", None) or {}


def calibration_note(profile) -> str:
    """One line for plans and reports: whether the estimate uses fitted coefficients, and which."""
    cal = calibration(profile)
    if not cal:
        return "uncalibrated"
    return profile.calibration_source or "calibrated (autopar calibrate)"


def _gemm_shape(lin: Linear, tokens: float, tp: int, sp: bool = False) -> tuple[float, float, float]:
    """(M, N, K) of a linear's forward GEMM on one tp rank, as the runtime shards it: a
    TP-split linear by its features; one TP leaves whole (a router, a MoE layer's shared
    experts) runs on the rank's sequence shard under sequence parallel."""
    n, k = lin.out_features, lin.in_features
    if tp > 1 and lin.role in OUT_SPLIT_ROLES:
        n = n / tp
    elif tp > 1 and lin.role == "row":
        k = k / tp
    elif tp > 1 and sp:
        tokens = tokens / tp
    return tokens, n, k


def _captured_tokens(layer: Layer, graph: ModelGraph) -> float:
    """Tokens of the layer's GEMMs at capture: its matmul FLOPs (all but the attention core)
    over 2 x sum(in x out) of its linears, plus 3 x 2 x top_k x hidden x expert_ffn per token
    for routed experts."""
    per_token = 2.0 * sum(l.in_features * l.out_features for l in layer.linears)
    if layer.moe is not None:
        per_token += 6.0 * layer.moe.top_k * graph.hidden * layer.moe.expert_ffn
    if not per_token:
        return 0.0
    return max(layer.fwd_flops - attn_core_flops(layer, graph.batch), 0.0) / per_token


def memory_bandwidth(cluster: Cluster, cal: dict[str, float] | None = None) -> float:
    """Bytes/s a memory-bound kernel sustains on one device: the nominal bandwidth times the
    GPU kernel model's ``mem_eff`` on GPUs, ``EFF_MEMORY`` (or the calibrated ``eff_memory``)
    on CPUs."""
    bw = cluster.device.mem_bw_gbs * 1e9
    if cluster.backend != "gloo":
        return bw * gk.GpuCoefficients.of(cal).mem_eff
    return bw * (cal or {}).get("eff_memory", EFF_MEMORY)


def expert_gemms(moe: MoEDims, tokens: float, hidden: int, ep: int = 1) -> list[tuple[float, float, float]]:
    """(M, N, K) of one local routed expert's forward GEMMs (gate, up: hidden -> expert_ffn;
    down: back) on the busiest rank when each of the ``ep`` ranks of an expert-parallel group
    routes ``tokens`` tokens ``top_k`` ways (``cost_models.moe_layer.expert_rows``)."""
    rows = expert_rows(moe, tokens, ep)
    return [(rows, moe.expert_ffn, hidden), (rows, moe.expert_ffn, hidden), (rows, hidden, moe.expert_ffn)]


def gpu_layer_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
                   cal: dict[str, float] | None = None, engine: Engine = DEFAULT_ENGINE) -> LayerTime:
    """Forward and backward seconds of ``layer`` for one micro-batch on one GPU, from its
    kernels (cost_models/gpu_kernels.py): every linear's GEMMs at their sharded shapes
    (backward: input and weight gradients), each routed expert's GEMMs at its share of the
    rows (:func:`expert_gemms`, the balanced load), the fused attention core (causal-halved,
    divided by tp and cp, efficiency by the kv length each rank's blocks have: ``S / cp`` under
    ring attention, ``S`` under Ulysses, whose heads are split instead; the ring's
    log-sum-exp merges of partial outputs as memory-bound kernels), and each
    op's remaining bytes (norms, activations, rotary, softmax, loss) at HBM bandwidth,
    divided as TP / SP / CP divide that op, plus a launch floor per memory-bound kernel."""
    co = gk.GpuCoefficients.of(cal)
    elem = 4 if cfg.dtype == "fp32" else 2
    gpu = gk.GpuSpec(peak=cluster.peak_flops(cfg.dtype), bw=cluster.device.mem_bw_gbs * 1e9, sms=cluster.device.sms)
    g = _GpuPass(layer, graph, cfg, gpu, co, elem, engine)
    g.fp8_cores = "fp8" in cluster.device.peak_tflops
    if cfg.fp8 != "none" and layer.kind == "transformer_block":  # the blocks' linears in float8 (torchao)
        g.fp8 = gk.GpuSpec(peak=cluster.peak_flops("fp8"), bw=gpu.bw, sms=gpu.sms)
    g.gemms()
    g.attention()
    mem_fwd = g.memory_bound()
    # per-op recompute re-runs the unkept GEMMs and every memory-bound kernel, not attention
    return LayerTime(g.fwd, g.bwd, "roofline", op_recompute_s=g.unkept + mem_fwd if checkpointed(layer) else 0.0,
                     experts_fwd_s=g.experts_fwd, experts_bwd_s=g.experts_bwd)


# Bytes per element a float8 cast moves, by whether the block is compiled: eager, torchao reads the
# bf16 tensor for its amax, then reads it again and writes 1 byte (2 + 2 + 1); under torch.compile
# the amax is taken in the kernel that produced the tensor, leaving the cast's read and write (2 + 1).
# At 2 bytes per bf16 element (scaled to the compute dtype's size).
FP8_CAST_BYTES = {False: 5.0, True: 3.0}


class _GpuPass:
    """One layer's GPU kernels for one micro-batch, summed in order: GEMMs, attention, memory-bound."""

    def __init__(self, layer: Layer, graph: ModelGraph, cfg: ParallelConfig, gpu, co, elem: int,
                 engine: Engine = DEFAULT_ENGINE) -> None:
        self.layer, self.graph, self.cfg, self.gpu, self.co, self.elem = layer, graph, cfg, gpu, co, elem
        self.engine = engine
        self.scale = cfg.mbs / graph.batch
        self.m_cap = _captured_tokens(layer, graph)
        self.tokens = self.m_cap * self.scale / cfg.cp
        self.fwd = self.bwd = self.unkept = 0.0  # unkept: the forward GEMMs per-op recompute runs again
        self.experts_fwd = self.experts_bwd = 0.0  # the routed experts' GEMMs (part of fwd / bwd)
        self.gemm_bytes_cap: dict[str, float] = {}
        self.fp8: gk.GpuSpec | None = None  # float8 linears: the device at its fp8 peak
        self.fp8_cores = False  # the device has float8 tensor cores (Hopper and later)

    def gemm(self, m: float, n: float, k: float, times: float = 1.0) -> float:
        """Add ``times`` GEMMs of (m, n, k) forward and their two backward GEMMs; the forward seconds."""
        gpu, co, elem = self.gpu, self.co, self.elem
        t = times * gk.gemm_seconds(m, n, k, elem, gpu, co)
        self.fwd += t
        self.bwd += times * (gk.gemm_seconds(m, k, n, elem, gpu, co) + gk.gemm_seconds(n, k, m, elem, gpu, co))
        return t

    def fp8_linear(self, m: float, n: float, k: float, role: str = "") -> float:
        """Add a float8 linear (torchao's recipe: all three GEMMs in float8, at the device's fp8
        peak, 1-byte operands) and its casts (``FP8_CAST_BYTES``): forward X [m, k] and W [k, n],
        backward dY [m, n] and the transposed float8 copies of X and W; the forward seconds.
        On an engine that all-gathers sequence-parallel activations in float8
        (``Engine.fp8_tp_all_gather``) a column-parallel linear casts its input, and a
        row-parallel one its output's gradient, on the rank's sequence shard before the gather."""
        gpu8, co, cfg = self.fp8, self.co, self.cfg
        t = gk.gemm_seconds(m, n, k, 1, gpu8, co)
        self.fwd += t
        self.bwd += gk.gemm_seconds(m, k, n, 1, gpu8, co) + gk.gemm_seconds(n, k, m, 1, gpu8, co)
        gathered = self.engine.fp8_tp_all_gather and cfg.sp and cfg.tp > 1
        x_rows = m / cfg.tp if gathered and role in OUT_SPLIT_ROLES else m
        dy_rows = m / cfg.tp if gathered and role == "row" else m
        cast = FP8_CAST_BYTES[cfg.compile] * self.elem / 2
        self.fwd += gk.memory_seconds(cast * (x_rows * k + k * n), 4, self.gpu, co)
        self.bwd += gk.memory_seconds(cast * dy_rows * n + 2 * (m * k + k * n), 4, self.gpu, co)
        return t

    def grouped(self, groups: int, m: float, n: float, k: float) -> float:
        """Add a grouped GEMM of ``groups`` (m, n, k) forward and its two backward ones
        (``cost_models.moe_layer.grouped_gemm_seconds``); the forward seconds."""
        gpu, co, elem = self.gpu, self.co, self.elem
        t = grouped_gemm_seconds(groups, m, n, k, elem, gpu, co)
        self.fwd += t
        self.bwd += grouped_gemm_seconds(groups, m, k, n, elem, gpu, co) + grouped_gemm_seconds(groups, n, k, m, elem, gpu, co)
        return t

    def gemms(self) -> None:
        """Every linear at its sharded shape; routed experts per expert at its share of the rows."""
        layer, graph, cfg, m_cap = self.layer, self.graph, self.cfg, self.m_cap
        kept = {id(lin) for lin in kept_linears(layer)}
        for lin in layer.linears:
            shape = _gemm_shape(lin, self.tokens, cfg.tp, cfg.sp)
            t = self.fp8_linear(*shape, lin.role) if self.fp8 is not None else self.gemm(*shape)
            self.unkept += 0.0 if id(lin) in kept else t
            op = next((o.name for o in layer.ops if o.name and lin.name.startswith(o.name + ".")), "")
            io = m_cap * lin.in_features + lin.in_features * lin.out_features + m_cap * lin.out_features
            self.gemm_bytes_cap[op] = self.gemm_bytes_cap.get(op, 0.0) + io * graph.dtype_bytes
        if layer.moe is not None:  # routed experts: per expert, its share of the rows (balanced load)
            routed = self.tokens / cfg.seq_shards  # under TP the rank routes its sequence shard
            local = layer.moe.experts // cfg.ep
            fwd0, bwd0, unkept = self.fwd, self.bwd, routed_unkept_share(layer)  # (walks the matmuls: once)
            for m, n, k in expert_gemms(layer.moe, routed, graph.hidden, cfg.ep):
                if self.engine.moe_grouped_gemm:  # one kernel over the local experts
                    t = self.grouped(local, m, n, k)
                else:
                    t = self.gemm(m, n, k, local)
                self.unkept += t * unkept
            self.experts_fwd, self.experts_bwd = self.fwd - fwd0, self.bwd - bwd0
            rows_cap, h, f = m_cap * layer.moe.top_k, graph.hidden, layer.moe.expert_ffn
            io = 3 * (rows_cap * h + layer.moe.experts * h * f + rows_cap * f)  # inputs, weights, outputs
            self.gemm_bytes_cap[layer.moe.part] = self.gemm_bytes_cap.get(layer.moe.part, 0.0) + io * graph.dtype_bytes

    def attention(self) -> None:
        """The fused attention core, and the ring's log-sum-exp merges."""
        layer, graph, cfg, gpu, co, a = self.layer, self.graph, self.cfg, self.gpu, self.co, self.layer.attention
        if a is None:
            return
        core = attn_core_flops(layer, cfg.mbs) * (0.5 if a.causal else 1.0) * attention_share(layer, graph, cfg)
        core /= cfg.tp * cfg.cp
        ring = cfg.cp // cfg.ulysses  # CP's ring degree: each block call sees kv_len / ring keys
        kv = min(a.kv_len / ring, document_kv_len(layer, graph, cfg))  # packed documents: their mean length
        if cfg.attention == "eager":
            self.eager_attention(a)
            return
        slow = FA2_HOPPER_SLOWDOWN if self.engine.attention_fa2 and self.fp8_cores else 1.0  # engines.py
        self.fwd += slow * gk.attention_seconds(core, kv, gpu, co)
        self.bwd += slow * gk.attention_seconds(core, kv, gpu, co, backward=True)
        if ring > 1:  # each ring step's partial output merged by log-sum-exp: read two, write one (fp32)
            merge = 3 * cfg.mbs * (a.seq_len / cfg.cp) * (a.heads / cfg.tp) * (a.head_dim + 1) * 4
            self.fwd += gk.memory_seconds((ring - 1) * merge, ring - 1, gpu, co)
            self.bwd += gk.memory_seconds(2 * (ring - 1) * merge, 2 * (ring - 1), gpu, co)

    def eager_attention(self, a) -> None:
        """Unfused attention (``attention=eager``; Megatron-LM before flash attention): the scores
        materialised over the full square (no causal skipping), two batched GEMMs per pass -
        Q K^T of (S, S, d) and P V of (S, d, S) per head, with their backward GEMMs - and the
        fused scale-mask-softmax reading and writing the scores in HBM (backward: reading the
        probabilities and their gradient, writing the scores' gradient)."""
        cfg, gpu, co = self.cfg, self.gpu, self.co
        rows = cfg.mbs * (a.heads / cfg.tp) * (a.seq_len / cfg.cp)  # (sequence, head, query) rows
        kv = a.kv_len
        self.gemm(rows, kv, a.head_dim)
        self.gemm(rows, a.head_dim, kv)
        scores = rows * kv * self.elem
        self.fwd += gk.memory_seconds(2 * scores, 1, gpu, co)
        self.bwd += gk.memory_seconds(3 * scores, 1, gpu, co)

    def memory_bound(self) -> float:
        """Each op's bytes beyond its GEMMs at HBM bandwidth; returns the forward's seconds."""
        layer, cfg, scale = self.layer, self.cfg, self.scale
        dscale = self.elem / self.graph.dtype_bytes
        mem_f = mem_b = 0.0
        kern_f, kern_b = layer.fwd_kernels, layer.bwd_kernels
        fused_moe = layer.moe is not None and self.engine.moe_fused_permute
        for op in layer.ops:
            div = (cfg.tp if op.tp_style != "replicated" else cfg.seq_shards) * cfg.cp
            if fused_moe and op.name == layer.moe.part:  # the engine's fused dispatcher, not the capture's kernels
                f, b = dispatch_bytes(layer.moe, self.tokens / cfg.seq_shards, self.graph.hidden, self.elem, cfg.ep)
                mem_f, mem_b = mem_f + f, mem_b + b
                share = op.fwd_bytes / layer.fwd_bytes if layer.fwd_bytes else 0.0  # its kernels, by its bytes
                kern_f = kern_f - share * layer.fwd_kernels + DISPATCH_KERNELS[0]
                kern_b = kern_b - share * layer.bwd_kernels + DISPATCH_KERNELS[1]
                continue
            share = (op.fwd_bytes / layer.fwd_bytes) if layer.fwd_bytes else 0.0
            fused = fused_op(op, layer, self.graph, self.elem) if fuses_elementwise(self.engine, cfg) else None
            if fused is not None:  # the engine's fused kernels (cost_models/fused_elementwise.py)
                tokens = (self.m_cap or self.graph.batch * self.graph.seq_len) * scale
                mem_f += fused.fwd_bytes * tokens / div
                mem_b += fused.bwd_bytes * tokens / div
                kern_f += fused.fwd_kernels - share * layer.fwd_kernels  # its eager kernels, by its bytes
                kern_b += fused.bwd_kernels - share * layer.bwd_kernels
                continue
            mm = self.gemm_bytes_cap.get(op.name, 0.0)
            mem_f += max(op.fwd_bytes - mm, 0.0) * scale * dscale / div
            mem_b += max(layer.bwd_bytes * share - 2 * mm, 0.0) * scale * dscale / div
        if not layer.ops:
            mem_f = layer.fwd_bytes * scale * dscale * _shard_factor(layer, cfg)
            mem_b = layer.bwd_bytes * scale * dscale * _shard_factor(layer, cfg)
        mem_fwd = gk.memory_seconds(mem_f, kern_f, self.gpu, self.co)
        self.fwd += mem_fwd
        self.bwd += gk.memory_seconds(mem_b, kern_b, self.gpu, self.co)
        return mem_fwd


def roofline_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
                  cal: dict[str, float] | None = None, engine: Engine = DEFAULT_ENGINE) -> LayerTime:
    """The model's layer time: the GPU kernel model on GPU clusters (as ``engine`` runs the
    layer), the roofline on CPUs."""
    cal = cal or {}
    if cluster.backend != "gloo":
        return gpu_layer_time(layer, graph, cluster, cfg, cal, engine)
    peak = cluster.peak_flops("fp32")
    eff = cal.get("eff_matmul", EFF_MATMUL_CPU)
    bw = cluster.device.mem_bw_gbs * 1e9 * cal.get("eff_memory", EFF_MEMORY)
    scale = cfg.mbs / graph.batch
    dscale = (2 if cfg.dtype != "fp32" else 4) / graph.dtype_bytes
    core = attn_core_flops(layer, graph.batch)
    causal = layer.attention is not None and layer.attention.causal
    fallback = cfg.attention == "flash" and (document_masked(layer, graph, cfg) or (causal and cfg.cp > 1))
    causal_cut = core * (1.0 - 0.5 * attention_share(layer, graph, cfg, cluster if fallback else None)) if causal else 0.0
    slow = CPU_TORCH_ATTENTION_SLOWDOWN if fallback else 1.0  # masks, or CP's blocks: the torch fallback
    fwd = bwd = 0.0
    shard = _shard_factor(layer, cfg)
    for op in layer.ops:
        f_fwd, f_bwd = op.fwd_flops, op.bwd_flops
        if op.kind == "attention" and causal_cut:
            f_fwd -= causal_cut
            f_bwd -= causal_cut * BWD_ATTN_CORE_FACTOR
        if op.kind == "attention":
            f_fwd, f_bwd = f_fwd * slow, f_bwd * slow
        op_div = (cfg.tp if op.tp_style != "replicated" else cfg.seq_shards) * cfg.cp
        bytes_f = op.fwd_bytes * dscale
        fwd += max(max(f_fwd, 0.0) / (peak * eff), bytes_f / bw) * scale / op_div
        share = (op.fwd_bytes / layer.fwd_bytes) if layer.fwd_bytes else 0.0
        bytes_b = layer.bwd_bytes * share * dscale
        bwd += max(max(f_bwd, 0.0) / (peak * eff), bytes_b / bw) * scale / op_div
    if not layer.ops:
        fwd = layer.fwd_bytes * dscale / bw * scale * shard
        bwd = layer.bwd_bytes * dscale / bw * scale * shard
    op_s = cal.get("op_overhead_s", CPU_OP_OVERHEAD_S) + thread_op_s(cluster, cfg)  # + the threads' wake-up
    fwd += layer.fwd_ops * op_s
    return LayerTime(fwd, bwd + layer.bwd_ops * op_s, "roofline",
                     op_recompute_s=op_recompute_share(layer, graph, cfg) * fwd)


def _documents_scaled(got: tuple[float, float], layer: Layer, graph: ModelGraph, cluster: Cluster,
                      cfg: ParallelConfig, cal: dict[str, float]) -> tuple[float, float]:
    """A profiled (forward, backward) time, measured with one document filling each sequence,
    scaled to the graph's packed documents by the model's own ratio of the two layer times."""
    with_docs = roofline_time(layer, graph, cluster, cfg, cal)
    without = roofline_time(layer, replace(graph, documents=None), cluster, cfg, cal)
    f = with_docs.fwd_s / without.fwd_s if without.fwd_s > 0 else 1.0
    b = with_docs.bwd_s / without.bwd_s if without.bwd_s > 0 else 1.0
    return got[0] * f, got[1] * b


def _speed_scaled(got: tuple[float, float], layer: Layer, graph: ModelGraph, cluster: Cluster,
                  profiled_on: Cluster, cfg: ParallelConfig, cal: dict[str, float]) -> tuple[float, float]:
    """A profiled (forward, backward) time, measured on ``profiled_on``'s ranks, on ``cluster``'s
    (other CPU ranks and threads: ``cost_models.shared_cores.ranks_cluster``), scaled by the
    roofline's own ratio of the two (its per-op cost does not speed up with threads)."""
    now = roofline_time(layer, graph, cluster, cfg, cal)
    then = roofline_time(layer, graph, profiled_on, cfg, cal)
    f = now.fwd_s / then.fwd_s if then.fwd_s > 0 else 1.0
    b = now.bwd_s / then.bwd_s if then.bwd_s > 0 else 1.0
    return got[0] * f, got[1] * b


def layer_time(layer: Layer, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig,
               profile=None, engine: Engine = DEFAULT_ENGINE, profiled_on: Cluster | None = None) -> LayerTime:
    """Forward and backward seconds of ``layer`` for one micro-batch of ``cfg.mbs`` sequences
    on one rank: from ``profile`` (a ProfileDB) when it measured this layer class at this
    tp/cp, interpolated across shapes; from the roofline otherwise. A calibrated profile's
    ``compute_scale`` multiplies either. ``profiled_on``: the cluster the profile measured when
    ``cluster`` is another (fewer CPU ranks with more threads, :func:`_speed_scaled`)."""
    cal = calibration(profile)
    k = cal.get("compute_scale", 1.0)
    df, db = dtensor_dispatch_s(layer, cluster, cfg, cal)
    if profile is not None:
        got = profile.layer_time(layer.signature, cfg.mbs, graph.seq_len, cfg.tp, cfg.cp)
        if got is not None and attention_share(layer, graph, cfg) != 1.0:
            got = _documents_scaled(got, layer, graph, cluster, cfg, cal)
        if got is not None and profiled_on is not None and profiled_on is not cluster:
            got = _speed_scaled(got, layer, graph, cluster, profiled_on, cfg, cal)
        if got is not None:  # the profiler times plain local shards: no DTensor dispatch
            fwd = (got[0] + df) * k
            return LayerTime(fwd, (got[1] + db) * k, "profile",
                             op_recompute_s=op_recompute_share(layer, graph, cfg) * fwd)
    t = roofline_time(layer, graph, cluster, cfg, cal, engine)
    share = t.op_recompute_s / t.fwd_s if t.fwd_s > 0 else 0.0
    fwd = (t.fwd_s + df) * k
    return LayerTime(fwd, (t.bwd_s + db) * k, t.source, op_recompute_s=share * fwd,
                     experts_fwd_s=t.experts_fwd_s * k, experts_bwd_s=t.experts_bwd_s * k)
