"""Cluster, Device, Link: the hardware and topology a plan targets.

This module is a leaf contract: it imports nothing else from autopar (torch only
lazily, inside :meth:`Cluster.detect`), so a plan, a report or a cost model can read
a cluster description without the rest of the package.

Model
-----
A cluster is ``nodes`` identical machines of ``devices_per_node`` identical devices.
Global rank ``r`` lives on node ``r // devices_per_node`` (ranks fill nodes
contiguously). Two links:

- ``intra``: between devices of one node (NVLink/NVSwitch class; shared memory for
  local CPU processes);
- ``inter``: between nodes (InfiniBand/RoCE class).

A cluster may also have structure (:mod:`cost_models.topology`): optional ``[[groups]]`` of
nodes (datacenters, regions), each with its own device type, and ``[[links]]`` between
groups (aggregate bandwidth and one-way latency per ordered pair; a WAN). Without them the
cluster is one group, exactly as before (same dict, same fingerprint).

Units, everywhere:

- ``Device.memory_gib``: GiB (2**30 bytes) usable per device;
- ``Device.peak_tflops[dtype]``: dense peak, 1e12 FLOP/s (a multiply-add is 2 FLOP);
- ``Device.mem_bw_gbs``: device memory bandwidth, GB/s (1e9 bytes/s);
- ``Device.sms``: streaming multiprocessors (0 = not given; the GPU kernel model then
  skips wave quantization);
- ``Link.bandwidth_gbs``: per device, one direction, GB/s (1e9 bytes/s). For
  ``inter`` this is the NIC bandwidth one device can use (e.g. one 400 Gb/s NDR NIC
  per GPU = 50 GB/s);
- ``Link.latency_us``: one message's start-up latency (the alpha of the
  alpha-beta model), microseconds.

TOML format (every key required unless marked optional; no other keys)::

    name = "my-cluster"
    nodes = 2
    devices_per_node = 8
    backend = "nccl"            # "nccl" or "gloo"
    profile = "profile.json"    # optional: a ProfileDB measured on this cluster
    cores_per_node = 2          # optional: CPU cores a node's processes share (local CPU clusters)
    thread_speedup = 1.8        # optional: a GEMM on cores_per_node threads over one thread (measured)
    thread_sync_us = 10         # optional: what each parallel op adds on cores_per_node threads (measured)
    [device]
    name = "H100-SXM"
    memory_gib = 80
    mem_bw_gbs = 3350
    sms = 132                   # optional: streaming multiprocessors (GEMM wave quantization)
    host_gbs = 55               # optional: device <-> host memory, one direction (PCIe / C2C; activation offload)
    host_memory_gib = 240       # optional: host memory one device may pin (its share of the node's RAM)
    [device.peak_tflops]        # at least one of fp32, tf32, bf16, fp16, fp8
    bf16 = 989
    fp32 = 67
    [intra]
    bandwidth_gbs = 450
    latency_us = 3
    [inter]
    bandwidth_gbs = 50
    latency_us = 10

    # optional, see cost_models/topology.py: [[groups]] name, nodes, [groups.device];
    # [[links]] from, to, bandwidth_gbs, latency_us

A relative ``profile`` path is resolved against the TOML file's folder.

Cluster specs accepted by :func:`parse_cluster`: ``PRESET`` (one node; a grouped preset:
its own node counts), ``PRESET:N`` (N nodes; a grouped preset: N nodes in every group), ``local-cpu:N`` (N gloo processes on this machine, figures
measured by :meth:`Cluster.detect`; ``local-cpu`` alone: one process per core) or a path to a ``.toml`` file.

Every bad input raises :class:`ClusterError` with a one-line message naming the
problem and the fix.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from cost_models import machine
from cost_models.hardware import (DTYPES, ClusterError, Device, Link, check_keys, integer, number,
                                  string)
from cost_models.topology import GroupLink, Region, Topology

__all__ = ["BACKENDS", "DTYPES", "Cluster", "ClusterError", "Device", "GroupLink", "Link", "Region", "Topology",
           "load_preset", "parse_cluster", "preset_names"]

BACKENDS = ("nccl", "gloo")

# When a dtype's peak is not given, use the first of these that is. Falling back from
# a low precision to fp32 is conservative on GPUs (it under-estimates throughput) and
# right on CPUs (no fast bf16 units); fp32 never falls back to a faster mode.
_DTYPE_FALLBACK: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "tf32": ("fp32",),
    "bf16": ("fp16", "fp32"),
    "fp16": ("bf16", "fp32"),
    "fp8": ("bf16", "fp16", "fp32"),
}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}

# Defaults for local CPU processes talking over gloo, from medians measured on a
# 2-core machine with 2 ranks (AR 1 KB 260 us, AG/RS 1 KB 200-270 us; AR 64 MB 54 ms
# i.e. ~1.2 GB/s algorithm bandwidth; AG/RS 64 MB 0.4-0.5 GB/s; P2P 64 MB 2.3 GB/s).
# One (alpha, beta) cannot fit them all; these sit between the collectives' figures.
# A measured profile (``autopar profile``) replaces them in the cost model.
GLOO_LINK_GBS = 1.0
GLOO_LATENCY_US = 130.0


@dataclass
class Cluster:
    """``nodes`` x ``devices_per_node`` identical devices joined by two link classes.

    ``detected`` is True for clusters whose figures :meth:`detect` measured; their
    fingerprint then covers topology and identity only, because measurements vary
    from run to run and a profile measured on this machine must keep matching.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    inter: Link
    profile: str | None = None
    backend: str = "nccl"
    detected: bool = False
    cores_per_node: int = 0  # CPU cores a node's processes share (local-cpu); 0: each device computes alone
    thread_speedup: float = 0.0  # a GEMM on cores_per_node intra-op threads over one (local-cpu); 0: not measured
    thread_sync_us: float = 0.0  # microseconds each parallel op adds on cores_per_node threads (local-cpu)
    topology: Topology | None = None  # groups of nodes (regions) and their links; None: one group

    # ---- groups ----------------------------------------------------------------
    @property
    def n_groups(self) -> int:
        """Groups of nodes (datacenters / regions); 1 without a topology."""
        return len(self.topology.groups) if self.topology is not None else 1

    def group_of_rank(self, rank: int) -> int:
        """The group holding global rank ``rank`` (ranks fill nodes, nodes fill groups, in order)."""
        return self.topology.group_of_node(rank // self.devices_per_node) if self.topology is not None else 0

    def group_device(self, group: int) -> Device:
        """The device of group ``group`` (the cluster's own without a topology)."""
        return self.topology.device(group, self.device) if self.topology is not None else self.device

    @property
    def mixed(self) -> bool:
        """True when some rank's device is not the cluster's ``[device]`` (the reference every layer is
        priced on): groups of different device types, or groups whose one type is not ``[device]``."""
        return len({self.device.name} | {self.group_device(g).name for g in range(self.n_groups)}) > 1

    # ---- derived figures -------------------------------------------------------
    @property
    def world(self) -> int:
        """Number of devices (ranks)."""
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> int:
        """Usable memory per device, bytes."""
        return int(self.device.memory_gib * 2**30)

    def compute_dtype(self, dtype: str) -> str:
        """The dtype whose peak a plan in ``dtype`` computes at here: fp32 on a CPU (gloo) cluster,
        whatever the plan's dtype (CPU GEMMs run fp32), else the plan's."""
        return "fp32" if self.backend == "gloo" else dtype

    @property
    def core_share(self) -> float:
        """Share of a core each of a node's processes runs on: ``min(1, cores_per_node /
        devices_per_node)`` where the cores are known (a detected local CPU cluster, whose
        per-process figures ``detect`` scales by it), else 1.0."""
        if not self.cores_per_node:
            return 1.0
        return min(1.0, self.cores_per_node / self.devices_per_node)

    def peak_flops(self, dtype: str = "bf16", device: Device | None = None) -> float:
        """Dense peak of one device (``device``: one of the groups'; default the cluster's) for ``dtype``,
        FLOP/s (see ``_DTYPE_FALLBACK``)."""
        key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
        if key not in _DTYPE_FALLBACK:
            raise ClusterError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        table = (device or self.device).peak_tflops
        for candidate in (key, *_DTYPE_FALLBACK[key]):
            if candidate in table:
                return float(table[candidate]) * 1e12
        raise ClusterError(
            f"cluster {self.name!r} gives no peak for {key}: add [device.peak_tflops] {key} = ..."
        )

    # ---- serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON/TOML-ready dict (the TOML layout; ``detected`` only when True)."""
        d: dict[str, Any] = {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "backend": self.backend,
            "device": self.device.to_dict(),
            "intra": self.intra.to_dict(),
            "inter": self.inter.to_dict(),
        }
        if self.profile is not None:
            d["profile"] = self.profile
        if self.detected:
            d["detected"] = True
        if self.cores_per_node:
            d["cores_per_node"] = self.cores_per_node
        if self.thread_speedup:
            d["thread_speedup"] = float(self.thread_speedup)
        if self.thread_sync_us:
            d["thread_sync_us"] = float(self.thread_sync_us)
        if self.topology is not None:
            d.update(self.topology.to_dict())
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "cluster") -> "Cluster":
        """Build and validate a Cluster from the TOML layout; ``source`` names it in errors."""
        check_keys(data, source, "", required=_TOP_REQUIRED, optional=_TOP_OPTIONAL)
        profile = data.get("profile")
        if profile is not None and not isinstance(profile, str):
            raise ClusterError(f"{source}: profile must be a path string, got {type(profile).__name__}")
        detected = data.get("detected", False)
        if not isinstance(detected, bool):
            raise ClusterError(f"{source}: detected must be true or false")
        cluster = cls(
            name=string(data["name"], source, "name"),
            nodes=integer(data["nodes"], source, "nodes"),
            devices_per_node=integer(data["devices_per_node"], source, "devices_per_node"),
            device=Device.from_dict(data["device"], source),
            intra=Link.from_dict(data["intra"], source, "intra"),
            inter=Link.from_dict(data["inter"], source, "inter"),
            profile=profile,
            backend=string(data["backend"], source, "backend"),
            detected=detected,
            cores_per_node=integer(data["cores_per_node"], source, "cores_per_node") if "cores_per_node" in data else 0,
            thread_speedup=(number(data["thread_speedup"], source, "thread_speedup") if "thread_speedup" in data
                            else 0.0),
            thread_sync_us=(number(data["thread_sync_us"], source, "thread_sync_us", allow_zero=True)
                            if "thread_sync_us" in data else 0.0),
        )
        if "groups" in data:
            cluster.topology = Topology.from_dict(data["groups"], data.get("links"), cluster.nodes, source)
        elif "links" in data:
            raise ClusterError(f"{source}: links join groups, and no [[groups]] are declared: add [[groups]] or "
                               f"remove [[links]]")
        cluster.validate(source=source)
        return cluster

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> "Cluster":
        """Read a cluster TOML file (format in the module docstring)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ClusterError(f"cluster file {p} not found: check the path or use a preset ({', '.join(preset_names())})") from None
        except OSError as e:
            raise ClusterError(f"cannot read cluster file {p}: {e.strerror}") from None
        except (ValueError, UnicodeDecodeError) as e:  # a NUL in the path, a binary file
            raise ClusterError(f"cannot read cluster file {str(p)!r}: {e}: give a UTF-8 .toml file") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ClusterError(f"{p}: TOML syntax error: {e}: fix the file") from None
        cluster = cls.from_dict(data, source=str(p))
        if cluster.profile is not None and not os.path.isabs(cluster.profile):
            cluster.profile = str((p.parent / cluster.profile))
        return cluster

    def validate(self, *, source: str | None = None) -> None:
        """Raise ClusterError if any figure is missing, of the wrong type or non-positive."""
        src = source or f"cluster {self.name!r}"
        string(self.name, src, "name")
        integer(self.nodes, src, "nodes")
        integer(self.devices_per_node, src, "devices_per_node")
        if self.backend not in BACKENDS:
            raise ClusterError(f"{src}: backend {self.backend!r} is not supported: use one of {', '.join(BACKENDS)}")
        if not isinstance(self.device, Device):
            raise ClusterError(f"{src}: device must be a Device")
        self.device.validate(src)
        for which in ("intra", "inter"):
            link = getattr(self, which)
            if not isinstance(link, Link):
                raise ClusterError(f"{src}: {which} must be a Link")
            number(link.bandwidth_gbs, src, f"{which}.bandwidth_gbs")
            number(link.latency_us, src, f"{which}.latency_us", allow_zero=True)
        if self.topology is not None:
            self.topology.validate(self.nodes, src)

    def fingerprint(self) -> str:
        """16 hex digits of sha256 over the normalised description.

        ``profile`` is left out (a profile records this fingerprint; the cluster
        naming its profile must not change it). For a detected cluster the measured
        figures are left out too (see the class docstring).
        """
        d = self.to_dict()
        d.pop("profile", None)
        if self.detected:  # (the core count is in the device name)
            d.pop("cores_per_node", None)
            d.pop("thread_speedup", None)
            d.pop("thread_sync_us", None)
            d["device"] = {"name": self.device.name, "memory_gib": round(self.device.memory_gib, 3)}
            d.pop("intra")
            d.pop("inter")
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- local CPU -------------------------------------------------------------
    @classmethod
    def detect(cls, n: int) -> "Cluster":
        """Measure this machine as ``n`` gloo CPU processes (about 1 s).

        Assumptions: each process runs one intra-op thread (torchrun sets
        OMP_NUM_THREADS=1 when it starts several processes) and the ``n`` processes
        share the cores, so per-process figures = single-thread figures x
        min(1, cores / n). ``thread_speedup``: a GEMM on every core's thread over one
        (``machine.thread_speedup``), and ``thread_sync_us``, what each op torch runs in
        parallel then adds (``machine.thread_sync_s``: milliseconds while another process
        holds a core): what a plan with fewer ranks and more threads per rank runs at
        (``cost_models.shared_cores.ranks_cluster``, ``thread_op_s``). Memory per process = total RAM / n. Links: the gloo
        defaults above (``GLOO_LINK_GBS``, ``GLOO_LATENCY_US``); nodes = 1.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ClusterError(f"local-cpu needs a positive process count, got {n!r}: use local-cpu:N, e.g. local-cpu:2")
        gemm_flops, copy_bps = machine.measure_cpu()
        speedup, sync_us = machine.thread_speedup(), machine.thread_sync_s() * 1e6
        share = min(1.0, machine.cpu_count() / n)
        device = Device(
            name=f"cpu-{machine.cpu_model()}-{machine.cpu_count()}c",
            memory_gib=machine.total_ram_bytes() / n / 2**30,
            peak_tflops={"fp32": gemm_flops * share / 1e12},
            mem_bw_gbs=copy_bps * share / 1e9,
        )
        link = Link(bandwidth_gbs=GLOO_LINK_GBS, latency_us=GLOO_LATENCY_US)
        return cls(name=f"local-cpu:{n}", nodes=1, devices_per_node=n, device=device,
                   intra=link, inter=Link(link.bandwidth_gbs, link.latency_us),
                   backend="gloo", detected=True, cores_per_node=machine.cpu_count(), thread_speedup=speedup,
                   thread_sync_us=sync_us)


