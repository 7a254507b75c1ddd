"""The GPU kernel model of one layer's time (cost_models/gpu_kernels.py's coefficients): every
linear's GEMMs at their sharded shapes, each routed expert's at its share of the rows, the fused
attention core by its kv length, each op's remaining bytes at HBM bandwidth with a launch floor
per memory-bound kernel, float8 linears and casts, the engine's fused kernels
(cost_models/engines.py). ``cost_models.compute.roofline_time`` calls it on GPU clusters.
"""
from __future__ import annotations

from cost_models import gpu_kernels as gk
from cost_models.cluster import Cluster
from cost_models.engines import DEFAULT_ENGINE, HOPPER_ATTENTION, UNFUSED_ATTENTION, Engine, fuses_elementwise
from cost_models.fused_elementwise import fused_op
from cost_models.layer_work import (LayerTime, attention_share, attn_core_flops, captured_tokens, document_kv_len,
                                    expert_gemms, full_square, fused_loss_layer, gemm_shape, shard_factor)
from cost_models.moe_layer import DISPATCH_KERNELS, dispatch_bytes, grouped_gemm_seconds
from cost_models.op_recompute import checkpointed, kept_linears, routed_unkept_share
from planner.graph import OUT_SPLIT_ROLES, Layer, ModelGraph
from planner.plan import ParallelConfig


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
    gpu = gk.gpu_spec(cluster, cfg.dtype)
    g = _GpuPass(layer, graph, cfg, gpu, co, elem, engine)
    g.fp8_cores = "fp8" in cluster.device.peak_tflops
    if cfg.fp8 != "none" and layer.kind == "transformer_block":  # the blocks' linears in float8 (torchao)
        g.fp8 = gk.gpu_spec(cluster, "fp8")
    g.gemms()
    g.attention()
    mem_fwd = g.memory_bound()
    # per-op recompute re-runs the unkept GEMMs and every memory-bound kernel, not attention
    return LayerTime(g.fwd, g.bwd, "roofline", op_recompute_s=g.unkept + mem_fwd if checkpointed(layer) else 0.0,
                     experts_fwd_s=g.experts_fwd, experts_bwd_s=g.experts_bwd,
                     moe_fwd_s=g.experts_fwd + g.dispatch_fwd)


# Bytes per element a float8 cast moves, by whether the block is compiled: eager, torchao reads the
# bf16 tensor for its amax, then reads it again and writes 1 byte (2 + 2 + 1); under torch.compile
# the amax is taken in the kernel that produced the tensor, leaving the cast's read and write (2 + 1).
# At 2 bytes per bf16 element (scaled to the compute dtype's size).
FP8_CAST_BYTES = {False: 5.0, True: 3.0}
# autopar's fused linear + cross-entropy forward (its Triton kernel: logits tile by tile with an
# online log-sum-exp) against a cuBLAS GEMM of the same shape as the kernel model prices it:
# benchmarks/kernels.py on one H200 (2026-12-04, benchmarks/measured/gpu_check_h200_2026-12-04.json),
# 8192 tokens, H 4096, V 128,256: 21.3 ms against the model's 13.4 ms.
FUSED_LOSS_FWD_SLOWDOWN = 1.59


