"""The CPU fallback kernel's work on packed documents (cost_models/fallback_attention.py)."""
from __future__ import annotations

import numpy as np
import pytest

from codegen.kernels.attention_torch import CHUNK
from cost_models.documents import busiest_share, pack_mix
from cost_models.fallback_attention import (BLOCK_ELEMENTS, BLOCK_ROW_ELEMENTS, FALLBACK_CHUNK, busiest,
                                            fallback_share, fallback_work, rank_elements, ring_calls, ring_factor,
                                            ring_runs)
from cost_models.ring_merges import CALL_ROW_ELEMENTS, MERGE_ROW_ELEMENTS, RING_CALL_ELEMENTS

S = 2048
CALL = BLOCK_ELEMENTS + BLOCK_ROW_ELEMENTS  # one call of one row of 128 queries
FULL = 128 * 128 * 16 * 17 / 2 + 16 * CALL  # one row of one document, no ring: 16 blocks


def own(merged: float, calls: int, held: float, rows: float = 1) -> float:
    """The ring's own work (cost_models.ring_merges) of hand-counted query rows merged and flash
    calls of a rank holding ``held`` query rows, ``rows`` batch rows (at 1 / u of the heads: u x
    fewer rows)."""
    return MERGE_ROW_ELEMENTS * merged * rows + CALL_ROW_ELEMENTS * calls * held * rows + RING_CALL_ELEMENTS * calls


def test_one_document_per_row_is_one_for_every_layout():
    mix = pack_mix([S] * 8, S)
    for dp, cp, u, mbs in ((4, 1, 1, 1), (2, 2, 1, 2), (1, 4, 1, 4), (1, 4, 2, 2), (1, 4, 4, 1), (8, 1, 1, 1)):
        assert fallback_share(mix, dp, cp, u, mbs) == 1.0
        assert fallback_share(mix, dp, cp, u, mbs, cores=2) == 1.0


