"""Calibrated out of the box: a short profile of this machine on first use, cached per machine.

The CPU cost model (roofline figures measured by ``Cluster.detect``, the shared-cores terms,
gloo link defaults) is uncalibrated: the Python, autograd, gloo and optimizer overheads of a
real step are not in it. The first plan for a ``local-cpu`` cluster on a machine therefore
runs a short profile (about 15-30 s on 2 cores): the reference model ``REFERENCE_MODEL``
trained for a few steps under every layout family this machine can run (DP, TP + SP, PP
1F1B; :func:`reference_configs`), all in one torchrun launch of one process per core
(``planner/entry/timed_runs.py``), and as one process running a thread on every core
(:func:`one_process_config`, its own launch). The one-process run is the only one without
communication: without it the fit cannot tell compute from communication (both grow with
the same three layouts) and prices a plan with no communication at all - the one-process
plan the search always considers - from whichever way the fit split them. After its layouts the
first launch measures the CPU runtime's own per-call work on the same ranks as ``autopar profile``
does (``cost_models.profile_runtime.measure_runtime``: the data-parallel wrappers per unit, the EP
dispatch, DTensor's dispatch per sharded module, FSDP2 units by size; about 6 s on 2 cores), so
those are measured figures of this machine, not defaults, both in the fit and in every later plan
(:func:`measured_profile`). ``cost_models.calibrate.fit`` fits the time and
memory coefficients to those runs and the result is cached in the user's cache directory
(``$AUTOPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``) under
the machine's fingerprint (CPU model, cores, memory, torch version), with the GEMM, copy and
thread figures the fit priced with (:func:`pinned_calibration`, :func:`pinned_cluster`). Later plans on the machine reuse it,
for any process count; every plan records whether it is calibrated
(``Plan.estimate["calibration"]``).

The reference model is not the demo's (``gpt-mini``) and not the user's: the coefficients
are the machine's, and a plan's prediction for another model is a real prediction. An
explicit ``--profile`` wins over the cache; ``--no-calibrate`` (or ``AUTOPAR_CALIBRATE=0``)
plans uncalibrated and never launches anything.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from cost_models.cluster import Cluster
from cost_models.profile_db import ProfileDB
from planner.errors import AutoparError
from planner.plan import ParallelConfig

REFERENCE_MODEL = "llama-mini"   # planner/zoo/config.py
REFERENCE_BATCH = 8              # sequences per step (its preset length, 96 tokens each)
ONE_PROCESS_BATCH = 16           # the one-process run's: twice the compute of the others' ranks
STEPS, WARMUP = 4, 2             # timed and untimed steps per reference layout
TIMEOUT_S = 120.0                # the profile is killed past this
CACHE_VERSION = 5                # 2: the one-process run joined the reference runs; 3: the figures fitted on;
                                 # 4: the runtime's measured work; 5: DTensor per SP norm, and TP's collectives
                                 # without the fitted latency (fits before it priced them with it)


@dataclass
class MachineCalibration:
    """The fitted coefficients of one machine and what they were fitted on."""
    machine: str                      # machine fingerprint (16 hex digits)
    device: str                       # Cluster.device.name of the profiled cluster
    world: int                        # processes the reference runs used
    calibration: dict[str, float]     # cost_models.calibrate coefficients
    runs: list[dict]                  # per reference layout: label, measured and fitted step seconds
    created: str                      # UTC time of the profile
    profile_s: float                  # wall seconds the profile took
    figures: dict[str, float] = field(default_factory=dict)  # machine_figures() the fit priced with
    measured: dict = field(default_factory=dict)  # ProfileDB layout: the runtime's work (measured_profile)
    version: int = CACHE_VERSION

    def summary(self) -> str:
        """One short line: when and on what this machine was calibrated."""
        return (f"calibrated on this machine ({self.created}, {len(self.runs)} reference runs of "
                f"{REFERENCE_MODEL} on {self.world} processes{' and on one' if self.world > 1 else ''})")

    def describe(self) -> str:
        """:meth:`summary` with each reference run's measured and fitted step time (what a plan records)."""
        fit = ", ".join(f"{r['label']} {r['measured_s']:.3g}/{r['fitted_s']:.3g} s" for r in self.runs)
        return f"{self.summary()[:-1]}; measured/fitted {fit})"


