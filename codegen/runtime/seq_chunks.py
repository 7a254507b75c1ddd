"""Sequence chunks in the runtime (Seq1F1B): each micro-batch's sequence runs as k pipeline units.

The plan's schedule IR (``planner/schedule_ir.py``, ``seq_chunks = k``) orders units ``u = mb k +
j``: chunk j of micro-batch mb. The runtime

1. lays the step's rows out as units (:func:`to_units`): ``[m mbs, S]`` -> ``[m k mbs, S/k]``,
   unit-major, so torch's schedule runtime, splitting along dim 0 into ``m k`` pieces, hands
   unit u its rows; positions go along as the chunk's ABSOLUTE positions (RoPE and learned
   position tables see the tokens where they lie in the sequence);
2. runs every block's attention through a :class:`ChunkAttention`: chunk j's queries attend to
   the keys/values of chunks 0..j of their sequence (causal, offset by ``j S/k``). The earlier
   chunks' keys/values come from the step's KV store (:class:`ChunkStore`) as leaves that
   require grad - detached, so chunk j's backward does not reach into chunk i's graph - and
   chunk i's own keys/values pass through :class:`_AddLaterGrads`, whose backward adds what the
   later chunks' backwards accumulated in those leaves. That is complete when chunk i's
   backward runs because the IR orders a sequence's backwards last chunk first
   (``schedule_ir.chunk_deps``), on every stage.

Which chunk a call serves: its absolute positions (each stage's forward tells the store its
first one, ``StageModule.take_step``); chunk 0 starts a sequence, and since a stage runs its
forwards in unit order (the built-in chunk orders; ``check_order``) a sequence's chunks reach
each block one after another. (torch's pipeline stage runs a forward of its own on the first
step to infer shapes; it is a chunk 0 whose keys/values the real chunk 0 replaces.) That holds only
without recomputation (a checkpoint replays the forward inside the backward), which
``codegen.runtime.recipe.runtime_problem`` refuses before anything is built.

The store is one object per build (``recipe.Stages.chunks``), emptied at every step's start and
end (:meth:`ChunkStore.clear`); nothing is installed beyond the blocks' attention implementation
(set by ``apply_attention`` like any other).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from planner.schedule_ir import Schedule


class ChunkStore:
    """The step's keys/values per block: leaves of the current sequence's chunks so far, which
    the later chunks read and accumulate gradients into; ``start``, the current call's first
    absolute position (set by each stage's forward, ``StageModule.take_step``)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.start = 0
        self.kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def at(self, start: int) -> None:
        """A stage's forward begins on the chunk whose first token sits at position ``start``."""
        self.start = start

    def clear(self) -> None:
        """A step starts or ends: forget every key/value."""
        self.kv.clear()
        self.start = 0

    def chunk_of(self, block: str, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The keys/values ``block`` holds of the current sequence's earlier chunks, for a chunk
        of ``length`` tokens (chunk 0 starts a new sequence)."""
        j = self.start // length
        if j == 0:
            self.kv[block] = []
        held = self.kv.setdefault(block, [])
        if len(held) != j:
            raise RuntimeError(f"sequence chunk {j} reached {block} after {len(held)} chunks of its sequence: "
                               "sequence chunks run forwards in unit order")
        return held


class _AddLaterGrads(torch.autograd.Function):
    """Identity on a chunk's own keys (or values); its backward adds the gradient the later
    chunks' backwards left in ``leaf`` (their copy of the same tensor)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        later = ctx.leaf.grad
        return (grad if later is None else grad + later), None


class ChunkAttention:
    """A block's attention over its sequence's chunks so far (module docstring); ``block`` names
    the block in the store."""

    def __init__(self, store: ChunkStore, block: str) -> None:
        self.store, self.block = store, block

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        if not causal:
            raise ValueError("sequence chunks need causal attention: plan this model with seq_chunks=1")
        held = self.store.chunk_of(self.block, q.shape[2])
        leaf_k, leaf_v = k.detach().requires_grad_(), v.detach().requires_grad_()
        own_k, own_v = _AddLaterGrads.apply(k, leaf_k), _AddLaterGrads.apply(v, leaf_v)
        keys = torch.cat([hk for hk, _ in held] + [own_k], dim=2)
        values = torch.cat([hv for _, hv in held] + [own_v], dim=2)
        held.append((leaf_k, leaf_v))
        c, total = q.shape[2], keys.shape[2]  # the chunk's queries sit at the end of the keys
        mask = torch.arange(total, device=q.device)[None, :] <= (total - c + torch.arange(c, device=q.device))[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])


def to_units(t: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """``[m mbs, S, ...]`` rows (micro-batch-major) as ``[m k mbs, S/k, ...]``: unit ``mb k + j``
    holds chunk j of micro-batch mb's rows."""
    rows, seq = t.shape[0], t.shape[1]
    mbs, c = rows // m, seq // k
    u = t.reshape(m, mbs, k, c, *t.shape[2:]).transpose(1, 2)
    return u.reshape(m * k * mbs, c, *t.shape[2:])


def check_order(schedule: Schedule) -> None:
    """Every stage forwards its units in order (what :meth:`ChunkStore.chunk_of` relies on)."""
    for r in range(schedule.p):
        seen: dict[int, int] = {}
        for a in schedule.actions(r):
            if a.kind == "F":
                if a.mb != seen.get(a.stage, 0):
                    raise ValueError(f"schedule {schedule.name!r} forwards unit {a.mb} of stage {a.stage} out of "
                                     "order: sequence chunks run forwards in unit order")
                seen[a.stage] = a.mb + 1
