"""Per-batch context parallelism in the runtime: each global batch's packed documents run on
context-parallel groups of the size they need (``planner.batch_assign``, the one rule the cost
model prices too).

The ``dp x cp`` ranks of a pipeline stage and tp coordinate are a pool of ``P`` *workers*, in
mesh order (dp outer, cp inner: worker ``d * cp + c``); they hold the same weights and reduce
gradients over all ``P`` (the data-parallel mesh, dp flattened with cp), so where a token is
computed does not change the step. Every step:

1. the global batch is cut into *pieces*: its documents (``cu_seqlens``) as the rows cut them,
   each an independent causal sequence whose positions restart at 0; each document's last
   target is ignored (``documents.mask_document_ends``), as on the fixed layout;
2. :func:`planner.batch_assign.assign` (deterministic, the same on every rank) gives each piece
   a group of consecutive workers;
3. each worker builds its one local row (:func:`worker_row`): its whole pieces first, then
   its shares of the group pieces in the assignment's group order; a group piece is padded
   after its end (pad tokens: id 0, target ignored; no real query sees them) to a multiple of
   ``2 g`` and cut zigzag like a ring's sequence (``context_parallel.local_positions``);
4. :class:`PerBatchAttention` (every block's attention) runs each whole piece's attention
   locally (causal within the piece), and each group share through the ring (or Ulysses)
   attention of that group's process group; the :class:`RowLayout` of the step says which
   tokens are which (a context object of the build, pointed at each step's layout by the
   step before its forward, like ``documents.Documents``);
5. the loss is the row's summed token loss over the global batch's target count times ``P``
   (``train.TokenLoss``): the data-parallel reduction's average makes it the global mean token
   loss of the same batch, as on the fixed layout.

Process groups (:class:`PieceGroups`): built once at start-up for every window of consecutive
workers the assignment may use (``Pool.windows``: every contiguous window of every allowed size
up to the CP budget, or only aligned ones), for every (pp, tp) coordinate, in one order on
every rank (``dist.new_group`` is collective). A worker runs its groups in the assignment's
one global order, forward, and autograd runs their backward exchanges in the reverse order
on every member (each later segment's nodes are newer): no two groups wait on each other.

Limits (refused in one line before training, ``planner.batch_assign.per_batch_problem``, the
rule the planner applies too): one micro-batch per step (``global_batch == dp x mbs``), no
pipeline, no tensor parallelism, no recompute; only the model's token inputs (no images).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from codegen.runtime.context_parallel import RingAttention, RingCompute, UlyssesAttention, local_positions
from codegen.runtime.documents import IGNORE_INDEX, doc_starts
from codegen.runtime.layers import sdpa_attention
from planner.batch_assign import Assignment, Placement, Pool, WorkCost, assign

PAD_ID = 0


@dataclass(frozen=True)
class PerBatch:
    """How the runtime assigns each batch: the pool (``workers`` = dp x cp, groups up to the
    CP budget, tokens per worker) and the rates it balances (``planner.batch_assign``)."""
    pool: Pool
    cost: WorkCost

    @property
    def method(self) -> str:
        return self.cost.method


class PieceGroups:
    """The process groups of every window of the pool (module docstring) and this rank's
    attention over each window it belongs to: ``attention[(first, size)]``."""

    def __init__(self, mesh: DeviceMesh, per_batch: PerBatch):
        ranks = mesh.mesh  # [pp, dp, cp, tp] global ranks
        pp, _, _, tp = ranks.shape
        me = dist.get_rank()
        self.worker = -1
        self.attention: dict[tuple[int, int], Callable] = {}
        pool = per_batch.pool
        for i in range(pp):
            for j in range(tp):
                workers = ranks[i, :, :, j].reshape(-1).tolist()
                if me in workers:
                    self.worker = workers.index(me)
                for g in pool.group_sizes():
                    if g == 1:
                        continue
                    for first in pool.windows(g):
                        members = workers[first:first + g]
                        group = dist.new_group(members)
                        if me in members:
                            self.attention[(first, g)] = _group_attention(group, g, per_batch.method)
        if self.worker < 0:
            raise ValueError(f"rank {me} is not in the device mesh")


def _group_attention(group, g: int, method: str) -> Callable:
    """Ring attention over ``group`` (zigzag shares), or Ulysses: all-to-alls around a ring of one."""
    if method == "ulysses":
        return UlyssesAttention(RingCompute(1, 0, ulysses=g), group)
    return RingAttention(group, "zigzag")


@dataclass
class Segment:
    """A group share in this worker's row: tokens ``[start, start + length)``, its attention."""
    start: int
    length: int
    attention: Callable