# ---- presets -------------------------------------------------------------------------
def preset_names() -> list[str]:
    """Names of the bundled presets (``cost_models/presets/*.toml``)."""
    folder = resources.files("cost_models").joinpath("presets")
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_preset(name: str, nodes: int | None = None) -> Cluster:
    """A bundled preset with ``nodes`` nodes (None: one; a grouped preset: ``nodes`` per group,
    None: the preset's own counts)."""
    names = preset_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ClusterError(f"unknown cluster preset {name!r}: {hint}use one of {', '.join(names)}, local-cpu:N or a .toml path")
    res = resources.files("cost_models").joinpath("presets", f"{name}.toml")
    data = tomllib.loads(res.read_text(encoding="utf-8"))
    if "groups" in data:
        if nodes is not None:
            for g in data["groups"]:
                g["nodes"] = nodes
            data["nodes"] = nodes * len(data["groups"])
    else:
        data["nodes"] = 1 if nodes is None else nodes
    return Cluster.from_dict(data, source=f"preset {name}")


@lru_cache(maxsize=None)
def detect_cached(n: int) -> Cluster:
    return Cluster.detect(n)


def parse_cluster(spec: str) -> Cluster:
    """``PRESET``, ``PRESET:N``, ``local-cpu:N`` or a path to a ``.toml`` file -> Cluster."""
    if not isinstance(spec, str) or not spec.strip():
        raise ClusterError(f"empty cluster spec: use a preset ({', '.join(preset_names())}), PRESET:N, local-cpu:N or a .toml path")
    spec = spec.strip()
    if spec.endswith(".toml") or os.sep in spec or os.path.isfile(spec):
        return Cluster.from_toml(spec)
    name, sep, count = spec.partition(":")
    if name == "local-cpu":  # without a count: one process per core, so no rank waits for a core
        n = _parse_count(count, spec, "processes") if sep else machine.cpu_count()
        c = detect_cached(n)
        return Cluster.from_dict(c.to_dict(), source=spec)  # a fresh copy callers may mutate
    return load_preset(name, _parse_count(count, spec, "nodes") if sep else None)


def _parse_count(text: str, spec: str, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 or str(n) != text.strip():
        raise ClusterError(f"bad count {text!r} in cluster spec {spec!r}: the part after ':' is the number of {what}, a positive integer")
    return n


# ---- validation helpers --------------------------------------------------------------
_TOP_REQUIRED = ("name", "nodes", "devices_per_node", "backend", "device", "intra", "inter")
_TOP_OPTIONAL = ("profile", "detected", "cores_per_node", "thread_speedup", "thread_sync_us", "groups", "links")
