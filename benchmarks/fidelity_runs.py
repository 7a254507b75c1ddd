"""The fidelity benchmark's runs: each plan's program for a few steps, the repeats that show the
machine's noise, and the interleaved re-runs that settle each model's regret; the work folder's
manifest and the runs read back from it (``--reanalyse``)."""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any, Collection

from cost_models import calibrate as cal_mod

RUN_TIMEOUT_S = 300  # a plan whose run hangs is killed and counted as failed
RERUN = "c"  # the tag prefix of the interleaved re-runs: "c1", "c2", ... (the first pass is "0")
MANIFEST = "manifest.json"  # the work folder's index of its plans (:func:`write_manifest`)
RUN_RECORD = "run.json"     # a run folder's exit status and wall time (:func:`run_candidate`)
RUN_DIR = "run"             # a plan's run folders: run0, run1, ..., runc1, ... (``RUN_DIR + tag``)


def plan_name(c: Any) -> str:
    """"model layout": how the benchmark names a plan (re-run lists, samples, log lines)."""
    return f"{c.graph.name} {c.estimate.config.label()}"


def say(msg: str) -> None:
    print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


def run_candidate(c: Any, steps: int, warmup: int, tag: str, quiet: bool) -> dict:
    from planner.entry.launch import run_plan

    d = os.path.join(os.path.dirname(c.plan_path), RUN_DIR + tag)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    t0 = time.perf_counter()
    if quiet:
        with open(os.path.join(d, "stdout.txt"), "w") as fo:
            old_out, old_err = os.dup(1), os.dup(2)
            os.dup2(fo.fileno(), 1)
            os.dup2(fo.fileno(), 2)
            try:
                rc, log = run_plan(c.plan_path, steps=steps, run_dir=d, timeout_s=RUN_TIMEOUT_S)
            finally:
                os.dup2(old_out, 1)
                os.dup2(old_err, 2)
                os.close(old_out)
                os.close(old_err)
    else:
        rc, log = run_plan(c.plan_path, steps=steps, run_dir=d, timeout_s=RUN_TIMEOUT_S)
    wall = time.perf_counter() - t0
    with open(os.path.join(d, RUN_RECORD), "w", encoding="utf-8") as f:
        json.dump({"rc": rc, "wall_s": wall}, f)
    return read_run(d, tag, warmup, rc, wall, log)


def read_run(d: str, tag: str, warmup: int, rc: int, wall: float | None, log: str) -> dict:
    """One run's record: its exit status, wall seconds and log, and where it succeeded and
    logged steps its median step after ``warmup`` steps, those steps and every rank's peak RSS."""
    run = {"dir": d, "tag": tag, "rc": rc, "wall_s": wall, "log": log}
    if rc == 0 and os.path.exists(log):
        times, mem = cal_mod.read_log(log, warmup)
        run.update(median_s=statistics.median(times), times=times, mem_gib=mem)
    return run