def cache_dir() -> Path:
    """Where calibrations are cached (module docstring)."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar"


def machine_fingerprint(cluster: Cluster) -> str:
    """16 hex digits naming this machine for the cache: the detected device (CPU model, cores,
    memory), which the local cluster's fingerprint also covers, and the torch version (its
    kernels and overheads are part of what is calibrated)."""
    import torch

    ram = round(cluster.device.memory_gib * cluster.devices_per_node, 1)
    blob = json.dumps([cluster.device.name, ram, torch.__version__])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_path(cluster: Cluster) -> Path:
    return cache_dir() / f"machine-{machine_fingerprint(cluster)}.json"


def load_cached(cluster: Cluster) -> MachineCalibration | None:
    """The cached calibration of this machine, or None (none yet, or written by another version)."""
    p = cache_path(cluster)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
        mc = MachineCalibration(**d)
    except (OSError, ValueError, TypeError):
        return None
    if mc.version != CACHE_VERSION or mc.machine != machine_fingerprint(cluster):
        return None
    try:
        measured_profile(mc, cluster)
    except ValueError:  # its runtime figures unreadable (another profile version): profile again
        return None
    return mc


def reference_configs(world: int) -> list[ParallelConfig]:
    """The layouts the profile runs on ``world`` processes: pure DP, and where the world is
    even TP2 + SP and PP2 (1F1B, 4 micro-batches) beside DP on the rest - one of each family
    the search picks from, each with the micro-batch size the search would give it."""
    def cfg(dp: int, **kw) -> ParallelConfig:
        return ParallelConfig(dp=dp, zero="ddp", dtype="fp32", mbs=kw.pop("mbs", REFERENCE_BATCH // dp), **kw)

    if world == 1 or world % 2:
        return [cfg(world)]
    rest = world // 2
    return [cfg(world), cfg(rest, tp=2, sp=True),
            cfg(rest, pp=2, schedule="1f1b", mbs=max(1, REFERENCE_BATCH // (rest * 4)))]


def one_process_config(world: int) -> ParallelConfig | None:
    """The reference model run as one process with a thread on each of the ``world`` profiled
    cores, on ``ONE_PROCESS_BATCH`` sequences (None on one core, where :func:`reference_configs`
    already is that run). Every layout of :func:`reference_configs` gives each core about the
    same work, so their times cannot tell compute from a fixed cost per step; this run's
    twice that work can."""
    if world == 1:
        return None
    return ParallelConfig(dp=1, zero="ddp", dtype="fp32", mbs=ONE_PROCESS_BATCH, threads=world)


def profile_world(cores: int) -> int:
    """Processes the profile runs: one per core, as 1, 2 or 4 (the reference batch splits that way)."""
    return 4 if cores >= 4 else (2 if cores >= 2 else 1)


# What the reference layouts identify: compute speed (all), per-collective latency (DP's buckets and PP's
# p2p per micro-batch against the one process, which has none; TP's collectives carry none on CPUs:
# DTensor's figure holds it), bandwidth (DP), fixed per-step cost. Per-kind factors would over-fit them.
FIT_KEYS = ("compute_scale", "comm_scale", "comm_latency_s", "step_overhead_s")
FIT_PRIOR = 1e-4  # a hundredth of autopar calibrate's: the reference layouts are designed to identify FIT_KEYS


def run_profile(progress: Callable[[str], None] | None = None) -> MachineCalibration:
    """Profile this machine (module docstring), fit, write the cache; returns the calibration."""
    from cost_models import calibrate as cal
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.entry.launch import launch_timed_runs

    t0 = time.perf_counter()
    probe = parse_cluster("local-cpu")
    world = profile_world(probe.cores_per_node or probe.world)
    spec = f"local-cpu:{world}"
    cluster = parse_cluster(spec)
    graph = load_graph(REFERENCE_MODEL)
    launches = [(reference_configs(world), REFERENCE_BATCH)]
    launches += [([c], ONE_PROCESS_BATCH) for c in [one_process_config(world)] if c]
    if progress:
        progress(f"first plan on this machine: profiling it ({REFERENCE_MODEL}, {world} processes, "
                 f"{sum(len(c) for c, _ in launches)} layouts; cached for later plans)")
    samples, measured = [], {}
    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        for i, (cfgs, batch) in enumerate(launches):
            paths, est = _reference_plans(graph, cluster, spec, os.path.join(tmp, f"launch{i}"), cfgs, batch)
            got = launch_timed_runs(paths, os.path.join(tmp, f"runs{i}.json"), world=cfgs[0].world,
                                    steps=STEPS, warmup=WARMUP, timeout_s=TIMEOUT_S, runtime=i == 0)
            measured = got.get("runtime") or measured
            samples += [_sample(graph, cluster, e, r, batch, first=not samples and j == 0)
                        for j, (e, r) in enumerate(zip(est, got["runs"]))]
    profile = _measured_db(measured, cluster, world)
    fitted = cal.fit(samples, profile, keys=FIT_KEYS, per_kind=False, prior=FIT_PRIOR)
    rows = [{"label": s.name, "measured_s": round(s.measured_step_s, 4),
             "uncalibrated_s": round(cal.predict(s, profile, {}).step_s, 4),
             "fitted_s": round(cal.predict(s, profile, fitted).step_s, 4)} for s in samples]
    mc = MachineCalibration(machine=machine_fingerprint(cluster), device=cluster.device.name, world=world,
                            calibration=fitted, runs=rows,
                            created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            profile_s=round(time.perf_counter() - t0, 1), figures=machine_figures(cluster),
                            measured=measured)
    save_cached(cluster, mc)
    return mc


def _measured_db(measured: dict, cluster: Cluster, world: int) -> ProfileDB | None:
    """A ProfileDB of ``measured`` (a ``ProfileDB`` layout: the runtime's work and FSDP2 units as
    ``planner.entry.timed_runs`` measured them on ``world`` ranks) for planning on ``cluster``;
    None where nothing was measured (one core)."""
    if not measured:
        return None
    db = ProfileDB.from_dict(measured, source="the machine calibration's runtime figures")
    db.cluster_fingerprint, db.world = cluster.fingerprint(), world
    return db


def measured_profile(mc: MachineCalibration, cluster: Cluster) -> ProfileDB | None:
    """What ``mc``'s profile measured of the CPU runtime's own work (module docstring), for planning
    on ``cluster``: its per-call figures (``ProfileDB.runtime``) and FSDP2 unit samples."""
    return _measured_db(mc.measured, cluster, mc.world)


def _reference_plans(graph, cluster: Cluster, spec: str, folder: str, configs: list[ParallelConfig], batch: int):
    """Plan files of ``configs`` for ``batch`` sequences on an even split (what the runs execute)
    and their estimates."""
    from planner.search.planning import build_plan, evaluate_config

    os.makedirs(folder, exist_ok=True)
    paths, estimates = [], []
    for i, cfg in enumerate(configs):
        e, problems = evaluate_config(graph, cluster, cfg, batch, even_split=True)
        if problems:  # the reference model is chosen so this cannot happen: a bug, say so
            raise AutoparError(f"reference layout {cfg.label()} cannot run: {'; '.join(problems)}")
        plan = build_plan(graph, cluster, e, spec=REFERENCE_MODEL, cluster_spec=spec)
        paths.append(os.path.join(folder, f"ref{i}.json"))
        plan.save(paths[-1])
        estimates.append(e)
    return paths, estimates


def _sample(graph, cluster: Cluster, e, run: dict, batch: int, first: bool):
    """A calibration sample of one reference run (memory only from the first layout run: peak
    RSS never falls, so the later ones carry the earlier layouts' peaks)."""
    from cost_models.calibrate import RunSample, per_stage_memory

    return RunSample(name=e.config.label(), graph=graph, cluster=cluster, config=e.config,
                     partition=e.partition, global_batch=batch,
                     measured_step_s=statistics.median(run["step_s"]), step_times=list(run["step_s"]),
                     measured_mem_gib=per_stage_memory(e.config, run["memory_gib"]) if first else [])


def save_cached(cluster: Cluster, mc: MachineCalibration) -> None:
    p = cache_path(cluster)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(mc), indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, p)
    except OSError as e:  # an unwritable cache costs a profile per plan, not the plan
        from planner.entry.launch import progress
        progress(f"could not cache the calibration in {p.parent} ({e.strerror}); set AUTOPAR_CACHE_DIR")


