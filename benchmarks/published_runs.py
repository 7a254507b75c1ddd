"""The GPU cost model against published training runs (the development set).

Every run of the development set (``benchmarks/published/published_runs_dev.json`` and
``published_runs_dev2.json``, copies of the team's ``shared/data`` files) that autopar can
express (``benchmarks/published_express.py``: how, and what is assumed where a source is
silent) is priced at its published layout with ``evaluate_config`` (what ``autopar
evaluate`` calls) on the engine that ran it (``cost_models/engines.py``), with an even
stage split (the published runs split layers evenly), and compared with its published
throughput on the run's own counting basis: step time when the run gives it; tokens/s
per GPU; or TFLOP/s per GPU counted the way its source counts them (SC'21's Eq. 3, which
includes the recomputed forward, or model FLOPs: the MFU basis of the others).

The error is ``predicted throughput / published throughput - 1`` (positive: predicted too
fast). Printed: per run, the median absolute error, the share within 25 %, per source;
with ``--fit`` the coefficients fitted on every exact run and the leave-one-source-out
errors (every source predicted by a fit on the other sources: the headline); with
``--plan``, autopar's own pick for each job against the published layout, both priced on
autopar's runtime (>= 1.0: ours at least as fast), whether the degrees match, and why they
differ (the breakdown categories that move most).

Tiers: *exact* runs are expressed faithfully and make the headline figures;
*approximate* ones (marked ~) ran on a runtime whose behaviour no engine describes
(DeepSpeed's 2021 ZeRO-3; torchtitan's per-layer selective checkpointing) and are printed,
with the figures over all runs beside the headline. Skipped, with the reason printed:
FP8 runs, torch.compile runs, MegaScale's own system. The mixtures of experts are
``benchmarks/published_moe.py``.

    python -m benchmarks.published_runs [--fit] [--plan] [--out benchmarks/results/published_runs.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results import write_json  # noqa: E402
from cost_models.cluster import Cluster, load_preset  # noqa: E402
from benchmarks.published_express import Case, approx_reason, express, published_step_s  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# copies of the team's shared/data development set
DATA = [os.path.join(HERE, "published", "published_runs_dev.json"),
        os.path.join(HERE, "published", "published_runs_dev2.json")]


def cluster_for(c: Case) -> Cluster:
    cl = Cluster.from_toml(c.cluster) if c.cluster.endswith(".toml") else load_preset(c.cluster)
    cl.nodes = c.nodes
    return cl


class Graphs:
    """Captured graphs by model (ModelConfig keys), each captured once."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def get(self, model: dict[str, Any]):
        from planner.frontend.load import graph_of_config
        from planner.zoo import ModelConfig

        key = json.dumps(model, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = graph_of_config(ModelConfig(**model))
        return self.cache[key]


FIT_KEYS = ("gpu.gemm_eff_max", "gpu.attn_eff_max", "gpu.mem_eff", "overlap")
OVERLAP_DOCUMENTED = 0.8  # the DP-overlap prior (cost_models/dp_cost.py OVERLAP)


def predict(c: Case, graphs: Graphs, cal: dict[str, float] | None = None) -> dict[str, Any]:
    """Price ``c`` at its published layout with an even stage split (the published runs split
    layers evenly), with the defaults or the coefficients ``cal``."""
    from cost_models.calibrate import with_calibration
    from planner.search.planning import evaluate_config

    cluster = cluster_for(c)
    profile = with_calibration(None, cal, cluster) if cal else None  # an empty profile carrying the coefficients
    e, problems = evaluate_config(graphs.get(c.model), cluster, c.cfg, c.global_batch, even_split=True,
                                  profile=profile, engine=c.engine)
    pub = published_step_s(c)
    return {"step_s": e.step_s, "published_step_s": pub, "error": pub / e.step_s - 1.0, "fits": e.fits,
            "memory_gib": max(m.total for m in e.memory) / 2**30, "problems": problems,
            "breakdown": e.breakdown, "mfu": e.mfu}


def fit(cases: list[Case], graphs: Graphs) -> dict[str, float]:
    """Coefficients minimising the mean squared log error of step time over ``cases``, with a
    weak prior (0.1 per unit log) pulling each to its documented figure (never to a value
    fitted on other runs, so held-out errors are honest)."""
    from cost_models.calibrate import nelder_mead
    from cost_models.gpu_kernels import DOCUMENTED as d

    x0 = [math.log(d.gemm_eff_max), math.log(d.attn_eff_max), math.log(d.mem_eff), math.log(OVERLAP_DOCUMENTED)]

    def cal_of(x: list[float]) -> dict[str, float]:
        return {k: min(math.exp(v), 1.0) for k, v in zip(FIT_KEYS, x)}

    def loss(x: list[float]) -> float:
        cal = cal_of(x)
        errs = [math.log(predict(c, graphs, cal)["step_s"] / published_step_s(c)) for c in cases]
        return sum(e * e for e in errs) / len(errs) + 0.01 * sum((a - b) ** 2 for a, b in zip(x, x0))

    x, _ = nelder_mead(loss, x0, step=0.2, iters=200)
    return cal_of(x)


def summary(errors: list[float]) -> dict[str, float]:
    a = [abs(x) for x in errors]
    return {"n": len(a), "median_abs": statistics.median(a) if a else math.nan,
            "within_25": sum(x <= 0.25 for x in a) / len(a) if a else math.nan,
            "max_abs": max(a) if a else math.nan}


def _fmt(s: dict[str, float]) -> str:
    return (f"n={s['n']:<3} median |err| {s['median_abs'] * 100:5.1f}%   within 25%: {s['within_25'] * 100:3.0f}%"
            f"   max {s['max_abs'] * 100:.1f}%")


def plan_against(c: Case, graphs: Graphs) -> dict[str, Any]:
    """autopar's pick for the same job against the published layout, both priced by the same
    model on autopar's runtime (the engine the pick would run on), and why they differ: the
    step-time categories (``Estimate.breakdown``) that move most between the two."""
    from planner.errors import AutoparError
    from planner.search.planning import evaluate_config, plan_model

    g, cl = graphs.get(c.model), cluster_for(c)
    theirs, refused = evaluate_config(g, cl, c.cfg, c.global_batch, even_split=True)
    try:
        _, res = plan_model(g, cl, c.global_batch, spec=c.model["name"], cluster_spec=cl.name, fp8=c.cfg.fp8,
                            compile=c.cfg.compile)
    except AutoparError as err:  # a job autopar's runtime cannot run at all: say why, keep going
        # where autopar's runtime refuses their layout too, why (the planner's own names what it met first)
        why = f"their layout refused too: {'; '.join(refused)}" if refused else str(err).split(": ", 1)[-1]
        return {"pick": None, "speedup": None, "theirs_fits": theirs.fits, "degrees_match": False,
                "why": f"no plan: {why[:160]}", "theirs_on_autopar_s": theirs.step_s, "ours_s": None}
    ours = res.best
    deg = ("dp", "pp", "cp", "tp")
    keys = set(ours.breakdown) | set(theirs.breakdown)
    delta = {k: theirs.breakdown.get(k, 0.0) - ours.breakdown.get(k, 0.0) for k in keys}
    top = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:3]
    why = ", ".join(f"{k} {'-' if d > 0 else '+'}{abs(d) / theirs.step_s * 100:.0f}%" for k, d in top if abs(d) > 0.01 * theirs.step_s)
    return {"pick": ours.config.label(), "speedup": theirs.step_s / ours.step_s, "theirs_fits": theirs.fits,
            "degrees_match": all(getattr(ours.config, k) == getattr(c.cfg, k) for k in deg),
            "why": why or "same costs", "theirs_on_autopar_s": theirs.step_s, "ours_s": ours.step_s}


