"""Fit the cost model's coefficients to measured training runs (``autopar calibrate``).

Input: training runs of plans on one cluster, each a plan (the configuration, stage
split and batch it ran) and the ``train_log.jsonl`` its program wrote (per step the
wall time and every rank's peak RSS). Output: a ``calibration`` dict stored in the
profile JSON (cost_models/profile_db.py), which the estimator reads on every later
``autopar plan`` / ``evaluate`` with that profile.

Coefficients (all optional; absent = the uncalibrated model):

=================== ================================================ =====================
key                 meaning                                          read by
=================== ================================================ =====================
compute_scale       multiplies every layer's forward/backward time   compute.layer_time
eff_matmul          CPU roofline matmul efficiency (EFF_MATMUL_CPU)  compute.roofline_time
eff_memory          CPU roofline bandwidth efficiency (EFF_MEMORY)   compute.roofline_time
op_overhead_s       CPU per-op dispatch seconds (CPU_OP_OVERHEAD_S)  compute.roofline_time
replicate_unit_s,   CPU data-parallel wrapper work per unit and      cpu_runtime.wrapper_unit_s
fsdp_unit_s,        micro-batch (replicate; fully_shard; its
fsdp_reduce_unit_s  gradient reduction)
ep_dispatch_s       CPU EP dispatch host work per MoE layer          cpu_runtime.ep_dispatch_s
                    (these four: given, not fitted; the profile measures them)
dtensor_module_s,   CPU DTensor dispatch per TP-sharded linear; per  dtensor_dispatch.dtensor_dispatch_s
dtensor_norm_s      sequence-parallel norm (the profile measures
                    them; a CPU roofline fit stores them scaled, below)
gpu.<coefficient>   a GPU kernel-model coefficient (GpuCoefficients) gpu_kernels

comm_scale          multiplies every collective / p2p time           comm._group_time
comm_scale.<kind>   the same for one kind (all_reduce, all_gather,   comm._group_time
                    reduce_scatter, all_to_all, send_recv)
comm_latency_s      seconds added to every collective / p2p call     comm._group_time
                    (but TP's on CPUs: DTensor's figure prices it)
overlap             DP-communication overlap efficiency (OVERLAP),   dp_cost.dp_and_optimizer
                    where a core is spare for the communication
opt_scale           multiplies the optimizer step time               dp_cost.dp_and_optimizer
step_overhead_s     seconds added to every step                      estimate.estimate
mem_reserve_gib     per-process memory beside the tensors (CPU)      estimate.estimate
mem_reserve_frac    + this fraction of the tensor bytes (CPU)        estimate.estimate
=================== ================================================ =====================

When every fitted run on a CPU cluster priced its layers with the roofline (no measured
layers), ``compute_scale`` is folded into ``eff_matmul``, ``eff_memory``, ``op_overhead_s``, ``dtensor_module_s``
and ``dtensor_norm_s`` (the roofline is exactly proportional to 1/efficiency and to the per-op and
per-module costs; the last two are the profile's measured figures where it has them), so those are what
is stored. The CPU runtime's other per-call figures (cost_models/cpu_runtime.py) are measured,
not scaled: their keys replace them only when given.

The fit. Step time: minimise the mean squared log error ``mean(log(pred/measured)^2)``
over the runs, with a weak prior pulling each coefficient to its uncalibrated value
(``PRIOR``: an unidentifiable coefficient - ``overlap`` when no run uses DP - stays
put) and a stronger one pulling each per-kind communication factor to the common
``comm_scale`` (``KIND_PRIOR``). The estimator is re-run for every trial point (it is
not linear in the coefficients: the DP overlap window, pipeline bubbles), minimised by
Nelder-Mead from a few starting points. Memory: least squares of
``measured peak RSS - predicted tensor bytes = mem_reserve_gib + mem_reserve_frac x
tensor bytes`` over all runs and pipeline ranks, relative errors (both >= 0; a single
run or a single tensor size fits the offset alone, as the median difference).

Honesty: :func:`leave_one_out` refits without each run in turn and predicts the run
left out; ``autopar calibrate`` prints those held-out errors, not the in-sample ones.

Layering: this module reads the contracts (planner/graph.py, planner/plan.py,
cost_models/cluster.py) only; turning a plan file back into a graph needs the model
front end, which the caller passes in (``load_graph``).
"""
from __future__ import annotations

