"""Packed documents in the runtime, in one process: ``cu_seqlens`` -> document starts, the
loss mask, and a whole model's packed forward and backward through the attention the
runtime installs (flash: Triton under the CPU interpreter and the torch fallback; eager:
masked SDPA) against every document run alone (``tests/packed_documents.py``).

The multi-process cases (ring, Ulysses, hybrid, TP, DP, PP; gloo) are in
``tests/test_documents_parity.py`` (``dist_worker``'s group ``documents``).
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from codegen.kernels import attention_triton as T  # noqa: E402
from codegen.runtime import documents as docs  # noqa: E402
from codegen.runtime.adapters import adapter_for  # noqa: E402
from codegen.runtime.kernels import FlashAttention  # noqa: E402
from model_cases import GB, SEQ, case  # noqa: E402
from packed_documents import document_loss_sum, packed_batches, row_documents  # noqa: E402

TRITON = T.HAS_TRITON and T.interpreting()


def test_doc_starts_follow_the_documents_and_cut_at_row_ends():
    cu = torch.cumsum(torch.tensor([0, 3, 7, 2]), 0)      # 7 crosses the end of row 0 (S = 6)
    ds = docs.doc_starts(cu, rows=2, seq=6)
    assert ds.tolist() == [[0, 0, 0, 3, 3, 3], [0, 0, 0, 0, 4, 4]]
    full = docs.doc_starts(torch.cumsum(torch.tensor([0] + [SEQ] * GB), 0), GB, SEQ)
    assert full.eq(0).all()
    from packed_documents import DOC_LENGTHS
    ds = docs.doc_starts(torch.cumsum(torch.tensor([0] + DOC_LENGTHS), 0), GB, SEQ)
    for r, row in enumerate(row_documents()):
        for a, b in row:
            assert ds[r, a:b].eq(a).all()


@pytest.mark.parametrize("cu, msg", [
    (torch.tensor([0, 5, 11]), "must run from 0 to 2 x 6 = 12"),
    (torch.tensor([0, 5, 5, 12]), "increase strictly"),
    (torch.tensor([0.0, 12.0]), "1-D integer tensor"),
    (torch.tensor([[0, 12]]), "1-D integer tensor"),
])
def test_bad_cu_seqlens_get_one_line(cu, msg):
    with pytest.raises(ValueError, match=msg):
        docs.doc_starts(cu, rows=2, seq=6)


def test_the_last_token_of_a_document_predicts_nothing():
    ds = torch.tensor([[0, 0, 2, 3, 3, 3]])
    t = torch.arange(12).view(2, 6) + 10
    got = docs.mask_document_ends(t, torch.tensor([0, 2, 3, 8, 12]))  # the third document crosses the row end
    assert got.tolist() == [[10, -100, -100, 13, 14, 15], [16, -100, 18, 19, 20, 21]]  # ends of [0,2), [2,3), [3,8)
    assert docs.document_positions(ds, torch.tensor([1, 2, 5])).tolist() == [[1, 0, 2]]


def test_any_visible_decides_skipped_ring_blocks():
    q_pos = torch.tensor([8, 9, 10, 11])
    q_doc = torch.tensor([[8, 8, 10, 10]])                 # documents start at the block's own chunk
    assert not bool(docs.any_visible(q_pos, q_doc, torch.tensor([0, 1, 2, 3])))
    assert bool(docs.any_visible(q_pos, torch.tensor([[3, 3, 10, 10]]), torch.tensor([0, 1, 2, 3])))
    assert not bool(docs.any_visible(q_pos, q_doc, torch.tensor([12, 13])))   # keys after every query


def _packed_loss(c, model, b, impl) -> torch.Tensor:
    """The runtime's view of a packed batch in one process: its attention on every block,
    per-document positions, masked targets; the mean over the counted targets."""
    ad = adapter_for(model)
    holder = docs.Documents()
    for blk in ad.blocks:
        ad.set_attention(model.get_submodule(blk), impl(holder))
    ds = docs.doc_starts(b["cu_seqlens"], GB, SEQ)
    holder.set(ds)
    pos = docs.document_positions(ds, torch.arange(SEQ))
    targets = docs.mask_document_ends(ad.targets(b), b["cu_seqlens"])
    if c.kind == "hf":
        logits = model(input_ids=b["input_ids"], position_ids=pos, use_cache=False).logits
    else:
        logits = model(b["input_ids"], positions=pos)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           reduction="sum") / int((targets != -100).sum())


IMPLS = {"flash-triton": lambda h: FlashAttention(impl="triton", documents=h),
         "flash-torch": lambda h: FlashAttention(impl="torch", documents=h),
         "eager": lambda h: docs.EagerAttention(h)}


@pytest.mark.parametrize("impl", [pytest.param("flash-triton", marks=[pytest.mark.slow, pytest.mark.skipif(
    not TRITON, reason="triton interpreter not available")]), "flash-torch", "eager"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-llama"])
def test_packed_model_equals_documents_alone(name, impl):
    c = case(name)
    b = packed_batches(c, 1)[0]
    ref_model, model = c.build("cpu"), c.build("cpu")
    total, count = document_loss_sum(c, ref_model, b)
    (total / count).backward()
    loss = _packed_loss(c, model, b, IMPLS[impl])
    loss.backward()
    assert abs(loss.item() - (total / count).item()) <= 1e-5 * abs(loss.item())
    ref = dict(ref_model.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.values() if p.grad is not None)
    for n, p in model.named_parameters():
        if ref[n].grad is None:
            continue
        err = float((p.grad - ref[n].grad).abs().max()) / max(float(ref[n].grad.abs().max()), 1e-3 * scale)
        assert err <= 1e-5, (n, err)
    # without the documents (one sequence per row) the loss differs: the masks matter
    plain = _packed_loss(c, c.build("cpu"), {k: v for k, v in b.items()} | {
        "cu_seqlens": torch.arange(0, GB * SEQ + 1, SEQ)}, IMPLS[impl])
    assert abs(plain.item() - loss.item()) > 1e-3
