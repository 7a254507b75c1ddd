"""The vocabulary-parallel embedding's backward works on the rank's own rows
(codegen/runtime/tensor_parallel.py ``VocabParallelEmbedding``), so the cost model charges no
whole-table gradient for it: a profile written before (its ``runtime`` holding the retired
``dtensor_vocab_el_s``) prices a TP plan as one without the key."""
from __future__ import annotations

from cost_models.cluster import Cluster
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


def profile(runtime: dict[str, float]) -> ProfileDB:
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=4)
    db.runtime = dict(runtime)
    return db


def test_tp_plan_is_not_charged_the_whole_table() -> None:
    g, c = load_graph("gpt-tiny"), cpu4()
    for s in ("dp=2,tp=2,sp=on,mbs=1,dtype=fp32", "tp=4,sp=on,mbs=2,dtype=fp32"):
        cfg = ParallelConfig.parse(s)
        without, _ = evaluate_config(g, c, cfg, 8, profile=profile({"ep_dispatch_s": 3e-3}))
        stale, _ = evaluate_config(g, c, cfg, 8, profile=profile({"ep_dispatch_s": 3e-3, "dtensor_vocab_el_s": 1e-7}))
        assert stale.step_s == without.step_s and stale.breakdown == without.breakdown, s