def calibration_enabled() -> bool:
    return os.environ.get("AUTOPAR_CALIBRATE", "1").strip().lower() not in ("0", "false", "no", "off")


class MachineProfile(NamedTuple):
    """What planning on this machine prices with (:func:`machine_profile`)."""
    profile: ProfileDB | None  # the cached calibration, or None
    note: str                  # one short line saying which
    cluster: Cluster           # the cluster to plan on: the given one, at the thread figures the fit priced with


def machine_profile(cluster: Cluster, *, enabled: bool = True, allow_profile: bool = True,
                    progress: Callable[[str], None] | None = None) -> MachineProfile:
    """The ProfileDB carrying this machine's calibration, a line saying which, and the cluster to
    plan ``cluster``'s job on: the cached calibration of a ``local-cpu`` cluster, profiling the
    machine first when there is none and ``allow_profile``; no profile for other clusters, or when
    not ``enabled`` (``--no-calibrate``) or ``AUTOPAR_CALIBRATE=0``."""
    from cost_models.calibrate import with_calibration

    if not cluster.detected:
        return MachineProfile(None, "uncalibrated (no --profile for this cluster)", cluster)
    if not (enabled and calibration_enabled()):
        return MachineProfile(None, "uncalibrated (calibration off: --no-calibrate or AUTOPAR_CALIBRATE=0)", cluster)
    mc = load_cached(cluster)
    if mc is None and allow_profile:
        mc = run_profile(progress)
    if mc is None:
        return MachineProfile(None, "uncalibrated (this machine has not been profiled yet)", cluster)
    profile = with_calibration(measured_profile(mc, cluster), pinned_calibration(mc, cluster), cluster,
                               source=mc.describe())
    return MachineProfile(profile, mc.summary(), pinned_cluster(mc, cluster))


