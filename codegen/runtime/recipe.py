"""The parallelisation recipe: one public helper per concern, called in this order by the
emitted program and by :func:`codegen.runtime.train.parallelize` alike (torchtitan's manner):

1. :func:`check_runnable` - the planner's feasibility rule on the plan and the model's adapter,
   before anything is built
2. ``codegen.runtime.mesh.build_mesh`` - the ``[pp, dp, cp, tp]`` device mesh
3. :func:`split_stages` - this pp rank's stage modules (fqn-preserving) of the stage split
4. :func:`materialize` - a meta-built model's owned units initialised, or rank 0's weights
5. :func:`tie_weights` - the weights tied across pipeline ranks and the groups summing
   their gradients (pp > 1), before TP splits the two ends into separate DTensors
6. :func:`build_batch_planner` - per-batch assignment's process groups, when planned;
   :func:`apply_attention` - attention per block: kernel, ring attention (CP), selective
   recompute, or per-batch assignment's
7. :func:`apply_tp` - tensor (and sequence) parallel from the TP plan ``{module fqn: style}``
8. :func:`apply_ep` - MoE layers: on each tp rank's sequence shard (tp > 1); expert
   parallelism: each rank keeps its routed experts (ep > 1)
9. :func:`apply_recompute` - full or per-op recompute of the blocks whose stage asks for it
10. :func:`apply_dp` - FSDP2 / replicate over the data-parallel mesh (dp x cp); the routed
    experts over their own data-parallel group
11. ``codegen.runtime.optim.build_optimizer`` - one optimizer per stage module
12. :func:`build_schedule` - the schedule IR run by torch's schedule runtime (pp > 1)
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel.style import ParallelStyle

from codegen.runtime import data_parallel as dpar
from codegen.runtime import expert_parallel as epar
from codegen.runtime import pipeline_parallel as ppar
from codegen.runtime import vocab_passes as vpass
from codegen.runtime import recompute as rc
from codegen.runtime.offload import Offloader, offload_blocks
from codegen.runtime import tensor_parallel as tpar
from codegen.runtime.tp_styles import roles_of
from codegen.runtime.adapters import ModelAdapter
from codegen.runtime.attention import build_attention, context_attention, local_attention
from codegen.runtime.batch_parallel import BatchPlanner, PerBatch, PerBatchAttention, PieceGroups
from codegen.runtime.documents import Documents
from codegen.runtime.seq_chunks import ChunkAttention, ChunkStore, check_order
from codegen.runtime.mesh import cp_groups, device_type, dp_cp_mesh, hybrid_dp_mesh
from codegen.runtime.fp8 import convert_blocks, fp8_device_problem
from codegen.runtime.regional_compile import compile_blocks
from planner import schedule_ir as ir
from planner.vocab_passes import pass_count
from planner.batch_assign import per_batch_problem
from planner.plan import ModelFacts, ParallelConfig
from planner.schedule_file import parse
from planner.schedule_ir import Schedule
from planner.sharding import dp_replicas, dp_wrapper, reshard_after_forward
from planner.feasibility import Batch, ClusterShape, Nodes, microbatches, problems


@dataclass
class Stages:
    """This pp rank's share of the pipeline."""
    modules: list[nn.Module]        # its stage modules (fqns of the whole model), in virtual-stage order
    idx: list[int]                  # their virtual stage indices
    n_virtual: int                  # virtual stages in the whole pipeline (pp * vpp; 1 without PP)
    policy: dict[str, str]          # unit -> recompute policy of the plan stage holding it
    # the current micro-batch's packed documents, read by every block's attention (documents.py)
    documents: Documents = field(default_factory=Documents)
    offloaders: list[Offloader] = field(default_factory=list)  # one per stage module with offloaded blocks
    chunks: Optional[ChunkStore] = None  # sequence chunks: the step's KV store (codegen/runtime/seq_chunks.py)
    pp_mesh: Optional[DeviceMesh] = None  # the pp dimension (vocabulary passes shard the head over it)

    @property
    def has_first(self) -> bool:
        return 0 in self.idx

    @property
    def has_last(self) -> bool:
        return self.n_virtual - 1 in self.idx

    @property
    def reads_labels(self) -> bool:
        """Whether a stage here reads the labels: the last one, or a vocabulary pass."""
        return self.has_last or any(isinstance(m, vpass.VocabPassStage) for m in self.modules)


