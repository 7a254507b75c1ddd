"""What each ``autopar`` command does (the parser is ``planner/entry/cli.py``): graph, plan,
evaluate, codegen, run, export, demo and report. Profiling and calibration are ``planner/entry/measure.py``.
"""
from __future__ import annotations

import argparse
import json
import sys

from planner.entry.launch import check_plan, compare_run, data_args, run_plan
from planner.entry.launch import progress as _progress
from planner.describe import devices_text, schedule_name, wan_words
from planner.errors import AutoparError


def fmt_bytes(x: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def console():
    from rich.console import Console

    # Pipes and CI logs get a wide fixed width so tables are never cut to 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


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
                  fmt_bytes(l.act_bytes), fmt_bytes(l.output_bytes), l.repeat_of or "")
    con = console()
    con.print(t)
    seqs = g.batch
    con.print(f"parameters {g.params:,} ({_fmt_num(g.params)}); per sequence: forward {_fmt_num(g.fwd_flops / seqs)}FLOP, "
              f"backward {_fmt_num(g.bwd_flops / seqs)}FLOP, activations {fmt_bytes(g.act_bytes_per_seq())}; "
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


def check_out(path: str, force: bool) -> None:
    """Refuse an output ``write_atomic`` would refuse or fail on, before the work that makes it."""
    from planner.files import check_outputs

    check_outputs([path], force)


def _load_inputs(args: argparse.Namespace):
    """The graph, cluster, profile and pins the flags name. Everything cheap is checked first
    (the cluster, the pins against it, the model spec, the document lengths, a profile file),
    then this machine's calibration is read (or profiled, the first time), then the model is
    captured: a bad input never waits for either."""
    from cost_models.cluster import parse_cluster
    from planner import zoo
    from planner.frontend.load import load_graph, with_moe_imbalance
    from planner.search.pins import Pins

    cluster = parse_cluster(args.cluster)
    pins = Pins.parse(getattr(args, "fix", None)).check_world(cluster.world, cluster.name)
    zoo.load_model_spec(args.model)  # a bad model spec, before the work
    hist, seq_len = None, args.seq_len
    if getattr(args, "seq_lens", None):
        from planner.search.seq_lens import default_budget, read_seq_lens

        hist = read_seq_lens(args.seq_lens)
        seq_len = seq_len or default_budget(hist)
    cluster, profile = _profile_for(cluster, getattr(args, "profile", None), not getattr(args, "no_calibrate", False))
    graph = with_moe_imbalance(load_graph(args.model, batch=1, seq_len=seq_len), args.moe_imbalance)
    if hist is not None:
        import os

        from planner.search.seq_lens import describe, with_documents

        graph = with_documents(graph, hist, source=os.path.basename(args.seq_lens))
        _progress(describe(graph))
    return graph, cluster, profile, pins


def _profile_for(cluster, path: str | None, calibrate: bool):
    """``(cluster, profile)`` to price with: ``path`` (or the cluster file's), checked to be this
    cluster's; else, on this machine's CPUs, its cached calibration (profiled on first use), said in
    one line, and the cluster at the thread figures it was fitted with."""
    from cost_models.profile_db import ProfileDB

    path = path or cluster.profile
    if path:
        profile = ProfileDB.load(path)
        if not profile.matches(cluster.fingerprint()):
            raise AutoparError(f"profile {path} was measured on another cluster "
                               f"({profile.cluster_fingerprint} != {cluster.fingerprint()}): profile this cluster "
                               "with `autopar profile`")
        return cluster, profile
    if not cluster.detected:
        return cluster, None
    from planner.entry.calibration import machine_profile

    mp = machine_profile(cluster, enabled=calibrate, progress=_progress)
    _progress(mp.note)
    return mp.cluster, mp.profile


def _estimate_summary(e) -> dict:
    return {"config": e.config.to_str(), "label": e.config.label(), "step_s": e.step_s,
            "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "tflops_per_device": e.tflops_per_device,
            "fits": e.fits, "peak_memory_gib": [m.total / 2**30 for m in e.memory],
            "capacity_gib": e.capacity / 2**30, "breakdown": e.breakdown, "source": e.source,
            "calibration": e.calibration, "engine": e.engine, **({"wan": e.wan} if e.wan else {}),
            "stages": [list(b) for b in e.partition.bounds], "recompute": e.partition.recompute}


def _print_estimate(con, e, title: str) -> None:
    from rich.table import Table

    own = schedule_name(e.config, e.schedule_ir)
    con.print(f"[bold]{title}[/bold]: {e.config.label()}" + (f"   (schedule: {own})" if own != e.config.schedule else ""))
    con.print(f"  step {e.step_s:.4g} s   {e.tokens_per_s:,.0f} tokens/s   MFU {e.mfu * 100:.1f}%   "
              f"{e.tflops_per_device:.1f} model TFLOP/s per device   source: {e.source}")
    con.print(f"  calibration: {e.calibration}   engine: {e.engine}")
    for line in wan_words(e.wan):
        con.print(f"  across cluster groups: {line}")
    if e.devices:
        stages = [{"rank": j % e.config.pp, "layers": range(lo, hi)} for j, (lo, hi) in enumerate(e.partition.bounds)]
        title, text = devices_text(e.config, stages, e.devices)
        con.print(f"  {title}: {text}")
    t = Table(title="memory per pipeline rank (GiB)")
    for c in ("rank", "weights", "grads", "optimizer", "activations", "buffers", "reserve", "total", "capacity"):
        t.add_column(c, justify="right")
    for r, m in enumerate(e.memory):
        t.add_row(str(r), *(f"{x / 2**30:.2f}" for x in (m.weights, m.grads, m.optimizer, m.activations,
                                                         m.buffers, m.reserve, m.total, e.capacity)))
    con.print(t)
    if any(m.host for m in e.memory):  # recompute=offload (cost_models/offload.py)
        con.print("  offloaded activations in pinned host memory (GiB per rank): "
                  + ", ".join(f"{m.host / 2**30:.1f}" for m in e.memory) + f" of {e.host_capacity / 2**30:.0f}")
    con.print("  breakdown (s): " + ", ".join(f"{k} {v:.3g}" for k, v in e.breakdown.items()))


def cmd_plan(args: argparse.Namespace) -> int:
    import time

    from planner.files import write_atomic
    from planner.search.planning import plan_model
    from planner.report.data import fmt_n

    if args.out:
        check_out(args.out, args.force)
    images = None
    if getattr(args, "images_per_sample", ""):  # checked before anything is captured
        from planner.search.multimodal import parse_images
        images = parse_images(args.images_per_sample)
    schedule = None
    if args.schedule:  # checked before anything is captured
        from planner.schedule_file import load as load_schedule
        schedule = load_schedule(args.schedule)
    t0 = time.perf_counter()
    graph, cluster, profile, pins = _load_inputs(args)
    _progress(f"captured {graph.name}: {len(graph.layers)} layers, {fmt_n(graph.params)} parameters "
              f"({time.perf_counter() - t0:.2f} s); searching {cluster.world} devices of {cluster.name}"
              + (f" with {pins.to_str()} pinned" if pins else ""))
    plan, res = plan_model(graph, cluster, args.global_batch, spec=args.model, cluster_spec=args.cluster,
                           profile=profile, top_k=args.top_k, progress=_progress, loss=args.loss, fix=pins,
                           fp8=args.fp8, compile=args.compile, low_comm=args.low_comm,
                           per_batch=args.per_batch, schedule=schedule, schedule_source=args.schedule or "",
                           images=images)
    _progress(f"{res.considered} configurations considered, {res.pruned} pruned by bounds, "
              f"{res.estimated} estimated, {res.fully_solved} fully solved in {res.solve_s:.2f} s")
    from planner.search.candidates import fp8_caveat
    if caveat := fp8_caveat(args.fp8, args.compile):
        _progress(f"warning: {caveat}")
    for key in ("per_batch", "multimodal"):
        if key in plan.batch:
            _progress(plan.batch[key]["why"])
    if "schedule" in plan.search:
        _progress(plan.search["schedule"])
    if "split" in plan.search:
        _progress(f"stage split: {plan.search['split']}")
    if args.out:
        write_atomic(args.out, plan.to_json(), force=args.force)
    if args.json:
        print(plan.to_json(), end="")
        return 0
    con = console()
    _print_estimate(con, res.best, "plan" + (f" (pinned: {pins.to_str()})" if pins else ""))
    from rich.table import Column, Table

    t = Table("configuration", "step s", "vs plan", "why not", title="alternatives")
    for a in plan.alternatives:
        t.add_row(a["label"], f"{a['step_s']:.4g}", f"{a['delta_pct']:+.1f}%", a["why_not"])
    con.print(t)
    t = Table("reason", Column("count", justify="right"), title="rejected")
    for r, v in sorted(plan.rejected.items(), key=lambda kv: -kv[1]["count"])[:10]:
        t.add_row(r, str(v["count"]))
    con.print(t)
    if args.out:
        con.print(f"wrote {args.out}")
    return 0


def _with_defaults(cfg, given: set, graph, cluster, engine: str | None):
    """``cfg`` with what ``autopar evaluate --config`` left out as a plan for ``cluster`` would
    have it: the dtype it trains in there (``precision.default_dtype``: fp32 on CPU ranks) and,
    on autopar's runtime, the attention kernel the search would plan the layout with."""
    from planner.feasibility import default_attention
    from planner.precision import default_dtype
    from planner.search.candidates import facts_of
    from planner.search.kernel_choice import attention_choice

    if "dtype" not in given:
        cfg = cfg.replace(dtype=default_dtype(cluster.backend))
    if "attention" not in given:
        choice = attention_choice(graph, cluster, facts_of(graph), cfg.dtype, cfg.loss) \
            if engine in (None, "autopar") else None
        cfg = cfg.replace(attention=choice.of(cfg.cp) if choice else default_attention(graph.limits))
    return cfg


def cmd_evaluate(args: argparse.Namespace) -> int:
    from planner.config_text import config_keys, parse_config
    from planner.feasibility import microbatches
    from planner.files import write_atomic
    from planner.schedule_file import load as load_schedule
    from planner.schedule_ir import layout_problem
    from planner.search.planning import build_plan, evaluate_noted

    cfg = parse_config(args.config)
    schedule = None
    if args.schedule:  # the user's own order: schedule=custom, its stages per rank
        schedule = load_schedule(args.schedule)
        cfg = cfg.replace(schedule="custom", vpp=schedule.v).validate()
        if (why := layout_problem(schedule, cfg.pp, cfg.vpp, microbatches(cfg, args.global_batch), cfg.seq_chunks)):
            raise AutoparError(f"{args.schedule}: {why}")
    if args.out:
        check_out(args.out, args.force)
    graph, cluster, profile, pins = _load_inputs(args)
    cfg = _with_defaults(cfg, config_keys(args.config), graph, cluster, args.engine)
    _progress(f"pricing {cfg.label()} on {cluster.world} devices of {cluster.name}")
    e, problems, split = evaluate_noted(graph, cluster, cfg, args.global_batch, even_split=args.even_split,
                                        profile=profile, engine=args.engine, schedule=schedule)
    if split:
        _progress(f"stage split: {split}")
    if args.out and problems:
        raise AutoparError(f"{args.out} not written: the runtime cannot run {cfg.label()}: " + "; ".join(problems))
    if args.out:
        write_atomic(args.out, build_plan(graph, cluster, e, spec=args.model, cluster_spec=args.cluster,
                                          search_info={"split": split} if split else None,
                                          schedule=schedule).to_json(), force=args.force)
    checked = pins.check(cfg)
    if args.json:
        d = _estimate_summary(e)
        d["problems"] = problems
        if split:
            d["split"] = split
        d["fix"] = {pin: why is None for pin, why in checked}
        print(json.dumps(d, indent=1))
    else:
        con = console()
        _print_estimate(con, e, "evaluate")
        from planner.search.candidates import fp8_caveat
        for p in problems + [c for c in [fp8_caveat(cfg.fp8, cfg.compile)] if c]:
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


def cmd_codegen(args: argparse.Namespace) -> int:
    from codegen.emit import write_program
    from planner.plan import Plan

    plan = Plan.load(args.plan)
    check_plan(plan, import_user_code=False)
    out = args.out or f"train_{plan.model['name'].replace('-', '_')}.py"
    if args.launcher == "slurm":
        import os

        from planner.entry.slurm import write_slurm_script

        script = os.path.splitext(out)[0] + ".sbatch"
        check_out(script, args.force)
        write_program(plan, out, force=args.force)
        here = os.getcwd()
        submit = write_slurm_script(plan, script, out, ["--steps", "20"], workdir=here,
                                    log_dir=os.path.dirname(os.path.abspath(script)), force=args.force)
        print(f"wrote {out} and {script}: submit with `{submit}`")
        return 0
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
    from planner.plan import Plan

    plan = Plan.load(args.plan)
    # the data is checked before any process starts, unless the job runs elsewhere (Slurm: read there)
    extra = data_args(args.data, plan, args.data_dtype, args.data_eos, check=args.launcher != "slurm")
    if args.launcher == "slurm":
        return _write_run_script(args, extra)
    rc, log = run_plan(args.plan, steps=args.steps, run_dir=args.dir, ckpt_every=args.ckpt_every,
                       max_restarts=args.max_restarts, extra=extra, rig_mbit=args.rig_mbit)
    if rc != 0:
        raise AutoparError(f"the training job failed (torchrun exit {rc}); its output is above; "
                           "rerun with fewer processes or check the plan with `autopar report`")
    import os

    if os.path.exists(log):
        _print_comparison(compare_run(args.plan, log))
    return 0


def _write_run_script(args: argparse.Namespace, extra: list[str]) -> int:
    """``autopar run --launcher slurm``: the program and ``DIR/job.sbatch`` for the plan's
    cluster, paths as given from this folder; prints the sbatch command, submits nothing."""
    import os

    from planner.entry.launch import prepare_run
    from planner.entry.slurm import write_slurm_script

    if args.max_restarts:
        _progress("--max-restarts is for local runs; under Slurm, requeue the job (sbatch --requeue): "
                  "the program resumes from its newest checkpoint")
    plan, prog, _, prog_args = prepare_run(args.plan, steps=args.steps, run_dir=args.dir, ckpt_every=args.ckpt_every,
                                           extra=extra, here=False)
    script = os.path.join(args.dir, "job.sbatch")
    submit = write_slurm_script(plan, script, prog, prog_args, workdir=os.getcwd(),
                                log_dir=os.path.abspath(args.dir), force=True)
    print(f"wrote {script} ({plan.config.world} ranks on {plan.cluster.get('name')}); submit it with: {submit}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from planner.entry.export import export

    if args.plan is not None and args.model is not None:
        raise AutoparError("give --plan or --model, not both: the plan names its model")
    r = export(args.ckpt, args.out, plan=args.plan, model=args.model, fmt=args.format, force=args.force)
    for pair, d in r.tied_drift.items():
        if d > 0:
            _progress(f"tied {pair}: the two saved copies differ by up to {d:.3g}; exported the first")
    how = (f"AutoModelForCausalLM.from_pretrained({args.out!r})" if r.kind == "hf" else
           f"{r.spec}: model.load_state_dict(...) of {r.files[0]}")
    print(f"wrote {args.out} ({', '.join(r.files)}): {r.params:,} parameters from {r.step_dir}; load with {how}")
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
        print_text(build_report(Plan.load(args.plan), run_log=args.run_log, layers=False), console())
    return 0
