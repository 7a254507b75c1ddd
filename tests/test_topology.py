"""Clusters with structure (cost_models/topology.py): groups of nodes, their devices, the links
between them; every bad file gives one line naming the problem and the fix."""
from __future__ import annotations

import copy

import pytest

from cost_models.cluster import Cluster, ClusterError, parse_cluster

BASE = {
    "name": "two", "nodes": 3, "devices_per_node": 4, "backend": "nccl",
    "device": {"name": "H100", "memory_gib": 80, "mem_bw_gbs": 3350, "peak_tflops": {"bf16": 989}},
    "intra": {"bandwidth_gbs": 450, "latency_us": 3}, "inter": {"bandwidth_gbs": 50, "latency_us": 10},
    "groups": [{"name": "east", "nodes": 2},
               {"name": "west", "nodes": 1,
                "device": {"name": "A100", "memory_gib": 80, "mem_bw_gbs": 2039, "peak_tflops": {"bf16": 312}}}],
    "links": [{"from": "east", "to": "west", "bandwidth_gbs": 12.5, "latency_us": 10000}],
}


def _with(**change) -> dict:
    d = copy.deepcopy(BASE)
    d.update(change)
    return d


def _error(d: dict) -> str:
    with pytest.raises(ClusterError) as e:
        Cluster.from_dict(d, source="c.toml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("c.toml: ")
    return msg


def test_groups_ranks_and_devices():
    c = Cluster.from_dict(BASE)
    assert c.world == 12 and c.n_groups == 2 and c.mixed
    assert [c.group_of_rank(r) for r in (0, 7, 8, 11)] == [0, 0, 1, 1]
    assert c.group_device(0).name == "H100" and c.group_device(1).name == "A100"
    east_west, west_east = c.topology.link(0, 1), c.topology.link(1, 0)
    assert east_west.bandwidth_bps == 12.5e9 and west_east.latency_s == pytest.approx(0.01)


def test_asymmetric_link_kept_per_direction():
    links = BASE["links"] + [{"from": "west", "to": "east", "bandwidth_gbs": 5.0, "latency_us": 12000}]
    c = Cluster.from_dict(_with(links=links))
    assert c.topology.link(0, 1).bandwidth_gbs == 12.5 and c.topology.link(1, 0).bandwidth_gbs == 5.0
    assert Cluster.from_dict(c.to_dict()).topology.link(1, 0).latency_us == 12000
    assert c.fingerprint() != Cluster.from_dict(BASE).fingerprint()


def test_ungrouped_files_unchanged():
    c = parse_cluster("dgx-h100:2")
    assert c.topology is None and c.n_groups == 1 and not c.mixed
    assert "groups" not in c.to_dict() and "links" not in c.to_dict()
    assert c.fingerprint() == "92ac4d54105ec7b2"  # as before groups existed (main at a6d26d1)


def test_two_region_preset():
    c = parse_cluster("two-region-h100")
    assert (c.world, c.n_groups, c.group_of_rank(63), c.group_of_rank(64)) == (128, 2, 0, 1)
    link = c.topology.link(0, 1)
    assert link.bandwidth_gbs * 8 == 100 and 2 * link.latency_us == 20000  # 100 Gb/s, 20 ms RTT
    small = parse_cluster("two-region-h100:2")
    assert small.world == 32 and [g.nodes for g in small.topology.groups] == [2, 2]


@pytest.mark.parametrize("change, words", [
    ({"links": [dict(BASE["links"][0], to="north")]}, "unknown group 'north'"),
    ({"links": []}, "missing link between groups 'east' and 'west'"),
    ({"links": [dict(BASE["links"][0], bandwidth_gbs=-1)]}, "links[0].bandwidth_gbs must be > 0"),
    ({"links": [dict(BASE["links"][0], latency_us=-5)]}, "links[0].latency_us must be >= 0"),
    ({"links": [dict(BASE["links"][0], to="east")]}, "to itself"),
    ({"links": BASE["links"] * 2}, "declared twice"),
    ({"groups": [BASE["groups"][0], dict(BASE["groups"][0], nodes=1)]}, "group 'east' is declared twice"),
    ({"nodes": 4}, "the groups hold 3 nodes but nodes = 4"),
    ({"groups": []}, "groups must be a non-empty array"),
    ({"groups": [dict(BASE["groups"][0], rack=1), BASE["groups"][1]]}, "unknown key groups[0].rack"),
    ({"groups": [BASE["groups"][0], dict(BASE["groups"][1], device={"name": "x"})]},
     "missing key groups[1].device.memory_gib"),
])
def test_structure_errors_one_line(change, words):
    assert words in _error(_with(**change))


def test_links_without_groups():
    d = _with()
    del d["groups"]
    assert "no [[groups]] are declared" in _error(d)
