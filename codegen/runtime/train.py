"""``parallelize``: build the parallel training program for a plan; ``ParallelModel.step`` trains.

The runtime talks to the model through its adapter (``codegen/runtime/adapters``), never
through attribute names. Order of application: the feasibility rule
(``planner.plan.config_problems``) on the plan and the adapter's limits, then the pipeline
stage split (this rank's stage modules, built by the adapter) -> materialisation of a
meta-built model's owned units -> attention per block (kernel, ring attention for CP,
selective recompute; installed on the model instance) -> tensor parallel -> full recompute
-> data parallel (FSDP2 / replicate over ``dp`` x ``cp``) -> optimizers (one per stage
module, as torchtitan) -> the tied-weight group (pp > 1).

Batching: ``step(batch)`` receives the GLOBAL batch (``global_batch`` sequences) on every
rank. The adapter turns it into the first stage's inputs and per-position targets (a
transformers model's labels are shifted here, before any sharding); dp rank d takes rows
``[d*B/dp, (d+1)*B/dp)``, cp rank c the zigzag sequence shard (see context_parallel), and
the rows are cut into ``global_batch / (dp * mbs)`` micro-batches of ``mbs`` sequences:
pipeline micro-batches under PP, gradient accumulation without.

Loss scaling: the last stage returns each micro-batch's SUMMED token loss; ``loss_fn``
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

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.plan import ModelFacts, ParallelConfig, config_problems
from codegen.runtime import context_parallel as cpar
from codegen.runtime import data_parallel as dpar
from codegen.runtime import pipeline_parallel as ppar
from codegen.runtime import recompute as rc
from codegen.runtime import tensor_parallel as tpar
from codegen.runtime.adapters import IGNORE_INDEX, ModelAdapter, adapter_for
from codegen.runtime.attention import build_attention, ring_attention
from codegen.runtime.mesh import build_mesh, dp_cp_mesh

OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def default_optimizer(params: list) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3, weight_decay=0.1), the default optimizer factory."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().cpu()


class Optimizers:
    """One optimizer per stage module on this rank, stepped together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


@dataclass
class Layout:
    """Where this rank sits and what it runs: its virtual stages and the meshes."""
    mesh: DeviceMesh
    dp_mesh: DeviceMesh              # the gradient-reduction mesh: dp flattened with cp
    stage_idx: list[int]             # virtual stage indices this pp rank holds
    n_virtual: int
    load_balance: str = "zigzag"


