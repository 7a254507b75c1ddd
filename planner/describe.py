"""A plan in words: one phrase per concern, the same for the report and the emitted program.

:func:`describe` reads only the :class:`~planner.plan.Plan` (the layout, the stages' recompute
policies, the batch) and says what each part of the training step does under it: the
attention (context-parallel method and kernel), tensor, expert and data parallelism, the
optimizer's sharding, recomputation, the step's micro-batches or pipeline schedule, and
gradient clipping. The report prints these phrases (``planner/report/data.py``) and the
emitted program writes them as the comments of the calls they describe
(``codegen/emit.py``), so the two cannot disagree with each other or with the plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from planner.low_comm import CAVEAT, parse_low_comm
from planner.plan import ParallelConfig, Plan
from planner.precision import mixed_precision
from planner.schedule_ir import DEEP_1F1B, Schedule, deepened_by

# How context parallelism splits attention (ParallelConfig.cp_method -> words).
CP_METHODS = {"ring": "ring attention", "ulysses": "Ulysses all-to-all (heads for sequence)",
              "hybrid": "Ulysses inside groups, ring attention across them"}
# What each recompute policy recomputes in the backward (planner.plan.RECOMPUTE).
RECOMPUTE_WORDS = {"none": "keeps every activation",
                   "selective": "recomputes the attention core (the rest kept)",
                   "selective-op": "checkpoints each block, keeping every other matmul and the attention output",
                   "full": "checkpoints each block whole (recomputes its forward in the backward)",
                   "offload": "moves each block's saved activations to host memory and back for its backward"}


@dataclass(frozen=True)
class PlanWords:
    """One phrase per concern of a plan (see :func:`describe`)."""
    attention: str
    tp: str
    ep: str
    dp: str
    optimizer: str
    recompute: str
    float_eight: str
    compile: str
    step: str
    clip: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# What each attention kernel runs (the search's choice between them: planner/search/kernel_choice.py).
ATTENTION_KERNEL_WORDS = {"flash": "autopar's Triton flash kernel on GPUs", "eager": "torch SDPA; plain torch under CP"}


def attention_words(plan: Plan) -> str:
    c = plan.config
    kernel = f"{c.attention} attention kernel ({ATTENTION_KERNEL_WORDS[c.attention]})"
    per_batch = plan.batch.get("per_batch") or {}
    if per_batch.get("chosen"):
        return (f"per-batch assignment: each batch's documents on {per_batch['method']} groups of 1 to "
                f"{per_batch['max_group']} of the dp x cp ranks, {kernel}")
    if c.cp == 1:
        return f"cp=1: {kernel}"
    method = CP_METHODS[c.cp_method]
    ring = c.cp // c.ulysses
    shape = f" (Ulysses {c.ulysses} x ring {ring})" if c.cp_method == "hybrid" else ""
    return f"{method} over cp={c.cp}{shape}, {kernel}"


def recompute_words(plan: Plan) -> str:
    """Which virtual stages recompute what, in stage order (runs of the same policy merged)."""
    policies = [str(s["recompute"]) for s in plan.stages]
    if len(set(policies)) <= 1:
        policy = policies[0] if policies else "none"
        return f"every stage: {policy}, {RECOMPUTE_WORDS[policy]}"
    runs: list[tuple[int, int, str]] = []
    for j, p in enumerate(policies):
        if runs and runs[-1][2] == p:
            runs[-1] = (runs[-1][0], j, p)
        else:
            runs.append((j, j, p))
    return "; ".join((f"stage {a}" if a == b else f"stages {a}-{b}") + f": {p} ({RECOMPUTE_WORDS[p]})"
                     for a, b, p in runs)


def schedule_name(cfg: ParallelConfig, schedule_ir: Schedule | None) -> str:
    """The pipeline schedule's name as the user should read it: a plan's own schedule IR by its
    name (``1f1b-deep``, ``generated``, a file's), a built-in by ``cfg.schedule``."""
    return schedule_ir.name if cfg.schedule == "custom" and schedule_ir is not None else cfg.schedule


def step_words(plan: Plan) -> str:
    c = plan.config
    n = int(plan.batch["global"]) // (c.dp * c.mbs)
    if c.pp > 1:
        chunks = f", {c.vpp} stages per pp rank" if c.vpp > 1 else ""
        if c.seq_chunks > 1:  # Seq1F1B (planner/schedule_ir.py, cost_models/seq_chunks.py)
            chunks += (f", each sequence cut into {c.seq_chunks} chunks of {int(plan.batch['seq_len']) // c.seq_chunks}"
                       f" tokens run as pipeline units ({n * c.seq_chunks} units: the fill and drain shrink about "
                       f"{c.seq_chunks}-fold, each unit holds 1/{c.seq_chunks} of a micro-batch's activations plus the "
                       "earlier chunks' keys/values)")
        own = schedule_name(c, plan.schedule_ir)
        if own == DEEP_1F1B:  # planner/search/wan_warmup.py
            deeper = deepened_by(plan.schedule_ir)
            ranks = [r for r, d in enumerate(deeper) if d]
            chunks += (f"; 1F1B with {max(deeper)} more unit(s) in flight on pp ranks {ranks[0]}-{ranks[-1]}, whose "
                       "warm-up is deepened to hide the slow link after them") if ranks else ""
        if c.vocab_passes:  # planner/vocab_passes.py
            chunks += (f"; the head split by vocabulary into {c.pp} passes, each rank's second stage (the search "
                       "keeps them where they price faster than the head whole on one rank)")
        return f"the {own} schedule: {n} micro-batches of {c.mbs} sequences over pp={c.pp}{chunks}"
    return f"gradient accumulation: {n} micro-batches of {c.mbs} sequences (pp=1)"


def dp_words(c: ParallelConfig) -> str:
    """The data-parallel wrapper's phrase, with the plan's precision (``planner.sharding.dp_wrapper``)."""
    replicas = c.dp * c.cp
    mixed = f"; {c.dtype} compute copies of fp32 master weights, fp32 gradient reduction" \
        if mixed_precision(c.dtype) else ""
    low = parse_low_comm(c.low_comm)
    if low is not None:
        return (f"{c.zero} over dp x cp = {replicas // low.groups} ranks inside each of {low.groups} groups{mixed}; "
                f"across the groups every {low.every} steps: pseudo-gradients in {low.dtype}, outer Nesterov SGD "
                f"(lr {low.lr:g}, momentum {low.momentum:g}): {CAVEAT}")
    if replicas > 1:
        return f"{c.zero} over dp x cp = {replicas} ranks{mixed}"
    if mixed:
        return f"dp x cp = 1: fully_shard on this rank casts each unit{mixed}"
    return "dp x cp = 1: nothing to replicate"


def describe(plan: Plan) -> PlanWords:
    """The plan's phrases: what each call of the training step does under it."""
    c = plan.config
    replicas = c.dp * c.cp
    experts = plan.facts.experts
    return PlanWords(
        attention=attention_words(plan),
        tp=(f"tp={c.tp}" + (", sequence parallel between the blocks" if c.sp else "")) if c.tp > 1
        else "tp=1: nothing to shard",
        ep=(f"ep={c.ep}: each rank keeps {experts // c.ep} of {experts} experts per routed layer, tokens by all-to-all"
            if c.ep > 1 else "ep=1: every rank keeps all experts" if experts else "ep=1: no routed experts"),
        dp=dp_words(c),
        optimizer=("ZeRO-1: each rank steps its share of the optimizer state" if c.zero == "zero1" and replicas > 1
                   else "one optimizer per stage module"),
        recompute=recompute_words(plan),
        float_eight=(f"the blocks' linears in float8 (torchao {c.fp8} scaling)" if c.fp8 != "none"
                else f"no float8: the linears compute in {c.dtype}"),
        compile=("torch.compile of each block's forward (regional; the first step compiles)" if c.compile
                 else "eager: no block is compiled"),
        step=step_words(plan),
        clip="clip by the global gradient norm over all ranks (ParallelModel.clip_grad_norm_)",
    )


def device_words(stages: list[dict], devices: list[str]) -> str:
    """Which stages sit on which devices (an estimate's ``stage_devices``, one per pp rank, and the
    plan's stages): e.g. ``stage 0 (9 layers) on a100-pod: A100-SXM4-80GB``; "" on one device type."""
    if not devices:
        return ""
    return "; ".join(f"stage {j} ({len(s['layers'])} layers) on {devices[s['rank']]}" for j, s in enumerate(stages))


def devices_text(cfg: ParallelConfig, stages: list[dict], devices: list[str]) -> tuple[str, str]:
    """On mixed devices, the report's title and words for where the work sits (an estimate's
    ``devices``): which stages on which devices, or under ``dp_shares`` what each group's dp
    ranks take of every micro-batch (``cost_models.speed_shares.shares_words``)."""
    if cfg.dp_shares:
        return "data-parallel shares by device speed", f"{devices[0]} (gradients as with equal shares)"
    return "stages on devices", device_words(stages, devices)


def wan_words(crossings: list[dict]) -> list[str]:
    """One line per place the mesh crosses the links between cluster groups (an estimate's ``wan``
    list, ``cost_models.wan_cost.Crossing``); empty on a one-group cluster or when nothing crosses."""
    out = []
    for x in crossings:
        joins = " <-> ".join(x["groups"])
        link = (f"{x['flows']} flows at {x['gbs_per_flow']:.3g} GB/s each, {x['latency_ms']:.3g} ms one way"
                if x["flows"] else "on the cluster's own links (no groups declared)")
        if x["dim"] == "pp":
            out.append(f"pp {x['where']} crosses {joins}: {link}; {x['seconds']:.3g} s of transfers per step "
                       f"before overlap (hidden by the micro-batches in flight)")
        elif x["dim"] == "dp":
            how = ("one flat ring over every member (FSDP2's replicate takes a one-dimensional mesh), "
                   if x.get("mode") == "flat" else
                   "hierarchical gradient reduction (reduce in each group, exchange across, broadcast back), ")
            out.append(f"dp x cp crosses {joins} ({x['where']}): {how}overlapped with the backward; {link}; at least "
                       f"{x['seconds']:.3g} s per step across")
        elif x["dim"] == "edp":
            out.append(f"the experts' data-parallel group crosses {joins} ({x['where']}): one flat ring over every "
                       f"member (FSDP2 over the experts' own mesh), overlapped with the backward; {link}; at least "
                       f"{x['seconds']:.3g} s per step across")
        elif x["dim"] == "outer":
            out.append(f"low-communication DP across {joins or 'the groups'}: pseudo-gradients exchanged {x['where']}"
                       f" ({link}), {x['seconds']:.3g} s per exchange; {CAVEAT}")
        else:
            out.append(f"{x['dim']} crosses {joins} ({x['where']}): every {x['dim']} collective pays the WAN; {link}")
    return out
