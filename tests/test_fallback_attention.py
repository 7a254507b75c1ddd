"""The CPU fallback kernel's work on packed documents (cost_models/fallback_attention.py)."""
from __future__ import annotations

import pytest

from cost_models.documents import busiest_share, pack_mix
from cost_models.fallback_attention import (BLOCK_ELEMENTS, BLOCK_ROW_ELEMENTS, fallback_chunk, fallback_share,
                                            rank_elements)

S = 2048
CALL = BLOCK_ELEMENTS + BLOCK_ROW_ELEMENTS  # one call of one row of 128 queries
FULL = 128 * 128 * 16 * 17 / 2 + 16 * CALL  # one row of one document, no ring: 16 blocks


def test_one_document_per_row_is_one_without_a_ring():
    mix = pack_mix([S] * 8, S)
    for dp, mbs in ((4, 1), (2, 2), (1, 4), (8, 1)):
        assert fallback_share(mix, dp, 1, 1, mbs) == pytest.approx(1.0)
    # cp 4: key runs chunks 0, 1, 2, 3-4 (rank 3's, one run), 5, 6, 7; every rank 4 blocks of 128,
    # a block reaching every run up to its own: rank 0 2 x 1 + 2 x 7, rank 3 4 x 4, ...: 16 calls
    # each against 4 per rank without a ring (the elements the same)
    e = 128 * 128 * 16 * 17 / 2 / 4
    assert fallback_share(mix, 1, 4) == pytest.approx((e + 16 * CALL) / (e + 4 * CALL))
    assert 1.0 < fallback_share(mix, 1, 2) < fallback_share(mix, 1, 4)
    # Ulysses: a rank holds its group's chunks (4 runs at u 2, 8 at u 4), each a call per key run
    assert fallback_share(mix, 1, 4) < fallback_share(mix, 1, 4, 2) < fallback_share(mix, 1, 4, 4)


def test_short_documents_cost_a_block_square_each_block():
    # 32-token documents: every block of 128 queries computes 128 x 128 scores (four documents,
    # the rectangle back to the first one's start), not 4 x 32 x 33 / 2 pairs
    assert fallback_chunk() == 128
    mix = pack_mix([32] * (4 * S // 32), S)
    assert fallback_share(mix, 4, 1) == pytest.approx(16 * (128 * 128 + CALL) / FULL)
    assert fallback_share(mix, 4, 1) > 3 * busiest_share(mix, 4, 1)


def test_rows_of_one_micro_batch_share_the_earliest_start():
    # a row of short documents beside a row of one document: the micro-batch's blocks reach
    # back to position 0, the whole causal rectangle for both rows
    mix = pack_mix([32] * (S // 32) + [S], S)
    assert fallback_share(mix, 1, 1, 1, mbs=2) == pytest.approx(1.0)
    assert fallback_share(mix, 2, 1, 1, mbs=1) == pytest.approx(1.0)  # busiest rank: the long row
    work, full = rank_elements(mix, 2, 1)
    assert work[0, 0] < 0.2 * work[0, 1]
    assert full == pytest.approx(FULL)


def test_ring_ranks_hold_their_zigzag_blocks():
    # two documents of 1,024 over cp 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2; hand
    # count: each rank 128 x 4,608 elements; calls (key runs: chunk 0, chunks 1-2 of rank 1 as one,
    # chunk 3): rank 0's 4 blocks of chunk 0 one each, of chunk 3 two; rank 1's of chunk 1 two,
    # of chunk 2 one: 12 calls each
    mix = pack_mix([1024, 1024] * 2, S)
    work, full = rank_elements(mix, 1, 2)
    assert work[0].tolist() == pytest.approx([128 * 4608 + 12 * CALL] * 2)
    assert full == pytest.approx(FULL / 2)
    assert fallback_share(mix, 1, 2) == pytest.approx((128 * 4608 + 12 * CALL) / (FULL / 2))
    uly, _ = rank_elements(mix, 1, 2, ulysses=2)  # Ulysses: every rank all 24 calls at half the heads
    assert uly[0].tolist() == pytest.approx([128 * 4608 + 12 * BLOCK_ROW_ELEMENTS + 24 * BLOCK_ELEMENTS] * 2)