@dataclass
class RowLayout:
    """This step's row on this worker: the whole pieces (``whole``: (start, tokens) each, at the
    row's front), then the group shares (``segments``); ``active`` once a step set it."""
    whole: list[tuple[int, int]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    active: bool = False

    def set(self, whole: list[tuple[int, int]], segments: list[Segment]) -> None:
        self.whole, self.segments, self.active = whole, segments, True


class PerBatchAttention:
    """Every block's attention under per-batch assignment (module docstring): each whole piece
    through ``local`` (the plan's kernel, causal within the piece: its work is its own L^2),
    each group share through its group's attention, in the layout's order; non-causal calls
    and steps without a layout through ``local``."""

    def __init__(self, layout: RowLayout, local: Callable = sdpa_attention):
        self.layout, self.local = layout, local

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        lay = self.layout
        if not causal or not lay.active:
            return self.local(q, k, v, causal=causal, scale=scale)
        parts = [(slice(a, a + n), self.local) for a, n in lay.whole]
        parts += [(slice(s.start, s.start + s.length), s.attention) for s in lay.segments]
        outs = [fn(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, scale=scale).to(q.dtype) for sl, fn in parts]
        return torch.cat(outs, dim=2)


def pieces(cu_seqlens: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
    """[n] token offsets (in the flattened ``rows x seq`` batch) where each piece starts: every
    document start and every row start (``documents.doc_starts``' cuts)."""
    start = doc_starts(cu_seqlens, rows, seq)  # per token, its piece's start within its row
    row0 = (torch.arange(rows) * seq)[:, None]
    flat = (start + row0).reshape(-1)
    return torch.unique_consecutive(flat)


@dataclass
class WorkerRow:
    """One worker's row for a step: token ids, targets, positions (each [1, T]) and its layout."""
    ids: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    whole: list[tuple[int, int]]              # whole pieces: (start in the row, tokens)
    shares: list[tuple[Placement, int, int]]  # (placement, start in the row, tokens)


def worker_row(a: Assignment, w: int, starts: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> WorkerRow:
    """Worker ``w``'s row (module docstring, step 3) from the flattened batch ``ids`` /
    ``targets`` and the pieces' ``starts``."""
    parts_ids, parts_tgt, parts_pos, whole, shares = [], [], [], [], []
    offset = 0
    for p in a.on_worker(w):
        s = int(starts[p.piece])
        tok, tgt = ids[s:s + p.length], targets[s:s + p.length]
        if p.size == 1:
            pos = torch.arange(p.length)
            whole.append((offset, p.length))
        else:
            pad = p.padded - p.length
            tok = torch.cat([tok, tok.new_full((pad,), PAD_ID)])
            tgt = torch.cat([tgt, tgt.new_full((pad,), IGNORE_INDEX)])
            pos = local_positions(p.padded, p.size, w - p.first, "zigzag")
            tok, tgt = tok[pos], tgt[pos]
            shares.append((p, offset, len(pos)))
        parts_ids.append(tok)
        parts_tgt.append(tgt)
        parts_pos.append(pos)
        offset += len(tok)
    cat = lambda xs, like: torch.cat(xs)[None] if xs else like.new_zeros((1, 0))  # noqa: E731
    return WorkerRow(cat(parts_ids, ids), cat(parts_tgt, targets), cat(parts_pos, ids), whole, shares)


class BatchPlanner:
    """The step's part of per-batch assignment on this rank: the assignment of each global batch
    and this worker's row, the layout pointed at it. Built by the build (``parallelize``)."""

    def __init__(self, per_batch: PerBatch, groups: PieceGroups, layout: RowLayout):
        self.per_batch, self.groups, self.layout = per_batch, groups, layout
        self.last: Optional[Assignment] = None

    def local_row(self, ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor,
                  device: torch.device) -> WorkerRow:
        """This worker's row of the global batch ``ids`` / ``targets`` [B, S] (targets with every
        document's last one ignored already); points the layout at it."""
        rows, seq = ids.shape
        starts = pieces(cu_seqlens, rows, seq)
        ends = torch.cat([starts[1:], torch.tensor([rows * seq])])
        a = assign((ends - starts).tolist(), self.per_batch.pool, self.per_batch.cost)
        self.last = a
        if min(a.tokens) == 0:  # the same on every rank: all refuse together
            raise ValueError(f"per-batch assignment left a worker without tokens ({len(starts)} documents for "
                             f"{self.per_batch.pool.workers} workers): pack more documents per batch or plan "
                             "without --per-batch")
        row = worker_row(a, self.groups.worker, starts, ids.reshape(-1), targets.reshape(-1))
        segs = [Segment(start, n, self.groups.attention[(p.first, p.size)]) for p, start, n in row.shares]
        self.layout.set(row.whole, segs)
        return row


def per_batch_of(record: Optional[dict]) -> Optional[PerBatch]:
    """The :class:`PerBatch` a plan's ``batch.per_batch`` record asks for (None when absent or
    not chosen): the emitted program's literal."""
    if not record or not record.get("chosen"):
        return None
    cost = {k: record["cost"][k] for k in ("linear", "attention", "exchange", "alltoall", "latency", "method")}
    pool = Pool(int(record["workers"]), int(record["max_group"]), int(record["capacity"]),
                aligned=bool(record.get("aligned", False)))
    return PerBatch(pool, WorkCost(**cost))
