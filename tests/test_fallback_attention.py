"""The CPU fallback kernel's work on packed documents (cost_models/fallback_attention.py)."""
from __future__ import annotations

import pytest

from cost_models.documents import busiest_share, pack_mix
from cost_models.fallback_attention import fallback_chunk, fallback_share, rank_elements

S = 2048


def test_one_document_per_row_is_one_for_every_layout():
    mix = pack_mix([S] * 8, S)
    for dp, cp, u, mbs in ((4, 1, 1, 1), (2, 2, 1, 2), (1, 4, 1, 4), (1, 4, 2, 2), (1, 4, 4, 1)):
        assert fallback_share(mix, dp, cp, u, mbs) == pytest.approx(1.0)


def test_short_documents_cost_a_block_square_each_block():
    # 32-token documents: every block of 128 queries computes 128 x 128 scores (four documents,
    # the rectangle back to the first one's start), not 4 x 32 x 33 / 2 pairs.
    assert fallback_chunk() == 128
    mix = pack_mix([32] * (4 * S // 32), S)
    blocks = S // 128
    full = 128 * 128 * blocks * (blocks + 1) / 2
    assert fallback_share(mix, 4, 1) == pytest.approx(blocks * 128 * 128 / full)
    assert fallback_share(mix, 4, 1) > 3 * busiest_share(mix, 4, 1)


def test_rows_of_one_micro_batch_share_the_earliest_start():
    # a row of short documents beside a row of one document: the micro-batch's blocks reach
    # back to position 0, the whole causal rectangle for both rows
    mix = pack_mix([32] * (S // 32) + [S], S)
    assert fallback_share(mix, 1, 1, 1, mbs=2) == pytest.approx(1.0)
    assert fallback_share(mix, 2, 1, 1, mbs=1) == pytest.approx(1.0)  # busiest rank: the long row
    work, full = rank_elements(mix, 2, 1)
    assert work[0, 0] < 0.2 * work[0, 1]


def test_ring_ranks_hold_their_zigzag_blocks():
    # two documents of 1,024 over cp 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2;
    # hand count: each rank 128 x 4,608 elements against 128 x 8,704 with one document
    mix = pack_mix([1024, 1024] * 2, S)
    work, full = rank_elements(mix, 1, 2)
    assert work[0].tolist() == pytest.approx([128 * 4608, 128 * 4608])
    assert full == pytest.approx(128 * 8704)
    assert fallback_share(mix, 1, 2) == pytest.approx(4608 / 8704)
    uly, _ = rank_elements(mix, 1, 2, ulysses=2)  # Ulysses: every rank half the heads of both
    assert uly[0].tolist() == pytest.approx([128 * 4608, 128 * 4608])
