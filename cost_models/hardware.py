"""Device, Link, ClusterError and the one-line validators every cluster file goes through.

A leaf contract (imports nothing of ours): :mod:`cost_models.cluster` and
:mod:`cost_models.topology` build on it, and re-export its names, so
``from cost_models.cluster import Device, Link, ClusterError`` keeps working.

Units: ``Device.memory_gib`` GiB (2**30 bytes) usable per device; ``Device.peak_tflops[dtype]``
dense peak, 1e12 FLOP/s; ``Device.mem_bw_gbs`` GB/s (1e9 bytes/s); ``Device.sms`` streaming
multiprocessors (0 = not given); ``Device.host_gbs`` GB/s one direction between the device and
its host's memory (PCIe, NVLink-C2C; 0 = not given); ``Device.host_memory_gib`` GiB of host memory
one device may fill with pinned buffers (its share of the node's RAM; 0 = not given); ``Link.bandwidth_gbs`` GB/s one direction; ``Link.latency_us``
one message's start-up latency (the alpha of the alpha-beta model), microseconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
FORMAT_HINT = "see the format in cost_models/cluster.py"


class ClusterError(ValueError):
    """A bad cluster description or spec; the message is one line: problem and fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass
class Device:
    """One accelerator (or one CPU process' share of a machine).

    memory_gib: usable memory, GiB. peak_tflops: dense peak per dtype, 1e12 FLOP/s.
    mem_bw_gbs: memory bandwidth, 1e9 bytes/s. sms: streaming multiprocessors (0: unknown).
    host_gbs: device <-> host memory, one direction, 1e9 bytes/s (PCIe / C2C; 0: unknown).
    host_memory_gib: host memory a device may pin (its share of the node's RAM), GiB (0: unknown).
    """

    name: str
    memory_gib: float
    peak_tflops: dict[str, float]
    mem_bw_gbs: float
    sms: int = 0
    host_gbs: float = 0.0
    host_memory_gib: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The TOML layout of a ``[device]`` table."""
        return {"name": self.name, "memory_gib": float(self.memory_gib), "mem_bw_gbs": float(self.mem_bw_gbs),
                "peak_tflops": {k: float(self.peak_tflops[k]) for k in sorted(self.peak_tflops)},
                **({"sms": self.sms} if self.sms else {}),
                **({"host_gbs": float(self.host_gbs)} if self.host_gbs else {}),
                **({"host_memory_gib": float(self.host_memory_gib)} if self.host_memory_gib else {})}

    @classmethod
    def from_dict(cls, dev: Any, source: str, key: str = "device") -> "Device":
        """Read and check a ``[device]`` table (``key`` names it in errors)."""
        check_table(dev, source, key)
        check_keys(dev, source, f"{key}.", required=("name", "memory_gib", "mem_bw_gbs", "peak_tflops"),
                   optional=("sms", "host_gbs", "host_memory_gib"))
        peaks = dev["peak_tflops"]
        check_table(peaks, source, f"{key}.peak_tflops")
        if not peaks:
            raise ClusterError(f"{source}: [{key}.peak_tflops] is empty: give at least one of {', '.join(DTYPES)}")
        for k in peaks:
            if k not in DTYPES:
                raise ClusterError(f"{source}: unknown key {key}.peak_tflops.{k}: use one of {', '.join(DTYPES)}")
        return cls(name=string(dev["name"], source, f"{key}.name"),
                   memory_gib=number(dev["memory_gib"], source, f"{key}.memory_gib"),
                   peak_tflops={k: number(v, source, f"{key}.peak_tflops.{k}") for k, v in peaks.items()},
                   mem_bw_gbs=number(dev["mem_bw_gbs"], source, f"{key}.mem_bw_gbs"),
                   sms=integer(dev["sms"], source, f"{key}.sms") if "sms" in dev else 0,
                   host_gbs=number(dev["host_gbs"], source, f"{key}.host_gbs") if "host_gbs" in dev else 0.0,
                   host_memory_gib=(number(dev["host_memory_gib"], source, f"{key}.host_memory_gib")
                                    if "host_memory_gib" in dev else 0.0))

    def validate(self, source: str, key: str = "device") -> None:
        """Raise ClusterError if a figure is missing, of the wrong type or non-positive."""
        string(self.name, source, f"{key}.name")
        number(self.memory_gib, source, f"{key}.memory_gib")
        number(self.mem_bw_gbs, source, f"{key}.mem_bw_gbs")
        number(self.host_gbs, source, f"{key}.host_gbs", allow_zero=True)
        number(self.host_memory_gib, source, f"{key}.host_memory_gib", allow_zero=True)
        if not isinstance(self.peak_tflops, dict) or not self.peak_tflops:
            raise ClusterError(f"{source}: {key}.peak_tflops must give at least one of {', '.join(DTYPES)}")
        for k, v in self.peak_tflops.items():
            if k not in DTYPES:
                raise ClusterError(f"{source}: unknown key {key}.peak_tflops.{k}: use one of {', '.join(DTYPES)}")
            number(v, source, f"{key}.peak_tflops.{k}")


@dataclass
class Link:
    """A link class: per-device one-direction bandwidth (GB/s) and latency (us)."""

    bandwidth_gbs: float
    latency_us: float

    @property
    def bandwidth_bps(self) -> float:
        """Bandwidth in bytes/s."""
        return self.bandwidth_gbs * 1e9

    @property
    def latency_s(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6

    def to_dict(self) -> dict[str, float]:
        return {"bandwidth_gbs": float(self.bandwidth_gbs), "latency_us": float(self.latency_us)}

    @classmethod
    def from_dict(cls, d: Any, source: str, key: str) -> "Link":
        """Read and check a ``[intra]`` / ``[inter]`` table."""
        check_table(d, source, key)
        check_keys(d, source, f"{key}.", required=("bandwidth_gbs", "latency_us"))
        return cls(bandwidth_gbs=number(d["bandwidth_gbs"], source, f"{key}.bandwidth_gbs"),
                   latency_us=number(d["latency_us"], source, f"{key}.latency_us", allow_zero=True))


# ---- one-line validators ------------------------------------------------------------
def check_keys(d: Mapping[str, Any], source: str, prefix: str, *, required: tuple[str, ...],
               optional: tuple[str, ...] = ()) -> None:
    """Every required key present, no other than ``required + optional``."""
    for k in required:
        if k not in d:
            raise ClusterError(f"{source}: missing key {prefix}{k}: add it ({FORMAT_HINT})")
    for k in d:
        if k not in required and k not in optional:
            raise ClusterError(f"{source}: unknown key {prefix}{k}: remove it (allowed: {', '.join(required + optional)})")


def check_table(v: Any, source: str, key: str) -> None:
    """``v`` is a TOML table."""
    if not isinstance(v, Mapping):
        raise ClusterError(f"{source}: {key} must be a table ([{key}]), got {type(v).__name__}")


def number(v: Any, source: str, key: str, *, allow_zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with ``allow_zero``), as float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ClusterError(f"{source}: {key} must be a number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterError(f"{source}: {key} must be {bound}, got {v!r}")
    return float(v)


def integer(v: Any, source: str, key: str) -> int:
    """An integer >= 1."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ClusterError(f"{source}: {key} must be an integer, got {v!r}")
    if v < 1:
        raise ClusterError(f"{source}: {key} must be >= 1, got {v!r}")
    return v


def string(v: Any, source: str, key: str) -> str:
    """A non-empty string."""
    if not isinstance(v, str) or not v:
        raise ClusterError(f"{source}: {key} must be a non-empty string, got {v!r}")
    return v