def write_manifest(work: str, cands: list, args: argparse.Namespace, profile_path: str | None, cluster) -> None:
    """Index the work folder before its runs: each plan's folder, model and origin, and what the
    analysis reads (cluster, batch, sequence, warm-up, profile), so that ``--reanalyse WORK``
    scores the same runs again under the current cost model without running anything. ``cluster``:
    the cluster as this process measured it (``Cluster.detect``'s probes, the thread speed-up among
    them), kept so that a reanalysis prices with the same figures, not with its own probes."""
    plans = [{"dir": os.path.basename(os.path.dirname(c.plan_path)), "model": c.model, "origin": c.origin}
             for c in cands]
    man = {"cluster": args.cluster, "cluster_as_measured": cluster.to_dict(), "global_batch": args.global_batch,
           "seq_len": args.seq_len, "warmup": args.warmup,
           "profile": os.path.abspath(profile_path) if profile_path else None, "plans": plans}
    with open(os.path.join(work, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(man, f, indent=1)


def read_manifest(work: str) -> dict:
    """The manifest :func:`write_manifest` wrote, its profile found again if the folder moved;
    SystemExit naming the problem where there is none."""
    path = os.path.join(work, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--reanalyse {work}: no readable {MANIFEST} there ({e}); give a work folder "
                         "that benchmarks.fidelity ran in (--work)") from None
    prof = man.get("profile")
    if prof and not os.path.exists(prof) and os.path.exists(os.path.join(work, os.path.basename(prof))):
        man["profile"] = os.path.join(work, os.path.basename(prof))
    return man


def load_runs(plan_dir: str, warmup: int) -> list[dict]:
    """The runs a plan's folder holds (``run<tag>/``), as :func:`run_candidate` recorded them; a
    run without its record (a folder from before records were kept) counts as succeeded where
    its log has steps."""
    out = []
    for d in sorted(glob.glob(os.path.join(plan_dir, RUN_DIR + "*"))):
        log = os.path.join(d, "train_log.jsonl")
        rec_path = os.path.join(d, RUN_RECORD)
        if os.path.exists(rec_path):
            with open(rec_path, encoding="utf-8") as f:
                rec = json.load(f)
        else:
            rec = {"rc": 0 if os.path.exists(log) and os.path.getsize(log) else 1, "wall_s": None}
        out.append(read_run(d, os.path.basename(d)[len(RUN_DIR):], warmup, rec["rc"], rec["wall_s"], log))
    return out


def run_all(cands: list, args: argparse.Namespace, t_start: float) -> tuple[list[str], list[str]]:
    """Every plan once, then the repeats of the first (spread out in time: drift shows as noise),
    then the paired re-runs that settle each model's regret (:func:`confirm_order`); returns
    the runs skipped for the time budget and the plans re-run to settle regret."""
    order = [(i, "0") for i in range(len(cands))] + [(0, str(k)) for k in range(1, args.repeats)] if cands else []
    skipped = run_order(cands, order, args, t_start)
    confirm = confirm_order(cands, args.confirm)
    skipped += run_order(cands, confirm, args, t_start)
    plans = dict.fromkeys(i for i, _ in confirm)
    return skipped, [plan_name(cands[i]) for i in plans]


def confirm_order(cands: list, rounds: int, others: int = 2) -> list[tuple[int, str]]:
    """(candidate index, run tag) of the re-runs that settle regret: per model, the plan the
    uncalibrated predictions rank first and the ``others`` other plans measured fastest in the
    first pass, each run ``rounds`` more times, interleaved across plans and models so that
    drift in the machine's speed hits them alike. The plans are chosen whether or not the
    pick measured fastest, so that the re-runs correct a lucky pick as they correct an
    unlucky one (a single run's median moves by 5-35 % on this VM: moe-fid's one-process
    pick measured 70.8, 52.1, 47.5 ms in three runs, 2026-12-05)."""
    groups: list[list[int]] = []
    for model in dict.fromkeys(c.graph.name for c in cands):
        ok = [i for i, c in enumerate(cands) if c.graph.name == model and _first_median(c) is not None]
        if len(ok) < 2:
            continue
        pick = min(ok, key=lambda i: cands[i].estimate.step_s)
        rest = sorted((i for i in ok if i != pick), key=lambda i: _first_median(cands[i]))
        groups.append([pick] + rest[:others])
    return [(i, f"{RERUN}{r}") for r in range(1, rounds + 1) for g in groups for i in g]


def rerun_medians(runs: list[dict]) -> dict[str, float]:
    """Run tag -> the run's median step seconds, for the interleaved re-runs ("c1", "c2", ...)
    that succeeded; the first pass ("0", where the rivals were chosen as the fastest) and the
    noise repeats ("1", "2": back to back, apart from the other plans) are left out."""
    return {r["tag"]: r["median_s"] for r in runs if r["rc"] == 0 and "median_s" in r and r["tag"].startswith(RERUN)}


def paired_regret(rows: list[dict], pred_key: str, confirmed: Collection[str]) -> dict[str, float | None]:
    """Per model, regret from paired rounds: in each interleaved re-run round where the plan
    ranked first by ``pred_key`` and every other re-run plan of the model (``confirmed``: "model
    label" as :func:`run_all` returns them) succeeded, the pick's median over the fastest median
    of that round; the median of those ratios. One round runs each model's plans a few minutes
    apart at most, so a drift of the machine's speed between rounds cancels, where the ratio of
    medians over rounds keeps it (on this VM a whole round ran 30-43 % slower: moe-fid's three
    re-run plans measured 54, 62, 66 ms in one round and 77, 83, 86 ms in the next, 2026-12-06).
    The first pass is not a round here: its rivals were chosen as its fastest plans. None where
    the pick was not re-run, or fewer than two rounds are complete."""
    out: dict[str, float | None] = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        pick = min(mine, key=lambda r: r[pred_key])
        group = [r for r in mine if f"{model} {r['label']}" in confirmed]
        rounds = [rerun_medians(r["runs"]) for r in group]
        tags = sorted(set.intersection(*(set(m) for m in rounds))) if rounds else []
        if pick not in group or len(tags) < 2:
            out[model] = None
            continue
        mine_r = rounds[group.index(pick)]
        out[model] = statistics.median(mine_r[t] / min(m[t] for m in rounds) for t in tags)
    return out


def _first_median(c) -> float | None:
    return next((r["median_s"] for r in c.runs if r["rc"] == 0 and "median_s" in r), None)


def run_order(cands: list, order: list[tuple[int, str]], args: argparse.Namespace, t_start: float) -> list[str]:
    """Run ``order``'s (candidate, tag) pairs; returns those skipped for the time budget."""
    skipped = []
    for i, tag in order:
        c = cands[i]
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            skipped.append(f"{plan_name(c)} run {tag}")
            continue
        run = run_candidate(c, args.steps, args.warmup, tag, quiet=not args.verbose)
        c.runs.append(run)
        say(f"[{i + 1}/{len(cands)}{f' run {tag}' if tag != '0' else ''}] {c.graph.name} "
            f"{c.estimate.config.label()}: rc {run['rc']}, predicted {c.estimate.step_s:.3f} s, measured "
            f"{run.get('median_s', float('nan')):.3f} s, wall {run['wall_s']:.0f} s")
    return skipped


def noise_of(cands: list) -> dict | None:
    """Run-to-run spread of the first plan's repeats, or None with fewer than two runs."""
    rep = [r for r in cands[0].runs if "median_s" in r] if cands else []
    if len(rep) < 2:
        return None
    meds = sorted(r["median_s"] for r in rep)
    return {"label": plan_name(cands[0]), "runs": len(rep),
            "run_medians_s": meds, "min_s": meds[0], "median_s": statistics.median(meds),
            "max_s": meds[-1], "spread_pct": (meds[-1] - meds[0]) / statistics.median(meds) * 100,
            "all_steps_min_s": min(t for r in rep for t in r["times"]),
            "all_steps_max_s": max(t for r in rep for t in r["times"])}
