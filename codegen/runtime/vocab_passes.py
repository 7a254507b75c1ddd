"""Vocabulary passes at run time: the head's rows split over the pp ranks, one pipeline stage each.

The rule (names, rows, what flows between passes and why the loss is exact) is
``planner/vocab_passes.py``'s. Here:

- :class:`VocabPassStage`: pass ``j`` of ``p``, a :class:`StageModule` holding the head module
  under its own fqn (so the build materialises and initialises it like any unit); it is called
  with the final hidden states (pass 0) or what the pass before sent (:func:`pack`: h, the
  running log-sum-exp and target logit) and the micro-batch's ``labels``, and sends the same on,
  or on the last pass returns the summed token loss (the stage protocol's);
- :func:`shard_heads` (``recipe.materialize`` calls it once the weights exist): each pass's head
  weight becomes its rows, a ``Shard(0)`` DTensor over the pp mesh (a DCP checkpoint saves each
  rank's rows, the gradient check gathers them; its squared norm is summed over the pp group once,
  ``optim.clip_grad_norm_``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from codegen.runtime.adapters.base import IGNORE_INDEX, ModelAdapter, StageModule, attach
from planner.vocab_passes import VocabPass, pass_unit, shard_rows


class VocabPassStage(StageModule):
    """Pass ``vp.j`` of ``vp.p`` over the head ``vp.head`` (module docstring)."""

    def __init__(self, adapter: ModelAdapter, vp: VocabPass):
        super().__init__([vp.head], adapter.units)
        self.vp, self.is_last = vp, vp.j == vp.p - 1
        head = adapter.model.get_submodule(vp.head)
        self.linear = adapter.head_linear()  # fqn of the head's Linear (its weight's rows are split)
        attach(self, vp.head, head)

    @property
    def weight(self) -> nn.Parameter:
        return self.get_submodule(self.linear).weight

    def forward(self, *args: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, doc_start: Optional[torch.Tensor] = None):
        if labels is None:
            raise ValueError("a vocabulary pass needs the micro-batch's labels (the schedule passes them to every rank)")
        self.take_step(positions, doc_start)
        h, lse, tgt = unpack(args) if self.vp.j else (args[0], None, None)
        if not isinstance(self.weight, DTensor):
            raise RuntimeError(f"{pass_unit(self.vp.head, self.vp.j, self.vp.p)}: the head holds every row; "
                               "recipe.materialize splits it over the pp ranks before the first step")
        w = self.weight.to_local()  # this pass's rows (differentiable: the gradient comes back as the DTensor's)
        lo = shard_rows(int(self.weight.shape[0]), self.vp.p, self.vp.j)[0]
        logits = F.linear(h, w).float()
        here = labels - lo
        inside = (here >= 0) & (here < w.shape[0])
        t = logits.gather(-1, here.clamp(0, w.shape[0] - 1).unsqueeze(-1)).squeeze(-1) * inside
        part = torch.logsumexp(logits, dim=-1)
        lse = part if lse is None else torch.logaddexp(lse, part)
        tgt = t if tgt is None else tgt + t
        if self.is_last:
            return ((lse - tgt) * (labels != IGNORE_INDEX)).sum()
        return pack(h, lse, tgt)


def pack(h: torch.Tensor, lse: torch.Tensor, tgt: torch.Tensor):
    """What a pass sends the next: one float32 tensor ``[..., hidden + 2]`` (the hidden states, then
    the log-sum-exp and target logit) when the hidden states are float32, else ``(h, [..., 2])``
    (the hidden states keep their dtype on the wire). One message per hop where it can: on gloo
    each tensor sent is a message of its own (a third more time per hop, measured on local-cpu:4)."""
    stats = torch.stack((lse, tgt), dim=-1)
    if h.dtype == torch.float32:
        return torch.cat((h, stats), dim=-1)
    return h.clone(), stats  # (a tensor of its own: torch detaches stage outputs in place)


def unpack(args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, lse, tgt) of what :func:`pack` sent."""
    if len(args) == 1:
        h, stats = args[0][..., :-2], args[0][..., -2:]
    else:
        h, stats = args
    return h, stats[..., 0], stats[..., 1]


def build_pass(adapter: ModelAdapter, unit: str, vp: VocabPass) -> VocabPassStage:
    """The stage module of vocabulary pass ``unit`` (refused in one line where the model cannot run it)."""
    if (why := adapter.limits().get("fused_loss")):  # the same rule: the head is a plain Linear + cross-entropy
        raise ValueError(f"{unit}: {why}; plan without vocabulary passes")
    if vp.head != adapter.units[-1]:
        raise ValueError(f"{unit}: the model's head is {adapter.units[-1]}, not {vp.head}; plan again")
    if any(x.startswith(vp.head + ".") for pair in adapter.tied() for x in pair):
        raise ValueError(f"{unit}: the head {vp.head} shares its weight with another layer; vocabulary passes "
                         "split an untied head (plan without them)")
    return VocabPassStage(adapter, vp)


def shard_heads(modules: Sequence[nn.Module], pp_mesh) -> None:
    """Each vocabulary pass's head weight (materialised whole) becomes its rows, a ``Shard(0)``
    DTensor over ``pp_mesh`` (no communication: every rank holds the same initial weight)."""
    for sm in modules:
        if not isinstance(sm, VocabPassStage):
            continue
        lin = sm.get_submodule(sm.linear)
        full = lin.weight.detach()
        if isinstance(full, DTensor):
            raise ValueError("a vocabulary pass's head is already sharded (tensor parallel): run the passes with tp = 1")
        lo, hi = shard_rows(full.shape[0], sm.vp.p, sm.vp.j)
        rows = full[lo:hi].clone()
        lin.weight = nn.Parameter(DTensor.from_local(rows, pp_mesh, [Shard(0)], run_check=False,
                                                     shape=full.shape, stride=full.stride()))