def runtime_problem(cfg: ParallelConfig, policies: Sequence[str] = ()) -> Optional[str]:
    """What this runtime does not run of the plan's per-stage recompute ``policies`` (one line
    with the fix), or None: sequence chunks with a stage recomputing or offloading
    (``planner.schedule_ir.seq_chunks_batch_problem``'s rule, per stage)."""
    for p in sorted(set(policies) - {"none"}):
        if (why := ir.seq_chunks_batch_problem(cfg.seq_chunks, 0, False, {}, p)):
            return why
    return None


def check_runnable(cfg: ParallelConfig, adapter: Optional[ModelAdapter], facts: Optional[ModelFacts], batch: Batch,
                   cluster: Optional[ClusterShape] = None) -> None:
    """Refuse, before anything is built, what this rank's runtime cannot run (ValueError, one
    line): the planner's feasibility predicate (``planner.feasibility.problems``) on the plan's
    model ``facts`` with the ``adapter``'s own units and limits (when given), ``batch`` and
    ``cluster`` (None: one node holding this job's processes)."""
    facts = facts or ModelFacts()
    if adapter is not None:
        facts = dataclasses.replace(facts, units=len(adapter.units), limits={**facts.limits, **adapter.limits()})
    if cluster is None:
        cluster = Nodes("this job", 1, dist.get_world_size() if dist.is_initialized() else cfg.world)
    found = problems(cfg, facts, batch, cluster)
    if found:
        raise ValueError(f"{cfg.label()} cannot run for this model: " + "; ".join(found))


def plan_schedule(text: Optional[str]) -> Optional[Schedule]:
    """The plan's own pipeline schedule from its JSON form (``planner/schedule_file.py``;
    checked), or None when the plan runs a built-in one (``text`` None)."""
    return None if text is None else parse(text, "json", where="the program's SCHEDULE")


def pipeline_schedule(cfg: ParallelConfig, n_microbatches: int, custom: Optional[Schedule] = None) -> Schedule:
    """The schedule IR the pipeline runs: ``custom`` (the plan's own, for ``schedule=custom``),
    else the built-in ``cfg.schedule`` over pp ranks, the micro-batches and vpp; either cut into
    ``cfg.seq_chunks`` sequence chunks (forwards in unit order: ``check_order``)."""
    if cfg.schedule != "custom":
        built = ir.builtin(cfg.schedule, cfg.pp, n_microbatches, cfg.vpp, cfg.seq_chunks)
        if cfg.seq_chunks > 1:
            check_order(built)
        return built
    if custom is None:
        raise ValueError("schedule=custom needs the plan's schedule (plan.pipeline.schedule_ir); plan again with "
                         "--schedule FILE")
    if (why := ir.layout_problem(custom, cfg.pp, cfg.vpp, n_microbatches, cfg.seq_chunks)):
        raise ValueError(why)
    if cfg.seq_chunks > 1:
        check_order(custom)
    return custom


def split_stages(adapter: ModelAdapter, stages: Sequence[Sequence[str]], recompute: Sequence[str],
                 cfg: ParallelConfig, mesh: DeviceMesh, schedule: Optional[Schedule] = None) -> Stages:
    """This pp rank's stage modules of ``stages`` (unit names per virtual stage, ``pp * vpp``
    lists covering the model's units in order; merged into one with pp == 1), ``recompute``
    holding the policy per virtual stage; ``schedule`` is the plan's own IR for
    ``schedule=custom`` (its placement of the stages)."""
    stages = [list(s) for s in stages]
    recompute = [rc.check_policy(p) for p in recompute] if recompute else ["none"] * len(stages)
    if len(recompute) != len(stages):
        raise ValueError(f"{len(recompute)} recompute policies for {len(stages)} stages")
    policy = {u: recompute[j] for j, s in enumerate(stages) for u in s}
    if cfg.pp == 1:
        stages, recompute = [[u for s in stages for u in s]], ["none"]
    if len(stages) != cfg.pp * cfg.vpp:
        raise ValueError(f"{len(stages)} stages for pp={cfg.pp} x vpp={cfg.vpp}; give pp*vpp stage lists")
    if cfg.vocab_passes != bool(pass_count(u for s in stages for u in s)):
        raise ValueError(f"vocab_passes={'on' if cfg.vocab_passes else 'off'} but the plan's stages "
                         f"{'do not end' if cfg.vocab_passes else 'end'} with vocabulary passes; plan again")
    placement = (schedule.stage_rank if cfg.schedule == "custom" and schedule is not None
                 else ir.placement(cfg.schedule, cfg.pp, cfg.vpp))
    idx, mods = ppar.build_stages(adapter, stages, recompute, mesh["pp"].get_local_rank(), placement)
    out = Stages(mods, idx, len(stages), policy, chunks=ChunkStore(cfg.seq_chunks) if cfg.seq_chunks > 1 else None,
                 pp_mesh=mesh["pp"] if cfg.vocab_passes else None)
    for sm in mods:
        sm.loss_kernel, sm.sp, sm.documents, sm.chunks = cfg.loss, cfg.sp, out.documents, out.chunks
    return out


