"""Process group and device mesh for emitted programs.

``init_distributed`` always initialises the default process group explicitly (an
implicit init through ``init_device_mesh`` leaves ``dist.get_backend()`` undefined) and
``teardown`` ends with a barrier before ``destroy_process_group``. A gloo group whose
threads are still running when the interpreter tears down can abort the rank at exit
(``terminate called without an active exception``; how often: ``benchmarks/clean_exit.py``
and README's benchmark table): a build's groups are destroyed by its ``close()``, or by the
``atexit`` hook it registers (``codegen/runtime/installs.py``), which also collects the
garbage holding them; ``teardown`` collects it after destroying the default group.

On CPUs every rank is pinned to its own slice of the machine's cores
(:func:`pin_cpu_rank`): left to the scheduler, ranks sharing cores migrate and the same
1 KiB send/recv took 0.12 ms in one launch and 1.4 ms in another; pinned, the same
placement every launch makes runs reproducible, and the profiler (cost_models/profiler.py) pins
the same way so its measurements hold for the training runs. ``AUTOPAR_NO_PIN=1``
turns it off. What plans or probes the machine inside a pinned rank runs :func:`unpinned`, on
every core of the launch: pinned, it would see one rank's slice (a rank pinned to 1 of 2 cores
named a 1-core machine, so its profile matched no cluster, and probed a thread speed-up of 1.0).
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from codegen.runtime.torch_compat import flatten_mesh
from planner.low_comm import parse_low_comm
from planner.plan import MESH_DIMS, ParallelConfig


def device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def pin_cpu_rank() -> Optional[set[int]]:
    """Pin this process (torchrun ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``) to its slice of the
    cores it may use: ``max(1, cores // ranks)`` consecutive cores, slices assigned round-robin
    when there are more ranks than cores. Several torchruns sharing one machine (the two-region
    rig, planner/entry/netns_rig.py) say so with ``AUTOPAR_HOST_RANKS`` (ranks on the machine)
    and ``AUTOPAR_HOST_RANK_BASE`` (this torchrun's first), so their slices do not overlap.
    Returns the cores, or None when not pinned (``AUTOPAR_NO_PIN`` set, not under torchrun, or
    no affinity support)."""
    if os.environ.get("AUTOPAR_NO_PIN") or "LOCAL_RANK" not in os.environ or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    ranks = int(os.environ.get("AUTOPAR_HOST_RANKS", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    local = int(os.environ["LOCAL_RANK"]) + int(os.environ.get("AUTOPAR_HOST_RANK_BASE", "0"))
    k = max(1, len(cores) // max(ranks, 1))
    start = (local * k) % len(cores)
    mine = set(cores[start:start + k])
    os.sched_setaffinity(0, mine)
    return mine


def launch_cores() -> set[int]:
    """The cores this job's launch allowed: under torchrun (``LOCAL_RANK`` set) also the agent's,
    this rank's parent process, whose affinity :func:`pin_cpu_rank` did not narrow; else this
    process's own."""
    mine = os.sched_getaffinity(0)
    if "LOCAL_RANK" not in os.environ:
        return mine
    try:
        return mine | os.sched_getaffinity(os.getppid())
    except OSError:  # the parent is gone or not ours to read
        return mine


@contextmanager
def unpinned() -> Iterator[None]:
    """Run the block on every core of the launch (:func:`launch_cores`), then on this rank's own
    again: ``auto_parallelize``'s rank 0 plans (and probes the machine) while the other ranks wait
    in a broadcast, and the profiler names the cluster its profile is for, as the job sees it.
    Affinity is per thread on Linux and a thread started inside (the probe's OpenMP workers)
    inherits the wide set, so on the way out every thread of the process is put back."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, launch_cores())
    try:
        yield
    finally:
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, before)
            except OSError:  # a thread that ended meanwhile
                pass


def _threads() -> list[int]:
    """This process's thread ids (Linux ``/proc/self/task``; this thread only elsewhere)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def init_distributed(backend: Optional[str] = None, threads: int = 0) -> torch.device:
    """Initialise the default process group from the torchrun environment; returns this rank's device.

    ``backend`` defaults to nccl on CUDA, gloo on CPU. On CUDA the device is chosen by
    ``LOCAL_RANK``. On CPU the rank is pinned to its cores (:func:`pin_cpu_rank`) and, when
    ``threads`` (the plan's ``ParallelConfig.threads``) is set, runs that many intra-op threads
    (0: the environment's, ``OMP_NUM_THREADS``). Calling it twice is harmless.
    """
    dev_type = device_type()
    if dev_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        pin_cpu_rank()
        if threads:
            torch.set_num_threads(threads)
    if not dist.is_initialized():
        backend = backend or ("nccl" if dev_type == "cuda" else "gloo")
        kw = {"device_id": device} if dev_type == "cuda" else {}
        dist.init_process_group(backend, **kw)
    return device


def build_mesh(cfg: ParallelConfig) -> DeviceMesh:
    """A 4-d DeviceMesh with dims ``("pp", "dp", "cp", "tp")`` of shape ``cfg.mesh_shape``.

    Size-1 dims are kept so every submesh name exists. Raises if the world size does not
    equal ``dp * pp * cp * tp``.
    """
    world = dist.get_world_size()
    if world != cfg.world:
        raise RuntimeError(f"world size {world} != dp*pp*cp*tp = {cfg.world} for {cfg.label()}; "
                           f"launch with --nproc-per-node {cfg.world}")
    low = parse_low_comm(cfg.low_comm)
    if low is not None:  # low-communication DP: dp cut into (outer groups, replicas in a group), same ranks
        return init_device_mesh(device_type(), (cfg.pp, low.groups, cfg.dp // low.groups, cfg.cp, cfg.tp),
                                mesh_dim_names=("pp", "outer", "dp", "cp", "tp"))
    return init_device_mesh(device_type(), cfg.mesh_shape, mesh_dim_names=MESH_DIMS)


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel mesh gradients are reduced over: ``dp`` flattened with ``cp``."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    if mesh["dp"].size() == 1:
        return mesh["cp"]
    try:
        return mesh["dp_cp"]
    except (KeyError, RuntimeError, ValueError):
        return flatten_mesh(mesh["dp", "cp"], "dp_cp")


def hybrid_dp_mesh(cfg: ParallelConfig, replicas: int) -> DeviceMesh:
    """The data-parallel (dp x cp) ranks as a 2-D ``("dp_rep", "dp_shard")`` mesh: ``replicas``
    rows of consecutive ranks (one per cluster group the dp group spans,
    ``planner.sharding.dp_replicas``), each row's ``dp * cp / replicas`` ranks inside one group
    (collective: every rank builds it). Ranks follow the ``(pp, dp, cp, tp)`` order, dp
    outside cp, so a row holds whole dp ranks when ``replicas`` divides ``dp``."""
    n = cfg.dp * cfg.cp
    if replicas < 2 or cfg.dp % replicas:
        raise ValueError(f"hierarchical DP over {replicas} cluster groups needs dp ({cfg.dp}) divisible by it")
    m = init_device_mesh(device_type(), (cfg.pp, replicas, n // replicas, cfg.tp),
                         mesh_dim_names=("pp", "dp_rep", "dp_shard", "tp"))
    return m["dp_rep", "dp_shard"]


def cp_groups(cfg: ParallelConfig, mesh: DeviceMesh) -> tuple:
    """(ring group, Ulysses group) of this rank's context parallelism: the cp group and None
    for ring attention; with a Ulysses degree u, the groups of u consecutive cp ranks and the
    groups of the ``cp / u`` ranks at the same place in them (context_parallel.cp_rank), from
    a ``[pp, dp, cp_ring, cp_ulysses, tp]`` mesh over the same ranks (collective)."""
    if cfg.ulysses == 1:
        return mesh["cp"].get_group(), None
    split = init_device_mesh(device_type(), (cfg.pp, cfg.dp, cfg.cp // cfg.ulysses, cfg.ulysses, cfg.tp),
                             mesh_dim_names=("pp", "dp", "cp_ring", "cp_ulysses", "tp"))
    return split["cp_ring"].get_group(), split["cp_ulysses"].get_group()


def teardown() -> None:
    """Barrier, destroy the default process group, then collect the garbage holding the
    process-group objects: gloo's worker threads end only when those objects are freed, and a
    program that leaves them to the interpreter's own teardown can lose a rank to SIGABRT at
    exit (module docstring)."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
            gc.collect()


def exit_process(code: int = 0) -> None:
    """End a distributed program after :func:`teardown`: flush stdio and leave without running
    C++ static destructors. Kept for the profiler, the timed runs and the benchmarks' and
    tests' workers, which ended this way before builds closed their process groups (a gloo
    rank then aborted at exit about once in three ``autopar run`` launches); emitted
    programs and ``auto_parallelize`` scripts end normally (module docstring)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