class _GpuPass:
    """One layer's GPU kernels for one micro-batch, summed in order: GEMMs, attention, memory-bound."""

    def __init__(self, layer: Layer, graph: ModelGraph, cfg: ParallelConfig, gpu, co, elem: int,
                 engine: Engine = DEFAULT_ENGINE) -> None:
        self.layer, self.graph, self.cfg, self.gpu, self.co, self.elem = layer, graph, cfg, gpu, co, elem
        self.engine = engine
        self.scale = cfg.mbs / graph.batch
        self.m_cap = captured_tokens(layer, graph)
        self.tokens = self.m_cap * self.scale / cfg.cp
        self.fwd = self.bwd = self.unkept = 0.0  # unkept: the forward GEMMs per-op recompute runs again
        self.experts_fwd = self.experts_bwd = 0.0  # the routed experts' GEMMs (part of fwd / bwd)
        self.dispatch_fwd = 0.0  # the engine's fused dispatcher's forward kernels (part of fwd)
        self.gemm_bytes_cap: dict[str, float] = {}
        self.fp8: gk.GpuSpec | None = None  # float8 linears: the device at its fp8 peak
        self.fp8_cores = False  # the device has float8 tensor cores (Hopper and later)
        self.fused_loss = fused_loss_layer(layer, cfg)  # the head's logits GEMM and loss in one kernel

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

    def fused_loss_gemm(self, m: float, n: float, k: float) -> float:
        """Add autopar's fused linear + cross-entropy in place of the head's logits GEMM (m, n, k)
        (codegen/kernels/fused_loss.py): the forward kernel at ``FUSED_LOSS_FWD_SLOWDOWN`` times
        the GEMM's time; the backward runs it again (it recomputes the logits chunk by chunk),
        writes each chunk's logit gradient [m, n] once and runs the two dense backward GEMMs. The
        loss's memory-bound kernels never run (:meth:`memory_bound`); the forward seconds."""
        gpu, co, elem = self.gpu, self.co, self.elem
        t = FUSED_LOSS_FWD_SLOWDOWN * gk.gemm_seconds(m, n, k, elem, gpu, co)
        self.fwd += t
        self.bwd += (t + gk.gemm_seconds(m, k, n, elem, gpu, co) + gk.gemm_seconds(n, k, m, elem, gpu, co)
                     + gk.memory_seconds(m * n * elem, 1, gpu, co))
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
            shape = gemm_shape(lin, self.tokens, cfg.tp, cfg.sp)
            if self.fused_loss and lin.role == "vocab":
                t = self.fused_loss_gemm(*shape)
            elif self.fp8 is not None:
                t = self.fp8_linear(*shape, lin.role)
            else:
                t = self.gemm(*shape)
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
        """The attention core as the engine runs the plan's kernel (``Engine.attention_kernel_of``):
        fused, at its kernel's factors on Hopper; or unfused. The ring's log-sum-exp merges."""
        layer, graph, cfg, gpu, co, a = self.layer, self.graph, self.cfg, self.gpu, self.co, self.layer.attention
        if a is None:
            return
        half = a.causal and not full_square(layer, graph, cfg)  # SDPA with a document mask: the whole square
        core = attn_core_flops(layer, cfg.mbs) * (0.5 if half else 1.0) * attention_share(layer, graph, cfg)
        core /= cfg.tp * cfg.cp
        ring = cfg.cp // cfg.ulysses  # CP's ring degree: each block call sees kv_len / ring keys
        kv = min(a.kv_len / ring, document_kv_len(layer, graph, cfg))  # packed documents: their mean length
        kernel = self.engine.attention_kernel_of(cfg.attention, cfg.cp)
        if kernel == UNFUSED_ATTENTION:
            self.eager_attention(a)
            return
        sf, sb = HOPPER_ATTENTION[kernel] if self.fp8_cores else (1.0, 1.0)  # engines.py
        self.fwd += sf * gk.attention_seconds(core, kv, gpu, co)
        self.bwd += sb * gk.attention_seconds(core, kv, gpu, co, backward=True)
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
                self.dispatch_fwd = gk.memory_seconds(f, DISPATCH_KERNELS[0], self.gpu, self.co)
                share = op.fwd_bytes / layer.fwd_bytes if layer.fwd_bytes else 0.0  # its kernels, by its bytes
                kern_f = kern_f - share * layer.fwd_kernels + DISPATCH_KERNELS[0]
                kern_b = kern_b - share * layer.bwd_kernels + DISPATCH_KERNELS[1]
                continue
            share = (op.fwd_bytes / layer.fwd_bytes) if layer.fwd_bytes else 0.0
            if self.fused_loss and op.tp_style == "vocab":  # logits, softmax, loss: inside the fused kernel
                kern_f, kern_b = kern_f - share * layer.fwd_kernels, kern_b - share * layer.bwd_kernels
                continue
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
            mem_f = layer.fwd_bytes * scale * dscale * shard_factor(layer, cfg)
            mem_b = layer.bwd_bytes * scale * dscale * shard_factor(layer, cfg)
        mem_fwd = gk.memory_seconds(mem_f, kern_f, self.gpu, self.co)
        self.fwd += mem_fwd
        self.bwd += gk.memory_seconds(mem_b, kern_b, self.gpu, self.co)
        return mem_fwd
