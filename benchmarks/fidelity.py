"""Planner fidelity on a local CPU cluster: predicted vs measured step time and memory of real plans.

1. Profile the cluster (``cost_models.profiler`` under torchrun) for every model; the
   per-model profiles are merged into one ProfileDB (``--profile none``: roofline only;
   ``--profile PATH``: reuse a profile).
2. For every model, take the planner's pick and its best distinct runner-ups (the
   search's ranked candidates), plus forced layouts priced with ``evaluate_config``
   (DP / TP+SP / CP / PP mixes, schedules, ZeRO stages) that fit and the runtime supports.
3. Emit and run every plan's program (``planner.entry.launch.run_plan``) for ``--steps`` steps;
   the measured step time is the median after ``--warmup`` steps, the measured memory
   every rank's peak RSS. The planner's pick of the first model runs ``--repeats``
   times (noise: min / median / max of the runs' medians). Then, per model, the pick and
   the two other plans measured fastest run ``--confirm`` more times, interleaved, so that
   the regret compares medians of several runs (:func:`confirm_order`). A plan with several
   runs enters the comparison with the median of their medians.
4. Uncalibrated predictions vs measurements: Spearman rank correlation, MAPE, the
   planner's regret (measured time of its pick / best measured time, per model: plans
   of different models are not alternatives to each other), memory error. Regret two ways:
   ``regret``, each plan at the median of its runs, and ``regret_paired``, the median over
   the re-run rounds of the ratio within one round (``fidelity_runs.paired_regret``: a round
   that runs slow as a whole cancels). Both are printed against the same target.
5. Calibration (cost_models/calibrate.py), leave-one-out: every plan is predicted by a
   fit on the OTHER plans; the same figures on those held-out predictions. The fit on
   all plans is written into a calibrated copy of the profile and every model is
   planned again with it.

    python -m benchmarks.fidelity [--cluster local-cpu:4] [--seq-len 64] [--global-batch 8]
        [--steps 8] [--repeats 3] [--models gpt-small,benchmarks/fidelity_llama.toml,benchmarks/fidelity_moe.toml]
        [--out benchmarks/results/fidelity.json]
    python -m benchmarks.fidelity --reanalyse runs/fidelity --out X.json   # steps 4-5 again on
        # the runs of that work folder (its manifest.json), under the current cost model

Targets (issue): Spearman >= 0.9, MAPE <= 15 %, regret <= 1.05, peak memory within 15 %; the
expert-parallel layouts (benchmarks/fidelity_moe.toml) within 25 %. The forced layouts include fewer processes than
the cluster's with more threads each (``ParallelConfig.threads``), down to one process.
Memory: the programs log peak RSS, which includes the interpreter and torch; the
uncalibrated model predicts tensor bytes only (RESERVE_CPU = 0), calibration fits the
per-process reserve (``mem_reserve_gib``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cost_models import calibrate as cal_mod  # noqa: E402
from cost_models.cluster import Cluster, parse_cluster  # noqa: E402
from cost_models.profile_db import ProfileDB  # noqa: E402
from benchmarks.fidelity_layouts import FORCED, FORCED_BY_WORLD  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from benchmarks.fidelity_runs import (RERUN, load_runs, noise_of, paired_regret, plan_name, read_manifest,  # noqa: E402
                                      run_all, run_candidate, write_manifest)
from benchmarks.fidelity_runs import say as _log  # noqa: E402

TARGETS = {"spearman": 0.9, "mape_pct": 15, "regret": 1.05, "memory_err_pct": 15}
LLAMA_SPEC = "benchmarks/fidelity_llama.toml"
MOE_SPEC = "benchmarks/fidelity_moe.toml"


@dataclass
class Candidate:
    model: str                 # the model spec
    graph: Any
    estimate: Any              # uncalibrated Estimate
    origin: str                # "pick" | "search #k" | "forced"
    plan_path: str = ""
    runs: list[dict] = field(default_factory=list)   # {"dir", "rc", "median_s", "times", "mem_gib", "wall_s"}


def _layout_key(cfg) -> tuple:
    """Layouts that differ only by recompute (the same run on CPU at these sizes) count as one."""
    return (cfg.dp, cfg.pp, cfg.cp, cfg.tp, cfg.ep, cfg.mbs, cfg.zero, cfg.schedule if cfg.pp > 1 else "-", cfg.vpp,
            cfg.sp, cfg.threads)


def _kind(graph) -> str:
    if any(layer.moe is not None for layer in graph.layers):
        return "moe"
    if graph.name.endswith("-tiny"):
        return "tiny"
    return "llama" if "llama" in graph.name else "gpt"


# ----------------------------------------------------------------------------- profile

def profile_models(models: list[str], cluster_spec: str, seq: int, batches: str, repeats: int, sizes: str,
                   work: str) -> str:
    from cost_models.profiler import worker_args
    from planner.entry.launch import cpu_scheduling, torchrun_cmd, worker_env

    cluster = parse_cluster(cluster_spec)
    merged: ProfileDB | None = None
    for i, model in enumerate(models):
        out = os.path.join(work, f"profile-{i}.json")
        # collectives once (with the first model); the others only add their layers
        args = worker_args(cluster_spec, model, out, seq_len=seq, batches=batches, repeats=repeats,
                           sizes=sizes if i == 0 else "1024")
        t0 = time.perf_counter()
        subprocess.run(torchrun_cmd(cluster.world, args), check=True, env=worker_env(1, cluster.backend),
                       preexec_fn=cpu_scheduling(cluster.world, 1, cluster.backend),  # as the runs are launched
                       stdout=subprocess.DEVNULL)
        _log(f"profiled {model} in {time.perf_counter() - t0:.0f} s")
        db = ProfileDB.load(out)
        if merged is None:
            merged = db
        else:
            for k, v in db.layers.items():
                merged.layers.setdefault(k, []).extend(v)
    path = os.path.join(work, "profile.json")
    assert merged is not None
    merged.to_json(path)
    return path


# ----------------------------------------------------------------------------- plans

def choose_plans(models: list[str], cluster, cluster_spec: str, seq: int, gb: int, profile, per_model_search: int,
                 forced: dict[str, list[str]], max_plans: int) -> list[Candidate]:
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config, plan_model

    out: list[list[Candidate]] = []
    for model in models:
        g = load_graph(model, batch=1, seq_len=seq)
        _, res = plan_model(g, cluster, gb, spec=model, cluster_spec=cluster_spec, profile=profile, top_k=40)
        seen = {_layout_key(res.best.config)}
        mine = [Candidate(model, g, res.best, "pick")]
        for k, alt in enumerate(res.alternatives, 1):
            if len(mine) > per_model_search:
                break
            if _layout_key(alt.config) in seen:
                continue
            seen.add(_layout_key(alt.config))
            mine.append(Candidate(model, g, alt, f"search #{k + 1}"))
        for s in forced.get(_kind(g), []):
            cfg = ParallelConfig.parse(s + ",dtype=fp32")
            if _layout_key(cfg) in seen:
                continue
            try:
                e, problems = evaluate_config(g, cluster, cfg, gb, profile=profile)
            except Exception as exc:  # noqa: BLE001 - a layout this model cannot take
                _log(f"skip {g.name} {s}: {exc}")
                continue
            if problems or not e.fits:
                _log(f"skip {g.name} {s}: {'does not fit' if not e.fits else '; '.join(problems)}")
                continue
            seen.add(_layout_key(cfg))
            mine.append(Candidate(model, g, e, "forced"))
        out.append(mine)
    flat = [c for group in zip_longest(*out) for c in group if c is not None]
    return flat[:max_plans] if max_plans else flat


def write_plans(cands: list[Candidate], cluster, cluster_spec: str, work: str) -> None:
    from planner.search.planning import build_plan

    for i, c in enumerate(cands):
        d = os.path.join(work, f"{i:02d}-{c.graph.name}-{c.estimate.config.label().replace(' ', '_')}")
        os.makedirs(d, exist_ok=True)
        plan = build_plan(c.graph, cluster, c.estimate, spec=c.model, cluster_spec=cluster_spec)
        c.plan_path = os.path.join(d, "plan.json")
        plan.save(c.plan_path, force=True)


# ----------------------------------------------------------------------------- analysis

def _sample(c: Candidate, cluster) -> cal_mod.RunSample | None:
    ok = [r for r in c.runs if r["rc"] == 0 and "median_s" in r]
    if not ok:
        return None
    mems = [cal_mod.per_stage_memory(c.estimate.config, r["mem_gib"]) for r in ok]
    mem = [max(col) for col in zip(*mems)] if all(mems) else []
    return cal_mod.RunSample(name=plan_name(c), graph=c.graph, cluster=cluster,
                             config=c.estimate.config, partition=c.estimate.partition,
                             global_batch=c.estimate.global_batch,
                             measured_step_s=statistics.median(r["median_s"] for r in ok), measured_mem_gib=mem,
                             step_times=[t for r in ok for t in r["times"]])


def median_regret(rows: list[dict], pred_key: str) -> dict[str, float]:
    """Per model: measured time of the plan the predictions rank first / best measured time, each
    plan at the median of its runs' medians."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        pick = min(mine, key=lambda r: r[pred_key])
        out[model] = pick["measured_step_s"] / min(r["measured_step_s"] for r in mine)
    return out


