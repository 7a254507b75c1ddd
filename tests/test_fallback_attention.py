"""The CPU fallback kernel's work on packed documents (cost_models/fallback_attention.py)."""
from __future__ import annotations

import numpy as np
import pytest

from codegen.kernels.attention_torch import CHUNK
from cost_models.documents import busiest_share, pack_mix
from cost_models.fallback_attention import (BLOCK_ELEMENTS, BLOCK_ROW_ELEMENTS, FALLBACK_CHUNK, busiest,
                                            fallback_share, rank_elements, ring_runs)

S = 2048
CALL = BLOCK_ELEMENTS + BLOCK_ROW_ELEMENTS  # one call of one row of 128 queries
FULL = 128 * 128 * 16 * 17 / 2 + 16 * CALL  # one row of one document, no ring: 16 blocks


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


def test_rows_of_one_micro_batch_share_the_earliest_start():
    # a row of short documents beside a row of one document: the micro-batch's blocks reach
    # back to position 0, the whole causal rectangle for both rows
    mix = pack_mix([32] * (S // 32) + [S], S)
    assert fallback_share(mix, 1, 1, 1, mbs=2) == pytest.approx(1.0)
    assert fallback_share(mix, 2, 1, 1, mbs=1) == pytest.approx(1.0)  # busiest rank: the long row
    work, one = rank_elements(mix, 2, 1)
    assert work[0, 0] < 0.2 * work[0, 1]
    assert one.tolist() == pytest.approx([FULL, FULL])


def test_ring_ranks_hold_their_zigzag_blocks():
    # two documents of 1,024 over cp 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (one
    # key run: RingCompute's held positions are consecutive there)
    assert ring_runs(S, 2) == [(0, 512, 0), (512, 1536, 1), (1536, 2048, 0)]
    assert ring_runs(S, 4, 2)[3] == (768, 1280, 1)
    # hand count: each rank 128 x 4,608 elements; calls: rank 0's 4 blocks of chunk 0 one each,
    # of chunk 3 two; rank 1's of chunk 1 two, of chunk 2 one: 12 calls each. One document:
    # 128 x 8,704 elements, 16 calls (rank 0's chunk 3 blocks reach all three runs)
    mix = pack_mix([1024, 1024] * 2, S)
    work, one = rank_elements(mix, 1, 2)
    assert work[0].tolist() == pytest.approx([128 * 4608 + 12 * CALL] * 2)
    assert one.tolist() == pytest.approx([128 * 8704 + 16 * CALL] * 2)
    assert fallback_share(mix, 1, 2) == pytest.approx((128 * 4608 + 12 * CALL) / (128 * 8704 + 16 * CALL))
    uly, _ = rank_elements(mix, 1, 2, ulysses=2)  # Ulysses: every rank all 24 calls at half the heads
    assert uly[0].tolist() == pytest.approx([128 * 4608 + 12 * BLOCK_ROW_ELEMENTS + 24 * BLOCK_ELEMENTS] * 2)


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
