"""Pipeline schedule families: predicted vs measured step time on a local CPU cluster.

For one small Llama (``benchmarks/fidelity_llama.toml``, 32M parameters), every schedule family
the runtime runs, each on a layout that runs it (:data:`FAMILIES`), priced uncalibrated
(``evaluate_config`` on the measured profile, ``AUTOPAR_CALIBRATE=0``; every family on the even
stage split, as dualpipev and custom schedules are priced, and the plan runs the split priced) and
run ``--repeats`` times for ``--steps`` steps through ``benchmarks/fidelity.py``'s machinery
(profile, plan files, ``autopar run``, step times from the run's log: the median after
``--warmup`` steps; a family's figure is the median of its runs' medians):

gpipe, 1f1b, interleaved-1f1b (vpp 2), zb-h1, dualpipev, a generated schedule
(``planner/search/schedule_gen.py`` for the 1f1b layout's own stage times), a user-written CSV
schedule (:data:`USER_CSV`, torch's action format), sequence chunks (k = 2 and 4), activation
offload (``recompute=offload``) and the head as vocabulary passes under a schedule generated for
them (``planner/search/vocab_schedule.schedule_for``).

    python -m benchmarks.schedule_fidelity [--cluster local-cpu:4] [--steps 6] [--profile PATH]
        [--repeats 2] [--families gpipe,1f1b,...] [--out benchmarks/results/schedule_fidelity.json]

Target (issue 28): every family within 15 %.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.fidelity import LLAMA_SPEC, Candidate, add_profile_args, load_profile, write_plans  # noqa: E402
from benchmarks.fidelity_runs import run_candidate  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from cost_models.cluster import parse_cluster  # noqa: E402

TARGET_PCT = 15.0
BASE = "pp=4,mbs=1,dtype=fp32"          # 8 micro-batches of one sequence at global batch 8
# family -> config string (a "generated" or "csv" family prices that layout with its own schedule IR)
FAMILIES: dict[str, str] = {
    "gpipe": f"{BASE},schedule=gpipe",
    "1f1b": f"{BASE},schedule=1f1b",
    "interleaved-1f1b": f"{BASE},schedule=interleaved-1f1b,vpp=2",
    "zb-h1": f"{BASE},schedule=zb-h1",
    "dualpipev": f"{BASE},schedule=dualpipev,vpp=2",
    "generated": f"{BASE},schedule=1f1b",
    "user-csv": "pp=2,dp=2,mbs=1,zero=zero1,dtype=fp32,schedule=1f1b",
    "seq-chunks-2": f"{BASE},schedule=1f1b,seq_chunks=2",
    "seq-chunks-4": f"{BASE},schedule=1f1b,seq_chunks=4",
    "offload": f"{BASE},schedule=1f1b,recompute=offload",
    "vocab-passes": f"{BASE},schedule=custom,vpp=2,vocab_passes=on",
    "vocab-passes-interleaved": f"{BASE},schedule=custom,vpp=2,vocab_passes=on",
}
# a hand-written schedule for pp2 x 4 micro-batches: stage 0 runs three forwards ahead
# (one more than 1F1B's warm-up), stage 1 alternates forward and backward
USER_CSV = "0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"


def _log(msg: str) -> None:
    print(f"[schedule_fidelity] {msg}", file=sys.stderr, flush=True)


def price(family: str, graph, cluster, gb: int, profile, work: str):
    """The uncalibrated estimate of ``family``'s layout, with its schedule IR where it has one."""
    from planner.plan import ParallelConfig
    from planner.schedule_file import load as load_schedule
    from planner.search.planning import evaluate_config
    from planner.search.schedule_gen import generate

    cfg = ParallelConfig.parse(FAMILIES[family])
    schedule = None
    if family == "generated":
        base, _ = evaluate_config(graph, cluster, cfg, gb, profile=profile, even_split=True)
        schedule = generate(base.stage_fwd_s, base.stage_bwd_s, base.microbatches, p2p=base.p2p_hop_s,
                            split=base.split)
    elif family.startswith("vocab-passes"):  # the head as 4 passes: the interleaved order, or one generated
        from planner.schedule_ir import builtin
        from planner.search.vocab_schedule import schedule_for
        from planner.vocab_passes import with_vocab_passes
        schedule = builtin("interleaved-1f1b", cfg.pp, gb // cfg.mbs, 2)
        if family == "vocab-passes":
            first, _ = evaluate_config(graph, cluster, cfg, gb, profile=profile, even_split=True, schedule=schedule)
            schedule = schedule_for(with_vocab_passes(graph, cfg.pp), first)
    elif family == "user-csv":
        path = os.path.join(work, "user_schedule.csv")
        with open(path, "w", encoding="utf-8") as f:
            f.write(USER_CSV)
        schedule = load_schedule(path)
    if schedule is not None and not cfg.vocab_passes:
        cfg = cfg.replace(schedule="custom", vpp=schedule.v).validate()
    e, problems = evaluate_config(graph, cluster, cfg, gb, profile=profile, even_split=True, schedule=schedule)
    if problems:
        raise SystemExit(f"{family} ({cfg.label()}): the runtime cannot run it: {'; '.join(problems)}")
    return e


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Price and run every family; returns the result rows and timings."""
    from planner.frontend.load import load_graph

    t0 = time.perf_counter()
    cluster = parse_cluster(args.cluster)
    os.makedirs(args.work, exist_ok=True)
    profile_path, profile = load_profile(args, [args.model])
    t_prof = time.perf_counter() - t0
    graph = load_graph(args.model, batch=1, seq_len=args.seq_len)
    fams = [f for f in args.families.split(",") if f]
    cands = [Candidate(args.model, graph, price(f, graph, cluster, args.global_batch, profile, args.work), f)
             for f in fams]
    write_plans(cands, cluster, args.cluster, args.work)
    for k in range(args.repeats):  # every family once, then again: drift shows as spread, not as error
        for c in cands:
            run = run_candidate(c, args.steps, args.warmup, str(k), quiet=not args.verbose)
            c.runs.append(run)
            _log(f"{c.origin} run {k}: rc {run['rc']}, predicted {c.estimate.step_s:.3f} s, measured "
                 f"{run.get('median_s', float('nan')):.3f} s, wall {run['wall_s']:.0f} s")
    rows = [row_of(c) for c in cands]
    return {"rows": rows, "profile": profile_path, "timings": {"profile_s": t_prof,
                                                                "total_s": time.perf_counter() - t0}}


def row_of(c: Candidate) -> dict[str, Any]:
    """One family's record: the prediction, every run, and (when any ran) the median of the runs'
    medians with its error."""
    ok = [r for r in c.runs if "median_s" in r]
    row = {"family": c.origin, "layout": c.estimate.config.label(), "config": c.estimate.config.to_str(),
           "predicted_s": c.estimate.step_s, "breakdown": c.estimate.breakdown,
           "runs": [{k: v for k, v in r.items() if k != "log"} for r in c.runs]}
    if ok:
        meas = statistics.median(r["median_s"] for r in ok)
        row.update(measured_s=meas, run_medians_s=[r["median_s"] for r in ok],
                   times=[t for r in ok for t in r["times"]], error_pct=(c.estimate.step_s / meas - 1) * 100)
    return row


def print_table(res: dict[str, Any]) -> None:
    print(f"{'family':<18}{'layout':<40}{'pred s':>8}{'meas s':>8}{'runs':>14}{'err%':>7}")
    for r in res["rows"]:
        if "measured_s" not in r:
            print(f"{r['family']:<18}{r['layout'][:39]:<40}{r['predicted_s']:>8.3f}  failed: "
                  + ", ".join(f"rc {x['rc']} {x['dir']}" for x in r["runs"]))
            continue
        runs = "/".join(f"{x:.3f}" for x in r["run_medians_s"])
        print(f"{r['family']:<18}{r['layout'][:39]:<40}{r['predicted_s']:>8.3f}{r['measured_s']:>8.3f}"
              f"{runs:>14}{r['error_pct']:>7.1f}")
    ok = [r for r in res["rows"] if "measured_s" in r]
    off = [r["family"] for r in ok if abs(r["error_pct"]) > TARGET_PCT]
    if ok:
        print(f"within {TARGET_PCT:.0f}%: {len(ok) - len(off)}/{len(ok)}; MAPE "
              f"{statistics.mean(abs(r['error_pct']) for r in ok):.1f}%" + (f"; off: {', '.join(off)}" if off else ""))
    print(f"total {res['timings']['total_s']:.0f} s (profile {res['timings']['profile_s']:.0f} s)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="local-cpu:4")
    ap.add_argument("--model", default=LLAMA_SPEC)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of every family (measured: the median of their medians)")
    add_profile_args(ap, "runs/schedule_fidelity")
    ap.add_argument("--out", default="benchmarks/results/schedule_fidelity.json")
    ap.add_argument("--verbose", action="store_true", help="show the training programs' output")
    args = ap.parse_args(argv)
    if (bad := [f for f in args.families.split(",") if f and f not in FAMILIES]):
        ap.error(f"unknown families {bad}: choose from {','.join(FAMILIES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["AUTOPAR_CALIBRATE"] = "0"   # the uncalibrated model, as benchmarks/fidelity.py compares
    res = measure(args)
    res["args"] = vars(args)
    print_table(res)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