# the two predictions the benchmark scores: (result key, step-time column, memory column)
PREDICTIONS = (("before", "predicted_step_s", "predicted_mem_gib"),
               ("after_heldout", "heldout_step_s", "heldout_mem_gib"))


def summaries(rows: list[dict], confirmed: Sequence[str]) -> dict[str, Any]:
    """Per prediction (``PREDICTIONS``) over all ``rows``: Spearman, MAPE, memory error and both
    regrets; and ``per_model``, the same without regret for each model's rows."""
    out: dict[str, Any] = {key: dict(cal_mod.summarize(rows, pred, mem), regret=median_regret(rows, pred),
                                     regret_paired=paired_regret(rows, pred, confirmed))
                           for key, pred, mem in PREDICTIONS}
    models = sorted({r["model"] for r in rows})
    out["per_model"] = {m: {key: cal_mod.summarize([r for r in rows if r["model"] == m], pred, mem)
                            for key, pred, mem in PREDICTIONS} for m in models}
    return out


def analyse(cands: list[Candidate], cluster, profile, profile_path: str | None, cluster_spec: str, gb: int,
            seq: int, out_dir: str, confirmed: Sequence[str] = ()) -> dict[str, Any]:
    """Predictions against measurements, before calibration and held out (module docstring, 4-5);
    ``confirmed``: the plans re-run to settle regret ("model label", :func:`run_all`)."""
    from planner.search.planning import plan_model

    samples, rows = [], []
    for c in cands:
        s = _sample(c, cluster)
        if s is None:
            continue
        samples.append(s)
        rows.append({"model": c.graph.name, "origin": c.origin, "config": c.estimate.config.to_str(),
                     "label": c.estimate.config.label(), "plan": c.plan_path,
                     "runs": [{k: v for k, v in r.items() if k != "times"} for r in c.runs]})
    t0 = time.perf_counter()
    loo = cal_mod.leave_one_out(samples, profile)
    fit_s = time.perf_counter() - t0
    for r, l, s in zip(rows, loo, samples):
        r.update({k: v for k, v in l.items() if k not in ("name", "config")})
        r["measured_min_s"], r["measured_max_s"] = min(s.step_times), max(s.step_times)
    full = cal_mod.fit(samples, profile)
    for r, s in zip(rows, samples):
        r["breakdown_before"] = cal_mod.predict(s, profile, {}).breakdown
        after = cal_mod.predict(s, profile, full)
        r["breakdown_calibrated_all"] = after.breakdown
        r["calibrated_all_step_s"] = after.step_s
    res: dict[str, Any] = {"plans": rows, **summaries(rows, confirmed)}
    res["calibration"] = full
    res["calibration_fit_s"] = fit_s
    # the planner again, with the calibrated profile
    calibrated = cal_mod.with_calibration(profile, full, cluster)
    cal_path = os.path.join(out_dir, "fidelity_profile_calibrated.json")
    calibrated.to_json(cal_path)
    res["calibrated_profile"] = cal_path
    replan = {}
    for c in cands:
        if c.origin != "pick" or c.graph.name in replan:
            continue
        _, sr = plan_model(c.graph, cluster, gb, spec=c.model, cluster_spec=cluster_spec, profile=calibrated,
                           top_k=1)
        new = sr.best.config
        hit = [r for r in rows if r["model"] == c.graph.name and _layout_key_str(r["config"]) == _layout_key(new)]
        best_meas = min(r["measured_step_s"] for r in rows if r["model"] == c.graph.name)
        if not hit:
            res.setdefault("_replan_new", []).append(Candidate(c.model, c.graph, sr.best, "replan"))
        replan[c.graph.name] = {"before": c.estimate.config.label(), "after": new.label(),
                                "after_predicted_s": sr.best.step_s,
                                "after_measured_s": hit[0]["measured_step_s"] if hit else None,
                                "after_regret": hit[0]["measured_step_s"] / best_meas if hit else None}
    res["replan_calibrated"] = replan
    return res