def fit_report(exact: list[Case], graphs: Graphs) -> dict[str, Any]:
    """Fit on every exact run, then leave each source out in turn; print and return the errors."""
    cal = fit(exact, graphs)
    print("fitted on all exact runs:", {k: round(v, 3) for k, v in cal.items()})
    ins = [predict(c, graphs, cal)["error"] for c in exact]
    print("  in-sample:          ", _fmt(summary(ins)))
    held = []
    for src in sorted({c.source for c in exact}):
        cal_src = fit([c for c in exact if c.source != src], graphs)
        e = [predict(c, graphs, cal_src)["error"] for c in exact if c.source == src]
        held += e
        print(f"  held out {src:<11}", _fmt(summary(e)), {k: round(v, 3) for k, v in cal_src.items()})
    print("  leave-one-source-out:", _fmt(summary(held)))
    return {"coefficients": cal, "in_sample": summary(ins), "leave_one_source_out": summary(held)}


def plan_report(exact: list[Case], graphs: Graphs) -> list[dict[str, Any]]:
    """autopar's pick for every exact run against its published layout (``plan_against``), printed."""
    picks = [dict(id=c.run_id, **plan_against(c, graphs)) for c in exact]
    print("autopar's pick against the published layout, both on autopar's runtime; why: the step's share "
          "each category saves (-) or adds (+) in our pick")
    for p in picks:
        if p["pick"] is None:
            print(f"  {p['id']:<44} {p['why']}")
            continue
        print(f"  {p['id']:<44} {p['pick']:<60} {p['speedup']:.3f}x  "
              f"{'same degrees; ' if p['degrees_match'] else ''}{'' if p['theirs_fits'] else 'theirs OOM; '}{p['why']}")
    sp = [p["speedup"] for p in picks if p["speedup"] is not None]
    print(f"planner vs published layouts ({len(sp)} of {len(picks)} planned): median {statistics.median(sp):.3f}x, "
          f"min {min(sp):.3f}x, degrees match {sum(p['degrees_match'] for p in picks)} of {len(picks)}")
    return picks


