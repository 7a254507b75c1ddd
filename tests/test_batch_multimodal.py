"""Multimodal batches on the per-batch planner (planner/batch_multimodal.py and the ``images``
term of planner/batch_assign.assign): every sample placed once and whole, with its images;
skewed batches balanced better than the fixed data-parallel split; deterministic; bad input
refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from planner.batch_assign import AssignError, Pool, WorkCost, assign
from planner.batch_multimodal import (MultimodalBatchShape, assign_samples, balance, fixed_split_work,
                                      sample_work)

COST = WorkCost(linear=1.0, attention=0.01, vision=40.0)
PATCHES = 16


def skewed(samples: int, seed: int) -> MultimodalBatchShape:
    """Most samples text-only or one image, a few with many: the images bunch in one block."""
    rng = np.random.default_rng(seed)
    counts = rng.choice([0, 1, 2, 8], size=samples, p=[0.5, 0.35, 0.1, 0.05])
    counts[: samples // 8] += 6  # the first block (one fixed rank's) carries many more images
    return MultimodalBatchShape.of(counts.tolist(), rng.integers(8, 64, samples).tolist(), PATCHES)


def test_vision_term_prices_images() -> None:
    shape = MultimodalBatchShape.of([0, 2], [10, 10], PATCHES)
    assert shape.tokens().tolist() == [10, 42]
    w = sample_work(shape, COST)
    assert w[0] == pytest.approx(10 + 0.01 * 100)
    assert w[1] == pytest.approx(42 + 0.01 * 42 ** 2 + 2 * 40.0)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_assignment_beats_fixed_split_on_skewed_batches(dp: int) -> None:
    for seed in range(5):
        shape = skewed(64, seed)
        b = balance(shape, dp, COST, capacity=10 ** 6)
        assert max(b.assigned) < max(b.fixed), (seed, b)
        assert b.spread_assigned < b.spread_fixed
        assert b.spread_assigned <= 1.05, b.spread_assigned  # close to the ideal on 64 samples
        assert sum(b.assigned) == pytest.approx(sum(b.fixed))  # same work, moved


def test_samples_run_whole_with_their_images() -> None:
    shape = skewed(48, 1)
    a = assign_samples(shape, 4, COST, capacity=10 ** 6)
    assert [p.piece for p in a.placements] == list(range(48))
    assert all(p.size == 1 and p.padded == p.length for p in a.placements)
    # even when the pool may form groups: a piece carrying images is never split
    big = assign([4000, 10, 10, 10], Pool(4, 4, 10 ** 6), COST, images=[3, 0, 0, 0])
    assert big.placements[0].size == 1
    text = assign([4000, 10, 10, 10], Pool(4, 4, 10 ** 6), COST)
    assert text.placements[0].size > 1  # the same length without images is split


def test_without_images_the_rule_is_unchanged() -> None:
    lens = [300, 5, 17, 40, 2, 90, 33, 8]
    cost = WorkCost(linear=1.0, attention=0.02, exchange=0.1)
    assert assign(lens, Pool(4, 4, 500), cost) == assign(lens, Pool(4, 4, 500), cost, images=[0] * 8)


def test_deterministic() -> None:
    shape = skewed(1024, 3)
    a = assign_samples(shape, 8, COST, capacity=10 ** 7)
    b = assign_samples(MultimodalBatchShape.of(list(shape.image_counts), list(shape.text), PATCHES), 8, COST,
                       capacity=10 ** 7)
    assert a == b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40)), min_size=4, max_size=40),
       st.sampled_from([1, 2, 4]))
def test_fuzz_placed_once_within_capacity(samples, dp) -> None:
    samples = samples[: len(samples) // dp * dp]
    counts, text = [c for c, _ in samples], [t for _, t in samples]
    shape = MultimodalBatchShape.of(counts, text, PATCHES)
    cap = int(shape.tokens().sum())  # room for all on any rank
    a = assign_samples(shape, dp, COST, capacity=cap)
    held = np.zeros(dp, dtype=np.int64)
    for p, n in zip(a.placements, shape.tokens().tolist()):
        assert p.length == n and p.size == 1
        held[p.first] += n
    assert held.tolist() == list(a.tokens)
    assert sum(a.work) == pytest.approx(sum(fixed_split_work(shape, dp, COST)))
    assert max(a.work) <= a.ideal + max(sample_work(shape, COST)) * (1 - 1 / dp) + 1e-9  # list scheduling's bound


def test_bad_input_one_line() -> None:
    with pytest.raises(AssignError, match="one of each per"):
        MultimodalBatchShape.of([1, 2], [3], PATCHES)
    with pytest.raises(AssignError, match="neither images nor text"):
        assign_samples(MultimodalBatchShape.of([0, 1], [0, 4], PATCHES), 2, COST, 100)
    with pytest.raises(AssignError, match="split evenly"):
        fixed_split_work(MultimodalBatchShape.of([0, 1, 2], 4, PATCHES), 2, COST)
    with pytest.raises(AssignError, match="image counts for"):
        assign([4, 5], Pool(2, 1, 100), COST, images=[1])
    with pytest.raises(AssignError, match=r"sample 0 \(8 images, 132 decoder tokens\) exceeds the 100 tokens"):
        assign_samples(MultimodalBatchShape.of([8, 0], 4, PATCHES), 2, COST, capacity=100)
    with pytest.raises(AssignError, match="no worker has room"):  # each fits, not all together
        assign_samples(MultimodalBatchShape.of([5, 5, 5], 4, PATCHES), 1, COST, capacity=100)
    with pytest.raises(AssignError, match="non-negative"):
        WorkCost(linear=1.0, attention=0.0, vision=-1.0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 3)), min_size=1, max_size=30))
def test_fuzz_pieces_with_images_never_split(pieces) -> None:
    """Text pieces and pieces carrying images mixed on a pool that forms groups: every piece
    with images runs whole, every token is held once."""
    lens, imgs = [n for n, _ in pieces], [k for _, k in pieces]
    cost = WorkCost(linear=1.0, attention=0.01, exchange=0.05, vision=50.0)
    a = assign(lens, Pool(4, 4, 10 ** 6), cost, images=imgs)
    assert all(p.size == 1 for p, k in zip(a.placements, imgs) if k > 0)
    held = np.zeros(4, dtype=np.int64)
    for p in a.placements:
        held[list(p.workers)] += p.padded // p.size
    assert held.tolist() == list(a.tokens)
    solo = sum(cost.linear * n + cost.attention * n * n + cost.vision * k for n, k in zip(lens, imgs))
    assert sum(a.work) >= solo * (1 - 1e-9)  # splitting only adds (padding, communication); images counted once
    if all(p.size == 1 for p in a.placements):
        assert sum(a.work) == pytest.approx(solo)
