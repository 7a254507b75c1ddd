"""DTensor's vocabulary-parallel embedding backward (cost_models/dtensor_dispatch.py): the whole table's
gradient on every tp rank, priced per element and micro-batch on CPU clusters only."""
from __future__ import annotations

import pytest

from cost_models import cpu_runtime
from cost_models.cluster import Cluster, load_preset
from cost_models.dtensor_dispatch import vocab_table_elements
from cost_models.profile_db import ProfileDB
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig
from planner.search.planning import evaluate_config


def cpu4() -> Cluster:
    """4 gloo processes on 2 cores, per-process figures as detect() writes them."""
    return Cluster.from_dict({
        "name": "local-cpu:4", "nodes": 1, "devices_per_node": 4, "backend": "gloo",
        "device": {"name": "cpu-test", "memory_gib": 4.0, "mem_bw_gbs": 5.0, "peak_tflops": {"fp32": 0.05}},
        "intra": {"bandwidth_gbs": 1.0, "latency_us": 130.0}, "inter": {"bandwidth_gbs": 1.0, "latency_us": 130.0},
        "detected": True, "cores_per_node": 2, "thread_speedup": 1.8, "thread_sync_us": 0.0})


def profile(el_s: float) -> ProfileDB:
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=4)
    db.runtime = {"dtensor_vocab_el_s": el_s}
    return db


def test_whole_table_elements_of_the_vocab_parallel_embedding_under_tp_only() -> None:
    g = load_graph("gpt-tiny")
    emb = next(l for l in g.layers if any(o.kind == "embedding" and o.tp_style == "vocab" for o in l.ops))
    block = next(l for l in g.layers if l.attention is not None)
    table = sum(o.params for o in emb.ops if o.tp_style == "vocab")
    assert table > 0
    for tp in (2, 4):  # the whole table on every rank, whatever tp cuts it into
        assert vocab_table_elements(emb, ParallelConfig(tp=tp, sp=True)) == table
    assert vocab_table_elements(emb, ParallelConfig(dp=2)) == 0
    assert vocab_table_elements(block, ParallelConfig(tp=2, sp=True)) == 0
    assert cpu_runtime.vocab_grad_s(emb, load_preset("dgx-h100", 1), ParallelConfig(tp=2)) == 0.0
    assert cpu_runtime.vocab_grad_s(emb, cpu4(), ParallelConfig(tp=2)) == pytest.approx(
        table * cpu_runtime.CPU_DTENSOR_VOCAB_EL_S)


def test_tp_plan_costs_more_by_the_priced_amount_and_dp_plan_is_unchanged() -> None:
    g, c = load_graph("gpt-tiny"), cpu4()
    emb = next(l for l in g.layers if any(o.kind == "embedding" and o.tp_style == "vocab" for o in l.ops))
    table = sum(o.params for o in emb.ops if o.tp_style == "vocab")
    el_s = 1e-7
    for s, priced in (("dp=2,tp=2,sp=on,mbs=1,dtype=fp32", True), ("tp=4,sp=on,mbs=2,dtype=fp32", True),
                      ("dp=4,zero=zero1,mbs=1,dtype=fp32", False)):
        cfg = ParallelConfig.parse(s)
        without, _ = evaluate_config(g, c, cfg, 8, profile=profile(0.0))
        with_, _ = evaluate_config(g, c, cfg, 8, profile=profile(el_s))
        micro = 8 // (cfg.dp * cfg.mbs)  # micro-batches per step, each pays the whole table once
        want = micro * table * el_s if priced else 0.0
        assert with_.breakdown["compute"] - without.breakdown["compute"] == pytest.approx(want, rel=1e-6, abs=1e-12)
        assert with_.step_s - without.step_s == pytest.approx(want, rel=1e-3, abs=1e-12)