def test_short_documents_cost_a_block_square_each_block():
    # 32-token documents: every block of 128 queries computes 128 x 128 scores (four documents,
    # the rectangle back to the first one's start), not 4 x 32 x 33 / 2 pairs
    assert FALLBACK_CHUNK == CHUNK == 128  # the kernel's blocks, mirrored by the cost model
    mix = pack_mix([32] * (4 * S // 32), S)
    assert fallback_share(mix, 4, 1) == pytest.approx(16 * (128 * 128 + CALL) / FULL)
    assert fallback_share(mix, 4, 1) > 3 * busiest_share(mix, 4, 1)


def test_rows_of_one_micro_batch_reach_back_to_their_own_starts():
    # a row of short documents beside a row of one document: each row's blocks reach back to its
    # own earliest document start (a block square each block of the short row), a call per row
    # and block
    mix = pack_mix([32] * (S // 32) + [S], S)
    rect = 128 * 128 * 136
    want = (16 * 128 * 128 + rect + 32 * CALL) / (2 * rect + 32 * CALL)
    assert fallback_share(mix, 1, 1, 1, mbs=2) == pytest.approx(want)
    assert fallback_share(mix, 2, 1, 1, mbs=1) == pytest.approx(1.0)  # busiest rank: the long row
    work, one = rank_elements(mix, 2, 1)
    assert work[0, 0] < 0.2 * work[0, 1]
    assert one.tolist() == pytest.approx([FULL, FULL])


def test_ring_ranks_hold_their_zigzag_blocks():
    # two documents of 1,024 over cp 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (one
    # key run: RingCompute's held positions are consecutive there)
    assert ring_runs(S, 2) == [(0, 512, 0), (512, 1536, 1), (1536, 2048, 0)]
    # the 2-D hybrid (cp 4, Ulysses 2): ring rank 0 holds chunks 0, 1, 6, 7 and attends them in
    # position order (two runs), ring rank 1 chunks 2-5 (one); pure Ulysses: the whole row
    assert ring_runs(S, 4, 2) == [(0, 512, 0), (512, 1536, 1), (1536, 2048, 0)]
    assert ring_runs(S, 4, 4) == [(0, S, 0)]
    # hand count: each rank 128 x 4,608 elements; calls: rank 0's 4 blocks of chunk 0 one each,
    # of chunk 3 two; rank 1's of chunk 1 two, of chunk 2 one: 12 calls each. One document:
    # 128 x 8,704 elements, 16 calls (rank 0's chunk 3 blocks reach all three runs)
    # The ring's own work, both steps computed (every block some query sees): rank 0's own block
    # makes 3 flash calls (its late run reaches both its runs: a merge of 512 queries), the
    # visiting block 1 (only the late run reaches it) and a merge of all 1,024; rank 1 (one run)
    # 2 calls and the visiting merge
    own0, own1 = own(512 + 1024, 4, 1024), own(1024, 2, 1024)
    mix = pack_mix([1024, 1024] * 2, S)
    work, one = rank_elements(mix, 1, 2)
    assert work[0].tolist() == pytest.approx([128 * 4608 + 12 * CALL + own0, 128 * 4608 + 12 * CALL + own1])
    assert one.tolist() == pytest.approx([128 * 8704 + 16 * CALL + own0, 128 * 8704 + 16 * CALL + own1])
    assert fallback_share(mix, 1, 2) == pytest.approx((128 * 4608 + 12 * CALL + own0) / (128 * 8704 + 16 * CALL + own0))
    uly, _ = rank_elements(mix, 1, 2, ulysses=2)  # Ulysses: every rank all 16 calls at half the heads
    # pure Ulysses: the rank attends the row in position order (RingCompute.attention_order), one
    # run: one step, one flash call, no merge (held in the order 0, 3, 1, 2 it was three runs:
    # 1 + 2 + 3 calls and merges of 1,024 and 2 x 512 queries)
    uly_own = own(0, 1, 2048, rows=0.5)
    assert uly[0].tolist() == pytest.approx([128 * 4608 + 8 * BLOCK_ROW_ELEMENTS + 16 * BLOCK_ELEMENTS + uly_own] * 2)


def test_shared_cores_wait_for_the_busiest_core():
    # ranks pinned round-robin: ranks 0 and 2 on core 0, 1 and 3 on core 1; a core runs its ranks'
    # work one after another, so a light rank beside the busiest one shortens the wait
    work = np.array([[4.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 3.0]])
    assert busiest(work).tolist() == [4.0, 3.0]
    assert busiest(work, cores=2).tolist() == [2.5, 2.0]
    assert busiest(work, cores=4).tolist() == [4.0, 3.0]  # a core per rank: the busiest rank
    # dp 4, rows full, full, short, short: each core holds a full row and a short one
    mix = pack_mix([S, S] + [32] * 128, S)
    w, one = rank_elements(mix, 4, 1)
    x = w[0, 2] / one[0]
    assert 0 < x < 0.2 and w[0, 3] == w[0, 2]
    assert fallback_share(mix, 4, 1) == pytest.approx(1.0)
    assert fallback_share(mix, 4, 1, cores=2) == pytest.approx((1 + x) / 2)


def _counted_blocks(seq: int, cp: int, ulysses: int, doc_start=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per ring rank, (forward, backward) ``[calls, score elements per head, rows x queries]`` of the
    fallback's score blocks, traced on a real run of the runtime's ring path (``RingCompute``
    with the flash kernels, on CPU their plain-torch fallback) over ``doc_start``'s rows (None:
    one row of one document): each block is one return of its score function, whose
    ``[rows, kv heads, group, queries, keys]`` shape says its elements."""
    import sys

    import torch

    import codegen.kernels.attention_torch as at
    from codegen.runtime.context_parallel import RingCompute
    from codegen.runtime.documents import Documents

    count = np.zeros(3)

    def trace(frame, event, arg):
        if event == "return" and frame.f_code.co_filename == at.__file__ and frame.f_code.co_name == "_scores":
            b, _, _, queries, keys = arg.shape
            count[:] += (1, b * queries * keys, b * queries)

    docs = None
    if doc_start is not None:
        docs = Documents()
        docs.set(torch.as_tensor(doc_start, dtype=torch.int64))
    rows = 1 if doc_start is None else len(doc_start)
    ring, out = cp // ulysses, []
    for rank in range(ring):
        q, k, v = (torch.randn(rows, 4 // ulysses, seq * ulysses // cp, 64, requires_grad=True) for _ in range(3))
        sys.setprofile(trace)
        try:
            y = RingCompute(ring, rank, flash=True, ulysses=ulysses, documents=docs)(q, k, v, causal=True)
            fwd = count.copy()
            y.sum().backward()                         # CPU autograd: on this thread
        finally:
            sys.setprofile(None)
        out.append((fwd, count - fwd))
        count[:] = 0
    return out


@pytest.mark.parametrize("cp,ulysses", [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4)])
def test_ring_calls_are_the_fallbacks_calls(monkeypatch, cp, ulysses):
    # the cost model's (query block, key run) calls per ring rank against the runtime's own ring
    # run through the fallback, counted: forward and backward alike
    monkeypatch.delenv("AUTOPAR_KERNEL_IMPL", raising=False)  # "auto": the fallback on CPU
    seq = 1024
    got = _counted_blocks(seq, cp, ulysses)
    want = ring_calls(seq, cp, ulysses).tolist()
    assert [f[0] for f, _ in got] == want and [b[0] for _, b in got] == want
    assert ring_calls(seq, 1).tolist() == [seq // CHUNK]   # cp 1: one call per block of the row
    # a ring's extra calls (what ring_factor prices); pure Ulysses attends the row as one run: cp 1's
    assert sum(want) > seq // CHUNK if ulysses < cp else sum(want) == seq // CHUNK


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_modelled_work_is_the_fallbacks_blocks(monkeypatch, cp):
    # four rows of one micro-batch, documents starting at different places (rows 0 and 1 one
    # document; short documents in row 3): the model's score elements, calls and rows x queries
    # per ring rank equal the blocks the runtime's ring makes, counted, forward and backward
    # alike; no row reaches back to another row's document start, and each call is one row
    import cost_models.fallback_attention as fa
    import cost_models.ring_merges as rm
    from cost_models.fallback_attention import row_doc_starts

    monkeypatch.delenv("AUTOPAR_KERNEL_IMPL", raising=False)
    for name in ("MERGE_ROW_ELEMENTS", "CALL_ROW_ELEMENTS", "RING_CALL_ELEMENTS"):  # the calls only (own work:
        monkeypatch.setattr(rm, name, 0.0)                                         # test_ring_own_work...)
    seq = 1024
    mix = pack_mix([seq, seq, 200, 500, 324] + [64] * 16, seq)
    assert mix.rows == 4
    got = _counted_blocks(seq, cp, 1, row_doc_starts(mix))
    parts = []
    for element, row in ((0.0, 0.0), (1.0, 0.0), (0.0, CHUNK)):   # elements; + calls; + rows x queries
        monkeypatch.setattr(fa, "BLOCK_ELEMENTS", element)
        monkeypatch.setattr(fa, "BLOCK_ROW_ELEMENTS", row)
        parts.append(rank_elements(mix, 1, cp, mbs=4)[0][0])
    want = np.stack([parts[1] - parts[0], parts[0], parts[2] - parts[0]], axis=1)  # [ranks, 3]
    assert np.array([f for f, _ in got]) == pytest.approx(want) and np.array([b for _, b in got]) == pytest.approx(want)
    if cp == 1:  # hand count: rows 0, 1 the causal rectangle (8 blocks); row 2 each block from its
        # earliest start (0, 0, 200, 200, 200, 200, 700, 700); row 3 a block square each block;
        # a call per row and block (the queries' rows of 128, each call one row)
        assert want[0].tolist() == [32, 2 * 128 * 128 * 36 + 128 * 2408 + 8 * 128 * 128, 32 * 128]
    assert want[:, 2].tolist() == pytest.approx((want[:, 0] * 128).tolist())  # one row a call


def test_ring_factor_prices_the_calls_beyond_cp_1():
    # one row of 2,048 over cp 4 (mbs 1): each rank holds 4 blocks of 128 and makes 16 calls
    # against cp 1's 16 for all 16 blocks; the rectangles are cp 1's, split
    # and the ring's own work: the busiest, rank 0 (chunks 0 and 7), merges 3 x 256 queries in its
    # blocks (its late run reaching two key runs) and 3 x 512 over the visiting ones, in 8 calls
    rect = 128 * 128 * 16 * 17 / 2
    assert ring_calls(S, 4).tolist() == [16] * 4
    assert ring_factor(S, 1, 4) == pytest.approx((rect / 4 + 16 * CALL + own(3 * 256 + 3 * 512, 8, 512)) / (FULL / 4))
    assert ring_factor(S, 4, 1) == 1.0
    # on 2 shared cores the busier core's mean: ranks 0 and 2 (ranks 1 and 3 make 8 and 4 calls)
    assert ring_factor(S, 1, 4, cores=2) == pytest.approx((rect / 4 + 16 * CALL + own(2048, 8, 512)) / (FULL / 4))
    # pure Ulysses over 2: cp 1's 16 calls (one key run: the row in position order) at half the
    # heads, the fixed part whole, and one flash call's own work
    assert ring_calls(S, 2, 2).tolist() == [16]
    assert ring_factor(S, 1, 2, 2) == pytest.approx((rect / 2 + 16 * (BLOCK_ROW_ELEMENTS / 2 + BLOCK_ELEMENTS)
                                                     + own(0, 1, 2048, rows=0.5)) / (FULL / 2))
    assert fallback_work(None, S, 1, 4) == ring_factor(S, 1, 4)
    mix = pack_mix([1024, 1024] * 2, S)
    assert fallback_work(mix, S, 1, 2) == pytest.approx(fallback_share(mix, 1, 2) * ring_factor(S, 1, 2))
    assert fallback_work(mix, S, 1, 2) == pytest.approx(2 * (128 * 4608 + 12 * CALL + own(1536, 4, 1024)) / FULL)


def test_a_rings_estimate_grows_by_what_its_calls_cost(monkeypatch):
    # llama-mini's attention (4 heads of 64) over cp 4, 4 rows per micro-batch, no documents: the
    # roofline's fallback core grows by ring_factor - 1 of cp 1's per rank, forward and backward,
    # and the estimate's compute by that, every attention layer
    import cost_models.fallback_attention as fa
    from cost_models import compute
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import graph_of_config
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config
    from planner.zoo import ModelConfig

    g = graph_of_config(ModelConfig(name="ring-llama", arch="llama", layers=2, hidden=256, ffn_hidden=688, heads=4,
                                    kv_heads=2, vocab=1024, seq_len=S, max_seq_len=S))
    cpu = parse_cluster("local-cpu:4")
    cfg = ParallelConfig(cp=4, mbs=4, dtype="fp32")
    block = next(l for l in g.layers if l.attention is not None)
    factor = ring_factor(S, 1, 4, 1, 4, fa.pinned_cores(cpu, cfg))
    rect = 4 * 128 * 128 * 136                                      # 4 rows' causal rectangles
    # a call per row; the ring's own work on core 0's ranks 0 and 2 (the busier: ranks 1 and 3 make
    # 8 and 4 calls), each 8 calls, merging 2,304 and 1,792 queries of each of 4 rows
    ring_own = own((2304 + 1792) / 2, 8, 512, rows=4)
    assert factor == pytest.approx((rect / 4 + 4 * 16 * CALL + ring_own) / ((rect + 4 * 16 * CALL) / 4))
    core_s = (compute.attn_core_flops(block, g.batch) * 0.5 * compute.CPU_TORCH_ATTENTION_SLOWDOWN * cfg.mbs
              / g.batch / cfg.cp / (cpu.peak_flops("fp32") * compute.EFF_MATMUL_CPU))  # cp 1's fallback core per rank
    calls, est = compute.roofline_time(block, g, cpu, cfg), evaluate_config(g, cpu, cfg, 4)[0]
    monkeypatch.setattr(fa, "ring_factor", lambda *a, **k: 1.0)
    plain, est0 = compute.roofline_time(block, g, cpu, cfg), evaluate_config(g, cpu, cfg, 4)[0]
    assert calls.fwd_s - plain.fwd_s == pytest.approx((factor - 1) * core_s)
    assert calls.bwd_s - plain.bwd_s == pytest.approx((factor - 1) * core_s * compute.BWD_ATTN_CORE_FACTOR)
    layers = sum(l.attention is not None for l in g.layers)
    assert est.breakdown["compute"] - est0.breakdown["compute"] == pytest.approx(
        layers * (factor - 1) * core_s * (1 + compute.BWD_ATTN_CORE_FACTOR))
