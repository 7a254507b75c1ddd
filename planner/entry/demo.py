"""``autopar demo``: plan a small model for this machine, run it, and say honestly how it went.

Steps: this machine's calibration (profiled on first use, planner/entry/calibration.py) ->
capture and plan the model for ``local-cpu`` (at most one process per core: the demo never puts
two ranks on a core; the search also weighs fewer processes with more threads each, down to one
process with every core) -> the same model and batch in one plain PyTorch process
(planner/entry/single_process.py) -> the plan's emitted program under torchrun on the learnable
synthetic data -> the one process again -> predicted against measured step time, the loss at the
first and last step (and the data's entropy floor), the speedup over one process (its median step
over both of its runs, so that a drift in the machine's speed while the demo runs hits the plan
and the baseline alike: on a 2-core VM one process's median step moved 0.295-0.331 s between
demos, 2026-12-05), called a tie where the plan's median step lies within the one-process steps'
middle half (where one process wins, the plan runs one process too, and the two differ by less
than a 2-core VM's steps do among themselves) -> the HTML report of the plan with the run beside it.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from planner.errors import AutoparError

# timed steps of the one-process baseline on each side of the plan's run: 3 + 3 steps' median
# moved with the 1-3 s slow spells of a 2-core VM, whose step time wandered 0.23-0.31 s within one
# 30-step run (2026-12-06)
BASELINE_STEPS = 6


@dataclass
class DemoResult:
    plan_path: str
    report_path: str
    label: str
    calibration: str
    predicted_s: float
    measured_s: float
    single_process_s: float
    single_process_quartiles: tuple[float, float]  # the one-process steps' middle half (seconds)
    first_loss: float
    last_loss: float
    entropy_floor: float
    wall_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.predicted_s

    @property
    def speedup(self) -> float:
        return self.single_process_s / self.measured_s

    @property
    def tie(self) -> bool:
        """Whether the plan's median step lies within the one-process steps' middle half: the
        difference is smaller than this machine's step-to-step spread."""
        lo, hi = self.single_process_quartiles
        return lo <= self.measured_s <= hi


def run_demo(model: str, cluster_spec: str, global_batch: int, seq_len: int | None, steps: int, run_dir: str, *,
             lr: float = 1e-3, calibrate: bool = True, progress: Callable[[str], None] = print) -> DemoResult:
    """The whole demo (module docstring); raises AutoparError naming what failed."""
    from codegen.runtime.data import entropy_floor
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.entry.launch import compare_run, run_plan
    from planner.entry.calibration import machine_profile
    from planner.files import write_atomic
    from planner.search.planning import plan_model
    from planner.report.data import threads_text
    from planner.report.render import write_reports
    from planner.entry.single_process import single_process_step

    t0 = time.perf_counter()
    cluster = parse_cluster(cluster_spec)
    if cluster.detected and cluster.world > cluster.cores_per_node:
        raise AutoparError(f"{cluster.name} puts {cluster.world} processes on {cluster.cores_per_node} cores: "
                           "the demo runs one process per core; use --cluster local-cpu")
    profile, note, cluster = machine_profile(cluster, enabled=calibrate, progress=progress)
    progress(note)
    graph = load_graph(model, batch=1, seq_len=seq_len)
    os.makedirs(run_dir, exist_ok=True)
    plan_path = os.path.join(run_dir, "plan.json")
    plan, res = plan_model(graph, cluster, global_batch, spec=model, cluster_spec=cluster_spec, profile=profile)
    write_atomic(plan_path, plan.to_json(), force=True)
    progress(f"plan for {graph.name} ({graph.params / 1e6:.1f} M parameters, {global_batch} x {graph.seq_len} "
             f"tokens) on {cluster.name}: {res.best.config.label()}, predicted {res.best.step_s:.3f} s/step")
    if (threads := threads_text(plan)) is not None:
        progress(threads)
    before = single_process_step(model, global_batch, graph.seq_len, lr=lr, steps=BASELINE_STEPS)
    progress(f"one plain PyTorch process ({before.threads} threads): {before.step_s:.3f} s/step; "
             f"running the plan for {steps} steps")
    log = os.path.join(run_dir, "train_log.jsonl")
    if os.path.exists(log):
        os.remove(log)
    rc, log = run_plan(plan_path, steps=steps, run_dir=run_dir, extra=["--lr", str(lr)])
    if rc != 0:
        raise AutoparError(f"the training job failed (torchrun exit {rc}); its output is above")
    c = compare_run(plan_path, log)
    after = single_process_step(model, global_batch, graph.seq_len, lr=lr, steps=BASELINE_STEPS)
    single_s = statistics.median(before.times + after.times)
    q1, _, q3 = statistics.quantiles(before.times + after.times, n=4)
    progress(f"one plain PyTorch process again: {after.step_s:.3f} s/step (median of both: {single_s:.3f} s/step)")
    report = os.path.join(run_dir, "report.html")
    write_reports(plan_path, html=report, run_log=log, force=True)
    return DemoResult(plan_path=plan_path, report_path=report, label=res.best.config.label(), calibration=note,
                      predicted_s=c["predicted_step_s"], measured_s=c["measured_step_s"],
                      single_process_s=single_s, single_process_quartiles=(q1, q3),
                      first_loss=c["first_loss"], last_loss=c["last_loss"],
                      entropy_floor=entropy_floor(graph.vocab), wall_s=time.perf_counter() - t0)


def summary_lines(r: DemoResult) -> list[str]:
    """What the demo prints at the end."""
    return [
        f"plan: {r.label} ({'calibrated' if r.calibration.startswith('calibrated') else 'uncalibrated'})",
        f"step time: predicted {r.predicted_s:.3f} s, measured {r.measured_s:.3f} s "
        f"(measured/predicted {r.ratio:.2f})",
        f"one process: {r.single_process_s:.3f} s/step -> speedup {r.speedup:.2f}x"
        + (f" (a tie: within the one-process steps' middle half, {r.single_process_quartiles[0]:.3f}-"
           f"{r.single_process_quartiles[1]:.3f} s)" if r.tie else ""),
        f"loss: {r.first_loss:.3f} at the first step -> {r.last_loss:.3f} at the last "
        f"(the synthetic data's entropy floor: {r.entropy_floor:.2f})",
        f"report: {os.path.abspath(r.report_path)}",
        f"demo wall time: {r.wall_s:.0f} s",
    ]
