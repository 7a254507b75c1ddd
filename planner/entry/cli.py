"""The ``autopar`` command.

Every subcommand turns bad input into one line on stderr (``error: ...``) and exit
status 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from planner.errors import AutoparError
from planner.entry.launch import check_plan, compare_run, run_plan, torchrun_cmd
from planner.entry.launch import progress as _progress
from planner.plan import LOSS_KERNELS


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _console():
    from rich.console import Console

    # Pipes and CI logs get a wide fixed width so tables are never cut to 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


# ---------------------------------------------------------------- graph ---------

def cmd_graph(args: argparse.Namespace) -> int:
    from planner.frontend.load import load_graph_and_fx

    g, fx = load_graph_and_fx(args.model, batch=args.batch, seq_len=args.seq_len)
    if args.fx:
        return _print_fx(g, fx, args.layer)
    if args.json:
        print(json.dumps(g.to_dict(), indent=1))
        return 0
    from rich.table import Table

    from planner.report.data import fmt_n as _fmt_num

    t = Table(title=f"{g.name}: batch {g.batch} x seq {g.seq_len}, captured in {g.capture_s:.2f} s")
    for col in ("#", "layer", "kind", "params", "fwd FLOPs", "bwd FLOPs", "activations", "output", "repeat of"):
        t.add_column(col, justify="right" if col not in ("layer", "kind", "repeat of") else "left")
    for i, l in enumerate(g.layers):
        t.add_row(str(i), l.name, l.kind, _fmt_num(l.params), _fmt_num(l.fwd_flops), _fmt_num(l.bwd_flops),
                  _fmt_bytes(l.act_bytes), _fmt_bytes(l.output_bytes), l.repeat_of or "")
    con = _console()
    con.print(t)
    seqs = g.batch
    con.print(f"parameters {g.params:,} ({_fmt_num(g.params)}); per sequence: forward {_fmt_num(g.fwd_flops / seqs)}FLOP, "
              f"backward {_fmt_num(g.bwd_flops / seqs)}FLOP, activations {_fmt_bytes(g.act_bytes_per_seq())}; "
              f"{len(g.classes())} distinct layer classes of {len(g.layers)} layers")
    for n in g.notes:
        con.print(f"note: {n}")
    return 0


def _print_fx(g, fx, layer: str | None) -> int:
    """The FX graph (forward and backward ATen ops) of one layer: ``layer`` or the first block."""
    from planner.frontend.fx_graph import format_unit
    from planner.graph import BLOCK_KINDS

    names = [l.name for l in g.layers]
    if layer is None:
        layer = next((l.name for l in g.layers if l.kind in BLOCK_KINDS), names[0])
    if layer not in names:
        raise AutoparError(f"--layer {layer!r} is not a layer of {g.name}; layers: {', '.join(names[:8])}"
                           f"{' ...' if len(names) > 8 else ''}")
    rep = g.layer(layer).repeat_of or layer
    lines = format_unit(fx, rep)
    note = f" (captured as its class's first block, {rep})" if rep != layer else ""
    print(f"# {g.name}: FX graph of {layer}{note}: {len(lines)} ATen ops, forward and backward")
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------- profile -------

def cmd_profile(args: argparse.Namespace) -> int:
    import os
    import subprocess

    from cost_models.cluster import parse_cluster
    from cost_models.profiler import worker_args
    from planner import zoo

    cluster = parse_cluster(args.cluster)
    zoo.load_model_spec(args.model)  # fail early on a bad model
    _check_out(args.out, args.force)
    worker = worker_args(args.cluster, args.model, args.out, seq_len=args.seq_len or None, batches=args.batches,
                         repeats=args.repeats)
    if cluster.nodes > 1 or cluster.backend != "gloo":
        print("run on every node (set NODE_RANK and MASTER_ADDR):")
        print(f"  torchrun --nnodes {cluster.nodes} --nproc-per-node {cluster.devices_per_node} "
              f"--node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500 " + " ".join(worker[1:]))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(torchrun_cmd(cluster.world, worker), env=env)
    if r.returncode != 0:
        raise AutoparError(f"profiling failed (torchrun exit {r.returncode}); see the output above, "
                           "or rerun with fewer processes")
    return 0


def _check_out(path: str, force: bool) -> None:
    """Refuse an output ``write_atomic`` would refuse or fail on, before the work that makes it."""
    from planner.files import check_outputs

    check_outputs([path], force)


# ---------------------------------------------------------------- plan / evaluate

def _load_inputs(args: argparse.Namespace):
    """The graph, cluster, profile and pins the flags name; ``--fix`` is checked against the
    cluster before the model is captured."""
    from cost_models.cluster import parse_cluster
    from cost_models.profile_db import ProfileDB
    from planner.frontend.load import load_graph, with_moe_imbalance
    from planner.search.pins import Pins

    cluster = parse_cluster(args.cluster)
    pins = Pins.parse(getattr(args, "fix", None)).check_world(cluster.world, cluster.name)
    profile = None
    prof_path = getattr(args, "profile", None) or cluster.profile
    if prof_path:
        profile = ProfileDB.load(prof_path)
        if not profile.matches(cluster.fingerprint()):
            raise AutoparError(f"profile {prof_path} was measured on another cluster "
                               f"({profile.cluster_fingerprint} != {cluster.fingerprint()}): profile this cluster "
                               "with `autopar profile`")
    elif cluster.detected:
        from planner.entry.calibration import machine_profile

        profile, note = machine_profile(cluster, enabled=not getattr(args, "no_calibrate", False),
                                        progress=_progress)
        _progress(note)
    hist, seq_len = None, args.seq_len
    if getattr(args, "seq_lens", None):  # read (and refused) before the capture
        from planner.search.seq_lens import default_budget, read_seq_lens

        hist = read_seq_lens(args.seq_lens)
        seq_len = seq_len or default_budget(hist)
    graph = with_moe_imbalance(load_graph(args.model, batch=1, seq_len=seq_len), args.moe_imbalance)
    if hist is not None:
        import os

        from planner.search.seq_lens import describe, with_documents

        graph = with_documents(graph, hist, source=os.path.basename(args.seq_lens))
        _progress(describe(graph))
    return graph, cluster, profile, pins


def _estimate_summary(e) -> dict:
    return {"config": e.config.to_str(), "label": e.config.label(), "step_s": e.step_s,
            "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "tflops_per_device": e.tflops_per_device,
            "fits": e.fits, "peak_memory_gib": [m.total / 2**30 for m in e.memory],
            "capacity_gib": e.capacity / 2**30, "breakdown": e.breakdown, "source": e.source,
            "calibration": e.calibration,
            "stages": [list(b) for b in e.partition.bounds], "recompute": e.partition.recompute}


def _print_estimate(con, e, title: str) -> None:
    from rich.table import Table

    con.print(f"[bold]{title}[/bold]: {e.config.label()}")
    con.print(f"  step {e.step_s:.4g} s   {e.tokens_per_s:,.0f} tokens/s   MFU {e.mfu * 100:.1f}%   "
              f"{e.tflops_per_device:.1f} model TFLOP/s per device   source: {e.source}")
    con.print(f"  calibration: {e.calibration}")
    t = Table(title="memory per pipeline rank (GiB)")
    for c in ("rank", "weights", "grads", "optimizer", "activations", "buffers", "reserve", "total", "capacity"):
        t.add_column(c, justify="right")
    for r, m in enumerate(e.memory):
        t.add_row(str(r), *(f"{x / 2**30:.2f}" for x in (m.weights, m.grads, m.optimizer, m.activations,
                                                         m.buffers, m.reserve, m.total, e.capacity)))
    con.print(t)
    con.print("  breakdown (s): " + ", ".join(f"{k} {v:.3g}" for k, v in e.breakdown.items()))


def cmd_plan(args: argparse.Namespace) -> int:
    import time

    from planner.files import write_atomic
    from planner.search.planning import plan_model
    from planner.report.data import fmt_n

    if args.out:
        _check_out(args.out, args.force)
    t0 = time.perf_counter()
    graph, cluster, profile, pins = _load_inputs(args)
    _progress(f"captured {graph.name}: {len(graph.layers)} layers, {fmt_n(graph.params)} parameters "
              f"({time.perf_counter() - t0:.2f} s); searching {cluster.world} devices of {cluster.name}"
              + (f" with {pins.to_str()} pinned" if pins else ""))
    plan, res = plan_model(graph, cluster, args.global_batch, spec=args.model, cluster_spec=args.cluster,
                           profile=profile, top_k=args.top_k, progress=_progress, loss=args.loss, fix=pins)
    _progress(f"{res.considered} configurations considered, {res.pruned} pruned by bounds, "
              f"{res.estimated} estimated, {res.fully_solved} fully solved in {res.solve_s:.2f} s")
    if args.out:
        write_atomic(args.out, plan.to_json(), force=args.force)
    if args.json:
        print(plan.to_json(), end="")
        return 0
    con = _console()
    _print_estimate(con, res.best, "plan" + (f" (pinned: {pins.to_str()})" if pins else ""))
    from rich.table import Table

    t = Table(title="alternatives")
    for c in ("configuration", "step s", "vs plan", "why not"):
        t.add_column(c)
    for a in plan.alternatives:
        t.add_row(a["label"], f"{a['step_s']:.4g}", f"{a['delta_pct']:+.1f}%", a["why_not"])
    con.print(t)
    t = Table(title="rejected")
    t.add_column("reason")
    t.add_column("count", justify="right")
    for r, v in sorted(plan.rejected.items(), key=lambda kv: -kv[1]["count"])[:10]:
        t.add_row(r, str(v["count"]))
    con.print(t)
    if args.out:
        con.print(f"wrote {args.out}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from planner.plan import ParallelConfig
    from planner.feasibility import default_attention
    from planner.search.planning import evaluate_config

    cfg = ParallelConfig.parse(args.config)
    graph, cluster, profile, pins = _load_inputs(args)
    if "attention=" not in args.config:
        cfg = cfg.replace(attention=default_attention(graph.limits))  # the default kernel may be one it cannot use
    _progress(f"pricing {cfg.label()} on {cluster.world} devices of {cluster.name}")
    e, problems = evaluate_config(graph, cluster, cfg, args.global_batch, even_split=args.even_split,
                                  profile=profile)
    checked = pins.check(cfg)
    if args.json:
        d = _estimate_summary(e)
        d["problems"] = problems
        d["fix"] = {pin: why is None for pin, why in checked}
        print(json.dumps(d, indent=1))
    else:
        con = _console()
        _print_estimate(con, e, "evaluate")
        for p in problems:
            con.print(f"[yellow]warning[/yellow]: {p}")
        con.print("pins: " + "; ".join(f"{pin} {'satisfied' if why is None else f'VIOLATED ({why})'}"
                                       for pin, why in checked) if pins else
                  "evaluate prices this configuration as given (every key pinned); "
                  '`autopar plan --fix "tp=4,..."` searches the keys you leave free')
    if not e.fits:
        rank, over = e.shortfall()
        print(f"error: does not fit: stage {rank} needs {e.memory[rank].total / 2**30:.1f} GiB of "
              f"{e.capacity / 2**30:.1f} GiB (short by {over / 2**30:.1f} GiB); try zero=fsdp, recompute=full, "
              "more pipeline stages or more devices", file=sys.stderr)
        return 2
    return 0


# ---------------------------------------------------------------- codegen / run / demo

def cmd_codegen(args: argparse.Namespace) -> int:
    from codegen.emit import write_program
    from planner.plan import Plan

    plan = Plan.load(args.plan)
    check_plan(plan, import_user_code=False)
    out = args.out or f"train_{plan.model['name'].replace('-', '_')}.py"
    write_program(plan, out, force=args.force)
    print(f"wrote {out}: torchrun --nproc-per-node {plan.config.world} {out} --steps 20")
    return 0


def _print_comparison(c: dict) -> None:
    print(f"step time: predicted {c['predicted_step_s']:.3f} s, measured median {c['measured_step_s']:.3f} s "
          f"(min {c['measured_min_s']:.3f}, max {c['measured_max_s']:.3f}; measured/predicted {c['ratio']:.2f})")
    if c["first_loss"] is not None:
        print(f"loss: {c['first_loss']:.4f} -> {c['last_loss']:.4f} over {c['steps']} steps")
    per_pp = {m["pp"]: m["predicted_gib"] for m in c["memory"] if m["predicted_gib"] is not None}
    pm = ", ".join(f"{per_pp[p]:.2f}" for p in sorted(per_pp))
    mm = ", ".join(f"{m['measured_gib']:.2f}" for m in c["memory"])
    print(f"memory: predicted per pp rank [{pm}] GiB (tensors + reserve); measured peak RSS per rank [{mm}] GiB "
          "(includes the Python/torch process, ~0.3-0.5 GiB)")


def cmd_run(args: argparse.Namespace) -> int:
    from codegen.runtime.data import FUNC_SPEC

    if args.data is not None and not FUNC_SPEC.match(args.data):
        raise AutoparError(f"--data {args.data!r} is not package.module:function (step, global_batch, seq_len) -> batch")
    rc, log = run_plan(args.plan, steps=args.steps, run_dir=args.dir, ckpt_every=args.ckpt_every,
                       max_restarts=args.max_restarts, extra=["--data", args.data] if args.data else None)
    if rc != 0:
        raise AutoparError(f"the training job failed (torchrun exit {rc}); its output is above; "
                           "rerun with fewer processes or check the plan with `autopar report`")
    import os

    if os.path.exists(log):
        _print_comparison(compare_run(args.plan, log))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from planner.entry.demo import run_demo, summary_lines

    r = run_demo(args.model, args.cluster, args.global_batch, args.seq_len, args.steps, args.dir, lr=args.lr,
                 calibrate=not args.no_calibrate, progress=_progress)
    for line in summary_lines(r):
        print(line)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from planner.report.render import build_report, print_text, write_reports
    from planner.plan import Plan

    outs = [x for x in (args.out, args.md, args.trace) if x]
    if outs:
        write_reports(args.plan, html=args.out, md=args.md, trace=args.trace, run_log=args.run_log, force=args.force)
        for x in outs:
            _progress(f"wrote {x}")
    if args.text or not outs:
        print_text(build_report(Plan.load(args.plan), run_log=args.run_log, layers=False), _console())
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model to measured runs and store the coefficients in the profile.

    Each ``--run-log`` is ``PLAN.json:train_log.jsonl`` or a run directory holding
    ``plan.json`` and ``train_log.jsonl`` (``autopar run --dir`` writes the log there;
    copy the plan beside it). Logs of the same plan are pooled (median of their medians)."""
    import math
    import os
    import time

    from cost_models import calibrate as cal
    from cost_models.cluster import parse_cluster
    from cost_models.profile_db import ProfileDB
    from planner.frontend.load import load_graph

    profile = ProfileDB.load(args.profile)
    by_plan: dict[str, list[str]] = {}
    for arg in args.run_log:
        plan_path, log = cal.parse_run_arg(arg)
        by_plan.setdefault(os.path.abspath(plan_path), []).append(log)
    samples = []
    for plan_path, logs in by_plan.items():
        s = cal.sample_from_run(plan_path, logs[0], extra_logs=logs[1:], load_graph=load_graph,
                                load_cluster=parse_cluster, warmup=args.warmup, name=os.path.relpath(plan_path))
        if not profile.matches(s.cluster.fingerprint()):
            raise AutoparError(f"{plan_path} ran on another cluster than {args.profile} was measured on: "
                               "calibrate with runs of the profiled cluster")
        samples.append(s)
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
        return 0
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
    print("calibration: " + ", ".join(f"{k}={v:.4g}" for k, v in fitted.items()))
    print(f"wrote {out}: `autopar plan --profile {out}` uses it")
    return 0


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--cluster", required=True, help="preset[:nodes] (dgx-h100:128), local-cpu:N or cluster.toml")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--profile", default=None, help="profile.json measured by `autopar profile`")
    p.add_argument("--no-calibrate", action="store_true",
                   help="local-cpu: plan uncalibrated instead of with this machine's cached calibration "
                        "(profiled on first use, about 15-30 s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="X",
                   help="mixtures of experts: the busiest expert-parallel rank's tokens over the mean (default 1.0)")
    p.add_argument("--seq-lens", default=None, metavar="FILE",
                   help="document lengths packed into rows of --seq-len tokens (default: the longest, rounded up "
                        "to 128): one length per line, a JSON list, {\"length\": count} or length,count lines")
    p.add_argument("--fix", default=None, metavar="PINS", help="keep part of the layout, e.g. 'tp=8,pp=1' or "
                   "'tp<=4,zero=fsdp': dp pp cp tp ep mbs vpp with =, <=, >=; schedule zero recompute sp with = "
                   "(evaluate: check --config against them)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="zoo preset (e.g. llama3-8b), spec.toml, hf:<preset>, or package.module:function")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autopar", description="Plan and compile parallel training for PyTorch models.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="cmd", parser_class=_Parser)

    _add_planning_commands(sub)
    _add_running_commands(sub)
    _add_inspection_commands(sub)
    return ap


def _add_planning_commands(sub) -> None:
    """graph, plan, evaluate."""
    g = sub.add_parser("graph", help="capture a model and print its layer table")
    _add_model_args(g)
    g.add_argument("--batch", type=int, default=1, help="sequences in the example batch")
    g.add_argument("--json", action="store_true", help="print the ModelGraph as JSON")
    g.add_argument("--fx", action="store_true", help="print the captured torch.fx graph (ATen ops) of one layer")
    g.add_argument("--layer", default=None, help="with --fx: the layer (default: the first block)")
    g.set_defaults(fn=cmd_graph)

    p = sub.add_parser("plan", help="search the parallel configurations and write a plan")
    _add_plan_args(p)
    p.add_argument("--top-k", type=int, default=5, help="alternatives to keep")
    p.add_argument("--loss", choices=LOSS_KERNELS, default="eager", help="loss kernel to plan with")
    p.add_argument("-o", "--out", default=None, help="plan file to write (JSON)")
    p.add_argument("--force", action="store_true", help="overwrite an existing plan file")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("evaluate", help="price a configuration you already run")
    _add_plan_args(p)
    p.add_argument("--config", required=True,
                   help="e.g. dp=8,pp=2,cp=1,tp=4,mbs=1,schedule=1f1b,vpp=1,zero=fsdp,recompute=selective,sp=on")
    p.add_argument("--even-split", action="store_true", help="equal layers per stage instead of the ILP split")
    p.set_defaults(fn=cmd_evaluate)


def _add_running_commands(sub) -> None:
    """codegen, run, demo."""
    p = sub.add_parser("codegen", help="emit the training program of a plan")
    p.add_argument("plan")
    p.add_argument("-o", "--out", default=None)
    p.add_argument("--force", action="store_true", help="overwrite an existing program")
    p.set_defaults(fn=cmd_codegen)

    p = sub.add_parser("run", help="emit and run a plan's program on this machine (torchrun)")
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dir", default="runs/latest", help="where the program, log and checkpoints go")
    p.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every K steps")
    p.add_argument("--max-restarts", type=int, default=0, help="relaunch a job whose process died")
    p.add_argument("--data", default=None,
                   help="package.module:function(step, global_batch, seq_len) -> batch (default: synthetic tokens)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("demo", help="plan a model for this machine, run it, compare predicted and measured")
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--cluster", default="local-cpu", help="local-cpu (one process per core) or local-cpu:N")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the run and the baseline")
    p.add_argument("--no-calibrate", action="store_true", help="plan uncalibrated (no machine profile)")
    p.add_argument("--dir", default="runs/demo")
    p.set_defaults(fn=cmd_demo)


def _add_inspection_commands(sub) -> None:
    """report, profile, calibrate."""
    p = sub.add_parser("report", help="explain a plan: HTML, Markdown, Perfetto trace or a terminal summary")
    p.add_argument("plan", help="plan file written by `autopar plan -o`")
    p.add_argument("-o", "--out", default=None, help="self-contained HTML report to write")
    p.add_argument("--md", default=None, help="Markdown summary to write (for a pull request or issue)")
    p.add_argument("--trace", default=None, help="Chrome/Perfetto trace JSON of the simulated step to write")
    p.add_argument("--run-log", default=None, help="train_log.jsonl of a run: predicted and measured side by side")
    p.add_argument("--text", action="store_true", help="print a terminal summary (default when no file is asked)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("profile", help="measure layers and collectives on a cluster -> profile.json")
    _add_model_args(p)
    p.add_argument("--cluster", required=True, help="local-cpu:N, a preset[:nodes] or cluster.toml")
    p.add_argument("--batches", default="1,2", help="micro-batch sizes to measure, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("calibrate", help="fit the cost model to measured runs and store it in the profile")
    p.add_argument("--run-log", nargs="+", required=True, metavar="RUN",
                   help="PLAN.json:train_log.jsonl, or a run directory holding plan.json and train_log.jsonl")
    p.add_argument("--profile", required=True, help="profile.json of the cluster the runs ran on")
    p.add_argument("-o", "--out", default=None, help="write the calibrated profile here (default: in place)")
    p.add_argument("--keys", default="", help="coefficients to fit, comma-separated (default: all time coefficients)")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped from the front of each log")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out (held-out) error")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_calibrate)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    fn: Callable[[argparse.Namespace], int] | None = getattr(args, "fn", None)
    if fn is None:
        ap.print_help()
        return 2
    try:
        return fn(args)
    except (AutoparError, ValueError) as e:  # ClusterError, PlanError are ValueErrors
        if args.debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable output path, a full disk
        if args.debug:
            raise
        what = f"{e.filename}: " if e.filename else ""
        print(f"error: {what}{e.strerror or e}: check the path and its permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
