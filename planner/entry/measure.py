"""The measuring commands: ``autopar profile`` (layers and collectives measured on a cluster)
and ``autopar calibrate`` (the cost model's coefficients fitted to measured runs)."""
from __future__ import annotations

import argparse
import json

from planner.entry.commands import check_out
from planner.entry.launch import cpu_scheduling, torchrun_cmd, worker_env
from planner.errors import AutoparError


def cmd_profile(args: argparse.Namespace) -> int:
    import subprocess

    from cost_models.cluster import parse_cluster
    from cost_models.profiler import worker_args
    from planner import zoo

    cluster = parse_cluster(args.cluster)
    zoo.load_model_spec(args.model)  # fail early on a bad model
    check_out(args.out, args.force)
    worker = worker_args(args.cluster, args.model, args.out, seq_len=args.seq_len or None, batches=args.batches,
                         repeats=args.repeats, dtype=args.dtype)
    if cluster.nodes > 1 or cluster.backend != "gloo":
        print("run on every node (set NODE_RANK and MASTER_ADDR):")
        print(f"  torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.devices_per_node} "
              f"--node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500 " + " ".join(worker[1:]))
        return 0
    env = worker_env(1, cluster.backend)  # as the plans run
    r = subprocess.run(torchrun_cmd(cluster.world, worker), env=env,
                       preexec_fn=cpu_scheduling(cluster.world, 1, cluster.backend))
    if r.returncode != 0:
        raise AutoparError(f"profiling failed (torchrun exit {r.returncode}); see the output above, "
                           "or rerun with fewer processes")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model to measured runs and store the coefficients in the profile.

    Each ``--run-log`` is ``PLAN.json:train_log.jsonl`` or a run directory holding
    ``plan.json`` and ``train_log.jsonl`` (``autopar run --dir`` writes the log there;
    copy the plan beside it). Logs of the same plan are pooled (median of their medians)."""
    import math
    import time

    from cost_models import calibrate as cal
    from cost_models.profile_db import ProfileDB

    profile = ProfileDB.load(args.profile)
    samples = _run_samples(args.run_log, profile, args.profile, args.warmup)
    profile.calibration = {}
    keys = [k for k in args.keys.split(",") if k] if args.keys else list(cal.TIME_KEYS)
    fitted = cal.fit(samples, profile, keys=keys)
    if not all(math.isfinite(v) for v in fitted.values()):
        raise AutoparError(f"the fit did not converge ({fitted}); check the run logs")
    rows = cal.leave_one_out(samples, profile, keys=keys) if len(samples) > 1 and not args.no_loo else []
    out = args.out or args.profile
    profile.calibration = fitted
    profile.calibration_source = (f"calibrated by autopar calibrate on {len(samples)} run(s) "
                                  f"({time.strftime('%Y-%m-%d', time.gmtime())})")
    profile.to_json(out)
    report = {"runs": len(samples), "calibration": fitted, "profile": out, "leave_one_out": [
        {k: r[k] for k in ("name", "measured_step_s", "predicted_step_s", "heldout_step_s",
                           "measured_mem_gib", "predicted_mem_gib", "heldout_mem_gib")} for r in rows]}
    if rows:
        report["before"] = cal.summarize(rows, "predicted_step_s", "predicted_mem_gib")
        report["after_heldout"] = cal.summarize(rows, "heldout_step_s", "heldout_mem_gib")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_fit(report, rows)
    return 0


def _run_samples(run_logs: list[str], profile, profile_path: str, warmup: int) -> list:
    """One calibration sample per plan, its logs pooled; every run must be of the profiled cluster."""
    import os

    from cost_models import calibrate as cal
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph

    by_plan: dict[str, list[str]] = {}
    for arg in run_logs:
        plan_path, log = cal.parse_run_arg(arg)
        by_plan.setdefault(os.path.abspath(plan_path), []).append(log)
    samples = []
    for plan_path, logs in by_plan.items():
        s = cal.sample_from_run(plan_path, logs[0], extra_logs=logs[1:], load_graph=load_graph,
                                load_cluster=parse_cluster, warmup=warmup, name=os.path.relpath(plan_path))
        if not profile.matches(s.cluster.fingerprint()):
            raise AutoparError(f"{plan_path} ran on another cluster than {profile_path} was measured on: "
                               "calibrate with runs of the profiled cluster")
        samples.append(s)
    return samples


def _print_fit(report: dict, rows: list[dict]) -> None:
    for r in rows:
        m = r["measured_step_s"]
        print(f"{r['name']}: measured {m:.4g} s, uncalibrated {r['predicted_step_s']:.4g} s "
              f"({(r['predicted_step_s'] / m - 1) * 100:+.1f}%), held-out fit {r['heldout_step_s']:.4g} s "
              f"({(r['heldout_step_s'] / m - 1) * 100:+.1f}%)")
    for k in ("before", "after_heldout"):
        if k in report:
            v = report[k]
            print(f"{'uncalibrated' if k == 'before' else 'calibrated, leave-one-out'}: Spearman "
                  f"{v['spearman']:.3f}, MAPE {v['mape_pct']:.1f}%, memory error {v['memory_mean_abs_err_pct']:.1f}%")
    if not rows:
        print("(one run: no held-out error; pass runs of several plans to measure it)")
    print("calibration: " + ", ".join(f"{k}={v:.4g}" for k, v in report["calibration"].items()))
    print(f"wrote {report['profile']}: `autopar plan --profile {report['profile']}` uses it")
