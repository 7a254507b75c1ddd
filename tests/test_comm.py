"""Collective cost model on the mesh, and the measured-profile contract it reads."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cost_models.cluster import Cluster, ClusterError, Device, Link, parse_cluster
from cost_models.comm import NCCL_BUS_EFF, Mesh, collective_time, group_layout, p2p_links, p2p_time
from cost_models.profile_db import ProfileDB


def _toy(nodes: int = 4, dpn: int = 8) -> Cluster:
    """Round figures: intra 100 GB/s + 2 us, inter 10 GB/s + 20 us."""
    return Cluster("toy", nodes, dpn, Device("gpu", 80, {"bf16": 100.0}, 1000),
                   intra=Link(100, 2), inter=Link(10, 20))


B = 64 * 2**20
# the toy is an NCCL cluster: links run at NCCL's bus efficiency, an all-reduce takes the
# smaller of the ring's and the tree's latency
BW_I, A_I, BW_E, A_E = 100e9 * NCCL_BUS_EFF["intra"], 2e-6, 10e9 * NCCL_BUS_EFF["inter"], 20e-6


def ar_steps(n: int) -> int:
    return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))


# ---- layout -----------------------------------------------------------------------------
def test_tp_inside_a_node_is_intra_dp_across_nodes_is_inter() -> None:
    c = _toy()
    mesh = Mesh(pp=2, dp=2, cp=1, tp=8)
    assert group_layout(c, mesh, "tp") == group_layout(c, mesh, "tp").__class__(8, "intra", 8, 1)
    dp = group_layout(c, mesh, "dp")
    assert (dp.size, dp.link, dp.per_node, dp.nodes) == (2, "inter", 1, 2)
    pp = group_layout(c, mesh, "pp")
    assert (pp.link, pp.per_node, pp.nodes) == ("inter", 1, 2)
    assert group_layout(c, mesh, "cp").size == 1


def test_mixed_group_layout() -> None:
    c = _toy(nodes=2)
    lay = group_layout(c, {"dp": 4, "tp": 4}, "dp")  # members 0, 4, 8, 12 -> nodes 0, 0, 1, 1
    assert (lay.size, lay.link, lay.per_node, lay.nodes) == (4, "mixed", 2, 2)
    lay = group_layout(c, {"dp": 16}, "dp")
    assert (lay.link, lay.per_node, lay.nodes) == ("mixed", 8, 2)
    assert group_layout(c, {"cp": 2, "tp": 4}, "cp").link == "intra"


def test_mesh_larger_than_cluster_is_refused() -> None:
    with pytest.raises(ClusterError, match="needs 64 devices"):
        group_layout(_toy(nodes=2), Mesh(dp=8, tp=8), "dp")
    with pytest.raises(ClusterError, match="unknown mesh dimension"):
        group_layout(_toy(), {"ep": 2}, "dp")


# ---- alpha-beta factors -------------------------------------------------------------------
def test_ring_algorithm_factors_intra() -> None:
    c, mesh, n = _toy(), Mesh(tp=8), 8
    t = lambda kind: collective_time(kind, B, c, mesh, "tp").seconds
    assert t("all_reduce") == pytest.approx(2 * (n - 1) / n * B / BW_I + ar_steps(n) * A_I, rel=1e-12)
    assert t("all_gather") == pytest.approx((n - 1) / n * B / BW_I + (n - 1) * A_I, rel=1e-12)
    assert t("reduce_scatter") == pytest.approx((n - 1) / n * B / BW_I + (n - 1) * A_I, rel=1e-12)
    assert t("all_to_all") == pytest.approx((n - 1) / n * B / BW_I + (n - 1) * A_I, rel=1e-12)
    assert t("send_recv") == pytest.approx(B / BW_I + A_I, rel=1e-12)
    assert collective_time("all_reduce", B, c, mesh, "tp").source == "model"


def test_inter_group_uses_the_network_per_device() -> None:
    c, mesh = _toy(), Mesh(dp=4, tp=8)  # dp members one per node
    got = collective_time("all_reduce", B, c, mesh, "dp").seconds
    assert got == pytest.approx(2 * 3 / 4 * B / BW_E + ar_steps(4) * A_E, rel=1e-12)


def test_trivial_groups_cost_nothing() -> None:
    c = _toy()
    assert collective_time("all_reduce", B, c, Mesh(tp=8), "dp").seconds == 0.0
    assert collective_time("all_gather", 0, c, Mesh(tp=8), "tp").seconds == 0.0


def test_hierarchical_mixed_all_reduce() -> None:
    c = _toy(nodes=2)
    mesh = Mesh(dp=4, tp=4)  # dp: g = 2 per node, k = 2 nodes
    g, k = 2, 2
    rs_intra = (g - 1) / g * B / BW_I + (g - 1) * A_I
    ar_inter = 2 * (k - 1) / k * (B / g) / BW_E + 2 * (k - 1) * A_E
    ag_intra = rs_intra
    got = collective_time("all_reduce", B, c, mesh, "dp").seconds
    assert got == pytest.approx(rs_intra + ar_inter + ag_intra, rel=1e-12)
    # cheaper than a flat ring over the network, dearer than one inside a node
    flat_inter = 2 * 3 / 4 * B / BW_E + 6 * A_E
    assert got < flat_inter
    ag = collective_time("all_gather", B, c, mesh, "dp").seconds
    assert ag == pytest.approx(((k - 1) / k * (B / g) / BW_E + (k - 1) * A_E) + rs_intra, rel=1e-12)
    rs = collective_time("reduce_scatter", B, c, mesh, "dp").seconds
    assert rs == pytest.approx(ag, rel=1e-12)


def test_p2p_link_follows_pp_stride() -> None:
    c = _toy(nodes=2)
    assert p2p_links(c, Mesh(pp=2, tp=8)) == ["inter"]
    assert p2p_links(c, Mesh(pp=4, tp=2)) == ["intra", "intra", "intra"]
    assert p2p_links(c, Mesh(pp=4, tp=4)) == ["intra", "inter", "intra"]
    assert p2p_time(B, c, Mesh(pp=4, tp=2)).seconds == pytest.approx(B / BW_I + A_I)
    assert p2p_time(B, c, Mesh(pp=4, tp=4)).seconds == pytest.approx(B / BW_E + A_E)  # slowest hop
    assert p2p_time(B, c, Mesh(pp=4, tp=4), boundary=0).seconds == pytest.approx(B / BW_I + A_I)
    assert p2p_time(B, c, Mesh(tp=8)).seconds == 0.0


def test_local_cpu_uses_gloo_defaults() -> None:
    c = parse_cluster("local-cpu:2")
    t = collective_time("all_reduce", 64 * 2**20, c, Mesh(dp=2), "dp")
    # measured 54 ms for 64 MB at 2 gloo ranks; the default must be in that decade
    assert 0.01 < t.seconds < 0.5 and t.source == "model"


# ---- profile ---------------------------------------------------------------------------------
def _profile() -> ProfileDB:
    db = ProfileDB(cluster_fingerprint="abc", backend="gloo", world=4)
    for nbytes, sec in [(1024, 260e-6), (256 * 1024, 422e-6), (4 * 2**20, 4.5e-3), (64 * 2**20, 54e-3)]:
        db.add_collective("all_reduce", 2, "intra", nbytes, sec)
    return db


def test_profile_interpolation_hits_measured_points() -> None:
    db = _profile()
    for s in db.collectives["all_reduce/2/intra"]:
        assert db.collective_time("all_reduce", 2, "intra", s.nbytes) == pytest.approx(s.seconds, rel=1e-12)
    # log-log midpoint of two samples is their geometric mean
    mid = math.sqrt(1024 * 256 * 1024)
    assert db.collective_time("all_reduce", 2, "intra", mid) == pytest.approx(math.sqrt(260e-6 * 422e-6), rel=1e-9)
    assert db.collective_time("all_reduce", 2, "intra", 10) == pytest.approx(260e-6)  # latency floor
    big = 128 * 2**20
    slope = (54e-3 - 4.5e-3) / (60 * 2**20)
    assert db.collective_time("all_reduce", 2, "intra", big) == pytest.approx(54e-3 + 64 * 2**20 * slope)
    assert db.collective_time("all_reduce", 4, "intra", 1024) is None


def test_profile_overrides_model_and_composes_mixed() -> None:
    c = _toy(nodes=2)
    db = ProfileDB(cluster_fingerprint=c.fingerprint(), backend="nccl", world=16)
    db.add_collective("all_reduce", 8, "intra", B, 1e-3)
    est = collective_time("all_reduce", B, c, Mesh(tp=8), "tp", profile=db)
    assert (est.seconds, est.source) == (pytest.approx(1e-3), "profile")
    # mixed group: intra RS/AG on 2 ranks and inter AR on 2 ranks all measured -> "profile"
    mesh = Mesh(dp=4, tp=4)
    assert collective_time("all_reduce", B, c, mesh, "dp", profile=db).source == "model"
    db.add_collective("reduce_scatter", 2, "intra", B, 1e-4)
    db.add_collective("all_gather", 2, "intra", B, 2e-4)
    db.add_collective("all_reduce", 2, "inter", B // 2, 3e-3)
    est = collective_time("all_reduce", B, c, mesh, "dp", profile=db)
    assert est.source == "profile" and est.seconds == pytest.approx(1e-4 + 3e-3 + 2e-4)
    db.add_collective("all_reduce", 4, "mixed", B, 7e-3)  # a direct measurement wins
    assert collective_time("all_reduce", B, c, mesh, "dp", profile=db).seconds == pytest.approx(7e-3)


def test_profile_json_round_trip_and_version(tmp_path: Path) -> None:
    db = _profile()
    db.add_layer("block:h=64", batch=1, seq_len=128, tp=1, cp=1, fwd_s=0.01, bwd_s=0.02)
    path = tmp_path / "sub" / "profile.json"
    db.to_json(path)
    assert not [p for p in path.parent.iterdir() if p.name != "profile.json"]  # no temp left
    again = ProfileDB.load(path)
    assert again == db
    data = json.loads(path.read_text())
    data["version"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"^profile version 7, expected 1: run `autopar profile` again$"):
        ProfileDB.load(path)
    with pytest.raises(ValueError, match="not found"):
        ProfileDB.load(tmp_path / "none.json")


def test_layer_time_interpolates_in_tokens() -> None:
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=2)
    db.add_layer("mlp", 1, 128, 1, 1, 1.0, 2.0)
    db.add_layer("mlp", 4, 128, 1, 1, 4.0, 8.0)
    db.add_layer("mlp", 2, 128, 2, 1, 0.5, 1.0)
    assert db.layer_time("mlp", 4, 128, 1, 1) == (4.0, 8.0)  # exact
    assert db.layer_time("mlp", 2, 128, 1, 1) == pytest.approx((2.0, 4.0))  # between
    assert db.layer_time("mlp", 8, 128, 1, 1) == pytest.approx((8.0, 16.0))  # scaled beyond
    assert db.layer_time("mlp", 1, 256, 2, 1) == pytest.approx((0.5, 1.0))  # same tokens, other shape
    assert db.layer_time("mlp", 1, 128, 4, 1) is None  # no exact tp
    assert db.layer_time("attn", 1, 128, 1, 1) is None