def _new_modes(c: Case) -> bool:
    """Whether a run trains with float8 linears or compiled blocks (the modes issue 27 added)."""
    return c.cfg.fp8 != "none" or c.cfg.compile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", default=DATA, help="development-set files (default: both)")
    ap.add_argument("--fit", action="store_true", help="fit the coefficients and print leave-one-source-out errors")
    ap.add_argument("--plan", action="store_true", help="plan every exactly expressed job and compare picks")
    ap.add_argument("--out", default="benchmarks/results/published_runs.json")
    args = ap.parse_args()
    runs = [r for path in args.data for r in json.load(open(path, encoding="utf-8"))["runs"]]
    graphs = Graphs()
    cases, tier, skipped = [], {}, []
    for run in runs:
        c = express(run)
        if isinstance(c, str):
            skipped.append({"id": run["id"], "why": c})
            continue
        cases.append(c)
        tier[c.run_id] = approx_reason(run)
    exact = [c for c in cases if tier[c.run_id] is None]
    rows = []
    for c in cases:
        r = predict(c, graphs)
        rows.append({"id": c.run_id, "source": c.source, "config": c.cfg.label(), "approximate": tier[c.run_id],
                     "assumptions": c.assumptions, **r})
    print(f"{'run':<46}{'layout':<56}{'pub s':>8}{'pred s':>8}{'err':>8}  fits")
    for r in rows:
        print(f"{r['id'] + (' ~' if r['approximate'] else ''):<46}{r['config']:<56}{r['published_step_s']:>8.3g}"
              f"{r['step_s']:>8.3g}{r['error'] * 100:>+7.1f}%  {'yes' if r['fits'] else 'NO'}")
    print(f"skipped {len(skipped)} runs autopar cannot express: " + "; ".join(sorted({s['why'] for s in skipped})))
    print("~ approximate: " + "; ".join(sorted({v for v in tier.values() if v})))
    out: dict[str, Any] = {"rows": rows, "skipped": skipped}
    err = {r["id"]: r["error"] for r in rows}
    out["summary"] = summary([err[c.run_id] for c in exact])
    print("exact runs:         ", _fmt(out["summary"]))
    for src in sorted({c.source for c in exact}):
        print(f"  {src:<18}", _fmt(summary([err[c.run_id] for c in exact if c.source == src])))
    for name, sub in (("  eager bf16 runs", [c for c in exact if not _new_modes(c)]),
                      ("  FP8 / compile runs", [c for c in exact if _new_modes(c)])):
        if sub:
            out[name.strip()] = summary([err[c.run_id] for c in sub])
            print(f"{name:<20}", _fmt(out[name.strip()]))
    print("exact + approximate:", _fmt(summary(list(err.values()))))
    fits = [r for r in rows if r["fits"]]
    print(f"judged to fit: {len(fits)} of {len(rows)} (exact: {sum(r['fits'] for r in rows if not r['approximate'])}"
          f" of {len(exact)})")
    if args.fit:
        out["fit"] = fit_report(exact, graphs)
    if args.plan:
        out["plans"] = plan_report(exact, graphs)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
