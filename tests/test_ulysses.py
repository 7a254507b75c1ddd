"""Ulysses and the 2-D hybrid context parallelism, priced and planned: the all-to-all and ring
bytes of one attention layer against hand counts, the groups each crosses, the feasibility rule
(heads per tp rank split by the Ulysses degree), and the search choosing the method by the
heads and the links, with the report saying why. The runtime's parity is in
tests/test_runtime_parity.py."""
from __future__ import annotations

import pytest

from cost_models import comm as comm_mod
from cost_models.cluster import load_preset
from cost_models.context_parallel import cp_comm, cp_meshes, ring_step_bytes, ulysses_bytes
from planner.graph import AttentionDims
from planner.plan import ModelFacts, ParallelConfig, PlanError, config_problems

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
    assert config_problems(ParallelConfig(cp=8, ulysses=8), f) == []
    assert config_problems(ParallelConfig(cp=8, ulysses=4, tp=2, sp=True), f) == []
    bad = config_problems(ParallelConfig(cp=8, ulysses=8, tp=2, sp=True), f)
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