def _layout_key_str(s: str) -> tuple:
    from planner.plan import ParallelConfig

    return _layout_key(ParallelConfig.parse(s))


def print_table(res: dict[str, Any]) -> None:
    hdr = (f"{'model':<11}{'layout':<42}{'origin':<10}{'pred s':>8}{'meas s':>8}{'min':>7}{'max':>7}"
           f"{'err%':>7}{'LOO s':>8}{'err%':>7}{'mem pred':>9}{'meas':>6}{'LOO':>6}")
    print(hdr)
    for r in res["plans"]:
        m = r["measured_step_s"]
        print(f"{r['model']:<11}{r['label'][:41]:<42}{r['origin']:<10}{r['predicted_step_s']:>8.3f}{m:>8.3f}"
              f"{r['measured_min_s']:>7.2f}{r['measured_max_s']:>7.2f}"
              f"{(r['predicted_step_s'] / m - 1) * 100:>7.1f}{r['heldout_step_s']:>8.3f}"
              f"{(r['heldout_step_s'] / m - 1) * 100:>7.1f}"
              f"{max(r['predicted_mem_gib']):>9.2f}{max(r['measured_mem_gib'] or [0]):>6.2f}"
              f"{max(r['heldout_mem_gib']):>6.2f}")
    for k in ("before", "after_heldout"):
        s = res[k]
        reg = ", ".join(f"{m} {v:.3f}" for m, v in s["regret"].items())
        paired = ", ".join(f"{m} {'-' if v is None else f'{v:.3f}'}" for m, v in s.get("regret_paired", {}).items())
        print(f"{k:<14} Spearman {s['spearman']:.3f}  MAPE {s['mape_pct']:.1f}%  regret [{reg}]  paired [{paired}]  "
              f"memory err mean {s['memory_mean_abs_err_pct']:.1f}% max {s['memory_max_abs_err_pct']:.1f}%")
    if res.get("confirmed", {}).get("plans"):
        c = res["confirmed"]
        print(f"regret settled by {c['rounds']} interleaved re-run(s) of: " + "; ".join(c["plans"]))
    if res.get("noise"):
        n = res["noise"]
        print(f"noise ({n['label']}, {n['runs']} runs): run medians min {n['min_s']:.3f} median {n['median_s']:.3f} "
              f"max {n['max_s']:.3f} s (spread {n['spread_pct']:.1f}%)")
    print("calibration: " + ", ".join(f"{k}={v:.4g}" for k, v in res["calibration"].items()))
    for m, v in res["replan_calibrated"].items():
        print(f"replan {m}: {v['before']} -> {v['after']}"
              + (f" (measured regret {v['after_regret']:.3f})" if v["after_regret"] else
                 f" ({v.get('note', 'not among the measured plans')})"))


