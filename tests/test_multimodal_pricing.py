"""Multimodal batches priced (cost_models/multimodal_pricing.py): the vision term from the
graph's vision layers, sampled images-per-sample batches, assignment against the fixed split."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.multimodal_pricing import compare_multimodal, multimodal_work_cost, sample_image_counts
from planner.batch_assign import WorkCost
from planner.batch_multimodal import MultimodalBatchShape
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig


def test_rates_split_vision_from_text() -> None:
    graph = load_graph("mllm-small", batch=1)
    cost = multimodal_work_cost(graph, parse_cluster("dgx-h100:1"), ParallelConfig(dp=8, mbs=1))
    assert cost.vision > 0 and cost.linear > 0 and cost.attention > 0
    # a ViT-B/16 image (196 patches) costs more than its 196 decoder tokens' linear work, less than 100x
    assert 196 * cost.linear < cost.vision < 100 * 196 * cost.linear
    with pytest.raises(ValueError, match="no vision layers"):
        multimodal_work_cost(load_graph("llama-tiny", batch=1), parse_cluster("local-cpu:4"), ParallelConfig(dp=4))


def test_sampled_counts_follow_the_distribution_and_are_seeded() -> None:
    a = sample_image_counts({0: 0.5, 1: 0.3, 8: 0.2}, 1000, 3, seed=1)
    assert a == sample_image_counts({0: 0.5, 1: 0.3, 8: 0.2}, 1000, 3, seed=1)
    flat = [c for b in a for c in b]
    assert set(flat) <= {0, 1, 8}
    assert abs(flat.count(8) / len(flat) - 0.2) < 0.03
    with pytest.raises(ValueError, match="counts >= 0"):
        sample_image_counts({-1: 1.0}, 4, 1)


def test_assignment_priced_faster_than_the_fixed_split() -> None:
    cost = WorkCost(linear=1e-5, attention=1e-9, vision=4e-3)
    counts = sample_image_counts({0: 0.4, 1: 0.4, 4: 0.15, 16: 0.05}, 256, 20, seed=0)
    shapes = [MultimodalBatchShape.of(c, 128, 196) for c in counts]
    c = compare_multimodal(shapes, 8, cost, 10 ** 9, fixed_s=0.01)
    s = c.summary()
    assert s["batches"] == 20 and s["speedup"] > 1.05
    assert s["spread_after"] < s["spread_before"] and s["spread_after"] < 1.02
    assert 1.0 <= c.ideal_gap < 1.02
    assert all(a <= f + 1e-12 for a, f in zip(c.assigned, c.fixed))


def test_plan_record_and_report_line() -> None:
    from planner.report.data import multimodal_text
    from planner.search.multimodal import multimodal_record
    from planner.search.planning import evaluate_config

    graph = load_graph("mllm-tiny", batch=1)
    cluster = parse_cluster("local-cpu:4")
    images = {0: 0.4, 1: 0.3, 6: 0.3}
    est, _ = evaluate_config(graph, cluster, ParallelConfig(dp=4, mbs=1, dtype="fp32"), 16)
    r = multimodal_record(graph, cluster, est, 16, images)
    assert r["patches"] == 16 and r["text_tokens"] == 16 and r["batches"] > 0
    assert r["spread_after"] < r["spread_before"] and r["chosen"] == (r["speedup"] >= 1 / 0.98)
    line = multimodal_text(r)
    assert "0:0.4, 1:0.3, 6:0.3" in line and f"{r['spread_before']:.2f}x the mean work" in line
    est, _ = evaluate_config(graph, cluster, ParallelConfig(dp=2, pp=2, mbs=1, dtype="fp32"), 16)
    r = multimodal_record(graph, cluster, est, 16, images)
    assert not r["chosen"] and "data-parallel layouts only" in multimodal_text(r)


def test_images_flag_refused_in_one_line() -> None:
    from planner.errors import AutoparError
    from planner.search.multimodal import multimodal_record, parse_images

    assert parse_images("0:1,4:0.5,4:0.5") == {0: 1.0, 4: 1.0}
    for bad in ("0-1", "1:x", "-1:1", "0:0"):
        with pytest.raises(AutoparError, match="--images-per-sample"):
            parse_images(bad)
    graph = load_graph("llama-tiny", batch=1)
    with pytest.raises(AutoparError, match="needs a vision"):
        multimodal_record(graph, parse_cluster("local-cpu:4"), None, 4, {0: 1.0})
