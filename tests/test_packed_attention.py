"""Packed documents through the flash-attention kernels (Triton under the CPU interpreter, and
the torch fallback): no query attends across a document boundary.

A batch row packs several documents; ``doc_start[b, i]`` is the global position of the first
token of query i's document. The reference attends each document on its own (causal SDPA on
its slice), so the packed call must equal the per-document results, forward and backward,
with boundaries inside the kernel's 64-row blocks, one-token documents, one document filling
its row, and ring-style calls whose queries and keys sit at other global offsets.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from codegen.kernels import attention_triton as T  # noqa: E402
from codegen.kernels.attention import flash_attention  # noqa: E402

TRITON = T.HAS_TRITON and T.interpreting()
IMPLS = [pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="triton interpreter not available")),
         "torch"]


def doc_starts(lengths: list[list[int]]) -> torch.Tensor:
    """[B, S]: each position's document start, from each row's document lengths."""
    rows = []
    for lens in lengths:
        starts = torch.cumsum(torch.tensor([0] + lens[:-1]), 0)
        rows.append(torch.repeat_interleave(starts, torch.tensor(lens)))
    return torch.stack(rows)


def per_document(q, k, v, lengths):
    """Causal attention of each document on its own (SDPA), concatenated back: [B, H, S, D]."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for b, lens in enumerate(lengths):
        parts, a = [], 0
        for n in lens:
            sl = slice(a, a + n)
            kk = k[b:b + 1, :, sl].repeat_interleave(rep, 1)
            vv = v[b:b + 1, :, sl].repeat_interleave(rep, 1)
            parts.append(F.scaled_dot_product_attention(q[b:b + 1, :, sl], kk, vv, is_causal=True))
            a += n
        outs.append(torch.cat(parts, 2))
    return torch.cat(outs, 0)


def masked_reference(q, k, v, doc_start, q_offset, kv_offset, causal=True):
    """Plain fp32 attention with the causal and document masks (``doc_start`` None: none) at
    global offsets: (out, lse)."""
    rep = q.shape[1] // k.shape[1]
    s = q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    i = torch.arange(q.shape[2])[:, None] + q_offset
    j = torch.arange(k.shape[2])[None, :] + kv_offset
    visible = ((j <= i) | (not causal))[None]                               # [1, Sq, Sk]
    if doc_start is not None:
        visible = visible & (j[None] >= doc_start[:, :, None])               # [B, Sq, Sk]
    s = s.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return p @ v.float().repeat_interleave(rep, 1), lse


def qkv(B, H, KVH, S, D, seed=0, Sk=None):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).requires_grad_()  # noqa: E731
    return mk(B, H, S, D), mk(B, KVH, Sk or S, D), mk(B, KVH, Sk or S, D)


def maxerr(a, b):
    return (a.float() - b.float()).abs().max().item()


def assert_grads_match(got, ref, fin, inputs):
    """The gradients of ``inputs`` from (out, lse) ``got`` equal those from the reference's,
    for random output and finite-lse cotangents (rows with nothing visible carry none)."""
    gout, glse = torch.randn_like(ref[0]), torch.randn_like(ref[1])
    obj = lambda o, l: (o.float() * gout).sum() + (torch.where(fin, l, 0.0) * glse).sum()  # noqa: E731
    for g, r in zip(torch.autograd.grad(obj(*got), inputs), torch.autograd.grad(obj(*ref), inputs)):
        assert maxerr(g, r) < 2e-5


# boundaries inside the 64-row blocks, one-token documents, and a row holding one document
LENGTHS = [[37, 1, 1, 64, 47], [150]]


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_documents_equal_each_document_alone(impl):
    q, k, v = qkv(2, 4, 2, 150, 16, seed=1)
    out, lse = flash_attention(q, k, v, causal=True, impl=impl, doc_start=doc_starts(LENGTHS))
    want = per_document(q, k, v, LENGTHS)
    assert maxerr(out, want) < 1e-5
    gout = torch.randn_like(want)
    got = torch.autograd.grad((out * gout).sum(), (q, k, v))
    ref = torch.autograd.grad((want * gout).sum(), (q, k, v))
    for g, r in zip(got, ref):
        assert maxerr(g, r) < 2e-5
    # a one-token document attends to itself only: its output is its own value row
    assert maxerr(out[0, :, 37], v[0, :, 37].repeat_interleave(2, 0)) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_step_skips_keys_of_earlier_documents(impl):
    """A ring step: queries at global positions 128..191 attend a visiting block of keys at
    64..127. Rows whose document starts after the block see nothing there (lse -inf, out 0),
    row 0's queries (document from 120) only keys 120..127; the log-sum-exp and the
    gradients of out and lse match the masked reference."""
    lens = [[100, 20, 72], [130, 62]]
    ds_all = doc_starts(lens)
    q, k, v = qkv(2, 2, 1, 64, 16, seed=2)
    ds = ds_all[:, 128:192]
    out, lse = flash_attention(q, k, v, causal=True, q_offset=128, kv_offset=64, impl=impl, doc_start=ds)
    rout, rlse = masked_reference(q, k, v, ds, 128, 64)
    fin = torch.isfinite(rlse)
    # row 1: queries 128, 129 end document 0 and see every key; the document from 130 none of them
    assert torch.equal(torch.isfinite(lse), fin) and fin[1, :, :2].all() and not fin[1, :, 2:].any()
    assert (out[~fin] == 0).all() and maxerr(out, rout) < 1e-5 and maxerr(lse[fin], rlse[fin]) < 1e-5
    assert_grads_match((out, lse), (rout, rlse), fin, (q, k, v))


