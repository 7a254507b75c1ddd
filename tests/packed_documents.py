"""Packed-document batches for the parity tests and their per-document reference.

The batches of ``model_cases`` (``GB`` rows of ``SEQ`` = 32 tokens) with ``cu_seqlens``:
documents of uneven lengths with boundaries inside the ring's chunks, one-token documents
(each row of three short ones), a row that is one document, and a document that runs past
its row's end (it continues as a new document in the next row, the runtime's rule).

The reference never packs: it runs every document on its own through the unmodified model
(positions from 0, attention within the document by construction), sums the token
cross-entropy of each document's own next-token targets (its last token predicts nothing,
except at a row's end where the zoo cases' given label is the continuation's first token),
divides by the number of targets of the global batch, and takes an SGD step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from model_cases import GB, SEQ, Case

# flattened over the GB x SEQ tokens; 19 runs from row 2 into row 3 (16 + 3)
DOC_LENGTHS = [5, 1, 13, 13, 32, 7, 9, 19, 1, 1, 3, 1, 20, 3]
assert sum(DOC_LENGTHS) == GB * SEQ


def row_documents() -> list[list[tuple[int, int]]]:
    """Per row, its documents as (start, end) row positions (cut at row ends)."""
    rows: list[list[tuple[int, int]]] = [[] for _ in range(GB)]
    a = 0
    for n in DOC_LENGTHS:
        b = a + n
        while a < b:
            r, end = a // SEQ, min(b, (a // SEQ + 1) * SEQ)
            rows[r].append((a - r * SEQ, end - r * SEQ))
            a = end
    return rows


def packed_batches(c: Case, n: int) -> list[dict[str, torch.Tensor]]:
    """``c.batches(n)`` with the documents' ``cu_seqlens``."""
    cu = torch.cumsum(torch.tensor([0] + DOC_LENGTHS), 0)
    return [dict(b, cu_seqlens=cu) for b in c.batches(n)]


def _document_targets(c: Case, b: dict, row: int, start: int, end: int) -> torch.Tensor:
    """The targets of document [start, end) of ``row``: what each of its positions predicts."""
    ignore = torch.tensor([-100])
    if c.kind == "hf":  # labels are the tokens; position i predicts token i + 1 of the same document
        return torch.cat((b["labels"][row, start + 1:end], ignore))
    last = b["labels"][row, end - 1:end] if end == SEQ else ignore
    return torch.cat((b["labels"][row, start:end - 1], last))


def _logits(c: Case, model, ids: torch.Tensor) -> torch.Tensor:
    if c.kind == "hf":
        return model(input_ids=ids, use_cache=False).logits
    return model(ids)


def document_loss_sum(c: Case, model, b: dict) -> tuple[torch.Tensor, int]:
    """(summed token loss over every document run alone, number of counted targets)."""
    total, count = torch.zeros(()), 0
    for row, docs in enumerate(row_documents()):
        for start, end in docs:
            tgt = _document_targets(c, b, row, start, end)
            logits = _logits(c, model, b["input_ids"][row:row + 1, start:end])
            total = total + F.cross_entropy(logits[0].float(), tgt, ignore_index=-100, reduction="sum")
            count += int((tgt != -100).sum())
    return total, count


def per_document_reference(c: Case, data: list[dict], lr: float) -> tuple[list[float], dict]:
    """(losses, first-step gradients) of SGD on the per-document loss (module docstring)."""
    model = c.build("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for s, b in enumerate(data):
        opt.zero_grad()
        total, count = document_loss_sum(c, model, b)
        loss = total / count
        loss.backward()
        if s == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads
