"""Packed documents in the runtime: document boundaries from the batch to the attention, the
positions and the loss.

A training row of ``S`` tokens often packs several documents. A batch says so with
``cu_seqlens``: the cumulative document lengths over the flattened global batch (1-D
integers, ``0 = cu[0] < cu[1] < ... < cu[-1] = B x S``, flash-attn's varlen convention). A
document that runs past a row's end continues as a new document at the next row's start.

From it the runtime derives ``doc_start`` [B, S]: per token, the row position of its
document's first token (:func:`doc_starts`), and with it

- the attention mask: query ``i`` sees key ``j`` iff ``doc_start[i] <= j <= i``. The
  attention implementations read the current micro-batch's ``doc_start`` (full sequence,
  global positions) from one :class:`Documents` holder per parallelised model, which each
  stage's forward points at its micro-batch's documents: :class:`EagerAttention` (SDPA with the
  mask), ``kernels.FlashAttention`` (the kernels' ``doc_start``) and ring / Ulysses
  attention (``context_parallel.RingCompute``: each query's start at its global position;
  a visiting block no local query may see is skipped);
- per-document positions ``position - doc_start`` (:func:`document_positions`): RoPE and
  learned position embeddings restart at every document;
- the loss (:func:`mask_document_ends`): a document's last token does not predict the next
  document's first token (that target is ignored, ``-100``), so the mean counts each
  document's own next-token predictions only.

The holder is a context object of one build (``ParallelModel.documents``), handed to the
attention implementations and the stage modules when they are built: nothing process-wide,
nothing on the model. Each stage's forward gets its micro-batch's ``doc_start`` (and
per-document ``positions``) as keyword arguments, from ``ParallelModel.microbatch`` or split
per micro-batch by the pipeline schedule, and points the holder at them
(``StageModule.take_step``); since other micro-batches run between a forward and its
backward, a checkpoint's recomputation sets again the documents its forward saw
(:class:`SameDocuments`).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch
import torch.nn.functional as F

from codegen.runtime.layers import sdpa_attention

IGNORE_INDEX = -100


class Documents:
    """The current micro-batch's ``doc_start`` [mbs, S] (global positions; None: no packed
    documents), shared by the attention implementations of one parallelised model.
    ``version`` names each micro-batch's documents (a recomputation restores its forward's
    pair, :class:`SameDocuments`), so implementations cache what they derive per version;
    ``used`` counts the attention calls that masked by them (the runtime checks some did)."""

    def __init__(self) -> None:
        self.doc_start: Optional[torch.Tensor] = None
        self.version = 0
        self.used = 0
        self._next = 0

    def set(self, doc_start: Optional[torch.Tensor]) -> None:
        """New documents (a new micro-batch): a new version."""
        self._next += 1
        self.doc_start, self.version = doc_start, self._next

    def restore(self, doc_start: Optional[torch.Tensor], version: int) -> None:
        """Documents seen before, under their version (what was cached for them stays valid)."""
        self.doc_start, self.version = doc_start, version


class PerVersion:
    """A small cache of what an implementation derives from each version of the documents,
    keyed by the version (and shapes): a pipeline keeps several micro-batches in flight and
    their recomputation comes back to them. The oldest entry goes first."""

    def __init__(self, size: int = 32) -> None:
        self.size, self.items = size, {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self.items:
            if len(self.items) >= self.size:
                self.items.pop(next(iter(self.items)))
            self.items[key] = make()
        return self.items[key]


def check_cu_seqlens(cu: torch.Tensor, rows: int, seq: int) -> None:
    """Raise one line naming the problem with a batch's ``cu_seqlens`` (module docstring)."""
    if cu.dim() != 1 or cu.dtype.is_floating_point or cu.numel() < 2:
        raise ValueError(f"batch['cu_seqlens'] must be a 1-D integer tensor of cumulative document lengths "
                         f"(0, ..., {rows * seq}); got shape {tuple(cu.shape)}, dtype {cu.dtype}")
    if int(cu[0]) != 0 or int(cu[-1]) != rows * seq:
        raise ValueError(f"batch['cu_seqlens'] must run from 0 to {rows} x {seq} = {rows * seq} tokens; "
                         f"got {int(cu[0])} .. {int(cu[-1])}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError("batch['cu_seqlens'] must increase strictly (every document at least one token); "
                         "drop empty documents")


