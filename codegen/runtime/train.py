"""``parallelize``: build the parallel training program for a plan; ``ParallelModel.step`` trains.

Order of application: context-parallel attention installed, then the pipeline stage split
(this rank's stage modules) -> tensor parallel -> activation recompute -> data parallel
(FSDP2 / replicate over ``dp`` x ``cp``) -> optimizers (one per stage module, as torchtitan).

Batching: ``step(batch)`` receives the GLOBAL batch (``global_batch`` sequences) on every
rank. dp rank d takes rows ``[d*B/dp, (d+1)*B/dp)``, cp rank c the zigzag sequence shard
(see context_parallel), and the rows are cut into ``global_batch / (dp * mbs)``
micro-batches of ``mbs`` sequences: pipeline micro-batches under PP, gradient
accumulation without.

Loss scaling: each micro-batch's loss is ``sum of token cross-entropies / N`` where N is
the number of non-ignored label tokens of the whole global batch, times the size of the
data-parallel (dp x cp) mesh (its gradient reduction averages). The pipeline schedules
run with ``scale_grads=False``. So gradients equal those of the single-process mean loss
over the global batch, whatever the micro-batch / dp / cp split and the ``-100`` labels.

Kernels (codegen/runtime/kernels.py): ``cfg.attention == "flash"`` installs the flash
attention kernel (and the ring's flash block path under CP); ``cfg.loss == "fused"`` makes
the last stage return the summed cross-entropy from the head's input (fused linear +
cross-entropy, no logits), which ``loss_fn`` then scales exactly as the logits path.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.plan import ParallelConfig
from codegen.runtime import context_parallel as cpar
from codegen.runtime import data_parallel as dpar
from codegen.runtime import kernels as kern
from codegen.runtime import pipeline_parallel as ppar
from codegen.runtime import recompute as rc
from codegen.runtime import tensor_parallel as tpar
from codegen.runtime.mesh import build_mesh, dp_cp_mesh

IGNORE_INDEX = -100
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


class ParallelModel:
    """The parallelised model on this rank: ``step(batch) -> loss``, ``optimizer``,
    ``parameters_for_check()``; ``stage_modules`` (FQN-preserving) and ``mesh``."""

    def __init__(self, model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh, stage_idx: list[int],
                 stage_mods: list[ppar.StageModule], n_virtual: int, global_batch: int, seq_len: int,
                 device: torch.device, optimizer: Optimizers, dp_mesh: DeviceMesh, load_balance: str):
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self.stage_idx, self.stage_modules, self.n_virtual = stage_idx, stage_mods, n_virtual
        self.global_batch, self.seq_len, self.device = global_batch, seq_len, device
        self.optimizer, self.dp_mesh, self.load_balance = optimizer, dp_mesh, load_balance
        self.step_count = 0
        self._prev_attention = None
        self.dp_rank = mesh["dp"].get_local_rank()
        self.cp_rank = mesh["cp"].get_local_rank()
        self.tp_rank = mesh["tp"].get_local_rank()
        self.n_microbatches = global_batch // (cfg.dp * cfg.mbs)
        self.is_mllm = hasattr(model, "vision")
        self.has_first = 0 in stage_idx
        self.has_last = (n_virtual - 1) in stage_idx
        self._n_tokens = 1
        self.fused_loss = cfg.loss == "fused"
        self.schedule = None
        if cfg.pp > 1:
            _, self.schedule = ppar.build_schedule(stage_mods, stage_idx, n_virtual, mesh["pp"].get_group(),
                                                   device, cfg.schedule, self.n_microbatches, self.loss_fn)

    # ---------------------------------------------------------------- loss
    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Micro-batch loss: summed CE / global token count * dp-mesh size (see module docstring).

        With the fused loss the stage output already is the summed CE (``logits`` is that scalar)."""
        if self.fused_loss:
            return logits * (self.dp_mesh.size() / self._n_tokens)
        ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
        return ce * (self.dp_mesh.size() / self._n_tokens)

    # ---------------------------------------------------------------- data
    def _local_batch(self, batch: dict[str, torch.Tensor]):
        ids, labels = batch["input_ids"], batch["labels"]
        pix = batch.get("pixel_values")
        if ids.shape[0] != self.global_batch:
            raise ValueError(f"step() expects the global batch of {self.global_batch} sequences, got {ids.shape[0]}")
        if self.is_mllm:
            n_img = self.model.config.num_patches
            if labels.shape[-1] == ids.shape[-1]:
                labels = torch.cat((labels.new_full((labels.shape[0], n_img), IGNORE_INDEX), labels), dim=1)
        self._n_tokens = int((labels != IGNORE_INDEX).sum())
        per = self.global_batch // self.cfg.dp
        rows = slice(self.dp_rank * per, (self.dp_rank + 1) * per)
        ids, labels = ids[rows], labels[rows]
        pix = pix[rows] if pix is not None else None
        positions = None
        if self.cfg.cp > 1:
            seq = labels.shape[1]
            ids = cpar.shard_sequence(ids, self.cfg.cp, self.cp_rank, 1, self.load_balance)
            labels = cpar.shard_sequence(labels, self.cfg.cp, self.cp_rank, 1, self.load_balance)
            positions = cpar.local_positions(seq, self.cfg.cp, self.cp_rank, self.load_balance, self.device)
        to = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        return to(ids), to(labels), to(pix), positions

    # ---------------------------------------------------------------- step
    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on the global ``batch``; returns the global mean loss (all ranks)."""
        ids, labels, pix, positions = self._local_batch(batch)
        for sm in self.stage_modules:
            sm.positions = positions
        self.optimizer.zero_grad()
        args = (ids, pix) if self.is_mllm else (ids,)
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # nccl reduces device tensors only
        with tpar.loss_context(self.cfg.tp):
            if self.schedule is None:
                sm = self.stage_modules[0]
                n = self.n_microbatches
                for mb in range(n):
                    dpar.sync_gradients(sm, self.cfg.zero, last=mb == n - 1)
                    sl = slice(mb * self.cfg.mbs, (mb + 1) * self.cfg.mbs)
                    lkw = {"labels": labels[sl]} if self.fused_loss else {}
                    logits = sm(*(a[sl] for a in args), **lkw)
                    loss = self.loss_fn(logits, labels[sl])
                    loss.backward()
                    total += _scalar(loss)
            else:
                losses: list[torch.Tensor] = []
                kw = {"target": labels, "losses": losses} if self.has_last else {}
                if self.has_last and self.fused_loss:
                    kw["labels"] = labels  # split per micro-batch like the target
                    kw["return_outputs"] = False  # stage outputs are scalar losses: nothing to merge
                if self.has_first:
                    self.schedule.step(*args, **kw)
                else:
                    self.schedule.step(**kw)
                for l in losses:
                    total += _scalar(l)
        self.optimizer.step()
        self.step_count += 1
        owns_loss = self.has_last and self.tp_rank == 0
        val = total / self.dp_mesh.size() if owns_loss else torch.zeros_like(total)
        dist.all_reduce(val)
        return float(val)

    def close(self) -> None:
        """Restore the attention implementation that was installed before ``parallelize``."""
        if self._prev_attention is not None:
            rc._ZOO_ATTN.set_attention_impl(self._prev_attention)
            self._prev_attention = None

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


def _materialize(model: nn.Module, units: Sequence[str], device: torch.device, seed: Optional[int]) -> None:
    if not any(p.is_meta for p in model.parameters()):
        return
    for fqn in units:
        model.get_submodule(fqn).to_empty(device=device)
    model.init_weights(seed)  # per-parameter seeded; meta (other stages') parameters are skipped


def parallelize(model: nn.Module, cfg: ParallelConfig, stages: Sequence[Sequence[str]],
                stage_recompute: Sequence[str], tp_layout: dict[str, str], global_batch: int, seq_len: int,
                device: torch.device | str, *, mesh: Optional[DeviceMesh] = None,
                optimizer_factory: OptimizerFactory = default_optimizer, seed: Optional[int] = None,
                load_balance: str = "zigzag") -> ParallelModel:
    """Parallelise ``model`` per ``cfg`` on this rank (collective: call on every rank).

    ``stages``: unit fqns per virtual stage (``pp * vpp`` lists, covering the model's units
    in order; with pp == 1 they are merged); ``stage_recompute``: policy per virtual
    stage; ``tp_layout``: ``{fqn: role}`` from the plan. ``model`` is the full zoo model,
    either materialised and initialised, or on ``meta`` (then only this rank's units are
    materialised and initialised with ``model.init_weights(seed)``).
    """
    cfg.validate()
    device = torch.device(device)
    mesh = mesh if mesh is not None else build_mesh(cfg)
    stages = [list(s) for s in stages]
    stage_recompute = list(stage_recompute) if stage_recompute else ["none"] * len(stages)
    if len(stage_recompute) != len(stages):
        raise ValueError(f"{len(stage_recompute)} recompute policies for {len(stages)} stages")
    if global_batch % (cfg.dp * cfg.mbs):
        raise ValueError(f"global batch {global_batch} is not divisible by dp*mbs = {cfg.dp * cfg.mbs}")
    n_mb = global_batch // (cfg.dp * cfg.mbs)
    block_policy: dict[str, str] = {u: stage_recompute[j] for j, s in enumerate(stages) for u in s}
    if cfg.pp == 1:
        merged_policy = "selective" if "selective" in stage_recompute else stage_recompute[0]
        stages, stage_recompute = [[u for s in stages for u in s]], [merged_policy]
    n_virtual = len(stages)
    if n_virtual != cfg.pp * cfg.vpp:
        raise ValueError(f"{n_virtual} stages for pp={cfg.pp} x vpp={cfg.vpp}; give pp*vpp stage lists")
    if cfg.pp > 1 and n_mb < cfg.pp:
        raise ValueError(f"{n_mb} micro-batches for pp={cfg.pp}: need at least pp (raise the global batch)")
    if cfg.cp > 1:
        if seq_len % (2 * cfg.cp if load_balance == "zigzag" else cfg.cp):
            raise ValueError(f"seq_len {seq_len} must be a multiple of 2*cp = {2 * cfg.cp} for zigzag CP")
        if hasattr(model, "vision"):
            raise ValueError("context parallel is not supported for the vision+language model (image tokens "
                             "are not sequence-sharded); use cp=1")
    if cfg.sp and (seq_len // cfg.cp) % cfg.tp:
        raise ValueError(f"sequence parallel needs seq_len/cp = {seq_len // cfg.cp} divisible by tp={cfg.tp}")
    if getattr(getattr(model, "config", None), "tie_embeddings", False) and cfg.pp > 1:
        raise ValueError("tied embeddings across pipeline stages are not supported; untie or use pp=1")

    prev_attention = rc._ZOO_ATTN.get_attention_impl()
    pp_rank = mesh["pp"].get_local_rank()
    stage_idx, stage_mods = ppar.build_stages(model, stages, stage_recompute, pp_rank, cfg.pp, cfg.schedule)
    owned = [u for sm in stage_mods for u in sm.units]
    _materialize(model, owned, device, seed)

    # Kernels: flash attention (before the ring, whose non-causal fallback it becomes).
    if cfg.attention == "flash":
        kern.install_flash_attention()
    if cfg.loss == "fused":
        for sm in stage_mods:
            if sm.is_last:
                sm.head_loss = functools.partial(kern.head_loss, sp=cfg.sp)
    # Context parallel: ring attention over the cp group (before selective recompute wraps it).
    if cfg.cp > 1:
        cpar.install_ring_attention(mesh["cp"].get_group(), load_balance, flash=cfg.attention == "flash")
    # Tensor parallel.
    for sm in stage_mods:
        tpar.apply_tp(sm, mesh["tp"], tp_layout, cfg.sp)
    # Recompute.
    for sm in stage_mods:
        rc.apply_recompute([(sm.get_submodule(u), block_policy.get(u, sm.recompute))
                            for u in sm.units if ppar.is_block(u)])
    # Data parallel over dp x cp.
    dp_mesh = dp_cp_mesh(mesh)
    dpar.apply_dp(stage_mods, dp_mesh, cfg.zero, pipelined=cfg.pp > 1)
    # Optimizers, one per stage module.
    opts: list[torch.optim.Optimizer] = []
    for sm in stage_mods:
        params = list(sm.parameters())
        if cfg.zero == "zero1" and dp_mesh.size() > 1:
            opts.append(dpar.ShardedOptimizer(params, optimizer_factory, dp_mesh.get_group()))
        else:
            opts.append(optimizer_factory(params))
    pm = ParallelModel(model, cfg, mesh, stage_idx, stage_mods, n_virtual, global_batch, seq_len, device,
                       Optimizers(opts), dp_mesh, load_balance)
    pm._prev_attention = prev_attention
    return pm