def add_profile_args(ap: argparse.ArgumentParser, work: str) -> None:
    """The options :func:`load_profile` reads (profile to reuse or measure, work folder)."""
    ap.add_argument("--profile", default="", help="reuse this profile, or 'none' for the roofline (default: measure)")
    ap.add_argument("--profile-batches", default="1,4")
    ap.add_argument("--profile-sizes", default="1024,65536,1048576,4194304,16777216,67108864")
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--work", default=work)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="local-cpu:4")
    ap.add_argument("--models", default=f"gpt-small,{LLAMA_SPEC},{MOE_SPEC}")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the first model's planner pick (noise)")
    ap.add_argument("--confirm", type=int, default=4,
                    help="paired re-runs of each model's pick and its two fastest-measured rivals (regret)")
    ap.add_argument("--search-alternatives", type=int, default=1, help="distinct runner-ups per model")
    ap.add_argument("--max-plans", type=int, default=0, help="stop after this many plans (0: all)")
    ap.add_argument("--forced", default="", help="';'-separated config strings replacing the built-in forced layouts")
    add_profile_args(ap, "runs/fidelity")
    ap.add_argument("--out", default="benchmarks/results/fidelity.json")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds from the start after which no new run is launched (0: no limit)")
    ap.add_argument("--run-replan", action=argparse.BooleanOptionalAction, default=True,
                    help="run the calibrated planner's pick when it is not among the measured plans")
    ap.add_argument("--verbose", action="store_true", help="show the training programs' output")
    ap.add_argument("--reanalyse", default="", metavar="WORK",
                    help="score the runs of an earlier work folder again (its manifest.json) under the current "
                         "cost model: no profiling, no runs; --out is still written")
    return ap.parse_args(argv)


