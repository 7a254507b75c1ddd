"""Ulysses and the 2-D hybrid context parallelism, priced and planned: the all-to-all and ring
bytes of one attention layer against hand counts, the groups each crosses, the feasibility rule
(heads per tp rank split by the Ulysses degree), and the search choosing the method by the
heads and the links, with the report saying why. The runtime's parity is in
tests/test_runtime_parity.py."""
from __future__ import annotations

import functools

import pytest

from cost_models import comm as comm_mod
from cost_models.cluster import load_preset
from cost_models.context_parallel import cp_comm, cp_meshes, ring_step_bytes, ulysses_bytes
from planner.graph import AttentionDims
from planner.plan import ModelFacts, ParallelConfig, PlanError
from model_cases import fitting_problems
from planner.report.data import build_report, mesh_groups, summary_rows

MHA = AttentionDims(heads=32, kv_heads=32, head_dim=128, seq_len=32768, kv_len=32768, causal=True)


def test_config_names_the_method_and_round_trips():
    cfg = ParallelConfig.parse("dp=2,cp=8,ulysses=4,tp=2,sp=on")
    assert cfg.cp_method == "hybrid" and "ulysses4" in cfg.label()
    assert ParallelConfig.parse(cfg.to_str()) == cfg
    assert ParallelConfig(cp=4, ulysses=4).cp_method == "ulysses" and ParallelConfig(cp=4).cp_method == "ring"
    assert "ulysses" not in ParallelConfig(cp=4).to_str()  # ring plans keep their old strings
    with pytest.raises(PlanError, match="must divide cp=4"):
        ParallelConfig(cp=4, ulysses=3).validate()


def test_feasibility_splits_each_tp_ranks_heads():
    f = ModelFacts(heads=(32,), kv_heads=(8,), hidden=4096, units=8, seq_len=8192)
    assert fitting_problems(ParallelConfig(cp=8, ulysses=8), f) == []
    assert fitting_problems(ParallelConfig(cp=8, ulysses=4, tp=2, sp=True), f) == []
    bad = fitting_problems(ParallelConfig(cp=8, ulysses=8, tp=2, sp=True), f)
    assert any("ulysses=8 x tp=2 does not divide the 8" in p for p in bad), bad


def test_alltoall_and_ring_bytes_match_hand_counts():
    cfg = ParallelConfig(cp=8, ulysses=4, tp=2, sp=True, mbs=1, dtype="bf16")
    # four all-to-alls of S/cp tokens: q and out with 32/2 heads, k and v with 32/2 kv heads
    assert ulysses_bytes(MHA, cfg) == 32768 / 8 * 128 * 2 * (2 * 16 + 2 * 16)
    # a ring step: K and V of S/cp tokens of the tp rank's kv heads (S/r tokens of 1/u of them)
    assert ring_step_bytes(MHA, cfg) == 2 * 32768 / 8 * 32 * 128 * 2 / 2
    ring, uly = cp_meshes(cfg)
    assert ring == comm_mod.Mesh(pp=1, dp=1, cp=2, tp=8) and uly == comm_mod.Mesh(pp=1, dp=2, cp=4, tp=2)


def test_pure_ulysses_has_no_ring_and_ring_no_alltoall():
    cl = load_preset("dgx-h100")
    uly = cp_comm(MHA, ParallelConfig(cp=8, ulysses=8, dtype="bf16"), cl, core_s=1.0)
    assert uly.exposed == uly.alltoall > 0  # nothing hides the all-to-alls
    ring = cp_comm(MHA, ParallelConfig(cp=8, dtype="bf16"), cl, core_s=1.0)
    assert ring.alltoall == 0 and ring.exposed == 0  # a second of attention hides every ring step
    bare = cp_comm(MHA, ParallelConfig(cp=8, dtype="bf16"), cl, core_s=0.0)
    e = comm_mod.collective_time("send_recv", ring_step_bytes(MHA, ParallelConfig(cp=8, dtype="bf16")), cl,
                                 cp_meshes(ParallelConfig(cp=8))[0], "cp")
    assert bare.exposed == pytest.approx(7 * e.seconds + 2 * 7 * e.seconds)  # forward, backward (K, V and grads)