class ParallelModel:
    """The parallelised model on this rank: ``step(batch) -> loss``, ``optimizer``,
    ``parameters_for_check()``; ``stage_modules`` (fqn-preserving) and ``mesh``."""

    def __init__(self, adapter: ModelAdapter, cfg: ParallelConfig, layout: Layout, stage_mods: list[nn.Module],
                 global_batch: int, seq_len: int, device: torch.device, optimizer: Optimizers,
                 tied: Optional[ppar.TiedWeights] = None):
        self.adapter, self.model, self.cfg = adapter, adapter.model, cfg
        self.mesh, self.dp_mesh = layout.mesh, layout.dp_mesh
        self.stage_idx, self.n_virtual, self.load_balance = layout.stage_idx, layout.n_virtual, layout.load_balance
        self.stage_modules = stage_mods
        self.global_batch, self.seq_len, self.device = global_batch, seq_len, device
        self.optimizer, self.tied = optimizer, tied
        self.step_count = 0
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.cp_rank = self.mesh["cp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.n_microbatches = global_batch // (cfg.dp * cfg.mbs)
        self.has_first = 0 in self.stage_idx
        self.has_last = (self.n_virtual - 1) in self.stage_idx
        self._n_tokens = 1
        self.schedule = None
        if cfg.pp > 1:
            _, self.schedule = ppar.build_schedule(stage_mods, self.stage_idx, self.n_virtual,
                                                   self.mesh["pp"].get_group(), device, cfg.schedule,
                                                   self.n_microbatches, self.loss_fn)

    # ---------------------------------------------------------------- loss
    def loss_fn(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Micro-batch loss: the last stage's summed token loss / global token count * dp-mesh
        size (see the module docstring)."""
        return loss_sum * (self.dp_mesh.size() / self._n_tokens)

    # ---------------------------------------------------------------- data
    def _local_batch(self, batch: dict[str, torch.Tensor]):
        """This rank's inputs and targets of the global ``batch`` (rows of its dp rank, the
        sequence shard of its cp rank) and, under CP, the global positions of its tokens."""
        if batch["input_ids"].shape[0] != self.global_batch:
            raise ValueError(f"step() expects the global batch of {self.global_batch} sequences, "
                             f"got {batch['input_ids'].shape[0]}")
        targets = self.adapter.targets(batch)
        self._n_tokens = int((targets != IGNORE_INDEX).sum())
        per = self.global_batch // self.cfg.dp
        rows = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        inputs = [t[rows] for t in self.adapter.inputs(batch)]
        targets = targets[rows]
        positions = None
        if self.cfg.cp > 1:
            seq = targets.shape[1]
            inputs[0] = cpar.shard_sequence(inputs[0], self.cfg.cp, self.cp_rank, 1, self.load_balance)
            targets = cpar.shard_sequence(targets, self.cfg.cp, self.cp_rank, 1, self.load_balance)
            positions = cpar.local_positions(seq, self.cfg.cp, self.cp_rank, self.load_balance, self.device)
        return tuple(t.to(self.device) for t in inputs), targets.to(self.device), positions

    # ---------------------------------------------------------------- step
    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on the global ``batch``; returns the global mean loss (all ranks)."""
        inputs, targets, positions = self._local_batch(batch)
        for sm in self.stage_modules:
            sm.positions = positions
        self.optimizer.zero_grad()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # nccl reduces device tensors only
        with tpar.loss_context(self.cfg.tp):
            if self.schedule is None:
                sm = self.stage_modules[0]
                n = self.n_microbatches
                for mb in range(n):
                    dpar.sync_gradients(sm, self.cfg.zero, last=mb == n - 1)
                    sl = slice(mb * self.cfg.mbs, (mb + 1) * self.cfg.mbs)
                    loss = self.loss_fn(sm(*(a[sl] for a in inputs), labels=targets[sl]), targets[sl])
                    loss.backward()
                    total += _scalar(loss)
            else:
                losses: list[torch.Tensor] = []
                # the last stage's outputs are scalar losses (nothing to merge); its forward gets
                # the micro-batch's targets as ``labels``, split like the schedule's target
                kw = dict(target=targets, losses=losses, labels=targets, return_outputs=False) if self.has_last else {}
                self.schedule.step(*inputs, **kw) if self.has_first else self.schedule.step(**kw)
                for l in losses:
                    total += _scalar(l)
        if self.tied is not None:
            self.tied.sync_grads()
        self.optimizer.step()
        self.step_count += 1
        owns_loss = self.has_last and self.tp_rank == 0
        val = total / self.dp_mesh.size() if owns_loss else torch.zeros_like(total)
        dist.all_reduce(val)
        return float(val)

    def close(self) -> None:
        """Nothing process-wide was installed; kept so callers can release the model uniformly."""

    # ---------------------------------------------------------------- checks
    def named_parameters(self):
        for sm in self.stage_modules:
            yield from sm.named_parameters()

    def parameters_for_check(self) -> dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """{fqn: (full param, full grad or None)} of the WHOLE model, identical on every rank.

        Collective: every rank must call it (gathers DTensor shards, then all ranks' stages).
        """
        local = {n: (_full(p), _full(p.grad)) for n, p in self.named_parameters()}
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        out: dict = {}
        for part in parts:
            for k, v in part.items():
                if k not in out or (out[k][1] is None and v[1] is not None):  # a rank that has the gradient wins
                    out[k] = v
        return out


def _scalar(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(torch.float64)


def _own_weights(model: nn.Module, stage_mods: Sequence[nn.Module], device: torch.device) -> None:
    """A model the caller built with its weights (every process holds all of them): every
    rank takes global rank 0's (replicas and stages start alike even if each process drew
    its own random initialisation), then this rank's stages move to ``device``. nccl
    broadcasts device tensors only: each tensor goes through ``device`` one at a time."""
    if dist.get_world_size() > 1:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                buf = t.data if t.device == device or dist.get_backend() == "gloo" else t.data.to(device)
                dist.broadcast(buf, src=0)
                if buf is not t.data:
                    t.data.copy_(buf)
    for sm in stage_mods:
        sm.to(device)


def check_runnable(cfg: ParallelConfig, adapter: ModelAdapter, facts: Optional[ModelFacts], global_batch: int,
                   seq_len: int) -> None:
    """Refuse, before anything is built, what this rank's runtime cannot run (one line)."""
    facts = facts or ModelFacts(units=len(adapter.units), seq_len=seq_len)
    facts = ModelFacts(facts.heads, facts.kv_heads, facts.hidden, len(adapter.units), seq_len,
                       {**facts.limits, **adapter.limits()})
    problems = config_problems(cfg, facts)
    if global_batch % (cfg.dp * cfg.mbs):
        problems.append(f"global batch {global_batch} is not divisible by dp*mbs = {cfg.dp * cfg.mbs}")
    elif cfg.pp > 1 and global_batch // (cfg.dp * cfg.mbs) < cfg.pp:
        problems.append(f"{global_batch // (cfg.dp * cfg.mbs)} micro-batches for pp={cfg.pp}: "
                        "need at least pp (raise the global batch)")
    if problems:
        raise ValueError(f"{cfg.label()} cannot run for this model: " + "; ".join(problems))


def _agreed_tied_pairs(adapter) -> list[tuple[str, str]]:
    """The tied parameter pairs every rank sees after materialising its own units, merged over
    the ranks: a stage that holds both ends re-ties them and the others do not (a zoo model built
    on meta), and TiedWeights creates its process groups collectively, so all must agree."""
    mine = adapter.tied()
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return sorted({tuple(p) for ranks_pairs in seen for p in ranks_pairs})


def parallelize(model: nn.Module, cfg: ParallelConfig, stages: Sequence[Sequence[str]],
                stage_recompute: Sequence[str], tp_layout: dict[str, str], global_batch: int, seq_len: int,
                device: torch.device | str, *, mesh: Optional[DeviceMesh] = None,
                optimizer_factory: OptimizerFactory = default_optimizer, seed: Optional[int] = None,
                load_balance: str = "zigzag", adapter: Optional[ModelAdapter] = None,
                facts: Optional[ModelFacts] = None) -> ParallelModel:
    """Parallelise ``model`` per ``cfg`` on this rank (collective: call on every rank).

    ``stages``: unit names per virtual stage (``pp * vpp`` lists, covering the model's units
    in order; with pp == 1 they are merged); ``stage_recompute``: policy per virtual stage;
    ``tp_layout``: ``{fqn: role}`` from the plan; ``facts``: the plan's model facts (head
    counts, limits) for the feasibility rule. ``model`` is either materialised, or built on
    ``meta`` (then only this rank's units are materialised and initialised, seeded by
    ``seed``). ``adapter`` defaults to :func:`codegen.runtime.adapters.adapter_for`.
    """
    cfg.validate()
    device = torch.device(device)
    adapter = adapter or adapter_for(model, order=[u for s in stages for u in s], seq_len=seq_len)
    check_runnable(cfg, adapter, facts, global_batch, seq_len)
    adapter.facts = facts
    mesh = mesh if mesh is not None else build_mesh(cfg)
    stages = [list(s) for s in stages]
    stage_recompute = [rc.check_policy(p) for p in stage_recompute] if stage_recompute else ["none"] * len(stages)
    if len(stage_recompute) != len(stages):
        raise ValueError(f"{len(stage_recompute)} recompute policies for {len(stages)} stages")
    block_policy: dict[str, str] = {u: stage_recompute[j] for j, s in enumerate(stages) for u in s}
    if cfg.pp == 1:
        stages, stage_recompute = [[u for s in stages for u in s]], ["none"]
    if len(stages) != cfg.pp * cfg.vpp:
        raise ValueError(f"{len(stages)} stages for pp={cfg.pp} x vpp={cfg.vpp}; give pp*vpp stage lists")
    if cfg.cp > 1 and seq_len % (2 * cfg.cp if load_balance == "zigzag" else cfg.cp):
        raise ValueError(f"seq_len {seq_len} must be a multiple of 2*cp = {2 * cfg.cp} for zigzag CP")

    stage_idx, stage_mods = ppar.build_stages(adapter, stages, stage_recompute, mesh["pp"].get_local_rank(), cfg.pp)
    if any(p.is_meta for p in model.parameters()):
        adapter.materialize([u for sm in stage_mods for u in sm.units], device, seed)
    else:
        _own_weights(model, stage_mods, device)
    ring = ring_attention(cfg, mesh["cp"].get_group(), load_balance) if cfg.cp > 1 else None
    blocks = set(adapter.blocks)
    for sm in stage_mods:
        sm.loss_kernel, sm.sp = cfg.loss, cfg.sp
        for u in (u for u in sm.units if u in blocks):
            adapter.set_attention(sm.get_submodule(u), build_attention(cfg, block_policy[u], ring=ring))
    for sm in stage_mods:
        tpar.apply_tp(sm, mesh["tp"], tp_layout, cfg.sp)
        adapter.tp_fixups(sm, mesh["tp"], tp_layout, cfg.sp)
        for u in (u for u in sm.units if u in blocks and block_policy[u] == "full"):
            rc.checkpoint_block(sm.get_submodule(u))
    dp_mesh = dp_cp_mesh(mesh)
    dpar.apply_dp(stage_mods, dp_mesh, cfg.zero, pipelined=cfg.pp > 1, blocks=adapter.blocks)
    opts: list[torch.optim.Optimizer] = []
    for sm in stage_mods:
        params = list(sm.parameters())
        if cfg.zero == "zero1" and dp_mesh.size() > 1:
            opts.append(dpar.ShardedOptimizer(params, optimizer_factory, dp_mesh.get_group()))
        else:
            opts.append(optimizer_factory(params))
    tied_pairs = _agreed_tied_pairs(adapter) if cfg.pp > 1 else []
    tied = ppar.TiedWeights(tied_pairs, stage_mods, mesh) if tied_pairs else None
    layout = Layout(mesh, dp_mesh, stage_idx, len(stages), load_balance)
    return ParallelModel(adapter, cfg, layout, stage_mods, global_batch, seq_len, device, Optimizers(opts), tied)