def materialize(adapter: ModelAdapter, stages: Stages, device: torch.device, seed: Optional[int]) -> None:
    """A model built on ``meta``: allocate and initialise only this rank's units (seeded by
    ``seed``). A model built with its weights: every rank takes global rank 0's (replicas and
    stages start alike), then this rank's stages move to ``device``. nccl broadcasts device
    tensors only: each tensor goes through ``device`` one at a time. Then each vocabulary pass's
    head becomes its rows over the pp ranks (``vocab_passes.shard_heads``)."""
    model = adapter.model
    if any(p.is_meta for p in model.parameters()):
        adapter.materialize([u for sm in stages.modules for u in sm.units], device, seed)
    else:
        _broadcast_weights(model, device)
        for sm in stages.modules:
            sm.to(device)
    if stages.pp_mesh is not None:  # then each vocabulary pass keeps its rows of the head
        vpass.shard_heads(stages.modules, stages.pp_mesh)


def _broadcast_weights(model: nn.Module, device: torch.device) -> None:
    """Every rank takes global rank 0's weights (nccl: through ``device``, one tensor at a time)."""
    if dist.get_world_size() > 1:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                buf = t.data if t.device == device or dist.get_backend() == "gloo" else t.data.to(device)
                dist.broadcast(buf, src=0)
                if buf is not t.data:
                    t.data.copy_(buf)


def build_batch_planner(per_batch: Optional[PerBatch], cfg: ParallelConfig, facts: Optional[ModelFacts],
                        global_batch: int, mesh: DeviceMesh) -> Optional[BatchPlanner]:
    """Per-batch assignment (codegen/runtime/batch_parallel.py) when the plan asks for it:
    refused in one line where the runtime cannot run it (``planner.batch_assign.per_batch_problem``),
    else the process group of every window of the dp x cp pool, built once (collective)."""
    if per_batch is None:
        return None
    heads = (math.gcd(*facts.heads), math.gcd(*facts.kv_heads)) if facts is not None else (0, 0)
    if why := per_batch_problem(cfg, global_batch, per_batch.pool, per_batch.method, *heads):
        raise ValueError(f"{cfg.label()}: {why}")
    return BatchPlanner(per_batch, PieceGroups(mesh, per_batch), cfg.pp)


def apply_attention(adapter: ModelAdapter, stages: Stages, cfg: ParallelConfig, mesh: DeviceMesh,
                    load_balance: str = "zigzag", per_batch: Optional[BatchPlanner] = None) -> None:
    """Every block's attention: the plan's kernel, context parallelism over ``cp`` (ring, Ulysses
    or both; one instance shared by the blocks), checkpointed when its stage recomputes
    ``selective``; each masks by the packed documents of ``stages.documents``. With per-batch
    assignment (``per_batch``, codegen/runtime/batch_parallel.py) every block runs
    :class:`PerBatchAttention` over each micro-batch's row layout (``stages.documents``) instead."""
    blocks = set(adapter.blocks)
    if stages.chunks is not None:  # sequence chunks: each block's attention over its sequence's chunks so far
        if (why := runtime_problem(cfg, list(stages.policy.values()))):  # a plan's stages may differ from cfg
            raise ValueError(why)
        for sm in stages.modules:
            for u in (u for u in sm.units if u in blocks):
                adapter.set_attention(sm.get_submodule(u), ChunkAttention(stages.chunks, u))
        return
    if per_batch is not None:
        impl = PerBatchAttention(stages.documents, per_batch.groups, local_attention(cfg))
        for sm in stages.modules:
            for u in (u for u in sm.units if u in blocks):
                adapter.set_attention(sm.get_submodule(u), impl)
        return
    docs = stages.documents
    ring = context_attention(cfg, *cp_groups(cfg, mesh), load_balance=load_balance,
                             documents=docs) if cfg.cp > 1 else None
    for sm in stages.modules:
        for u in (u for u in sm.units if u in blocks):
            adapter.set_attention(sm.get_submodule(u), build_attention(cfg, stages.policy[u], ring=ring,
                                                                       documents=docs))