def doc_starts(cu_seqlens: torch.Tensor, rows: int, seq: int, first: int = 0,
               count: Optional[int] = None) -> torch.Tensor:
    """[count, seq] (int64) for rows ``first .. first + count`` of the ``rows`` (default: all):
    per token, the row position where its document starts (a document crossing a row end
    restarts at the next row's position 0)."""
    check_cu_seqlens(cu_seqlens, rows, seq)
    count = rows - first if count is None else count
    cu = cu_seqlens.to(torch.int64).cpu()
    t = torch.arange(first * seq, (first + count) * seq)
    start = cu[torch.searchsorted(cu, t, right=True) - 1]
    row0 = t - t % seq
    return (torch.maximum(start, row0) - row0).view(count, seq)


def document_positions(doc_start: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows, len(positions)]: the position inside its document of each token at the (global)
    ``positions`` of ``doc_start``'s rows."""
    return positions[None, :] - doc_start.index_select(1, positions)


def mask_document_ends(targets: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``targets`` [B, S] of the global batch (per position, what it predicts) with the target
    of every document's last token before another document in its row set to ``-100``: the
    positions just before each document start that is not a row start."""
    seq = targets.shape[1]
    starts = cu_seqlens[1:-1].to(torch.int64).cpu()
    out = targets.clone()
    out.view(-1)[(starts[starts % seq != 0] - 1).to(out.device)] = IGNORE_INDEX
    return out


def visible_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor, q_doc: torch.Tensor) -> torch.Tensor:
    """[B, Sq, Sk] bool: query at ``q_pos`` (document start ``q_doc`` [B, Sq]) sees key at
    ``kv_pos`` (all global positions)."""
    causal = kv_pos[None, :] <= q_pos[:, None]
    return causal[None] & (kv_pos[None, None, :] >= q_doc[:, :, None])


def any_visible(q_pos: torch.Tensor, q_doc: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: whether any query (positions ``q_pos``, document starts ``q_doc``
    [B, Sq]) may see any key of a block at ``kv_pos``: some key in ``[q_doc, q_pos]``."""
    kv = kv_pos.sort().values
    lo = torch.searchsorted(kv, q_doc.contiguous())
    hi = torch.searchsorted(kv, q_pos.expand_as(q_doc).contiguous(), right=True)
    return (hi > lo).any()


def document_mask(doc_start: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: causal attention within the documents of ``doc_start`` [B, S]."""
    pos = torch.arange(q.shape[2], device=q.device)
    return visible_mask(pos, pos, doc_start.to(q.device))[:, None]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: Optional[float] = None) -> torch.Tensor:
    """SDPA with a boolean ``mask`` [B, 1, Sq, Sk] (:func:`document_mask`); grouped-query k/v
    without copies (``enable_gqa``, torch >= 2.5)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class EagerAttention:
    """The plan's ``attention == "eager"``: SDPA, with the document mask when the current
    micro-batch packs documents (``documents``, module docstring; one mask per micro-batch,
    shared by the layers)."""

    def __init__(self, documents: Optional[Documents] = None):
        self.documents = documents
        self._masks = PerVersion(4)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        docs = self.documents
        if docs is None or docs.doc_start is None or not causal:
            return sdpa_attention(q, k, v, causal=causal, scale=scale)
        docs.used += 1
        mask = self._masks.get((docs.version, q.shape[2], q.device), lambda: document_mask(docs.doc_start, q))
        return masked_attention(q, k, v, mask, scale)


class SameDocuments:
    """A checkpoint's recompute context: the packed documents its forward saw (taken when the
    context is made, at forward time) are current again while it is recomputed. Under a
    pipeline schedule other micro-batches run between a forward and its backward."""

    def __init__(self, documents: Optional[Documents]):
        self.documents = documents
        self.seen = (documents.doc_start, documents.version) if documents is not None else None
        self._prev: list[tuple] = []

    def __enter__(self) -> None:
        if self.documents is not None:
            self._prev.append((self.documents.doc_start, self.documents.version))
            self.documents.restore(*self.seen)

    def __exit__(self, *exc) -> None:
        if self.documents is not None:
            self.documents.restore(*self._prev.pop())
