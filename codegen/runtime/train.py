"""``parallelize``: build the parallel training program for a plan; ``ParallelModel`` trains.

The runtime talks to the model through its adapter (``codegen/runtime/adapters``), never
through attribute names. Order of application (one public helper each in
``codegen/runtime/recipe.py``, which the emitted program calls in the same order): the
feasibility predicate (``planner.feasibility.problems``) on the plan and the adapter's limits,
then the device mesh -> the pipeline stage split (this rank's stage modules, built by the
adapter) -> materialisation of a meta-built model's owned units -> the tied-weight pairs
and groups (pp > 1; before tensor parallelism splits the ends apart) -> attention per block
(kernel, ring attention for CP, selective recompute; held by the build, undone by close) ->
tensor parallel -> full recompute -> data parallel (FSDP2 / replicate over ``dp`` x ``cp``)
-> optimizers (one per stage module, as torchtitan) -> the pipeline schedule (pp > 1).

A training step (``ParallelModel.step``, or written out in the emitted program):
``local_batch`` -> ``zero_grad`` -> ``microbatch`` per micro-batch (gradient accumulation)
or ``pipeline`` (the schedule runs them) -> ``sync_grads`` -> ``clip_grad_norm_``
(optional) -> ``optimizer_step`` (optionally at a new learning rate) -> ``global_loss``.

Batching: ``step(batch)`` receives the GLOBAL batch (``global_batch`` sequences) on every
rank. The adapter turns it into the first stage's inputs and per-position targets (a
transformers model's labels are shifted here, before any sharding); dp rank d takes rows
``[d*B/dp, (d+1)*B/dp)`` (or its share under ``dp_shares``: planner/dp_shares.py), cp rank c the zigzag sequence shard (see context_parallel), and
the rows are cut into ``global_batch / (dp * mbs)`` micro-batches of ``mbs`` sequences:
pipeline micro-batches under PP, gradient accumulation without. A batch that packs several
documents per row says so with ``cu_seqlens`` (codegen/runtime/documents.py): attention
stays inside each document, positions restart at each, and no document's last token
predicts the next one's first. Per-step state travels as forward arguments: every stage
module gets its micro-batch's ``positions`` and ``doc_start`` as keyword arguments (from
``microbatch``, or split per micro-batch by the pipeline schedule), and recomputation
restores the documents its forward saw; nothing is held on the model.

Loss scaling: the last stage returns each micro-batch's SUMMED token loss; ``TokenLoss``
divides it by N, the number of non-ignored targets of the whole global batch, times the
size of the data-parallel (dp x cp) mesh (its gradient reduction averages). The pipeline
schedules run with ``scale_grads=False``. So gradients equal those of the single-process
mean loss over the global batch, whatever the micro-batch / dp / cp split and the ``-100``
targets.

Kernels (codegen/runtime/kernels.py): ``cfg.attention == "flash"`` installs the flash
attention kernel (and the ring's flash block path under CP); ``cfg.loss == "fused"`` makes
the last stage compute the cross-entropy from the head's input (fused linear +
cross-entropy, no logits).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.dp_shares import rank_rows
from planner.feasibility import Batch, Nodes, microbatches, problems
from planner.plan import ModelFacts, ParallelConfig, Plan
from planner.schedule_ir import Schedule
from codegen.runtime.multimodal import SampleBalancer
from codegen.runtime import batch_parallel as bpar
from codegen.runtime import context_parallel as cpar
from codegen.runtime import data_parallel as dpar
from codegen.runtime import documents as docs
from codegen.runtime import expert_parallel as epar
from codegen.runtime import experts
from codegen.runtime import recipe
from codegen.runtime import seq_chunks
from codegen.runtime import tensor_parallel as tpar
from codegen.runtime.tp_styles import styles_for
from codegen.runtime.adapters import IGNORE_INDEX, ModelAdapter, adapter_for
from codegen.runtime.mesh import build_mesh
from codegen.runtime.outer_loop import outer_loop_for
from codegen.runtime.torch_compat import live_process_groups
from codegen.runtime.optim import OptimizerFactory, Optimizers, build_optimizer, clip_grad_norm_, default_optimizer

__all__ = ["ParallelModel", "TokenLoss", "parallelize", "default_optimizer"]


class TokenLoss:
    """The micro-batch loss the backward starts from: the last stage's SUMMED token loss /
    ``n_tokens`` (non-ignored targets of the whole global batch, set per step) * the size of
    the data-parallel (dp x cp) mesh, whose gradient reduction averages."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.n_tokens = 1

    def __call__(self, loss_sum: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return loss_sum * (self.dp_size / self.n_tokens)


def _full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().cpu()


def _merge_ranks(local: dict, has_grad: Callable[[Any], bool]) -> dict:
    """Every rank's ``local`` {fqn: value} gathered and merged (collective): per fqn the first
    rank's value, unless a later rank's has the gradient (``has_grad``) and it does not."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            if k not in out or (not has_grad(out[k]) and has_grad(v)):  # a rank that has the gradient wins
                out[k] = v
    return out


def _scalar(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(torch.float64)


class ParallelModel:
    """The parallelised model on this rank: ``step(batch) -> loss`` or its parts (see the
    module docstring), ``optimizer``, ``parameters_for_check()``; ``stage_modules``
    (fqn-preserving), ``mesh``, ``schedule`` (None without PP)."""

    def __init__(self, adapter: ModelAdapter, cfg: ParallelConfig, mesh: DeviceMesh, stages: recipe.Stages,
                 optimizer: Optimizers, loss_fn: TokenLoss, global_batch: int, device: torch.device, *,
                 dp_mesh: DeviceMesh, schedule=None, tied=None, load_balance: str = "zigzag",
                 batch_planner: Optional[bpar.BatchPlanner] = None, sample_balancer: Optional[SampleBalancer] = None):
        self.adapter, self.model, self.cfg = adapter, adapter.model, cfg
        self.mesh, self.dp_mesh = mesh, dp_mesh
        self.stage_idx, self.n_virtual, self.load_balance = stages.idx, stages.n_virtual, load_balance
        self.stage_modules = stages.modules
        self.documents = stages.documents  # the micro-batch's packed documents, read by the attention
        self.offloaders = stages.offloaders  # activation offload per stage module (offload.py): bytes moved
        self.chunks = stages.chunks  # sequence chunks: the step's KV store (seq_chunks.py), or None
        # this step's per-step stage arguments, [rows of this rank, S_local] each: positions
        # (under CP or with packed documents) and doc_start (packed documents); cut per micro-batch
        self._step_args: dict[str, torch.Tensor] = {}
        self._documents_checked: dict[int, list[str]] = {}  # sequence length -> packed-document problems
        blocks = set(adapter.blocks)
        self.holds_blocks = any(u in blocks for sm in stages.modules for u in sm.units)
        self.global_batch, self.device = global_batch, device
        self.optimizer, self.loss_fn, self.schedule, self.tied = optimizer, loss_fn, schedule, tied
        self.step_count = 0
        self.batch_planner = batch_planner  # per-batch assignment (codegen/runtime/batch_parallel.py) or None
        # multimodal samples over the dp ranks (codegen/runtime/multimodal.py SampleBalancer) or None
        self.sample_balancer = sample_balancer
        self.dp_rank = mesh["dp"].get_local_rank()
        self.cp_rank = mesh["cp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        self.n_microbatches = microbatches(cfg, global_batch)
        self.outer = outer_loop_for(cfg, mesh, stages.modules)  # low-communication DP, or None
        self.outer_rank, self.groups = (mesh["outer"].get_local_rank(), mesh["outer"].size()) if self.outer else (0, 1)
        self.replica = self.outer_rank * (cfg.dp // self.groups) + self.dp_rank  # of all dp x groups replicas
        self.mbs = cfg.rank_mbs[self.replica]  # its sequences of each micro-batch (dp_shares, else cfg.mbs)
        self.has_first, self.has_last, self.reads_labels = stages.has_first, stages.has_last, stages.reads_labels
        self.moe_layers = experts.moe_layers(stages.modules)
        # MoE parameters each tp rank holds whole and trains on its own sequence shard
        self.tp_replicated = epar.tp_replicated_params(epar.moe_parts(stages.modules), cfg.ep) if cfg.tp > 1 else []

    # ---------------------------------------------------------------- data
    def local_batch(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """This rank's inputs and targets of the GLOBAL ``batch``: the rows of its dp rank, the
        sequence shard of its cp rank (whose global positions the stage modules get). Counts
        the global batch's non-ignored targets for the loss scaling."""
        if batch["input_ids"].shape[0] != self.global_batch:
            raise ValueError(f"step() expects the global batch of {self.global_batch} sequences, "
                             f"got {batch['input_ids'].shape[0]}")
        targets = self.adapter.targets(batch)
        if self.batch_planner is not None and "cu_seqlens" in batch:
            return self._per_batch_local(batch, targets)
        seq, replicas, shares, m = targets.shape[1], self.cfg.dp // self.groups, self.cfg.rank_mbs, self.n_microbatches
        rows = rank_rows(shares, self.replica, m)  # its share (planner/dp_shares.py)
        doc_start = self._doc_starts(batch, seq, rows)
        if doc_start is not None:  # each document's last target is ignored
            targets = docs.mask_document_ends(targets, batch["cu_seqlens"])
        first, last = self.outer_rank * replicas, (self.outer_rank + 1) * replicas - 1  # low-communication DP's group
        mine = slice(rank_rows(shares, first, m).start, rank_rows(shares, last, m).stop)  # the group's rows
        self.loss_fn.n_tokens = int((targets[mine] != IGNORE_INDEX).sum())
        inputs = [t[rows] for t in self.adapter.inputs(batch)]
        targets = targets[rows]
        positions = None
        if self.cfg.cp > 1:
            inputs[0] = cpar.shard_sequence(inputs[0], self.cfg.cp, self.cp_rank, 1, self.load_balance)
            targets = cpar.shard_sequence(targets, self.cfg.cp, self.cp_rank, 1, self.load_balance)
            positions = cpar.local_positions(seq, self.cfg.cp, self.cp_rank, self.load_balance, self.device)
        self._step_args = {}
        if doc_start is not None:  # per micro-batch: the document mask and per-document positions
            doc_start = doc_start.to(self.device)
            own = positions if positions is not None else torch.arange(seq, device=self.device)
            self._step_args = dict(doc_start=doc_start, positions=docs.document_positions(doc_start, own))
        elif positions is not None:  # the same global positions on every row
            self._step_args = dict(positions=positions.expand(rows.stop - rows.start, -1))
        self.documents.set(None)
        return tuple(t.to(self.device) for t in inputs), targets.to(self.device)

    def _per_batch_local(self, batch: dict[str, torch.Tensor],
                         targets: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """:meth:`local_batch` under per-batch assignment: this worker's row of each micro-batch
        of the global batch's pieces (``batch_parallel.BatchPlanner.local_rows``), their
        per-piece positions and layout codes (as ``doc_start``) the stage's arguments; the loss
        counts the global batch's targets as on the fixed layout."""
        inputs = self.adapter.inputs(batch)
        if len(inputs) != 1:
            raise ValueError("per-batch assignment runs models whose only input is the tokens; plan without it")
        self._doc_starts(batch, targets.shape[1], slice(0, self.global_batch))  # refuses what cannot run
        targets = docs.mask_document_ends(targets, batch["cu_seqlens"])
        self.loss_fn.n_tokens = int((targets != IGNORE_INDEX).sum())
        row = self.batch_planner.local_rows(inputs[0], targets, batch["cu_seqlens"], self.n_microbatches)
        self._step_args = dict(positions=row.positions.to(self.device), doc_start=row.codes.to(self.device))
        self.documents.set(None)
        return (row.ids.to(self.device),), row.targets.to(self.device)

    def _doc_starts(self, batch: dict[str, torch.Tensor], seq: int, rows: slice) -> Optional[torch.Tensor]:
        """This rank's ``rows`` of the global batch's ``doc_start`` [B, S] from its
        ``cu_seqlens`` (None without); refuses what cannot run with packed documents."""
        if "cu_seqlens" not in batch:
            return None
        why = self._documents_problems(seq)
        if why:
            raise ValueError(f"{'; '.join(why)}; drop batch['cu_seqlens']")
        return docs.doc_starts(batch["cu_seqlens"], self.global_batch, seq, rows.start, rows.stop - rows.start)

    def _documents_problems(self, seq: int) -> list[str]:
        """What the feasibility predicate (``planner.feasibility.problems``) finds for this
        layout and model with packed documents and not without them (the rest was checked
        when the model was built), for sequences of ``seq`` tokens; asked once per length."""
        if seq not in self._documents_checked:
            facts = ModelFacts(units=len(self.adapter.units), limits=self.adapter.limits())
            cluster = Nodes("this job", 1, dist.get_world_size())
            found = {d: problems(self.cfg, facts, Batch(self.global_batch, seq, documents=d,
                                                        load_balance=self.load_balance), cluster) for d in (True, False)}
            self._documents_checked[seq] = [p for p in found[True] if p not in found[False]]
        return self._documents_checked[seq]

    def _check_documents_used(self) -> None:
        """After a packed micro-batch's forward on a rank holding blocks: some attention masked
        by the documents, or the model computes its own attention, which would cross them."""
        if "doc_start" in self._step_args and self.documents.used == 0 and self.holds_blocks:
            raise ValueError("packed documents (cu_seqlens): no attention of this model went through autopar's "
                             "(it computes its own), so it would attend across documents; drop cu_seqlens")

    # ---------------------------------------------------------------- step parts
    def microbatch(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor, mb: int) -> torch.Tensor:
        """Forward and backward of micro-batch ``mb`` without a pipeline (gradients accumulate;
        replicate's all-reduce runs after the last one); returns its scaled loss (float64)."""
        sm, n, mbs = self.stage_modules[0], self.n_microbatches, self.mbs
        dpar.sync_gradients(sm, self.cfg.zero, last=mb == n - 1)
        sl = slice(mb * mbs, (mb + 1) * mbs)
        step_args = {k: v[sl] for k, v in self._step_args.items()}  # the stage's per-step arguments
        with tpar.loss_context(self.cfg.tp):
            loss = self.loss_fn(sm(*(a[sl] for a in inputs), labels=targets[sl], **step_args), targets[sl])
            self._check_documents_used()
            loss.backward()
        return _scalar(loss)

    def pipeline(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """The schedule's forwards and backwards of all micro-batches; returns the sum of this
        rank's scaled micro-batch losses (float64; zero off the last stage)."""
        losses: list[torch.Tensor] = []
        # the last stage's outputs are scalar losses (nothing to merge); its forward gets the
        # micro-batch's targets as ``labels``, split like the schedule's target
        step_args = dict(self._step_args)
        if self.chunks is not None:  # sequence chunks: rows as (micro-batch, chunk) units, absolute positions
            inputs, targets, step_args = self._units(inputs, targets)
        kw = dict(target=targets, losses=losses, labels=targets, return_outputs=False) if self.has_last else \
            (dict(labels=targets) if self.reads_labels else {})  # (vocabulary passes read them on every rank)
        kw.update(step_args)  # every stage: its micro-batch's positions and documents
        with tpar.loss_context(self.cfg.tp):
            self.schedule.step(*inputs, **kw) if self.has_first else self.schedule.step(**kw)
        if self.chunks is not None:
            self.chunks.clear()  # the step's keys/values and their gradients
        self._check_documents_used()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # nccl reduces device tensors only
        for loss in losses:
            total += _scalar(loss)
        return total

    def _units(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor):
        """(inputs, targets, stage arguments) laid out as sequence-chunk units
        (``seq_chunks.to_units``), each chunk with its absolute positions; the store emptied."""
        self.chunks.clear()
        m, k = self.n_microbatches, self.chunks.k
        rows, seq = targets.shape
        positions = torch.arange(seq, device=self.device).expand(rows, seq)
        return ([seq_chunks.to_units(t, m, k) for t in inputs], seq_chunks.to_units(targets, m, k),
                dict(positions=seq_chunks.to_units(positions, m, k)))

    def sync_grads(self) -> None:
        """After the backward, sum the gradients each rank holds only a part of: the weights
        tied across pipeline ranks (pp > 1) and the MoE parameters every tp rank holds whole
        (tp > 1, ``expert_parallel.sum_over_tp``)."""
        if self.tied is not None:
            self.tied.sync_grads()
        if self.tp_replicated:
            epar.sum_over_tp(self.tp_replicated, self.mesh["tp"].get_group())

    def clip_grad_norm_(self, max_norm: Optional[float]) -> float:
        """Clip all gradients to global L2 norm ``max_norm`` (None / <= 0: no clipping); returns
        the norm before clipping, the same on every rank (collective)."""
        copies = {id(p) for p in self.tied.copies} if self.tied is not None else set()
        params = list({id(p): p for sm in self.stage_modules for p in sm.parameters() if id(p) not in copies}.values())
        return clip_grad_norm_(params, max_norm, self.mesh["pp"].get_group())

    def optimizer_step(self, lr: Optional[float] = None) -> None:
        """Step the optimizers (at learning rate ``lr`` when given), move the MoE layers'
        balancing bias (codegen/runtime/experts.py) and count the step."""
        if lr is not None:
            self.optimizer.set_lr(lr)
        self.optimizer.step()
        groups = [self.dp_mesh.get_group()] + ([self.mesh["tp"].get_group()] if self.cfg.tp > 1 else [])
        experts.balance_experts(self.moe_layers, groups, first_step=self.step_count == 0)
        self.step_count += 1
        if self.outer is not None:  # every H steps: pseudo-gradients across the groups, outer Nesterov step
            self.outer.after_step(self.step_count)

    def global_loss(self, local: torch.Tensor) -> float:
        """The global batch's mean token loss from this rank's summed scaled losses (collective)."""
        owns_loss = self.has_last and self.tp_rank == 0
        val = local / (self.dp_mesh.size() * self.groups) if owns_loss else torch.zeros_like(local)
        dist.all_reduce(val)
        return float(val)

    def step(self, batch: dict[str, torch.Tensor], max_norm: Optional[float] = None,
             lr: Optional[float] = None) -> float:
        """One optimizer step on the global ``batch``; returns the global mean loss (all ranks)."""
        inputs, targets = self.local_batch(batch)
        self.optimizer.zero_grad()
        if self.schedule is None:
            loss = sum(self.microbatch(inputs, targets, mb) for mb in range(self.n_microbatches))
        else:
            loss = self.pipeline(inputs, targets)
        self.sync_grads()
        if max_norm is not None:
            self.clip_grad_norm_(max_norm)
        self.optimizer_step(lr)
        return self.global_loss(loss)

    def close(self) -> None:
        """Release what the build installed (collective: every rank calls it): after a barrier,
        the process groups it created are destroyed, transformers registry entries removed, the
        model's modules get back their attributes and lose the hooks (``codegen/runtime/installs.py``).
        The model is not trained again. Idempotent."""
        if self.adapter.installs.closed:
            return
        if dist.is_initialized():
            dist.barrier()
        if self.outer is not None:
            self.outer.close()
        self.adapter.close()

    # ---------------------------------------------------------------- checks
    def named_parameters(self):
        for sm in self.stage_modules:
            yield from sm.named_parameters()

    def parameters_for_check(self) -> dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """{fqn: (full param, full grad or None)} of the WHOLE model, identical on every rank.

        Collective: every rank must call it (gathers DTensor shards, then all ranks' stages).
        """
        local = {n: (_full(p), _full(p.grad)) for n, p in self.named_parameters()}
        return _merge_ranks(local, lambda v: v[1] is not None)

    def gradients_for_check(self) -> dict[str, Optional[torch.Tensor]]:
        """{fqn: full grad or None} of the WHOLE model, identical on every rank: the gradients of
        :meth:`parameters_for_check` without gathering the parameters (each sharded tensor
        gathered costs a collective: on gloo with 4+ ranks per 2 cores, milliseconds each).

        Collective: every rank must call it.
        """
        local = {n: _full(p.grad) for n, p in self.named_parameters()}
        return _merge_ranks(local, lambda v: v is not None)


def parallelize(model: nn.Module, cfg: ParallelConfig, stages: Sequence[Sequence[str]],
                stage_recompute: Sequence[str], tp_layout: dict[str, str], global_batch: int, seq_len: int,
                device: torch.device | str, *, mesh: Optional[DeviceMesh] = None,
                optimizer_factory: OptimizerFactory = default_optimizer, seed: Optional[int] = None,
                load_balance: str = "zigzag", adapter: Optional[ModelAdapter] = None,
                facts: Optional[ModelFacts] = None, schedule: Optional[Schedule] = None,
                per_batch: Optional[bpar.PerBatch] = None, dp_spans: int = 1) -> ParallelModel:
    """Parallelise ``model`` per ``cfg`` on this rank (collective: call on every rank), with
    the helpers of ``codegen/runtime/recipe.py`` in the order the emitted program calls them.

    ``stages``: unit names per virtual stage (``pp * vpp`` lists, covering the model's units
    in order; with pp == 1 they are merged); ``stage_recompute``: policy per virtual stage;
    ``tp_layout``: ``{fqn: role}`` from the plan; ``facts``: the plan's model facts (head
    counts, limits) for the feasibility rule. ``model`` is either materialised, or built on
    ``meta`` (then only this rank's units are materialised and initialised, seeded by
    ``seed``). ``adapter`` defaults to :func:`codegen.runtime.adapters.adapter_for`.
    ``schedule``: the plan's own pipeline schedule IR when ``cfg.schedule`` is ``custom``.
    ``per_batch``: assign each packed batch's documents to context-parallel groups of the size
    they need (codegen/runtime/batch_parallel.py); None: the plan's fixed layout.
    ``dp_spans``: the cluster groups (regions) the dp x cp group spans (the plan's
    ``cluster["dp_spans"]``): DP across them runs hierarchically (``recipe.apply_dp``).
    """
    device = torch.device(device)
    own = adapter is None  # an adapter made here is undone here if the build fails
    adapter = adapter or adapter_for(model, order=[u for s in stages for u in s], seq_len=seq_len, facts=facts)
    before = live_process_groups()
    try:
        recipe.check_runnable(cfg, adapter, facts, Batch(global_batch, seq_len, load_balance=load_balance))
        pm = _build(adapter, cfg, stages, stage_recompute, tp_layout, global_batch, device, mesh,
                    optimizer_factory, seed, load_balance, per_batch, facts, schedule, dp_spans)
    except BaseException:
        adapter.installs.own_groups_since(before)
        if own:
            adapter.installs.close()  # registry entries, config copy, hooks and groups of the failed build
        raise
    adapter.installs.own_groups_since(before)  # meshes, tied-weight groups: destroyed when the build closes
    return pm


def _build(adapter: ModelAdapter, cfg: ParallelConfig, stages: Sequence[Sequence[str]],
           stage_recompute: Sequence[str], tp_layout: dict[str, str], global_batch: int, device: torch.device,
           mesh: Optional[DeviceMesh], optimizer_factory: OptimizerFactory, seed: Optional[int],
           load_balance: str, per_batch: Optional[bpar.PerBatch] = None,
           facts: Optional[ModelFacts] = None, schedule: Optional[Schedule] = None,
           dp_spans: int = 1) -> ParallelModel:
    """The recipe's steps after the feasibility check (:func:`parallelize`)."""
    mesh = mesh if mesh is not None else build_mesh(cfg)
    if cfg.pp > 1:  # the schedule checked before anything is built
        schedule = recipe.pipeline_schedule(cfg, microbatches(cfg, global_batch), schedule)
    split = recipe.split_stages(adapter, stages, stage_recompute, cfg, mesh, schedule)
    recipe.materialize(adapter, split, device, seed)
    tied = recipe.tie_weights(adapter, split, mesh)  # before TP splits the tied ends apart
    planner_ = recipe.build_batch_planner(per_batch, cfg, facts, global_batch, mesh)
    recipe.apply_attention(adapter, split, cfg, mesh, load_balance, planner_)
    recipe.apply_tp(adapter, split, styles_for(tp_layout, cfg.sp, adapter.units), mesh, cfg.sp)
    experts = recipe.apply_ep(split, cfg)
    recipe.apply_fp8(adapter, split, cfg, device)
    recipe.apply_recompute(adapter, split)
    recipe.apply_compile(adapter, split, cfg)
    dp_mesh = recipe.apply_dp(adapter, split, cfg, mesh, experts, dp_spans)
    optimizer = build_optimizer(split.modules, optimizer_factory, cfg.zero, dp_mesh.size(), dp_mesh.get_group())
    loss_fn = TokenLoss(dp_mesh.size())
    runner = recipe.build_schedule(split, cfg, mesh, global_batch, loss_fn, device, schedule)
    return ParallelModel(adapter, cfg, mesh, split, optimizer, loss_fn, global_batch, device, dp_mesh=dp_mesh,
                         schedule=runner, tied=tied, load_balance=load_balance, batch_planner=planner_)


def parallelize_plan(model: nn.Module, plan: Plan, device: torch.device | str, *,
                     optimizer_factory: OptimizerFactory = default_optimizer, seed: Optional[int] = None,
                     adapter: Optional[ModelAdapter] = None) -> ParallelModel:
    """:func:`parallelize` with everything a plan file fixes taken from ``plan``: configuration,
    stage split, recompute per stage, TP layout, batch, sequence length, model facts and
    per-batch assignment (``batch.per_batch``, when chosen)."""
    return parallelize(model, plan.config, [s["layers"] for s in plan.stages], [s["recompute"] for s in plan.stages],
                       dict(plan.tp_layout), int(plan.batch["global"]), int(plan.batch["seq_len"]), device,
                       optimizer_factory=optimizer_factory, seed=seed, adapter=adapter, facts=plan.facts,
                       schedule=plan.schedule_ir,
                       per_batch=bpar.per_batch_of(plan.batch.get("per_batch")),
                       dp_spans=int(plan.cluster.get("dp_spans", 1)))