def apply_tp(adapter: ModelAdapter, stages: Stages, tp_plan: dict[str, ParallelStyle], mesh: DeviceMesh,
             sp: bool) -> None:
    """Shard the stage modules over ``mesh["tp"]`` per ``tp_plan`` (module fqn -> ParallelStyle,
    ``codegen/runtime/tp_styles.py``; fqns another rank's stages hold are skipped), then the
    adapter's local-size fix-ups for the roles those styles give."""
    roles = roles_of(tp_plan)
    tpar.apply_tp_stages(stages.modules, mesh["tp"], tp_plan)
    for sm in stages.modules:
        adapter.tp_fixups(sm, mesh["tp"], roles, sp)


@dataclass
class Experts:
    """Expert parallelism on this rank: the ``[pp, edp, ep]`` mesh and the routed-expert
    modules whose experts it split."""
    mesh: DeviceMesh
    modules: list[nn.Module]


def apply_ep(stages: Stages, cfg: ParallelConfig) -> Optional[Experts]:
    """The MoE layers (``codegen/runtime/expert_parallel.py``): with tp > 1 (and so sequence
    parallel) each runs on the rank's sequence shard; with ``cfg.ep > 1`` each routed layer
    keeps this rank's ``experts / ep`` experts and exchanges tokens with its EP group
    (returned), None otherwise. Call it after the weights are materialised (the whole stacks
    are cut here)."""
    if cfg.tp > 1:
        epar.run_on_sequence_shard(epar.moe_parts(stages.modules))
    if cfg.ep == 1:
        return None
    mesh = epar.expert_mesh(cfg, device_type())
    return Experts(mesh, epar.apply_ep(stages.modules, mesh, cfg.tp))


def apply_recompute(adapter: ModelAdapter, stages: Stages) -> None:
    """Checkpoint (recompute in backward) every block whose stage's policy is ``full`` or
    ``selective-op`` (the latter under the per-op save policy); move the saved activations of
    every block whose stage's policy is ``offload`` to host memory (``codegen/runtime/offload.py``)."""
    blocks = set(adapter.blocks)
    for sm in stages.modules:
        for u in (u for u in sm.units if u in blocks and stages.policy[u] in ("full", "selective-op")):
            rc.checkpoint_block(sm.get_submodule(u), per_op=stages.policy[u] == "selective-op",
                                documents=stages.documents, installs=adapter.installs)
        off = offload_blocks([sm.get_submodule(u) for u in sm.units if u in blocks and stages.policy[u] == "offload"],
                             installs=adapter.installs)
        stages.offloaders += [off] if off is not None else []


def apply_fp8(adapter: ModelAdapter, stages: Stages, cfg: ParallelConfig, device: torch.device) -> int:
    """With ``cfg.fp8``, the linears of each block this rank holds as torchao float8 linears
    (codegen/runtime/fp8.py), before data parallelism shards them; refused in one line on a
    device without float8 matmuls. Returns how many linears were converted."""
    if cfg.fp8 == "none":
        return 0
    if why := fp8_device_problem(cfg.fp8, torch.device(device)):
        raise ValueError(why)
    blocks = set(adapter.blocks)
    return convert_blocks((sm.get_submodule(u) for sm in stages.modules for u in sm.units if u in blocks), cfg.fp8,
                          fsdp=cfg.dp * cfg.cp > 1 and dp_wrapper(cfg.zero, cfg.pp, cfg.tp, cfg.dp * cfg.cp,
                                                                  cfg.dtype) == "fully_shard")


