"""The training engine an estimate prices: which communication it hides, and how.

The same layout runs at different speeds on different engines because they overlap
different things. Each engine is a set of explicit switches, each the documented
behaviour of a named engine (the flag or default that turns it on is cited):

- ``tp_overlap``: tensor-parallel collectives (the all-reduce, or sequence parallel's
  all-gather / reduce-scatter) run in chunks beside the GEMMs that consume or produce
  them (Megatron-Core ``--tp-comm-overlap``, Transformer Engine userbuffers; torchtitan's
  async TP). Each collective is cut into ``tp`` ring steps, each overlapped with a GEMM
  chunk; the first step waits for nothing to hide behind, so a layer's TP traffic ``C``
  beside its compute ``W`` costs ``exposed_s(C, W, C / tp)``.
- ``dp_overlap``: gradient reduction issued bucket by bucket while the backward still runs
  (torch DDP and FSDP2 by default; Megatron-Core ``--overlap-grad-reduce``; absent from
  2021-22 Megatron-LM, whose local DDP reduced after the backward: Korthikanti et al.
  2022, Sec. 6, "no data-parallel overlap").
- ``dist_opt_reduce_scatter``: a distributed optimizer (ZeRO-1) reduce-scatters the
  gradients and all-gathers the updated parameters (Megatron-Core's distributed optimizer,
  the same bytes as one all-reduce); otherwise all-reduce, then each parameter broadcast
  from its owner (autopar's runtime).
- ``dist_opt_states``: the distributed optimizer's states (Megatron-Core
  ``--use-distributed-optimizer``): under ZeRO-1 the parameters in the compute dtype, fp32 main
  gradients, the fp32 master weights and moments sharded over dp (``2 + 4 + 12 / dp`` bytes per
  parameter in bf16: cost_models/model_states.py); otherwise autopar's runtime's (fp32 masters
  and gradients, a compute copy per unit).
- ``param_gather_overlap``: ZeRO-1's parameter all-gather runs behind the next step's first
  forward (Megatron-Core ``--overlap-param-gather``); otherwise after the optimizer step.
- ``p2p_overlap``: pipeline sends and receives are asynchronous and hide behind the other
  micro-batches' compute in the steady state; only the fill and drain hops stay exposed
  (Megatron-Core ``overlap_p2p_comm`` for interleaved schedules; Llama 3's async P2P).
- ``ep_overlap``: expert all-to-alls hidden behind another micro-batch's compute under
  1F1B (Megatron-Core ``--overlap-moe-expert-parallel-comm``): one micro-batch's forward and
  another's backward of a layer are cut into attention, dispatch, experts and combine, and
  each communication chunk runs beside one compute chunk of the other pass (DeepSeek-V3
  §3.2.1's four components; cost_models/experts.py pairs them), adding what its partner does
  not hide (:func:`paired_exposed_s`).
- ``ep_comm_sms``: streaming multiprocessors the dispatcher's kernels hold while they run
  (DeepEP: 20 of an H100's 132, DeepSeek-V3 §3.2.2); compute overlapped with them runs on the
  rest, so even a hidden all-to-all costs that share of its time (:func:`paired_exposed_s`).
- ``moe_grouped_gemm``: the local experts' GEMMs as one grouped kernel (Megatron-Core
  ``--moe-grouped-gemm``; torchtitan's grouped matmul), waves counted over all of them.
- ``moe_fused_permute``: the dispatcher's permute / unpermute fused (Megatron-Core
  ``--moe-permute-fusion``): its passes and saved tensors, not the capture's eager kernels.
- ``ep_node_dedup``: node-deduplicated dispatch across nodes (DeepEP; Megatron-Core
  ``--moe-token-dispatcher-type flex``): a token crosses the network once per remote node.
  (The MoE mechanisms themselves: cost_models/moe_layer.py and cost_models/experts.py.)
- ``fused_elementwise``: a block's norms, rotary embedding and activation run as fused kernels
  (Transformer Engine's fused RMSNorm / LayerNorm and RoPE, Megatron-Core's fused bias-SwiGLU /
  bias-GeLU), moving and keeping what those kernels do rather than the eager ops the capture
  recorded (cost_models/fused_elementwise.py); off in autopar's runtime and torchtitan (eager).
- ``recompute_modules``: what Megatron-Core's selective recompute (``--recompute-modules``) re-runs
  in place of its default, the attention core (``core_attn``): ``layernorm`` (the norms' outputs,
  recomputed from their kept inputs), ``moe_act`` (the experts' activation outputs) and ``moe``
  (the whole MoE layer: router, dispatch and combine all-to-alls, experts; it keeps only its input);
  set per run where a run states it (benchmarks/published_moe.py), empty in every registered
  engine (:attr:`Engine.selective_modules`).
- ``split_ends``: the even stage split counts the layers before the first block (the embedding)
  and those after the last (final norm, head and loss) as one block each, so that the first and
  last virtual stages hold one block fewer (Megatron-Core ``--account-for-embedding-in-pipeline-split``
  and ``--account-for-loss-in-pipeline-split``: ``planner.search.stage_split.end_units``); set per
  run where a run states it (benchmarks/published_moe.py), off in every registered engine. It
  prices Megatron's even split only: the stage ILP's splits and vocabulary passes keep autopar's
  runtime's stage groups (its embedding runs with the first block), as do the plans autopar writes.
- ``fp8_tp_all_gather``: under float8 linears with sequence-parallel TP, the all-gathers of the
  activations into the column-parallel linears (and of the gradients into the row-parallel ones)
  move float8 (1 byte per element); reduce-scatters stay in the compute dtype (torchtitan's
  float8 TP styles, on by default with its ``Float8Linear``: docs/float8.md, "float8 all-gather
  ... for TP (by default for Float8Linear)").
- ``attention_kernel``: the kernel the attention core runs, a key of ``HOPPER_ATTENTION``, which
  gives its (forward, backward) time on devices with float8 tensor cores (Hopper) as multiples of
  the fitted fused-attention curve (``gpu_kernels.attention_seconds``), fitted on the FA3-class
  kernels (Transformer Engine's cuDNN attention, FlashAttention-3) of Megatron-Core's H100 runs:
  ``fa3`` those (Megatron-Core); ``fa2`` torch's SDPA flash kernel, FlashAttention-2 (torchtitan,
  2024); ``autopar-triton`` autopar's own Triton kernel (codegen/kernels/attention.py), which
  autopar's runtime runs for ``attention=flash`` on CUDA; ``torch-sdpa`` torch's
  ``scaled_dot_product_attention`` with the backend it chooses itself.
- ``eager_attention``: what ``attention=eager`` runs: ``unfused`` (Megatron-LM before flash
  attention: the scores and probabilities materialised in HBM, ``gpu_layer.eager_attention``), or a
  fused kernel, a key of ``HOPPER_ATTENTION``: autopar's runtime calls SDPA
  (``codegen.runtime.documents.EagerAttention``), fused on CUDA and on CPU alike - with a document
  mask too (torch 2.13 on CPU: a causal boolean mask over 4K tokens and 16 heads added 0.14 GiB to
  the peak, not the 1 GiB of materialised fp32 scores), so it keeps no S x S tensor; under CP
  its ring runs unfused blocks (:meth:`Engine.attention_kernel_of`).
- ``fsdp2_mixed_precision``: FSDP2's ``MixedPrecisionPolicy`` (fp32 masters, compute-dtype copies
  cast per unshard, gradients cast to fp32 and accumulated every backward): the per-micro-batch
  copies of cost_models/mp_casts.py (autopar's runtime, codegen/runtime/precision.py; torchtitan's
  ``mixed_precision_param`` bf16 / ``mixed_precision_reduce`` fp32 defaults).
- ``fused_optimizer``: one fused AdamW kernel per parameter group (Apex / TE FusedAdam in
  Megatron; torchtitan's default ``fused``; autopar's runtime, ``codegen.runtime.optim.adamw``):
  ``FUSED_OPT_BYTES_PER_PARAM`` instead of the
  eight passes of torch's foreach AdamW (``FOREACH_OPT_BYTES_PER_PARAM``).

What "hidden" means is one rule, :func:`exposed_s`: a collective of ``C`` seconds beside
``W`` seconds of compute it can run under adds ``tail + max(0, C - tail - W)``, where
``tail`` is the part that can start only when that compute is over.

Plans are priced under ``autopar`` (what codegen emits runs on it); published runs under
the engine that ran them (benchmarks/published_express.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.cluster import ClusterError

# torch's AdamW in its multi-tensor "foreach" form (autopar's runtime) passes over the fp32
# weights, gradients and two moments eight times: weight decay (8 B), the first moment's lerp
# (12), the second's mul and addcmul (8 + 12), its square root, bias correction and epsilon
# (3 x 8) and the addcdiv update (16). Measured on CPU: 2.5 ns per parameter, one process.
FOREACH_OPT_BYTES_PER_PARAM = 80.0
# Fused AdamW, fp32 states: read the parameter, gradient and two moments, write the
# parameter and the moments (7 x 4 bytes) per parameter, in one pass.
FUSED_OPT_BYTES_PER_PARAM = 28.0
# SMs DeepEP's dispatch / combine kernels occupy (DeepSeek-V3 technical report, §3.2.2: 20 SMs in
# 10 channels suffice to saturate IB and NVLink).
DEEPEP_SMS = 20
# FlashAttention-2 on Hopper against FA3-class kernels: FlashAttention-3 (Shah et al. 2024) is
# "1.5-2.0x faster than FlashAttention-2" on H100 in BF16; the midpoint.
FA2_HOPPER_SLOWDOWN = 1.75
# (forward, backward) time of each attention kernel on Hopper, as multiples of the fitted curve.
# autopar-triton: benchmarks/kernels.py on one H200 (2026-12-04, benchmarks/measured/
# gpu_check_h200_2026-12-04.json; causal, bf16, 32 heads over 8 KV heads, D 128, 16K tokens, S 1K-16K):
# forward 0.99 / 0.84 / 0.81 / 0.80 of the curve's time, backward 2.28 / 2.23 / 2.22 / 2.20; the medians.
# torch-sdpa: SDPA as it chooses its backend (torch 2.11, the same H200, benchmarks/kernels.py's
# ``sdpa_default`` rows, the second run of 2026-12-04: benchmarks/measured/
# gpu_check_h200_2026-12-04b.json): forward 0.65 / 0.63 / 0.61 / 0.61, backward 0.97 / 0.76 / 0.73 / 0.70;
# the medians. (The same run reproduced autopar-triton's factors: 0.820, 2.220.)
# (SDPA's FlashAttention-2 backend measured on the same run: forward 1.10, backward 1.85 / 1.38 /
# 1.28 / 1.21, below the paper's 1.75 that ``fa2`` keeps, with which torchtitan's runs are fitted:
# its medians (1.10, 1.33) in ``fa2`` move torchtitan's 31 published runs from 8.0% to 16.8% median
# error (predicted faster than they ran), so the paper's factor carries more than the kernel on its H100s.)
HOPPER_ATTENTION: dict[str, tuple[float, float]] = {
    "fa3": (1.0, 1.0),
    "fa2": (FA2_HOPPER_SLOWDOWN, FA2_HOPPER_SLOWDOWN),
    "autopar-triton": (0.824, 2.227),
    "torch-sdpa": (0.622, 0.747),
}
UNFUSED_ATTENTION = "unfused"
# Megatron-Core's --recompute-modules that the model prices (Engine.recompute_modules): time in
# cost_models.layer_costs.selective_recompute_s, memory in cost_models/memory.py
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "moe")


@dataclass(frozen=True)
class Engine:
    """One engine's overlap switches (module docstring: what each means and who has it)."""
    name: str
    tp_overlap: bool = False
    dp_overlap: bool = True
    dist_opt_reduce_scatter: bool = False
    dist_opt_states: bool = False
    param_gather_overlap: bool = False
    p2p_overlap: bool = False
    ep_overlap: bool = False
    moe_grouped_gemm: bool = False
    moe_fused_permute: bool = False
    ep_node_dedup: bool = False
    ep_comm_sms: int = 0
    fp8_tp_all_gather: bool = False
    attention_kernel: str = "fa3"
    eager_attention: str = UNFUSED_ATTENTION
    fsdp2_mixed_precision: bool = False
    fused_optimizer: bool = False
    fused_elementwise: bool = False
    recompute_modules: tuple[str, ...] = ()
    split_ends: bool = False
    doc: str = ""

    def __post_init__(self) -> None:
        if self.attention_kernel not in HOPPER_ATTENTION:
            raise ValueError(f"engine {self.name}: attention_kernel {self.attention_kernel!r} is none of "
                             f"{', '.join(HOPPER_ATTENTION)}")
        if not set(self.recompute_modules) <= set(RECOMPUTE_MODULES):
            raise ValueError(f"engine {self.name}: recompute_modules {self.recompute_modules} beyond "
                             f"{', '.join(RECOMPUTE_MODULES)}")
        if self.eager_attention != UNFUSED_ATTENTION and self.eager_attention not in HOPPER_ATTENTION:
            raise ValueError(f"engine {self.name}: eager_attention {self.eager_attention!r} is none of "
                             f"{UNFUSED_ATTENTION}, {', '.join(HOPPER_ATTENTION)}")

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """What ``recompute=selective`` re-runs on this engine (``RECOMPUTE_MODULES``):
        ``recompute_modules``, else the attention core (autopar's runtime; Megatron-Core's default)."""
        return self.recompute_modules or ("core_attn",)

    def attention_kernel_of(self, attention: str, cp: int = 1) -> str:
        """The kernel this engine runs for a plan's ``attention`` (``flash`` or ``eager``) at
        context-parallel degree ``cp``: a key of ``HOPPER_ATTENTION``, or ``UNFUSED_ATTENTION``.
        Under CP an eager plan's blocks are unfused whatever ``eager_attention`` says: autopar's
        ring (and Ulysses, a ring of one) computes them in plain torch
        (``codegen.runtime.context_parallel.partial_attention``: each block's scores materialised)."""
        if attention == "flash":
            return self.attention_kernel
        return self.eager_attention if cp == 1 else UNFUSED_ATTENTION

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Bytes the AdamW step moves per parameter it updates."""
        return FUSED_OPT_BYTES_PER_PARAM if self.fused_optimizer else FOREACH_OPT_BYTES_PER_PARAM


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("autopar", fused_optimizer=True, attention_kernel="autopar-triton", eager_attention="torch-sdpa",
           fsdp2_mixed_precision=True,
           doc="autopar's runtime (codegen/runtime): FSDP2 / DDP gradient overlap, fused AdamW "
               "(codegen.runtime.optim.adamw; the per-parameter loop where plain and DTensor parameters mix), "
               "blocking collectives elsewhere"),
    Engine("megatron-2021", dp_overlap=False, fused_optimizer=True,
           doc="Megatron-LM 2021-22 (Narayanan et al. SC'21, Korthikanti et al. 2022): gradients reduced "
               "after the backward, Apex FusedAdam"),
    Engine("megatron-core-2023", dp_overlap=False, dist_opt_reduce_scatter=True, dist_opt_states=True,
           p2p_overlap=True, fused_optimizer=True,
           doc="Megatron-LM with its default flags (no --overlap-grad-reduce, no --tp-comm-overlap), the "
               "distributed optimizer and overlapped p2p of the interleaved schedule (MegaScale's baseline)"),
    Engine("megatron-core", tp_overlap=True, dp_overlap=True, dist_opt_reduce_scatter=True,
           dist_opt_states=True, param_gather_overlap=True, p2p_overlap=True, fused_optimizer=True,
           doc="Megatron-Core with --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap "
               "(the flags of its README's H100 scaling table)"),
    Engine("megatron-moe", dp_overlap=True, dist_opt_reduce_scatter=True, dist_opt_states=True,
           param_gather_overlap=True, p2p_overlap=True, fused_optimizer=True, moe_grouped_gemm=True,
           moe_fused_permute=True, fused_elementwise=True,
           doc="Megatron-Core MoE model zoo: --moe-grouped-gemm --moe-permute-fusion, all-to-all dispatcher, "
               "--overlap-grad-reduce --overlap-param-gather"),
    Engine("megatron-moe-deepep", dp_overlap=True, dist_opt_reduce_scatter=True, dist_opt_states=True,
           param_gather_overlap=True, p2p_overlap=True, fused_optimizer=True, moe_grouped_gemm=True,
           moe_fused_permute=True, fused_elementwise=True, ep_node_dedup=True,
           doc="megatron-moe with the flex dispatcher on DeepEP"),
    Engine("megatron-moe-deepep-overlap", dp_overlap=True, dist_opt_reduce_scatter=True, dist_opt_states=True,
           param_gather_overlap=True, p2p_overlap=True, fused_optimizer=True, moe_grouped_gemm=True,
           moe_fused_permute=True, fused_elementwise=True, ep_node_dedup=True, ep_overlap=True, ep_comm_sms=DEEPEP_SMS,
           doc="megatron-moe-deepep with --overlap-moe-expert-parallel-comm (1F1B all-to-all overlap)"),
    Engine("llama3", dp_overlap=True, p2p_overlap=True, fused_optimizer=True,
           doc="Meta's Llama 3 stack as its paper describes it: FSDP (ZeRO-2-like) with overlapped "
               "reduction, asynchronous pipeline P2P"),
    Engine("torchtitan", dp_overlap=True, fused_optimizer=True, fp8_tp_all_gather=True, attention_kernel="fa2",
           fsdp2_mixed_precision=True,
           doc="torchtitan: FSDP2 with prefetch and overlapped reduce-scatter, fused AdamW (its default), "
               "eager TP without async TP"),
    Engine("torchtitan-asynctp", tp_overlap=True, dp_overlap=True, fused_optimizer=True, fp8_tp_all_gather=True,
           attention_kernel="fa2", fsdp2_mixed_precision=True,
           doc="torchtitan with --parallelism.enable_async_tensor_parallel (under torch.compile): the TP "
               "all-gather / reduce-scatter decomposed and overlapped with the GEMMs (micro-pipelined)"),
)}
DEFAULT_ENGINE = ENGINES["autopar"]


def engine_of(name: str | Engine | None) -> Engine:
    """The engine named ``name`` (None: autopar's runtime)."""
    if name is None:
        return DEFAULT_ENGINE
    if isinstance(name, Engine):
        return name
    if name not in ENGINES:
        raise ClusterError(f"unknown engine {name!r}: use one of {', '.join(ENGINES)}")
    return ENGINES[name]


def fuses_elementwise(engine: Engine, cfg) -> bool:
    """Whether a block's norms, rotary embedding and activation run as fused kernels
    (cost_models/fused_elementwise.py): the engine's own (Transformer Engine) or inductor's,
    under regional ``torch.compile`` (``ParallelConfig.compile``), which fuses each of them
    (and the residual adds beside them) into one kernel per pass."""
    return engine.fused_elementwise or cfg.compile


def exposed_s(comm_s: float, window_s: float, tail_s: float = 0.0) -> float:
    """Seconds a collective adds to the step when it runs beside ``window_s`` seconds of
    compute it can hide behind; ``tail_s`` of it can start only after that compute (the
    last bucket), so it is never hidden: ``tail + max(0, comm - tail - window)``. A fully
    hidden collective without a tail adds nothing; one without a window adds all of it."""
    if comm_s <= 0:
        return 0.0
    tail = min(max(tail_s, 0.0), comm_s)
    return tail + max(0.0, comm_s - tail - max(window_s, 0.0))


def paired_exposed_s(pairs: list[tuple[float, float]], sm_share: float = 0.0) -> float:
    """Seconds communication adds when each of its chunks runs on another stream beside one
    partner compute chunk, ``pairs`` = [(comm_s, compute_s)]: per pair :func:`exposed_s`, but
    at least ``sm_share x comm_s`` - while its kernels hold ``sm_share`` of the SMs the
    compute beside it runs on the rest (comm C beside compute W ends at ``W + sm_share x C``
    until C outgrows ``W / (1 - sm_share)``, then at C)."""
    return sum(max(exposed_s(c, w), sm_share * c) for c, w in pairs if c > 0)
