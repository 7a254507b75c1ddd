"""Cluster contract: presets, TOML parsing and validation, specs, local detection."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cost_models.cluster import Cluster, ClusterError, Device, Link, parse_cluster, preset_names

GOOD = """\
name = "my-cluster"
nodes = 2
devices_per_node = 8
backend = "nccl"
profile = "profile.json"
[device]
name = "H100-SXM"
memory_gib = 80
mem_bw_gbs = 3350
[device.peak_tflops]
bf16 = 989
fp32 = 67
[intra]
bandwidth_gbs = 450
latency_us = 3
[inter]
bandwidth_gbs = 50
latency_us = 10
"""


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_presets_have_documented_figures() -> None:
    assert {"dgx-a100-80g", "dgx-h100", "h200-8x"} <= set(preset_names())
    a100, h100, h200 = parse_cluster("dgx-a100-80g"), parse_cluster("dgx-h100"), parse_cluster("h200-8x")
    assert a100.peak_flops("bf16") == 312e12 and a100.device.mem_bw_gbs == 2039
    assert a100.intra.bandwidth_gbs == 300 and a100.inter.bandwidth_gbs == 25
    assert h100.peak_flops("bf16") == 989e12 and h100.device.mem_bw_gbs == 3350
    assert h100.intra.bandwidth_gbs == 450 and h100.inter.bandwidth_gbs == 50
    assert h200.device.mem_bw_gbs == 4800 and h200.device.memory_gib > 130
    for c in (a100, h100, h200):
        assert c.world == 8 and c.nodes == 1 and c.backend == "nccl"
        assert c.intra.latency_us < c.inter.latency_us


def test_preset_with_node_count() -> None:
    c = parse_cluster("dgx-h100:128")
    assert c.nodes == 128 and c.world == 1024
    assert c.fingerprint() != parse_cluster("dgx-h100").fingerprint()
    assert c.memory_bytes == int(c.device.memory_gib * 2**30)


def test_peak_flops_fallbacks() -> None:
    c = parse_cluster("dgx-h100")
    assert c.peak_flops("bfloat16") == c.peak_flops("bf16")
    dev = Device("x", 10, {"fp32": 2.0}, 100)
    cpu = Cluster("x", 1, 2, dev, Link(1, 1), Link(1, 1), backend="gloo")
    assert cpu.peak_flops("bf16") == 2e12  # low precision falls back to fp32
    gpu_bf16_only = Cluster("y", 1, 2, Device("y", 10, {"bf16": 100.0}, 100), Link(1, 1), Link(1, 1))
    with pytest.raises(ClusterError, match="no peak for fp32"):
        gpu_bf16_only.peak_flops("fp32")
    with pytest.raises(ClusterError, match="unknown dtype"):
        c.peak_flops("int3")


def test_toml_round_trip_and_relative_profile(tmp_path: Path) -> None:
    c = parse_cluster(str(_write(tmp_path, GOOD)))
    assert (c.name, c.nodes, c.devices_per_node, c.world) == ("my-cluster", 2, 8, 16)
    assert c.device.peak_tflops == {"bf16": 989.0, "fp32": 67.0}
    assert c.profile == str(tmp_path / "profile.json")
    again = Cluster.from_dict(c.to_dict())
    assert again == c and again.fingerprint() == c.fingerprint()
    # the profile path is not part of the fingerprint; the hardware is
    again.profile = None
    assert again.fingerprint() == c.fingerprint()
    again.inter = Link(100, 10)
    assert again.fingerprint() != c.fingerprint()
    assert len(c.fingerprint()) == 16


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace("nodes = 2\n", ""), r"missing key nodes"),
    (lambda t: t.replace("latency_us = 10\n", ""), r"missing key inter\.latency_us"),
    (lambda t: t + "color = 3\n", r"unknown key inter\.color"),
    (lambda t: t.replace('backend = "nccl"', 'backend = "nccl"\ncolour = 1'), r"unknown key colour"),
    (lambda t: t.replace("bf16 = 989", "bf17 = 989"), r"unknown key device\.peak_tflops\.bf17"),
    (lambda t: t.replace("nodes = 2", 'nodes = "two"'), r"nodes must be an integer"),
    (lambda t: t.replace("memory_gib = 80", 'memory_gib = "80"'), r"device\.memory_gib must be a number"),
    (lambda t: t.replace("mem_bw_gbs = 3350", "mem_bw_gbs = 0"), r"device\.mem_bw_gbs must be > 0"),
    (lambda t: t.replace("bandwidth_gbs = 450", "bandwidth_gbs = -1"), r"intra\.bandwidth_gbs must be > 0"),
    (lambda t: t.replace("devices_per_node = 8", "devices_per_node = 0"), r"devices_per_node must be >= 1"),
    (lambda t: t.replace('backend = "nccl"', 'backend = "mpi"'), r"backend 'mpi'"),
    (lambda t: t.replace("[intra]", "[intra"), r"TOML syntax error"),
])
def test_bad_toml_names_file_and_key(tmp_path: Path, edit, match: str) -> None:
    path = _write(tmp_path, edit(GOOD))
    with pytest.raises(ClusterError, match=match) as info:
        Cluster.from_toml(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg


def test_parse_cluster_errors() -> None:
    with pytest.raises(ClusterError, match=r"did you mean 'dgx-h100'.*dgx-a100-80g") as info:
        parse_cluster("dgx-h10")
    assert "\n" not in str(info.value)
    with pytest.raises(ClusterError, match="unknown cluster preset"):
        parse_cluster("tpu-v5")
    for bad in ("dgx-h100:0", "dgx-h100:x", "dgx-h100:-2", "dgx-h100:1.5", "local-cpu:0", "local-cpu:two"):
        with pytest.raises(ClusterError, match="positive integer"):
            parse_cluster(bad)
    assert parse_cluster("local-cpu").world == (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                else os.cpu_count())  # one process per core
    with pytest.raises(ClusterError, match="not found"):
        parse_cluster("missing/cluster.toml")
    with pytest.raises(ClusterError, match="empty"):
        parse_cluster("  ")


def test_local_cpu_detect() -> None:
    c = parse_cluster("local-cpu:2")
    assert c.backend == "gloo" and c.nodes == 1 and c.devices_per_node == 2 and c.world == 2
    assert c.peak_flops("fp32") > 1e8 and c.device.mem_bw_gbs > 0.1
    assert 0 < c.memory_bytes
    assert c.intra.latency_us > 50 and c.intra.bandwidth_gbs < 10  # gloo, not NVLink
    four = parse_cluster("local-cpu:4")  # cached measurements, shared cores
    assert four.world == 4
    assert four.memory_bytes < c.memory_bytes
    # measurements jitter; the fingerprint of a detected cluster must not
    jittered = parse_cluster("local-cpu:2")
    jittered.device.peak_tflops["fp32"] *= 1.1
    jittered.device.mem_bw_gbs *= 0.9
    assert jittered.fingerprint() == c.fingerprint()
    assert four.fingerprint() != c.fingerprint()
    assert Cluster.from_dict(c.to_dict()) == c
