"""Activation offload (the ``offload`` recompute policy): the host link it is priced on, and
what moving one layer's saved activations over that link costs.

Under ``offload`` every repeated block of a stage sends what autograd saves for its backward
to pinned host memory during its forward, and brings it back for its backward
(``codegen/runtime/offload.py``). The copies run on a side stream, so a layer's copy hides
behind that layer's own compute; only what the copy takes beyond the compute is exposed
(:func:`exposed_copy_s`, used by ``cost_models.layer_costs.layer_pass_times``). The device
then keeps nothing of an offloaded block between its forward and backward
(``cost_models.memory.layer_activation``); its backward holds the reloaded activations beside
their gradients (``MemoryRule.work``).

Assumptions: one copy stream per direction per device, at ``Device.host_gbs`` (the cluster
file's PCIe / NVLink-C2C figure, one direction) or :data:`DEFAULT_HOST_GBS` where the file does
not give it; the copies do not slow the compute (HBM traffic of a copy is small next to the
kernels'). The pinned buffers hold every in-flight micro-batch's offloaded activations
(``StageMemory.host``); a plan fits only if they fit :func:`host_capacity_bytes`. On a CPU (gloo) cluster host and device memory are the same memory: offload saves
nothing there (:func:`offload_saves`), the search does not propose it, and a pinned offload is
priced as a copy at the memory bandwidth (its memory figures, though, are a GPU's: the device
keeps none of the blocks' activations).
"""
from __future__ import annotations

import math

from cost_models.cluster import Cluster

# PCIe Gen5 x16 moves ~64 GB/s one way; ~55 GB/s is what pinned cudaMemcpyAsync sustains on it
# (an H100 SXM behind a DGX H100's PCIe switch). A Grace Hopper's NVLink-C2C: 450 GB/s one way.
DEFAULT_HOST_GBS = 55.0
# A DGX H100 has 2 TiB of RAM for 8 GPUs: 256 GiB each, less what the OS and the data loaders keep.
DEFAULT_HOST_GIB = 240.0


def host_link_bps(cluster: Cluster) -> float:
    """Bytes/s one direction between a device and its host memory: the cluster file's
    ``device.host_gbs``; else on a CPU cluster the memory copy bandwidth, on GPUs
    :data:`DEFAULT_HOST_GBS`."""
    dev = cluster.device
    if dev.host_gbs:
        return dev.host_gbs * 1e9
    return dev.mem_bw_gbs * 1e9 if cluster.backend == "gloo" else DEFAULT_HOST_GBS * 1e9


def host_capacity_bytes(cluster: Cluster) -> float:
    """Host memory one rank may fill with offloaded activations: the cluster file's
    ``device.host_memory_gib``, else :data:`DEFAULT_HOST_GIB` on GPUs; unbounded on a CPU
    cluster (its device memory is the host memory, already the device capacity)."""
    if cluster.device.host_memory_gib:
        return cluster.device.host_memory_gib * 2**30
    return math.inf if cluster.backend == "gloo" else DEFAULT_HOST_GIB * 2**30


def offload_saves(cluster: Cluster) -> bool:
    """Whether offloading activations frees device memory on ``cluster`` (not on CPUs, whose
    device memory is the host memory)."""
    return cluster.backend != "gloo"


def copy_seconds(nbytes: float, cluster: Cluster) -> float:
    """Seconds to move ``nbytes`` one way over the host link."""
    return nbytes / host_link_bps(cluster) if nbytes > 0 else 0.0


def exposed_copy_s(copy_s: float, compute_s: float) -> float:
    """What a copy of ``copy_s`` seconds on a side stream adds to a pass of ``compute_s``
    seconds it overlaps: the part it runs past the compute."""
    return max(0.0, copy_s - compute_s)