def apply_compile(adapter: ModelAdapter, stages: Stages, cfg: ParallelConfig) -> int:
    """With ``cfg.compile``, each block this rank holds through ``torch.compile``
    (codegen/runtime/regional_compile.py), after recomputation and before data parallelism,
    whose hooks stay outside the compiled forwards; returns how many were compiled."""
    if not cfg.compile:
        return 0
    blocks = set(adapter.blocks)
    return compile_blocks(sm.get_submodule(u) for sm in stages.modules for u in sm.units if u in blocks)


def apply_dp(adapter: ModelAdapter, stages: Stages, cfg: ParallelConfig, mesh: DeviceMesh,
             experts: Optional[Experts] = None, dp_spans: int = 1, wrap: bool = True) -> DeviceMesh:
    """FSDP2 / replicate (``cfg.zero``) of each block and stage module over ``dp`` x ``cp``,
    the routed experts of ``experts`` (expert parallelism) first over their own data-parallel
    group; returns the dense gradient-reduction mesh (1-D). ``dp_spans``: the cluster groups
    (regions) the dp x cp group spans (the plan's ``cluster["dp_spans"]``): DP across them runs
    hierarchically where ``planner.sharding.dp_replicas`` says (over a 2-D mesh,
    ``hybrid_dp_mesh``). ``wrap=False``: no wrapper (the caller's step reduces the gradients:
    multimodal sample assignment, codegen/runtime/multimodal.py); the mesh only."""
    dp_mesh = dp_cp_mesh(mesh)
    if not wrap:
        return dp_mesh
    if experts is not None and (dp_mesh.size() > 1 or experts.mesh["edp"].size() > 1):
        dpar.shard_experts(experts.modules, experts.mesh["edp"], cfg.zero, pipelined=cfg.pp > 1, dtype=cfg.dtype)
    n = dp_mesh.size()
    wrapper = dp_wrapper(cfg.zero, cfg.pp, cfg.tp, n, cfg.dtype)
    replicas = dp_replicas(wrapper, cfg.dp, dp_spans)
    wrap_mesh = hybrid_dp_mesh(cfg, replicas) if replicas > 1 else dp_mesh
    dpar.apply_dp(stages.modules, wrap_mesh, wrapper, adapter.blocks,
                  reshard=reshard_after_forward(cfg.zero, cfg.pp, n), dtype=cfg.dtype)
    return dp_mesh


def tie_weights(adapter: ModelAdapter, stages: Stages, mesh: DeviceMesh) -> Optional[ppar.TiedWeights]:
    """With pp > 1, the parameters tied across pipeline ranks (a tied embedding and head) and
    the groups summing their gradients, or None. Call it right after :func:`materialize`,
    before tensor parallelism splits each end into its own DTensor (the ends are then looked
    up by name). The pairs are what each rank sees after materialising its own units,
    merged over the ranks (a stage that holds both ends re-ties them, the others do not,
    and every rank must create the same process groups)."""
    if mesh["pp"].size() == 1:
        return None
    held = {n for sm in stages.modules for n, _ in sm.named_parameters(remove_duplicate=False)}
    pp_rank = mesh["pp"].get_local_rank()
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (adapter.tied(), pp_rank, sorted(held)))
    pairs = sorted({tuple(p) for ranks_pairs, _, _ in seen for p in ranks_pairs})
    names = {n for pair in pairs for n in pair}
    holders = {n: r for _, r, ns in seen for n in ns if n in names}
    pairs = [(a, b) for a, b in pairs if holders[a] != holders[b]]  # both ends on one rank (a V schedule): one tensor
    return ppar.TiedWeights(pairs, holders, stages.modules, mesh) if pairs else None


def build_schedule(stages: Stages, cfg: ParallelConfig, mesh: DeviceMesh, global_batch: int, loss_fn,
                   device: torch.device, schedule: Optional[Schedule] = None):
    """The pipeline schedule (:func:`pipeline_schedule`: ``cfg.schedule``, or ``schedule`` for a
    custom one) over this rank's stages, running the ``global_batch / (dp * mbs)`` micro-batches
    through torch's schedule runtime; None without PP. Gradients are not scaled by the schedule
    (``loss_fn`` does it)."""
    if cfg.pp == 1:
        return None
    sched_ir = pipeline_schedule(cfg, microbatches(cfg, global_batch), schedule)
    _, sched = ppar.build_schedule(stages.modules, stages.idx, stages.n_virtual, mesh["pp"].get_group(), device,
                                   sched_ir, loss_fn)
    return sched