def test_torch_fallback_skips_keys_chunk_by_chunk():
    """The torch fallback attends each 128-row query chunk only to the keys from its earliest
    document start to its last query: over four chunks at ring offsets (queries at 256..683,
    keys at 0..255), with chunks whose queries see no key of the block (their document starts
    at 512), the output, the log-sum-exp and the gradients equal the masked reference."""
    from codegen.kernels.attention_torch import CHUNK

    assert CHUNK == 128
    sq, sk, q_off = 428, 256, 256
    ds = doc_starts([[188, 324, 172], [684]])[:, q_off:]
    q, k, v = qkv(2, 2, 1, sq, 16, seed=5, Sk=sk)
    out, lse = flash_attention(q, k, v, causal=True, q_offset=q_off, kv_offset=0, impl="torch", doc_start=ds)
    rout, rlse = masked_reference(q, k, v, ds, q_off, 0)
    fin = torch.isfinite(rlse)
    assert fin[0, :, :256].all() and not fin[0, :, 256:].any() and fin[1].all()
    assert torch.equal(torch.isfinite(lse), fin) and (out[~fin] == 0).all()
    assert maxerr(out, rout) < 1e-5 and maxerr(lse[fin], rlse[fin]) < 1e-5
    assert_grads_match((out, lse), (rout, rlse), fin, (q, k, v))


@pytest.mark.parametrize("causal,docs", [(True, True), (True, False), (False, False)])
def test_torch_fallback_rows_reach_back_to_their_own_documents(causal, docs):
    """Five rows of one micro-batch whose documents start at different places, at ring offsets
    (queries at 200..499, keys at 100..359), GQA: each (query chunk, row) computes, one row at a
    time, only the keys from that row's own earliest document start (row 1 sees nothing in the
    last chunk: its document starts at 380), and the output, log-sum-exp and gradients equal
    the dense masked reference; without documents every row its own block of every key."""
    from codegen.kernels.attention_torch import row_calls

    lens = [[500], [380, 120], [500], [150, 180, 170], [420, 80]]
    q_off, kv_off, sq, sk = 200, 100, 300, 260
    ds = doc_starts(lens)[:, q_off:] if docs else None
    q, k, v = qkv(5, 4, 2, sq, 16, seed=11, Sk=sk)
    out, lse = flash_attention(q, k, v, causal=causal, q_offset=q_off, kv_offset=kv_off, impl="torch", doc_start=ds)
    rout, rlse = masked_reference(q, k, v, ds, q_off, kv_off, causal=causal)
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin) and (out[~fin] == 0).all()
    assert maxerr(out, rout) < 1e-5 and maxerr(lse[fin], rlse[fin]) < 1e-5
    assert_grads_match((out, lse), (rout, rlse), fin, (q, k, v))
    calls = [row_calls(5, slice(r, min(sq, r + 128)), sk, causal, q_off, kv_off, ds) for r in (0, 128, 256)]
    starts = [0, 0, 0, 50, 0] if docs else [0] * 5  # chunk 0: row 3 from its document at 150 (key 50)
    assert calls[0] == [(slice(b, b + 1), slice(lo, 228 if causal else sk)) for b, lo in enumerate(starts)]
    if docs:
        assert slice(1, 2) not in [bs for bs, _ in calls[2]] and not fin[1, :, 256:].any()
    else:
        assert [len(c) for c in calls] == [5, 5, 5]


def test_doc_start_is_validated():
    q, k, v = qkv(1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="doc_start must be"):
        flash_attention(q, k, v, causal=False, doc_start=torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="doc_start must be"):
        flash_attention(q, k, v, causal=True, doc_start=torch.zeros(1, 8, dtype=torch.long))


def test_opcheck_with_doc_start():
    q, k, v = qkv(1, 4, 2, 24, 16, seed=7)
    ds = doc_starts([[5, 1, 18]])
    torch.library.opcheck(torch.ops.autopar.flash_attn_fwd, (q, k, v, True, 0.25, 0, 0, "torch", ds))