import copy
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cost_models.cluster import Cluster
from cost_models.compute import CPU_OP_OVERHEAD_S, EFF_MATMUL_CPU, EFF_MEMORY
from cost_models.cpu_runtime import DTENSOR_KEYS, measured as runtime_measured
from cost_models.dp_cost import OVERLAP
from cost_models.estimate import GiB, estimate
from cost_models.profile_db import COLLECTIVE_KINDS, ProfileDB
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Partition, Plan

COMM_KINDS = COLLECTIVE_KINDS
TIME_KEYS = ("compute_scale", "comm_scale", "comm_latency_s", "overlap", "opt_scale", "step_overhead_s")
PRIOR = 0.01        # weight of (log coefficient)^2 per coefficient, vs the mean squared log error
KIND_PRIOR = 0.05   # weight of (log(kind factor / comm_scale))^2
WARMUP = 2          # steps dropped from the front of a log


class CalibrationError(ValueError):
    """Bad calibration input: one line naming the problem and the fix."""


@dataclass
class RunSample:
    """One measured run of one plan."""

    name: str
    graph: ModelGraph
    cluster: Cluster
    config: ParallelConfig
    partition: Partition
    global_batch: int
    measured_step_s: float                         # median over the steps after the warm-up
    measured_mem_gib: list[float] = field(default_factory=list)   # per pp rank: max peak RSS of its ranks
    step_times: list[float] = field(default_factory=list)


# ----------------------------------------------------------------------------- reading runs

def parse_run_arg(arg: str) -> tuple[str, str]:
    """``PLAN.json:LOG.jsonl`` or a run directory holding ``plan.json`` and ``train_log.jsonl``."""
    if os.path.isdir(arg):
        plan, log = os.path.join(arg, "plan.json"), os.path.join(arg, "train_log.jsonl")
    elif ":" in arg:
        plan, log = arg.rsplit(":", 1)
    else:
        raise CalibrationError(f"--run-log {arg!r}: give PLAN.json:train_log.jsonl or a run directory "
                               "holding plan.json and train_log.jsonl")
    for p in (plan, log):
        if not os.path.isfile(p):
            raise CalibrationError(f"--run-log {arg!r}: {p} not found")
    return plan, log


