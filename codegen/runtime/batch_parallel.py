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
   attention of that group's process group; the row's layout travels as the stage's
   ``doc_start`` argument (layout codes, below), which the stage points the build's
   ``documents.Documents`` at, as for packed documents;
5. the loss is the row's summed token loss over the global batch's target count times ``P``
   (``train.TokenLoss``): the data-parallel reduction's average makes it the global mean token
   loss of the same batch, as on the fixed layout.

Under a pipeline (pp > 1, gpipe or 1f1b) the ``dp x cp`` ranks of each stage are the pool; the
global batch's micro-batches (consecutive blocks of ``dp x mbs`` rows) are assigned one by one,
every worker gets one row per micro-batch, padded at its end to the pool's ``capacity``
(``planner.batch_assign.row_tokens``: the stages' send and receive buffers keep the first
step's shape; padding attends to nothing and its targets are ignored), and every stage computes
the same assignments from the same global batch, so worker ``w`` of one stage sends its rows to
worker ``w`` of the next. The schedule splits the rows and their layout codes per micro-batch.

Process groups (:class:`PieceGroups`): built once at start-up for every window of consecutive
workers the assignment may use (``Pool.windows``: every contiguous window of every allowed size
up to the CP budget, or only aligned ones), for every (pp, tp) coordinate, in one order on
every rank (``dist.new_group`` is collective). A worker runs its groups in the assignment's
one global order, forward, and autograd runs their backward exchanges in the reverse order
on every member (each later segment's nodes are newer): no two groups wait on each other.

Limits (refused in one line before training, ``planner.batch_assign.per_batch_problem``, the
rule the planner applies too): without a pipeline one micro-batch per step (``global_batch ==
dp x mbs``); pipelines only gpipe / 1f1b with vpp 1; no tensor parallelism, no recompute; only
the model's token inputs (multimodal batches, whose samples carry images, are assigned to the
data-parallel ranks by codegen/runtime/multimodal.py with the same planner).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from codegen.runtime.context_parallel import RingAttention, RingCompute, UlyssesAttention, local_positions
from codegen.runtime.documents import IGNORE_INDEX, Documents, PerVersion, doc_starts
from codegen.runtime.layers import sdpa_attention
from planner.batch_assign import Assignment, Placement, Pool, WorkCost, assign, microbatch_ranges, row_tokens

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
    attention over each window it belongs to: ``attention[(first, size)]``; ``windows``: every
    window of the pool, in one order on every rank (a row's group codes index it)."""

    def __init__(self, mesh: DeviceMesh, per_batch: PerBatch):
        ranks = mesh.mesh  # [pp, dp, cp, tp] global ranks
        pp, _, _, tp = ranks.shape
        me = dist.get_rank()
        self.worker = -1
        self.attention: dict[tuple[int, int], Callable] = {}
        pool = per_batch.pool
        self.windows = [(first, g) for g in pool.group_sizes() if g > 1 for first in pool.windows(g)]
        for i in range(pp):
            for j in range(tp):
                workers = ranks[i, :, :, j].reshape(-1).tolist()
                if me in workers:
                    self.worker = workers.index(me)
                for first, g in self.windows:
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


# A worker row's layout travels as the stage modules' ``doc_start`` argument (per token, split
# per micro-batch by the pipeline schedule like any step argument): ``v >= 0`` a whole piece
# starting at row position ``v`` (its true document start); ``PAD_CODE`` padding; ``v <= -2``
# the share of a group piece: ``-2 - v == window + n_windows * k`` (``window`` indexes
# ``PieceGroups.windows``; ``k`` the share's place in the row, so two shares on one window stay apart).
PAD_CODE = -1


@dataclass(frozen=True)
class Span:
    """A run of one row: tokens ``[start, start + length)``, a whole piece (``window`` None), a
    group share (``window``: an index into ``PieceGroups.windows``) or padding (``pad``)."""
    start: int
    length: int
    window: Optional[int] = None
    pad: bool = False


def row_spans(codes: torch.Tensor, n_windows: int) -> list[Span]:
    """The spans of one row from its layout codes ``codes`` [T] (the convention above)."""
    vals = codes.tolist()
    out: list[Span] = []
    i = 0
    while i < len(vals):
        j = i + 1
        while j < len(vals) and vals[j] == vals[i]:
            j += 1
        v = vals[i]
        out.append(Span(i, j - i, None if v >= -1 else (-2 - v) % max(n_windows, 1), v == PAD_CODE))
        i = j
    return out


class PerBatchAttention:
    """Every block's attention under per-batch assignment (module docstring): the micro-batch's
    row layout comes as the documents' ``doc_start`` (one row of codes, above); each whole
    piece through ``local`` (the plan's kernel, causal within the piece: its work is its own
    L^2), each group share through its group's attention, in the row's order; padding attends
    to nothing (output 0: no real token sees it, its loss is ignored). Non-causal calls and
    micro-batches without a layout through ``local``."""

    def __init__(self, documents: Documents, groups: PieceGroups, local: Callable = sdpa_attention):
        self.documents, self.groups, self.local = documents, groups, local
        self._spans = PerVersion(8)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        docs = self.documents
        if not causal or docs.doc_start is None:
            return self.local(q, k, v, causal=causal, scale=scale)
        if docs.doc_start.shape[0] != 1:
            raise ValueError(f"per-batch assignment runs one row per worker and micro-batch, got "
                             f"{docs.doc_start.shape[0]}")
        docs.used += 1
        spans = self._spans.get(docs.version, lambda: row_spans(docs.doc_start[0], len(self.groups.windows)))
        outs = []
        for sp in spans:
            sl = slice(sp.start, sp.start + sp.length)
            if sp.pad:
                outs.append(torch.zeros_like(q[:, :, sl]))
                continue
            fn = self.local if sp.window is None else self.groups.attention[self.groups.windows[sp.window]]
            outs.append(fn(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, scale=scale).to(q.dtype))
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
    """One worker's row for a micro-batch: token ids, targets, positions and layout codes
    (``codes``, the stage's ``doc_start``), each [1, T]; the group shares it runs."""
    ids: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    codes: torch.Tensor
    shares: list[Placement]


def worker_row(a: Assignment, w: int, starts: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor,
               windows: list[tuple[int, int]], pad_to: Optional[int] = None) -> WorkerRow:
    """Worker ``w``'s row (module docstring, step 3) from the flattened batch ``ids`` /
    ``targets`` and the pieces' ``starts``, padded at its end to ``pad_to`` tokens (when given)."""
    index = {win: i for i, win in enumerate(windows)}
    ids_, tgt_, pos_, codes, shares = [], [], [], [], []
    offset = 0
    for p in a.on_worker(w):
        s = int(starts[p.piece])
        tok, tgt = ids[s:s + p.length], targets[s:s + p.length]
        if p.size == 1:
            pos = torch.arange(p.length)
            code = torch.full((p.length,), offset)
        else:
            pad = p.padded - p.length
            tok = torch.cat([tok, tok.new_full((pad,), PAD_ID)])
            tgt = torch.cat([tgt, tgt.new_full((pad,), IGNORE_INDEX)])
            pos = local_positions(p.padded, p.size, w - p.first, "zigzag")
            tok, tgt = tok[pos], tgt[pos]
            code = torch.full((len(pos),), -2 - (index[(p.first, p.size)] + len(windows) * len(shares)))
            shares.append(p)
        ids_.append(tok)
        tgt_.append(tgt)
        pos_.append(pos)
        codes.append(code)
        offset += len(tok)
    if pad_to is not None:
        if offset > pad_to:
            raise ValueError(f"worker {w} holds {offset} tokens, more than its row of {pad_to}")
        n = pad_to - offset
        ids_.append(ids.new_full((n,), PAD_ID))
        tgt_.append(targets.new_full((n,), IGNORE_INDEX))
        pos_.append(torch.arange(n))
        codes.append(torch.full((n,), PAD_CODE))
    cat = lambda xs, like: torch.cat(xs)[None] if xs else like.new_zeros((1, 0))  # noqa: E731
    return WorkerRow(cat(ids_, ids), cat(tgt_, targets), cat(pos_, ids), cat(codes, ids), shares)


class BatchPlanner:
    """The step's part of per-batch assignment on this rank: the assignment of each micro-batch
    of the global batch and this worker's rows. Built by the build (``parallelize``)."""

    def __init__(self, per_batch: PerBatch, groups: PieceGroups, pp: int = 1):
        self.per_batch, self.groups = per_batch, groups
        self.row = row_tokens(per_batch.pool, pp)
        self.assignments: list[Assignment] = []

    @property
    def last(self) -> Optional[Assignment]:
        """The last step's first micro-batch's assignment."""
        return self.assignments[0] if self.assignments else None

    def local_rows(self, ids: torch.Tensor, targets: torch.Tensor, cu_seqlens: torch.Tensor,
                   microbatches: int = 1) -> WorkerRow:
        """This worker's rows of the global batch ``ids`` / ``targets`` [B, S] (targets with every
        document's last one ignored already): one per micro-batch (``microbatch_ranges``: blocks of
        ``B / microbatches`` rows, each assigned on its own), stacked [microbatches, T]."""
        rows, seq = ids.shape
        starts = pieces(cu_seqlens, rows, seq)
        lengths = (torch.cat([starts[1:], torch.tensor([rows * seq])]) - starts).tolist()
        flat_ids, flat_tgt = ids.reshape(-1), targets.reshape(-1)
        self.assignments, out = [], []
        for mine in microbatch_ranges(lengths, microbatches):
            a = assign(lengths[mine.start:mine.stop], self.per_batch.pool, self.per_batch.cost)
            if self.row is None and min(a.tokens) == 0:  # the same on every rank: all refuse together
                raise ValueError(f"per-batch assignment left a worker without tokens ({len(mine)} documents "
                                 f"for {self.per_batch.pool.workers} workers): pack more documents per batch or "
                                 "plan without --per-batch")
            self.assignments.append(a)
            out.append(worker_row(a, self.groups.worker, starts[mine.start:mine.stop], flat_ids, flat_tgt,
                                  self.groups.windows, self.row))
        stack = lambda f: torch.cat([getattr(r, f) for r in out])  # noqa: E731
        return WorkerRow(stack("ids"), stack("targets"), stack("positions"), stack("codes"),
                         [p for r in out for p in r.shares])


def per_batch_of(record: Optional[dict]) -> Optional[PerBatch]:
    """The :class:`PerBatch` a plan's ``batch.per_batch`` record asks for (None when absent or
    not chosen): the emitted program's literal."""
    if not record or not record.get("chosen"):
        return None
    cost = {k: record["cost"][k] for k in ("linear", "attention", "exchange", "alltoall", "latency", "method")}
    cost.update({k: record["cost"].get(k, 0.0) for k in ("merge", "ring")})  # absent from older plans
    pool = Pool(int(record["workers"]), int(record["max_group"]), int(record["capacity"]),
                aligned=bool(record.get("aligned", False)))
    return PerBatch(pool, WorkCost(**cost))