@functools.cache
def _graph(kv_heads: int, seq: int):
    """A 4-block Llama-shaped model (32 heads, ``kv_heads`` kv heads) at ``seq`` tokens."""
    from planner.frontend.load import graph_of_config
    from planner.zoo import ModelConfig

    return graph_of_config(ModelConfig(name="long-ctx", arch="llama", layers=4, hidden=4096, ffn_hidden=11008,
                                       heads=32, kv_heads=kv_heads, vocab=32000, seq_len=seq, max_seq_len=seq))


def _cluster(intra_gbs: float):
    """One DGX H100 whose NVLink is set to ``intra_gbs``."""
    import dataclasses

    from cost_models.cluster import load_preset
    cl = load_preset("dgx-h100")
    cl.intra = dataclasses.replace(cl.intra, bandwidth_gbs=intra_gbs)
    return cl


def _search(kv_heads: int, intra_gbs: float, seq: int):
    """The search for :func:`_graph` on :func:`_cluster`, context parallel pinned to 8, and its plan."""
    from planner.search.pins import Pins
    from planner.search.planning import build_plan
    from planner.search.space import search

    g, cl = _graph(kv_heads, seq), _cluster(intra_gbs)
    r = search(g, cl, 8, pins=Pins.parse("cp=8"))
    plan = build_plan(g, cl, r.best, spec="long-ctx", cluster_spec="dgx-h100", alternatives=r.alternatives,
                      rejected=r.rejected, counts=r.rejected_counts)
    return r, plan


def _why_not_ulysses(plan) -> dict:
    from planner.report.data import why_not_degrees
    return {w["degree"]: w for w in why_not_degrees(plan) if w["degree"].startswith("ulysses=")}


def test_many_heads_and_fast_links_pick_ulysses_and_the_report_says_why_not_the_ring():
    """32 kv heads on NVLink at 32k tokens: the all-to-alls cost less than the ring's seven steps
    of smaller, less efficient attention blocks and their merges."""
    r, plan = _search(32, 450.0, 32768)
    best = r.best.config
    assert best.ulysses > 1
    ring = _why_not_ulysses(plan)["ulysses=1"]
    assert any(f"slower layers than ulysses={best.ulysses}" in reason for reason in ring["reasons"]), ring
    # and by how much: the same layout with the ring, priced
    from planner.search.planning import evaluate_config
    e, problems = evaluate_config(_graph(32, 32768), _cluster(450.0), best.replace(ulysses=1), 8)
    assert not problems and e.step_s > r.best.step_s and e.breakdown["compute"] > r.best.breakdown["compute"]
    rows = {key: text for key, _, text, _ in summary_rows(build_report(plan, layers=False))}
    assert "context parallel by Ulysses" in rows["degrees"] and "Ulysses" in " ".join(mesh_groups(plan))
    # the mesh lines say what the all-to-alls move per attention layer and micro-batch
    traffic = next(line for line in mesh_groups(plan) if line.startswith("cp traffic"))
    assert f"all-to-alls {ulysses_bytes(MHA, best) / 2**20:.1f} MiB" in traffic


def test_few_kv_heads_and_slow_links_keep_the_ring():
    """8 kv heads on 25 GB/s links at 128k tokens: the ring's K/V steps (8 kv heads) hide behind
    the block attention, Ulysses' all-to-alls of q and the output (32 heads) cannot."""
    r, plan = _search(8, 25.0, 131072)
    assert r.best.config.cp_method == "ring"
    rows = _why_not_ulysses(plan)
    for u in (2, 4, 8):
        assert any("slower layers than ulysses=1" in reason for reason in rows[f"ulysses={u}"]["reasons"])
    from planner.search.planning import evaluate_config
    e, _ = evaluate_config(_graph(8, 131072), _cluster(25.0), r.best.config.replace(ulysses=8), 8)
    assert e.breakdown["cp_comm"] > r.best.breakdown["cp_comm"]  # the all-to-alls, unhidden


def test_kv_heads_bound_the_ulysses_degree_and_the_rejection_says_so():
    r, plan = _search(2, 450.0, 32768)
    assert r.best.config.ulysses <= 2
    rows = _why_not_ulysses(plan)
    assert any("does not divide the 2" in reason for reason in rows["ulysses=4"]["reasons"])