def read_log(log: str, warmup: int = WARMUP) -> tuple[list[float], list[float]]:
    """(step times after the warm-up, every rank's peak RSS in GiB at the last step)."""
    recs = []
    with open(log, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise CalibrationError(f"{log}: not a train_log.jsonl ({e})") from None
    if not recs:
        raise CalibrationError(f"{log}: no steps logged: run the plan for a few steps first")
    try:
        times = [float(r["step_s"]) for r in recs[warmup:]] or [float(r["step_s"]) for r in recs]
        mem = [float(x) for x in recs[-1].get("memory_gib") or [] if x is not None]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CalibrationError(f"{log}: not a train_log.jsonl (step records need step_s and memory_gib: "
                               f"{type(e).__name__} {e})") from None
    return times, mem


def per_stage_memory(cfg: ParallelConfig, per_rank: Sequence[float]) -> list[float]:
    """Max measured value over the ranks of each pp rank (mesh [pp, dp, cp, tp], pp outermost)."""
    per = cfg.dp * cfg.cp * cfg.tp
    if len(per_rank) != cfg.world:
        return []
    return [max(per_rank[r * per:(r + 1) * per]) for r in range(cfg.pp)]


def sample_from_run(plan_path: str, log_path: str, *, load_graph: Callable[..., ModelGraph],
                    load_cluster: Callable[[str], Cluster], warmup: int = WARMUP, name: str | None = None,
                    extra_logs: Sequence[str] = ()) -> RunSample:
    """A RunSample from a plan file and its log(s); several logs of one plan are pooled
    (median of the per-run medians)."""
    plan = Plan.load(plan_path)
    graph = load_graph(plan.model.get("spec") or plan.model["name"], batch=1, seq_len=plan.batch["seq_len"])
    if graph.fingerprint() != plan.model.get("fingerprint"):
        raise CalibrationError(f"{plan_path}: the model its spec names has changed since planning: plan it again")
    cluster = load_cluster(plan.cluster.get("spec") or plan.cluster["name"])
    medians, mems, all_times = [], [], []
    for log in (log_path, *extra_logs):
        times, mem = read_log(log, warmup)
        medians.append(statistics.median(times))
        all_times += times
        mems.append(per_stage_memory(plan.config, mem))
    mem = [max(col) for col in zip(*mems)] if all(mems) else []
    return RunSample(name=name or os.path.basename(os.path.dirname(os.path.abspath(log_path))) or plan_path,
                     graph=graph, cluster=cluster, config=plan.config, partition=plan.partition(),
                     global_batch=int(plan.batch["global"]), measured_step_s=statistics.median(medians),
                     measured_mem_gib=mem, step_times=all_times)


# ----------------------------------------------------------------------------- predicting

def with_calibration(profile: ProfileDB | None, cal: dict[str, float], cluster: Cluster,
                     source: str = "") -> ProfileDB:
    """A shallow copy of ``profile`` carrying ``cal`` (an empty profile when there is none) and
    ``source``, one line on what it was fitted on."""
    if profile is None:
        p = ProfileDB(cluster_fingerprint=cluster.fingerprint(), backend=cluster.backend, world=cluster.world)
    else:
        p = copy.copy(profile)
    p.calibration = dict(cal)
    p.calibration_source = source
    return p


def predict(s: RunSample, profile: ProfileDB | None, cal: dict[str, float] | None = None):
    """The Estimate of a run under ``cal`` (None: the profile's own calibration)."""
    prof = profile if cal is None else with_calibration(profile, cal, s.cluster)
    return estimate(s.graph, s.cluster, s.config, s.partition, s.global_batch, profile=prof)


def _defaults(cluster: Cluster) -> dict[str, float]:
    return {"compute_scale": 1.0, "comm_scale": 1.0, "comm_latency_s": 0.0, "overlap": OVERLAP.get(cluster.backend, 0.5),
            "opt_scale": 1.0, "step_overhead_s": 0.0}


def _kinds_used(samples: Sequence[RunSample], profile: ProfileDB | None) -> list[str]:
    """Collective kinds whose scaling changes some run's predicted step time."""
    out = []
    for kind in COMM_KINDS:
        for s in samples:
            a = predict(s, profile, {}).step_s
            b = predict(s, profile, {f"comm_scale.{kind}": 2.0}).step_s
            if abs(b - a) > 1e-3 * a:
                out.append(kind)
                break
    return out


class _Space:
    """Coefficients <-> an unconstrained vector (logs, a logit for overlap)."""

    def __init__(self, keys: Sequence[str], kinds: Sequence[str], base: dict[str, float], ref_s: float,
                 prior: float = PRIOR):
        self.keys, self.kinds, self.base, self.ref_s, self.prior = list(keys), list(kinds), base, ref_s, prior

    def x0(self) -> list[float]:
        return [0.0] * (len(self.keys) + len(self.kinds))

    def cal(self, x: Sequence[float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for k, v in zip(self.keys, x):
            if k == "overlap":
                b = min(max(self.base[k], 1e-3), 1 - 1e-3)
                z = math.log(b / (1 - b)) + v
                out[k] = 1.0 / (1.0 + math.exp(-max(min(z, 50), -50)))
            elif k == "step_overhead_s":
                out[k] = abs(v) * self.ref_s  # |x| keeps it non-negative; scaled to the runs' step time
            elif k == "comm_latency_s":
                out[k] = abs(v) * self.ref_s * 1e-2  # per call: about 1/100 of a step per unit
            else:
                out[k] = self.base[k] * math.exp(max(min(v, 20), -20))
        comm = out.get("comm_scale", 1.0)
        for k, v in zip(self.kinds, x[len(self.keys):]):
            out[f"comm_scale.{k}"] = comm * math.exp(max(min(v, 20), -20))
        return out

    def penalty(self, x: Sequence[float]) -> float:
        main = sum(v * v for v in x[:len(self.keys)])  # overhead: (overhead / median step)^2
        return self.prior * main + KIND_PRIOR * sum(v * v for v in x[len(self.keys):])


def nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.5, iters: int = 400,
                 tol: float = 1e-9) -> tuple[list[float], float]:
    n = len(x0)
    if n == 0:
        return x0, f(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (1 + abs(vals[0])):
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:  # shrink towards the best
                for i in range(1, n + 1):
                    pts[i] = [pts[0][j] + 0.5 * (pts[i][j] - pts[0][j]) for j in range(n)]
                    vals[i] = f(pts[i])
    best = min(range(n + 1), key=lambda i: vals[i])
    return pts[best], vals[best]


def fit(samples: Sequence[RunSample], profile: ProfileDB | None, *, keys: Sequence[str] = TIME_KEYS,
        per_kind: bool = True, memory: bool = True, prior: float = PRIOR) -> dict[str, float]:
    """Coefficients minimising the step-time error of ``samples`` (module docstring); ``prior``:
    the weight pulling each coefficient to its uncalibrated value (weaker for designed runs
    that identify every fitted coefficient, as the first-run machine profile's)."""
    if not samples:
        raise CalibrationError("no runs to calibrate on: pass at least one --run-log")
    for k in keys:
        if k not in TIME_KEYS:
            raise CalibrationError(f"unknown coefficient {k!r}: use {', '.join(TIME_KEYS)}")
    cluster = samples[0].cluster
    base = _defaults(cluster)
    kinds = _kinds_used(samples, profile) if per_kind and "comm_scale" in keys else []
    ref = statistics.median(s.measured_step_s for s in samples)
    space = _Space(keys, kinds, base, ref, prior)
    logm = [math.log(s.measured_step_s) for s in samples]

    def loss(x: list[float]) -> float:
        cal = space.cal(x)
        err = 0.0
        for s, lm in zip(samples, logm):
            p = predict(s, profile, cal).step_s
            err += (math.log(max(p, 1e-12)) - lm) ** 2
        return err / len(samples) + space.penalty(x)

    best_x, best_v = space.x0(), loss(space.x0())
    starts = [space.x0()]
    # a second start: all compute scaled to match the median ratio (a common first-order error)
    if "compute_scale" in keys:
        r = statistics.median(math.log(s.measured_step_s / predict(s, profile, {}).step_s) for s in samples)
        x = space.x0()
        x[space.keys.index("compute_scale")] = r
        if "comm_scale" in keys:
            x[space.keys.index("comm_scale")] = r
        starts.append(x)
    for x0 in starts:
        x, v = nelder_mead(loss, x0)
        x, v = nelder_mead(loss, x, step=0.1)  # restart: Nelder-Mead stalls on flat directions
        if v < best_v:
            best_x, best_v = x, v
    cal = space.cal(best_x)
    if memory:
        cal.update(fit_memory(samples, profile))
    sources = {predict(s, profile, {}).source for s in samples}
    if sources == {"roofline"} and "compute_scale" in cal and cluster.backend == "gloo":
        # a CPU roofline's scale is its efficiencies (a GPU's kernel model keeps compute_scale)
        k = cal.pop("compute_scale")
        cal["eff_matmul"] = EFF_MATMUL_CPU / k
        cal["eff_memory"] = EFF_MEMORY / k
        cal["op_overhead_s"] = CPU_OP_OVERHEAD_S * k
        for key in DTENSOR_KEYS:
            cal[key] = runtime_measured(key, profile) * k
    return {k: float(v) for k, v in sorted(cal.items())}


def fit_memory(samples: Sequence[RunSample], profile: ProfileDB | None) -> dict[str, float]:
    """``mem_reserve_gib`` and ``mem_reserve_frac`` (module docstring); {} without memory figures."""
    pts = []  # (predicted tensors GiB, measured GiB)
    for s in samples:
        est = predict(s, profile, {})
        pts += [(e.tensors / GiB, m) for m, e in zip(s.measured_mem_gib, est.memory) if m > 0]
    if not pts:
        return {}
    offset_only = {"mem_reserve_gib": max(0.0, statistics.median(m - t for t, m in pts)), "mem_reserve_frac": 0.0}
    if len({round(t, 3) for t, _ in pts}) < 2:
        return offset_only
    # weighted least squares on relative error: minimise sum ((t + b + f t - m) / m)^2
    w = [1.0 / (m * m) for _, m in pts]
    sxx = sum(wi * t * t for wi, (t, _) in zip(w, pts))
    sx = sum(wi * t for wi, (t, _) in zip(w, pts))
    s1 = sum(w)
    sxy = sum(wi * t * (m - t) for wi, (t, m) in zip(w, pts))
    sy = sum(wi * (m - t) for wi, (t, m) in zip(w, pts))
    det = s1 * sxx - sx * sx
    if det <= 1e-12 * s1 * sxx:
        return offset_only
    b = (sy * sxx - sx * sxy) / det
    f = (s1 * sxy - sx * sy) / det
    if b < 0 or f < 0:  # keep both physical: fit the other alone
        if f < 0:
            return offset_only
        return {"mem_reserve_gib": 0.0, "mem_reserve_frac": max(0.0, sxy / sxx)}
    return {"mem_reserve_gib": b, "mem_reserve_frac": f}


# ----------------------------------------------------------------------------- scoring

def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan for fewer than 2 points."""
    if len(xs) < 2:
        return float("nan")

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def mape(pred: Sequence[float], meas: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent of the measured values."""
    return 100.0 * statistics.mean(abs(p - m) / m for p, m in zip(pred, meas)) if pred else float("nan")


def memory_errors(pred_gib: Sequence[Sequence[float]], meas_gib: Sequence[Sequence[float]]) -> list[float]:
    """Per run, the worst pp rank's relative error (signed, of the measured value)."""
    out = []
    for p, m in zip(pred_gib, meas_gib):
        errs = [(a - b) / b for a, b in zip(p, m) if b]
        if errs:
            out.append(max(errs, key=abs))
    return out


def leave_one_out(samples: Sequence[RunSample], profile: ProfileDB | None, **fit_kw: Any) -> list[dict[str, Any]]:
    """For each run: the uncalibrated prediction, and the prediction of a fit on all the other runs."""
    rows = []
    for i, s in enumerate(samples):
        rest = [t for j, t in enumerate(samples) if j != i]
        cal = fit(rest, profile, **fit_kw) if rest else {}
        before, after = predict(s, profile, {}), predict(s, profile, cal)
        rows.append({"name": s.name, "config": s.config.label(), "measured_step_s": s.measured_step_s,
                     "predicted_step_s": before.step_s, "heldout_step_s": after.step_s,
                     "measured_mem_gib": list(s.measured_mem_gib),
                     "predicted_mem_gib": [m.total / GiB for m in before.memory],
                     "heldout_mem_gib": [m.total / GiB for m in after.memory], "calibration": cal})
    return rows


def summarize(rows: Sequence[dict[str, Any]], pred_key: str, mem_key: str) -> dict[str, float]:
    """Spearman, MAPE (%) and mean absolute memory error (%) of one prediction column."""
    meas = [r["measured_step_s"] for r in rows]
    pred = [r[pred_key] for r in rows]
    merr = memory_errors([r[mem_key] for r in rows], [r["measured_mem_gib"] for r in rows])
    return {"spearman": spearman(pred, meas), "mape_pct": mape(pred, meas),
            "memory_mean_abs_err_pct": 100 * statistics.mean(abs(e) for e in merr) if merr else float("nan"),
            "memory_max_abs_err_pct": 100 * max(abs(e) for e in merr) if merr else float("nan")}
