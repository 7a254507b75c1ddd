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
4. :class:`PerBatchAttention` (every block's attention) runs the whole pieces' attention
   locally with their document mask, and each group share through the ring (or Ulysses)
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

Limits (refused in one line before training, :func:`per_batch_problem`): one micro-batch per
step (``global_batch == dp x mbs``), no pipeline, no tensor parallelism, only the model's
token inputs (no images), no recompute.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from codegen.runtime.context_parallel import RingAttention, RingCompute, UlyssesAttention, local_positions
from codegen.runtime.documents import IGNORE_INDEX, PerVersion, doc_starts, masked_attention, visible_mask
from codegen.runtime.layers import sdpa_attention
from planner.batch_assign import Assignment, Placement, Pool, WorkCost, assign
from planner.plan import ParallelConfig

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


def per_batch_problem(cfg: ParallelConfig, global_batch: int, per_batch: PerBatch, heads: int = 0,
                      kv_heads: int = 0) -> Optional[str]:
    """Why this layout cannot run per-batch assignment (module docstring), or None."""
    if per_batch.pool.workers != cfg.dp * cfg.cp:
        return f"per-batch pool of {per_batch.pool.workers} workers, but dp x cp = {cfg.dp * cfg.cp}"
    if cfg.pp > 1 or cfg.tp > 1:
        return "per-batch assignment runs without pipeline or tensor parallelism yet (pp = tp = 1)"
    if global_batch != cfg.dp * cfg.mbs:
        return (f"per-batch assignment runs one micro-batch per step: set mbs = global batch / dp "
                f"({global_batch} / {cfg.dp})")
    if cfg.recompute != "none":
        return "per-batch assignment runs without recompute yet (recompute=none)"
    if per_batch.method == "ulysses":
        bad = [g for g in per_batch.pool.group_sizes() if g > 1 and (heads % g or kv_heads % g)]
        if bad:
            return (f"Ulysses groups of {bad} workers do not divide the {heads} heads / {kv_heads} kv heads: "
                    "pass sizes that divide both, or use ring groups")
    return None


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
    """This step's row on this worker: the whole pieces' tokens ``[0, whole)`` with each token's
    piece start (``doc_start`` [1, whole]), then the group shares (``segments``); ``version``
    names the step (the local mask is built once per step). None of it between steps."""
    whole: int = 0
    doc_start: Optional[torch.Tensor] = None
    segments: list[Segment] = field(default_factory=list)
    version: int = 0
    active: bool = False

    def set(self, whole: int, doc_start: torch.Tensor, segments: list[Segment]) -> None:
        self.whole, self.doc_start, self.segments = whole, doc_start, segments
        self.version += 1
        self.active = True


class PerBatchAttention:
    """Every block's attention under per-batch assignment (module docstring): the row's whole
    pieces masked by their documents, each group share through its group's attention, in the
    layout's order; non-causal calls and steps without a layout through ``local``."""

    def __init__(self, layout: RowLayout, local: Callable = sdpa_attention):
        self.layout, self.local = layout, local
        self._masks = PerVersion(4)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        lay = self.layout
        if not causal or not lay.active:
            return self.local(q, k, v, causal=causal, scale=scale)
        outs = []
        n = lay.whole
        if n:
            mask = self._masks.get((lay.version, q.device), lambda: _whole_mask(lay.doc_start, n, q.device))
            outs.append(masked_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], mask, scale))
        for s in lay.segments:
            sl = slice(s.start, s.start + s.length)
            outs.append(s.attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, scale=scale).to(q.dtype))
        return torch.cat(outs, dim=2)


def _whole_mask(doc_start: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(n, device=device)
    return visible_mask(pos, pos, doc_start.to(device))[:, None]


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
    whole: int
    doc_start: torch.Tensor
    shares: list[tuple[Placement, int, int]]  # (placement, start in the row, tokens)


def worker_row(a: Assignment, w: int, starts: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> WorkerRow:
    """Worker ``w``'s row (module docstring, step 3) from the flattened batch ``ids`` /
    ``targets`` and the pieces' ``starts``."""
    parts_ids, parts_tgt, parts_pos, doc, shares = [], [], [], [], []
    offset = 0
    for p in a.on_worker(w):
        s = int(starts[p.piece])
        tok, tgt = ids[s:s + p.length], targets[s:s + p.length]
        if p.size == 1:
            pos = torch.arange(p.length)
            doc.append(torch.full((p.length,), offset))
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
    whole = sum(len(d) for d in doc)
    cat = lambda xs, like: torch.cat(xs)[None] if xs else like.new_zeros((1, 0))  # noqa: E731
    return WorkerRow(cat(parts_ids, ids), cat(parts_tgt, targets), cat(parts_pos, ids), whole,
                     cat(doc, ids), shares)


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
        row = worker_row(a, self.groups.worker, starts, ids.reshape(-1), targets.reshape(-1))
        segs = [Segment(start, n, self.groups.attention[(p.first, p.size)]) for p, start, n in row.shares]
        self.layout.set(row.whole, row.doc_start.to(device), segs)
        return row