def load_profile(args: argparse.Namespace, models: list[str]) -> tuple[str | None, ProfileDB | None]:
    """The measured profile the "before" predictions use (uncalibrated), or none for the roofline."""
    if args.profile == "none":
        return None, None
    path = args.profile or profile_models(models, args.cluster, args.seq_len, args.profile_batches,
                                          args.profile_repeats, args.profile_sizes, args.work)
    return path, uncalibrated_profile(path)


def uncalibrated_profile(path: str) -> ProfileDB:
    """The profile at ``path`` without its calibration: predictions "before" are the uncalibrated model's."""
    profile = ProfileDB.load(path)
    profile.calibration = {}
    return profile


def run_replans(new: list, res: dict, cluster, profile, args: argparse.Namespace, t_start: float) -> None:
    """Run the calibrated planner's new picks (none of the measured plans is one) and record
    their measured regret in ``res["replan_calibrated"]``."""
    from planner.search.planning import build_plan, evaluate_config

    for c in new:
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            res["replan_calibrated"][c.graph.name]["note"] = "not run: time budget spent"
            continue
        d = os.path.join(args.work, f"replan-{c.graph.name}-{c.estimate.config.label().replace(' ', '_')}")
        os.makedirs(d, exist_ok=True)
        e0, _ = evaluate_config(c.graph, cluster, c.estimate.config, args.global_batch, profile=profile)
        c.plan_path = os.path.join(d, "plan.json")
        build_plan(c.graph, cluster, c.estimate, spec=c.model, cluster_spec=args.cluster).save(c.plan_path, force=True)
        run = run_candidate(c, args.steps, args.warmup, "0", quiet=not args.verbose)
        v = res["replan_calibrated"][c.graph.name]
        v["run"] = {k: x for k, x in run.items() if k != "times"}
        v["before_calibration_predicted_s"] = e0.step_s
        if "median_s" in run:
            best = min([r["measured_step_s"] for r in res["plans"] if r["model"] == c.graph.name] + [run["median_s"]])
            v["after_measured_s"] = run["median_s"]
            v["after_regret"] = run["median_s"] / best
            v["after_regret_note"] = "vs the best of the measured plans and this one"
        _log(f"replan {plan_name(c)}: rc {run['rc']}, predicted "
             f"{c.estimate.step_s:.3f} s (calibrated), measured {run.get('median_s', float('nan')):.3f} s")


def reload_candidates(man: dict, work: str, cluster, profile) -> list[Candidate]:
    """The manifest's plans with their recorded runs, each priced by the current estimator on
    the work folder's profile (the plan's own configuration, stage split and batch)."""
    from cost_models.estimate import estimate
    from planner.frontend.load import load_graph
    from planner.plan import Plan

    graphs: dict[str, Any] = {}
    cands = []
    for p in man["plans"]:
        d = os.path.join(work, p["dir"])
        plan = Plan.load(os.path.join(d, "plan.json"))
        if p["model"] not in graphs:
            graphs[p["model"]] = load_graph(p["model"], batch=1, seq_len=man["seq_len"])
        g = graphs[p["model"]]
        e = estimate(g, cluster, plan.config, plan.partition(), plan.batch["global"], profile=profile)
        cands.append(Candidate(p["model"], g, e, p["origin"], os.path.join(d, "plan.json"),
                               load_runs(d, man["warmup"])))
    return cands