def machine_figures(cluster: Cluster) -> dict[str, float]:
    """The figures ``Cluster.detect`` measured on this machine that the CPU roofline prices with,
    per core (the device's per-process figures over its share of a core): ``gemm_flops`` (fp32
    FLOP/s of one thread) and ``copy_bps`` (bytes/s read + written); and, where it measured them,
    ``thread_speedup`` (a GEMM on every core's thread over one) and ``thread_sync_us`` (what a
    parallel op adds on them)."""
    share = cluster.core_share
    figs = {"gemm_flops": cluster.peak_flops("fp32") / share, "copy_bps": cluster.device.mem_bw_gbs * 1e9 / share}
    if cluster.thread_speedup:
        figs.update(thread_speedup=float(cluster.thread_speedup), thread_sync_us=float(cluster.thread_sync_us))
    return figs


def pinned_calibration(mc: MachineCalibration, cluster: Cluster) -> dict[str, float]:
    """``mc``'s coefficients for planning on ``cluster``, whose figures were measured anew by this
    process: the roofline's fitted efficiencies (``eff_matmul``, ``eff_memory``) re-expressed over
    the new figures, so that a layer is priced at the speed the fit gave it (fit-time figure x
    fitted efficiency) and not at a fresh probe's. The probe is a 0.5 s GEMM and a copy: on a
    2-core VM, eight processes in a row read 133-176 GFLOP/s, and the demo's prediction of the same
    plan with the same cache moved 0.208-0.267 s with it; a demo priced at 0.214 s after a fast
    probe measured 0.256 s (2026-12-06). The thread figures are pinned too (:func:`pinned_cluster`)."""
    cal = dict(mc.calibration)
    live = machine_figures(cluster)
    for key, fig in (("eff_matmul", "gemm_flops"), ("eff_memory", "copy_bps")):
        if key in cal and mc.figures.get(fig) and live[fig] > 0:
            cal[key] *= mc.figures[fig] / live[fig]
    return cal


def pinned_cluster(mc: MachineCalibration, cluster: Cluster) -> Cluster:
    """``cluster`` at the thread figures ``mc``'s fit priced with (``Cluster.thread_speedup``,
    ``thread_sync_us``; ``cluster`` itself when ``mc`` has none, a cache written before they
    were kept). The fit's one-process reference run was priced at them, so a plan's threads are
    priced as the fit priced them, not at this process's 0.7 s probe: on the 2-core VM a cached
    demo that had planned one process with 2 threads at 0.281 s planned two processes in the next
    run (2026-12-07), and a speedup probed at 1.9 instead of 2.0 moves the one-process plan 5%."""
    from dataclasses import replace

    figs = mc.figures
    if "thread_speedup" not in figs or not cluster.detected:
        return cluster
    return replace(cluster, thread_speedup=figs["thread_speedup"], thread_sync_us=figs.get("thread_sync_us", 0.0))
