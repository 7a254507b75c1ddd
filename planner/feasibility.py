"""What can run: the one feasibility predicate.

``problems(cfg, facts, batch, cluster)`` lists everything about a parallel configuration
(``ParallelConfig``) that autopar's runtime cannot run for a model (``ModelFacts``: head
counts, hidden size, stage groups, routed experts, the adapter's limits),
a batch (:class:`Batch`: global batch, sequence length, packed documents, the sequence's
layout over cp ranks) and a cluster's shape (:class:`ClusterShape`: name, world size,
devices per node; ``cost_models.cluster.Cluster`` is one, :class:`Nodes` another). Each
problem is one line naming it and its fix; an empty list means the runtime can run it.

``problems`` is the composition of exactly the per-axis parts below, one public function
per rule, each returning its one line or None; the search calls the same parts degree by
degree to prune before any variant is priced (planner/search/candidates.py), and
``autopar evaluate``, ``autopar run``, the runtime's ``check_runnable`` and the emitted
program call ``problems``. The parts:

- :func:`model_problem`: the model's adapter runs nothing (limit ``any``); :func:`length_problem`:
  the sequence is longer than the model's learned positions (``ModelFacts.max_seq_len``);
- :func:`degrees_problem`: dp x pp x cp x tp is the cluster's device count, or on a local CPU
  cluster one of its process counts (:func:`rank_counts`: fewer ranks, more threads each);
- :func:`tp_problem`: tp inside a node, dividing every attention's heads and kv heads and
  the hidden size (limit ``tp``);
- :func:`cp_problem`: the sequence cuts into the load balance's chunks
  (:func:`sequence_problem`), the Ulysses degree divides cp and each tp rank's (kv) heads
  (limit ``cp``);
- :func:`pp_problem`: pp x vpp stages at most the model's stage groups (limit ``pp``);
- :func:`ep_problem`: a MoE model under TP needs sequence parallel; the expert-parallel
  groups exist (:func:`expert_groups_problem`, limit ``ep``);
- :func:`sp_problem`: sequence parallel shards ``seq_len / cp`` over tp (limit ``sp``);
- :func:`loss_problem`, :func:`attention_problem`: the fused loss and flash attention kernels
  where the model allows them;
- :func:`substitution_problem`: what runs autopar's attention in place of the model's
  (:data:`SUBSTITUTES`: TP's head split, CP, the flash kernel, selective recompute, packed
  documents) where the model's attention cannot be substituted (limit ``attention``); data
  and pipeline parallelism run the model's own attention and need nothing of it. The parts
  of those axes call it;
- :func:`zero_problem`: the data-parallel sharding the model and ep allow;
- ``recompute_problem``: the recompute policy under the schedule (planner/plan.py, since plan
  files check it per stage too);
- :func:`batch_problem`: the global batch splits over dp (:func:`replicas_problem`), then into
  micro-batches of mbs (:func:`microbatch_problem`, :func:`microbatches`), at least one per
  pipeline stage (:func:`fill_problem`) and as torch's schedules play them
  (:func:`schedule_problem`, :func:`interleave_problem`);
- :func:`documents_problem`: packed documents where autopar's attention and positions run (and,
  where the caller knows it, on causal attention only);
- ``seq_chunks_batch_problem`` (planner/schedule_ir.py): sequence chunks' batch and model side.

Pure Python on the contracts (imports planner/plan.py, schedule_ir.py and errors.py only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from planner.errors import PlanError
from planner.plan import ModelFacts, ParallelConfig
from planner.recompute_rules import recompute_problem
from planner.schedule_ir import V_SCHEDULES, builtin_problem, seq_chunks_batch_problem
from planner.sharding import SHARDED_PARAMS

# How a sequence lies over the cp ranks (codegen/runtime/context_parallel.py): zigzag cuts it into
# 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r (equal causal work); contiguous into cp.
LOAD_BALANCES = ("zigzag", "contiguous")
# Schedules torch's own classes played in max(1, m // pp) equal rounds (ScheduleInterleaved1F1B / ZeroBubble);
# the runtime now runs the schedule IR's orders, which do not need it: kept so plans stay as they were.
ROUND_SCHEDULES = ("interleaved-1f1b", "zb-h1")


class ClusterShape(Protocol):
    """What the predicate needs of a cluster: its name (for messages), its device count,
    the devices of one node and, on a local CPU cluster, the cores they share (0 otherwise)
    (``cost_models.cluster.Cluster`` and :class:`Nodes` are ones)."""
    name: str
    devices_per_node: int
    cores_per_node: int

    @property
    def world(self) -> int: ...


@dataclass(frozen=True)
class Nodes:
    """A cluster's shape alone: ``nodes`` machines of ``devices_per_node`` devices."""
    name: str
    nodes: int
    devices_per_node: int
    cores_per_node: int = 0

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @staticmethod
    def of_plan(cluster: Mapping[str, Any], world: int) -> "Nodes":
        """The shape a plan file's ``cluster`` section records (without one: ``world`` devices
        over its nodes, one node by default)."""
        def whole(key: str, default: int) -> int:
            v = cluster.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).strip().isdigit():
                raise PlanError(f"the plan's cluster {key} = {v!r} is not a whole number: write one (or plan again)")
            return int(v)
        nodes = max(whole("nodes", 1), 1)
        return Nodes(str(cluster.get("name", "the cluster")), nodes, whole("devices_per_node", max(world // nodes, 1)),
                     whole("cores_per_node", 0))


@dataclass(frozen=True)
class Batch:
    """What the predicate needs of the data: ``global_batch`` sequences per optimizer step of
    ``seq_len`` tokens each, whether each row packs several documents (``autopar plan
    --seq-lens``), and how a sequence lies over the cp ranks (:data:`LOAD_BALANCES`)."""
    global_batch: int
    seq_len: int
    documents: bool = False
    load_balance: str = "zigzag"

    @staticmethod
    def of_plan(batch: Mapping[str, Any], load_balance: str = "zigzag") -> "Batch":
        """The batch a plan file's ``batch`` section records."""
        return Batch(int(batch["global"]), int(batch["seq_len"]), "documents" in batch, load_balance)


# What runs autopar's attention in place of the model's (ModelAdapter.set_attention installs it):
# use -> (what, the fix). Refused where the model's attention cannot be substituted (limit ``attention``).
SUBSTITUTES = {"tp": ("tensor parallelism splits the heads inside", "use tp=1"),
               "cp": ("context parallelism runs", "use cp=1"),
               "flash": ("attention=flash runs", "use attention=eager"),
               "selective": ("recompute=selective checkpoints the core of", "use recompute=none, selective-op or full"),
               "documents": ("packed documents (--seq-lens, cu_seqlens) mask by document in",
                             "plan without --seq-lens")}


def substitution_problem(use: str, limits: Mapping[str, str]) -> str | None:
    """Why ``use`` (a key of :data:`SUBSTITUTES`) cannot run for a model whose ``limits``
    (``ModelFacts.limits``) say autopar cannot run its attention in place of the model's own
    (transformers Falcon, Bloom: attention outside ``AttentionInterface``)."""
    if "attention" not in limits:
        return None
    what, fix = SUBSTITUTES[use]
    return f"{what} autopar's attention, but {limits['attention']}; {fix}"


# ---------------------------------------------------------------------- the model and the mesh

def model_problem(f: ModelFacts) -> str | None:
    """Why the runtime runs this model in no layout at all (its adapter's ``any`` limit)."""
    return f"cannot run on autopar's runtime: {f.limits['any']}" if "any" in f.limits else None


def length_problem(seq_len: int, f: ModelFacts) -> str | None:
    """Why sequences of ``seq_len`` tokens cannot run through this model: its learned position
    table (``ModelFacts.max_seq_len`` rows, e.g. transformers' ``max_position_embeddings``) has
    no row for the later positions (every layout looks up the global positions, cp too)."""
    if not f.max_seq_len or seq_len <= f.max_seq_len:
        return None
    return (f"seq_len {seq_len} exceeds the {f.max_seq_len} positions the model learned (its position table); "
            f"use --seq-len {f.max_seq_len} or less, or raise the model's max positions (max_position_embeddings)")


def rank_threads(threads: int, cores: int, ranks: int) -> int:
    """Intra-op threads each of ``ranks`` processes on a node of ``cores`` CPU cores runs: the
    plan's ``ParallelConfig.threads`` when set, else ``cores // ranks`` (ranks x threads =
    cores), at least 1 (more ranks than cores: one each; ``cores`` 0, unknown: 1)."""
    if threads:
        return threads
    return max(1, cores // max(ranks, 1)) if cores > 0 else 1


def rank_counts(cluster: ClusterShape) -> list[int]:
    """The process counts a layout may use on ``cluster``, largest first: its device count; on a
    local CPU cluster (one node whose cores are known) every divisor of it too, each rank then
    running more intra-op threads (:func:`layout_threads`): fewer processes with more threads
    can beat one single-thread process per core, and one process with every core is a layout."""
    n = cluster.world
    if cluster.cores_per_node <= 0 or cluster.world != cluster.devices_per_node:
        return [n]
    return [d for d in range(n, 0, -1) if n % d == 0]


def layout_threads(cluster: ClusterShape, world: int) -> int:
    """``ParallelConfig.threads`` the search gives a layout of ``world`` ranks on ``cluster``:
    the cores per rank (:func:`rank_threads`: ranks x threads = cores) when that is
    more than one, else 0 (the default: one thread per rank, or unknown cores)."""
    t = rank_threads(0, cluster.cores_per_node, min(world, cluster.devices_per_node))
    return t if t > 1 else 0


def degrees_problem(cfg: ParallelConfig, cluster: ClusterShape) -> str | None:
    """Why the degrees do not cover the cluster: dp x pp x cp x tp must be its device count
    (on a local CPU cluster: one of :func:`rank_counts`)."""
    counts = rank_counts(cluster)
    if cfg.world in counts:
        return None
    if len(counts) > 1:
        return (f"dp*pp*cp*tp = {cfg.world} but {cluster.name} runs {' or '.join(map(str, counts))} processes: "
                "make the degrees multiply to one of them")
    return (f"dp*pp*cp*tp = {cfg.world} but {cluster.name} has {cluster.world} devices: "
            "make the degrees multiply to the device count")


def tp_problem(tp: int, f: ModelFacts, cluster: ClusterShape) -> str | None:
    """Why the runtime cannot shard this model ``tp`` ways: TP stays inside a node (its
    collectives sit on the critical path), and splits every attention's heads, its kv heads
    (the runtime does not replicate kv heads) and the hidden size."""
    if tp == 1:
        return None
    if tp > cluster.devices_per_node:
        return f"tp={tp} exceeds {cluster.devices_per_node} devices per node; use tp <= {cluster.devices_per_node}"
    if "tp" in f.limits:
        return f"tp={tp}: {f.limits['tp']}; use tp=1"
    if why := substitution_problem("tp", f.limits):
        return f"tp={tp}: {why}"
    if any(h % tp for h in f.heads) or (f.hidden and f.hidden % tp):
        return f"tp={tp} does not divide {max(f.heads, default=1)} heads / hidden {f.hidden}; use a tp dividing both"
    if any(h % tp for h in f.kv_heads):
        return (f"tp={tp} does not divide the {min(f.kv_heads)} kv heads (the runtime does not replicate kv "
                f"heads yet); use a tp dividing {min(f.kv_heads)}")
    return None


def sequence_chunks(cp: int, load_balance: str = "zigzag") -> int:
    """Chunks a sequence is cut into over ``cp`` ranks: 2 cp for zigzag, cp for contiguous."""
    if load_balance not in LOAD_BALANCES:
        raise PlanError(f"load_balance={load_balance!r}: use {' or '.join(LOAD_BALANCES)}")
    return 2 * cp if load_balance == "zigzag" else cp


def sequence_problem(seq_len: int, cp: int, load_balance: str = "zigzag") -> str | None:
    """Why a sequence of ``seq_len`` tokens does not split over ``cp`` ranks laid out by
    ``load_balance`` (equal chunks, :func:`sequence_chunks`)."""
    n = sequence_chunks(cp, load_balance)
    if cp == 1 or seq_len % n == 0:
        return None
    if load_balance == "zigzag":
        return (f"cp={cp} does not split sequence {seq_len} into 2*cp zigzag chunks; use a sequence length that "
                f"is a multiple of {n} or a smaller cp")
    return (f"cp={cp} does not split sequence {seq_len} into cp contiguous chunks; use a sequence length that "
            f"is a multiple of {n} or a smaller cp")


def cp_problem(cp: int, f: ModelFacts, batch: Batch, ulysses: int = 1, tp: int = 1) -> str | None:
    """Why the runtime cannot split this model's sequence ``cp`` ways with a Ulysses degree
    ``ulysses`` under ``tp``: the sequence must cut into the load balance's equal chunks, and
    each tp rank's heads and kv heads must split ``ulysses`` ways (the all-to-all trades the
    sequence split for a head split; kv heads are not replicated)."""
    if cp == 1:
        return None
    if "cp" in f.limits:
        return f"cp={cp}: {f.limits['cp']}; use cp=1"
    if why := substitution_problem("cp", f.limits):
        return f"cp={cp}: {why}"
    if why := sequence_problem(batch.seq_len, cp, batch.load_balance):
        return why
    if ulysses > 1 and cp % ulysses:
        return f"ulysses={ulysses} does not divide cp={cp}; use a divisor of cp"
    if ulysses > 1 and any(h % (ulysses * tp) for h in f.heads + f.kv_heads):
        return (f"ulysses={ulysses} x tp={tp} does not divide the {min(f.kv_heads + f.heads, default=0)} "
                "(kv) heads each attention splits; use a smaller Ulysses degree (ring attention has no such limit)")
    return None


def pp_problem(pp: int, f: ModelFacts, vpp: int = 1, vocab_passes: bool = False) -> str | None:
    """Why this model cannot pipeline over ``pp`` ranks of ``vpp`` virtual stages: each needs a stage
    group (``ModelFacts.units``; vocabulary passes: the groups before the head make ``pp (vpp-1)``)."""
    stages, units = (pp * (vpp - 1), f.units - 1) if vocab_passes else (pp * vpp, f.units)
    if pp == 1:
        return None
    if "pp" in f.limits:
        return f"pp={pp}: {f.limits['pp']}; use pp=1"
    if pp > units:
        return f"pp={pp} exceeds the {units} pipeline stages this model can be cut into; use pp <= {units}"
    if stages > units:
        return (f"{'pp*(vpp-1)' if vocab_passes else 'pp*vpp'} = {stages} virtual stages exceed the {units} pipeline "
                "stages this model can be cut into; use a smaller vpp")
    return None


def expert_groups(dp: int, cp: int, ep: int, tp: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, the experts' data-parallel groups) as indices into the
    flattened dp x cp x tp ranks of one pipeline stage (tp inner, as the mesh numbers them):
    ``ep`` consecutive ranks share one layer's experts out; the ranks at the same place in
    each such group hold the same experts. With tp > 1 the MoE layers run on each rank's
    sequence shard (sequence parallel, :func:`ep_problem`), so every one of these ranks
    routes tokens of its own."""
    edp, ep = ParallelConfig(dp=dp, cp=cp, tp=tp, ep=ep).expert_mesh
    ep_groups = [list(range(g * ep, (g + 1) * ep)) for g in range(edp)]
    edp_groups = [list(range(i, edp * ep, ep)) for i in range(ep)]
    return ep_groups, edp_groups


def ep_problem(ep: int, dp: int, cp: int, f: ModelFacts, tp: int = 1, sp: bool = False) -> str | None:
    """Why the runtime cannot run the routed experts split ``ep`` ways under ``tp`` / ``sp``.

    Under TP the MoE layers (router, shared and routed experts) are not tensor-parallel
    (expert tensor parallelism 1, as torchtitan's default): each tp rank runs them on its
    own sequence shard, so a MoE model needs sequence parallel with tp > 1. ``ep`` needs
    routed experts and must divide their count and the dp x cp x tp ranks it splits
    (:func:`expert_groups`); the data-parallel sharding it needs is :func:`zero_problem`'s."""
    if f.experts and tp > 1 and not sp:
        return (f"tp={tp} without sequence parallel: the routed experts run on each tp rank's own "
                "sequence shard (they are not tensor-parallel); use sp=on")
    return expert_groups_problem(ep, dp, cp, f, tp)


def expert_groups_problem(ep: int, dp: int, cp: int, f: ModelFacts, tp: int = 1) -> str | None:
    """Why the expert-parallel groups of ``ep`` (:func:`expert_groups`) do not exist for this
    model: it has no routed experts, its adapter cannot split them, ``ep`` does not divide
    them or the dp x cp x tp ranks (the part of :func:`ep_problem` without which no layout of
    the experts, and so no memory or time, can be worked out)."""
    if ep == 1:
        return None
    if not f.experts:
        return f"ep={ep}: the model has no routed experts; use ep=1"
    if "ep" in f.limits:
        return f"ep={ep}: {f.limits['ep']}; use ep=1"
    if f.experts % ep:
        return f"ep={ep} does not divide the {f.experts} experts; use an ep dividing {f.experts}"
    if (dp * cp * tp) % ep:
        return (f"ep={ep} does not divide dp x cp x tp = {dp * cp * tp} (expert parallelism splits the "
                f"ranks holding distinct tokens); use an ep dividing {dp * cp * tp}")
    return None


def sp_problem(tp: int, cp: int, f: ModelFacts, batch: Batch) -> str | None:
    """Why sequence parallel cannot run: it needs tp > 1, an adapter that shards the
    sequence, and each cp rank's ``seq_len / cp`` tokens divisible by tp."""
    if tp == 1:
        return "sequence parallel needs tp > 1; use sp=off"
    if "sp" in f.limits:
        return f"sequence parallel: {f.limits['sp']}; use sp=off"
    if (batch.seq_len // cp) % tp:
        return f"sequence parallel needs seq_len/cp = {batch.seq_len // cp} divisible by tp={tp}; use sp=off"
    return None


def loss_problem(loss: str, f: ModelFacts) -> str | None:
    """Why the fused linear + cross-entropy kernel cannot run for this model."""
    if loss == "fused" and "fused_loss" in f.limits:
        return f"loss=fused: {f.limits['fused_loss']}; use loss=eager"
    return None


def attention_problem(attention: str, f: ModelFacts) -> str | None:
    """Why the flash attention kernel cannot run for this model (:func:`default_attention`)."""
    if attention == "flash" and "flash_attention" in f.limits:
        return f"attention=flash: {f.limits['flash_attention']}; use attention=eager"
    return substitution_problem("flash", f.limits) if attention == "flash" else None


def recompute_attention_problem(recompute: str, limits: Mapping[str, str]) -> str | None:
    """Why ``recompute`` cannot run for a model of ``limits``: ``selective`` checkpoints the
    attention core autopar installs (:func:`substitution_problem`)."""
    return substitution_problem("selective", limits) if recompute == "selective" else None


def default_attention(limits: Mapping[str, str]) -> str:
    """The attention kernel to plan with: flash unless the model's limits (``ModelFacts.limits``)
    say it cannot use it (:func:`attention_problem`)."""
    return "eager" if "flash_attention" in limits or "attention" in limits else "flash"


def zero_problem(zero: str, tp: int, dp: int, f: ModelFacts, ep: int = 1) -> str | None:
    """Why the runtime cannot shard this model's parameters over dp with ``zero`` under ``tp``
    and ``ep`` (``dp``: the dp x cp ranks): expert parallelism needs sharded data parallelism
    (FSDP2 shards the experts over their own data-parallel group, ``dp * tp / ep`` ranks;
    DDP's reducer would all-reduce them over every rank), unless there is no data
    parallelism and no rank shares its experts (dp = 1, ep = tp)."""
    if zero in SHARDED_PARAMS and tp > 1 and dp > 1 and "fsdp_with_tp" in f.limits:
        return f"zero={zero} with tp={tp}: {f.limits['fsdp_with_tp']}; use zero=ddp or zero1"
    if ep > 1 and zero not in SHARDED_PARAMS and (dp > 1 or tp > ep):
        return (f"ep={ep} with zero={zero}: the experts are sharded by FSDP over their own data-parallel group; "
                "use zero=fsdp")
    return None


# ---------------------------------------------------------------------- the batch and the schedule

def replicas_problem(global_batch: int, dp: int) -> str | None:
    """Why the global batch does not split over ``dp`` replicas (each takes whole sequences)."""
    if global_batch < 1:
        return f"global batch {global_batch}: give a positive number of sequences"
    if global_batch % dp:
        return f"global batch {global_batch} not divisible by dp={dp}; use a global batch that is a multiple of {dp}"
    return None


def microbatch_problem(global_batch: int, dp: int, mbs: int) -> str | None:
    """Why each replica's share of the global batch does not split into micro-batches of
    ``mbs`` sequences."""
    per = dp * mbs
    if global_batch % per:
        return (f"global batch {global_batch} is not divisible by dp*mbs = {per}: choose a global batch "
                f"that is a multiple of {per}")
    return None


def microbatches(cfg: ParallelConfig, global_batch: int) -> int:
    """Micro-batches per optimizer step on each replica: ``global_batch / (dp * mbs)``
    (PlanError when it does not divide: :func:`microbatch_problem`)."""
    if why := replicas_problem(global_batch, 1) or microbatch_problem(global_batch, cfg.dp, cfg.mbs):
        raise PlanError(why)
    return global_batch // (cfg.dp * cfg.mbs)


def fill_problem(pp: int, m: int) -> str | None:
    """Why ``m`` micro-batches do not fill a pipeline of ``pp`` stages: every schedule here
    needs at least one per stage (:func:`schedule_problem`)."""
    if pp > 1 and m < pp:
        return (f"{m} micro-batches for pp={pp}: the schedules need at least one per stage; raise the global "
                "batch or lower pp or mbs")
    return None


def interleave_problem(pp: int, vpp: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot be interleaved over ``pp`` ranks of ``vpp`` > 1 chunks in
    Megatron's order (rounds of pp micro-batches through each chunk; the order
    cost_models/pipeline.py simulates): m must be a multiple of pp."""
    if vpp > 1 and m % pp:
        return (f"interleaved-1f1b needs micro-batches divisible by pp: m = {m}, pp = {pp}; "
                f"pick a global batch giving a multiple of {pp}")
    return None


def schedule_problem(schedule: str, pp: int, vpp: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run through ``schedule`` over ``pp`` ranks of ``vpp``
    virtual stages. What torch's schedules require: ``Schedule1F1B`` at least pp
    micro-batches (ValueError below); ``ScheduleInterleaved1F1B`` and
    ``ScheduleInterleavedZeroBubble`` (:data:`ROUND_SCHEDULES`) m divisible by their
    ``max(1, m // pp)`` rounds; ``ScheduleGPipe`` nothing. autopar asks at least pp for every
    schedule, for interleaving over vpp > 1 chunks a multiple of pp (Megatron's order), for
    DualPipeV at least 2 pp (planner.schedule_ir.builtin_problem)."""
    if pp == 1:
        return None
    if why := (fill_problem(pp, m) or (schedule == "interleaved-1f1b" and interleave_problem(pp, vpp, m))
               or (schedule in V_SCHEDULES and builtin_problem(schedule, pp, m, vpp))):
        return why
    rounds = max(1, m // pp)
    if schedule in ROUND_SCHEDULES and m % rounds:
        return (f"{schedule} runs {m} micro-batches in {rounds} rounds of pp={pp}: torch needs a multiple of "
                f"{rounds}; pick a global batch giving a multiple of {pp} micro-batches")
    return None


def batch_problem(cfg: ParallelConfig, batch: Batch) -> str | None:
    """The batch's first problem: replicas, then micro-batches, then the schedule's rule."""
    g = batch.global_batch
    if why := replicas_problem(g, cfg.dp) or microbatch_problem(g, cfg.dp, cfg.mbs):
        return why
    return schedule_problem(cfg.schedule, cfg.pp, cfg.vpp, g // (cfg.dp * cfg.mbs))


def documents_problem(limits: Mapping[str, str], causal_only: bool = True) -> str | None:
    """Why this model cannot train on packed documents (None if it can): only causal text
    (``causal_only`` False: the model also has non-causal attention, a vision encoder), and
    only where autopar's attention and token positions run, as context parallelism needs (a
    model whose limits refuse ``cp`` or ``any`` keeps its own attention, which would attend
    across documents, or takes no positions)."""
    if not causal_only:
        return ("packed documents (--seq-lens, cu_seqlens) are for text-only causal models; this one has non-causal "
                "attention; plan without --seq-lens")
    for key in ("any", "cp"):
        if key in limits:
            return ("packed documents (--seq-lens, cu_seqlens) need autopar's attention and token positions, as "
                    f"context parallelism does: {limits[key]}; plan without --seq-lens")
    return substitution_problem("documents", limits)


def modes_problem(dtype: str, fp8: str = "none", compile: bool = False, tp: int = 1, cp: int = 1) -> str | None:
    """Why the runtime cannot train in these modes on a layout (one line with the fix), or None:
    fp16 needs a loss scaler, which the runtime does not run; float8 linears under TP need
    torchao's float8 TP styles, which it does not apply; compiled blocks failed under TP (a
    DTensor redistribute in the backward) and hung under CP's in-block collectives (torch 2.13, gloo)."""
    if dtype == "fp16":
        return "dtype=fp16 needs loss scaling, which autopar's runtime does not run; use dtype=bf16 (or fp32)"
    if fp8 != "none" and tp > 1:
        return f"fp8={fp8} with tp > 1: autopar does not apply torchao's float8 tensor-parallel styles; use tp=1 or fp8=none"
    if compile and (tp > 1 or cp > 1):
        return (f"compile=on with {'tp' if tp > 1 else 'cp'} > 1: autopar's {'tensor' if tp > 1 else 'context'}-parallel "
                f"blocks do not run compiled yet; use {'tp' if tp > 1 else 'cp'}=1 or compile=off")
    return None


# ---------------------------------------------------------------------- the predicate

def problems(cfg: ParallelConfig, f: ModelFacts, batch: Batch, cluster: ClusterShape) -> list[str]:
    """Everything about ``cfg`` the runtime cannot run for the model of ``f`` on ``batch`` and
    ``cluster``, one line each (empty: it runs): the composition of the per-axis parts (module
    docstring). PlanError for a malformed ``cfg`` (``ParallelConfig.validate``)."""
    cfg.validate()
    parts = (model_problem(f), length_problem(batch.seq_len, f), degrees_problem(cfg, cluster), tp_problem(cfg.tp, f, cluster),
             cp_problem(cfg.cp, f, batch, cfg.ulysses, cfg.tp), pp_problem(cfg.pp, f, cfg.vpp, cfg.vocab_passes),
             ep_problem(cfg.ep, cfg.dp, cfg.cp, f, cfg.tp, cfg.sp),
             sp_problem(cfg.tp, cfg.cp, f, batch) if cfg.sp else None,
             loss_problem(cfg.loss, f), attention_problem(cfg.attention, f),
             zero_problem(cfg.zero, cfg.tp, cfg.dp * cfg.cp, f, cfg.ep),
             recompute_problem(cfg.recompute, cfg.schedule, cfg.pp),
             recompute_attention_problem(cfg.recompute, f.limits), batch_problem(cfg, batch),
             documents_problem(f.limits) if batch.documents else None,
             seq_chunks_batch_problem(cfg.seq_chunks, batch.seq_len, batch.documents, f.limits, cfg.recompute), modes_problem(cfg.dtype, cfg.fp8, cfg.compile, cfg.tp, cfg.cp))
    return [p for p in parts if p]