def reanalyse(args: argparse.Namespace) -> int:
    """``--reanalyse WORK``: steps 4-5 of the module docstring on the runs a work folder already
    holds; the calibrated planner's new picks are named, not run."""
    work = args.reanalyse
    man = read_manifest(work)
    if "cluster_as_measured" in man:  # the figures the runs' plans were priced with
        cluster = Cluster.from_dict(man["cluster_as_measured"], source=f"{work}/manifest")
    else:  # a folder from before the manifest kept them: this process's own probes
        cluster = parse_cluster(man["cluster"])
        _log(f"{work}: the manifest has no measured cluster; pricing with this process's probes of {cluster.name}")
    profile = uncalibrated_profile(man["profile"]) if man["profile"] else None
    cands = reload_candidates(man, work, cluster, profile)
    confirmed = [plan_name(c) for c in cands
                 if any(r["tag"].startswith(RERUN) for r in c.runs)]
    rounds = max((int(r["tag"][len(RERUN):]) for c in cands for r in c.runs if r["tag"].startswith(RERUN)),
                 default=0)
    out_dir = os.path.dirname(args.out) or "."
    os.makedirs(out_dir, exist_ok=True)
    res = analyse(cands, cluster, profile, man["profile"], man["cluster"], man["global_batch"], man["seq_len"],
                  out_dir, confirmed)
    for c in res.pop("_replan_new", []):
        res["replan_calibrated"][c.graph.name]["note"] = "not run: --reanalyse runs nothing"
    if (noise := noise_of(cands)) is not None:
        res["noise"] = noise
    res.update(reanalysed=work, confirmed={"rounds": rounds, "plans": confirmed}, profile=man["profile"],
               targets=TARGETS, args=vars(args))
    print_table(res)
    write_json(args.out, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyse:
        return reanalyse(args)
    t_start = time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    cluster = parse_cluster(args.cluster)
    os.makedirs(args.work, exist_ok=True)
    out_dir = os.path.dirname(args.out) or "."
    os.makedirs(out_dir, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    profile_path, profile = load_profile(args, models)
    timings["profile_s"] = time.perf_counter() - t0

    forced = FORCED_BY_WORLD.get(cluster.world, {})
    if args.forced:
        forced = {k: [s for s in args.forced.split(";") if s] for k in FORCED}
    cands = choose_plans(models, cluster, args.cluster, args.seq_len, args.global_batch, profile,
                         args.search_alternatives, forced, args.max_plans)
    write_plans(cands, cluster, args.cluster, args.work)
    write_manifest(args.work, cands, args, profile_path, cluster)
    _log(f"{len(cands)} plans: " + "; ".join(f"{plan_name(c)} ({c.origin})"
                                             for c in cands))
    t0 = time.perf_counter()
    skipped, confirmed = run_all(cands, args, t_start)
    timings["runs_s"] = time.perf_counter() - t0

    res = analyse(cands, cluster, profile, profile_path, args.cluster, args.global_batch, args.seq_len, out_dir,
                  confirmed)
    new = res.pop("_replan_new", [])
    if new and args.run_replan:
        run_replans(new, res, cluster, profile, args, t_start)
    if (noise := noise_of(cands)) is not None:
        res["noise"] = noise
    failed = [{"model": c.graph.name, "config": c.estimate.config.to_str(), "dirs": [r["dir"] for r in c.runs]}
              for c in cands if c.runs and not any(r["rc"] == 0 for r in c.runs)]
    timings["total_s"] = time.perf_counter() - t_start
    res.update(failed=failed, skipped_for_time=skipped, confirmed={"rounds": args.confirm, "plans": confirmed},
               timings=timings, args=vars(args), profile=profile_path,
               targets=TARGETS)
    print_table(res)
    if failed:
        print(f"{len(failed)} plan(s) failed to run: " + "; ".join(f["config"] for f in failed))
    print(f"total {timings['total_s']:.0f} s (profile {timings['profile_s']:.0f} s, runs {timings['runs_s']:.0f} s)")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
