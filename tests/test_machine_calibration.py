"""First-run calibration: the machine profile, its cache, and the demo that uses both."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from cost_models.cluster import parse_cluster
from planner.entry import calibration as mcal
from planner.frontend.load import load_graph
from planner.feasibility import Batch, problems
from planner.search.candidates import facts_of


def _fake(cluster, **kw) -> mcal.MachineCalibration:
    return mcal.MachineCalibration(machine=mcal.machine_fingerprint(cluster), device=cluster.device.name, world=2,
                                   calibration={"eff_matmul": 0.5, "comm_latency_s": 1e-3},
                                   runs=[{"label": "dp2", "measured_s": 0.1, "uncalibrated_s": 0.05,
                                          "fitted_s": 0.1}], created="2026-12-01 00:00 UTC", profile_s=9.0, **kw)


def test_reference_layouts_run_for_the_reference_model() -> None:
    facts = facts_of(load_graph(mcal.REFERENCE_MODEL))
    assert mcal.REFERENCE_MODEL != "gpt-mini"  # the demo's model is not the one fitted
    for world in (1, 2, 4):
        cfgs = mcal.reference_configs(world)
        assert {c.world for c in cfgs} == {world}
        assert len(cfgs) == (1 if world == 1 else 3)
        for c in cfgs:
            assert problems(c, facts, Batch(mcal.REFERENCE_BATCH, facts.seq_len), parse_cluster(f"local-cpu:{world}")) == []
    assert [mcal.profile_world(n) for n in (1, 2, 3, 4, 64)] == [1, 2, 2, 4, 4]


def test_one_process_run_has_no_communication_and_more_work() -> None:
    """The one-process reference run is what tells compute from communication and from a fixed
    cost per step: one rank with every profiled core's thread, twice the per-core work of the
    other reference runs; on one core there is none (the DP run is that run)."""
    facts = facts_of(load_graph(mcal.REFERENCE_MODEL))
    assert mcal.one_process_config(1) is None
    for world in (2, 4):
        one = mcal.one_process_config(world)
        assert (one.world, one.threads, one.mbs) == (1, world, mcal.ONE_PROCESS_BATCH)
        # the others spread REFERENCE_BATCH sequences over every core: this run gives each core twice that
        assert all(c.world == world for c in mcal.reference_configs(world))
        assert mcal.ONE_PROCESS_BATCH >= 2 * mcal.REFERENCE_BATCH
        cluster = parse_cluster(f"local-cpu:{world}")
        assert problems(one, facts, Batch(mcal.ONE_PROCESS_BATCH, facts.seq_len), cluster) == []


def test_cache_round_trip_per_machine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    c = parse_cluster("local-cpu:2")
    assert mcal.load_cached(c) is None
    mc = _fake(c)
    mcal.save_cached(c, mc)
    assert mcal.cache_path(c).parent == tmp_path and mcal.load_cached(c) == mc
    assert mcal.load_cached(parse_cluster("local-cpu:1")) == mc  # one per machine, any process count
    mcal.cache_path(c).write_text(json.dumps({**json.loads(mcal.cache_path(c).read_text()), "version": 0}))
    assert mcal.load_cached(c) is None  # another version's cache is not read
    mcal.cache_path(c).write_text(json.dumps({**json.loads(mcal.cache_path(c).read_text()), "version": mcal.CACHE_VERSION,
                                              "measured": {"version": 1, "world": 2}}))
    assert mcal.load_cached(c) is None  # runtime figures it cannot read: profiled again, not a failed plan
    mcal.cache_path(c).write_text("{not json")
    assert mcal.load_cached(c) is None


def test_machine_profile_uses_the_cache_and_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    c = parse_cluster("local-cpu:2")
    mcal.save_cached(c, _fake(c))
    prof, note, _ = mcal.machine_profile(c, allow_profile=False)
    assert prof.calibration == {"eff_matmul": 0.5, "comm_latency_s": 1e-3} and note.startswith("calibrated on this")
    assert prof.matches(c.fingerprint())
    assert mcal.machine_profile(c, enabled=False)[0] is None
    assert mcal.machine_profile(parse_cluster("dgx-h100"))[0] is None  # only local clusters are profiled
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "0")
    prof, note, _ = mcal.machine_profile(c)
    assert prof is None and note.startswith("uncalibrated (calibration off")
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    os.remove(mcal.cache_path(c))
    prof, note, _ = mcal.machine_profile(c, allow_profile=False)
    assert prof is None and "not been profiled" in note


def test_cached_calibration_prices_at_the_figures_it_was_fitted_on(tmp_path, monkeypatch) -> None:
    """A later process probes the machine anew (GEMM and copy speed); the cached fit's
    efficiencies are re-expressed over its figures, so a plan is priced as the fit priced it
    whether that probe read the machine 30% faster or slower. Without the fit's figures (a cache
    that has none) the price follows the probe."""
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    c = parse_cluster("local-cpu:2")
    mc = replace(_fake(c, figures=mcal.machine_figures(c)), calibration={"eff_matmul": 0.5, "eff_memory": 0.6})
    mcal.save_cached(c, mc)
    g = load_graph("gpt-mini")
    cfg = ParallelConfig(dp=1, mbs=16, zero="ddp", dtype="fp32", threads=2)

    def priced(cluster, figures: bool = True) -> float:
        if not figures:
            mcal.save_cached(c, replace(mc, figures={}))
        prof, _, cluster = mcal.machine_profile(cluster, allow_profile=False)
        e, why = evaluate_config(g, cluster, cfg, 16, profile=prof)
        assert not why, why
        return e.step_s

    def probed(factor: float):
        d = c.device
        return replace(c, device=replace(d, peak_tflops={"fp32": d.peak_tflops["fp32"] * factor},
                                         mem_bw_gbs=d.mem_bw_gbs * factor))

    base = priced(c)
    for factor in (0.7, 1.3):
        assert mcal.machine_figures(probed(factor))["gemm_flops"] == pytest.approx(
            factor * mc.figures["gemm_flops"])
        assert priced(probed(factor)) == pytest.approx(base, rel=1e-9)
    assert priced(probed(1.3), figures=False) < 0.9 * base


def test_cached_calibration_plans_at_the_thread_figures_it_was_fitted_on(tmp_path, monkeypatch) -> None:
    """A later process probes its threads anew (``Cluster.detect``); planning with the cached fit
    prices a process's threads at the figures the fit priced with, so a probe that read the
    machine's two threads at 1.6x instead of 2.0x (or a 40 us join) does not move the plan. A cache
    without them, and planning uncalibrated, keep the probe's."""
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    c = replace(parse_cluster("local-cpu:2"), cores_per_node=2)  # two cores whatever this machine has
    fitted = replace(c, thread_speedup=2.0, thread_sync_us=0.0)
    mc = _fake(c, figures=mcal.machine_figures(fitted))
    assert mc.figures["thread_speedup"] == 2.0 and mc.figures["thread_sync_us"] == 0.0
    mcal.save_cached(c, mc)
    later = replace(c, thread_speedup=1.6, thread_sync_us=40.0)
    g = load_graph("gpt-mini")
    cfg = ParallelConfig(dp=1, mbs=16, zero="ddp", dtype="fp32", threads=2)

    def priced(cluster) -> float:
        prof, _, planned = mcal.machine_profile(cluster, allow_profile=False)
        e, why = evaluate_config(g, planned, cfg, 16, profile=prof)
        assert not why, why
        return e.step_s

    mp = mcal.machine_profile(later, allow_profile=False)
    assert (mp.cluster.thread_speedup, mp.cluster.thread_sync_us) == (2.0, 0.0)
    assert mp.cluster.fingerprint() == later.fingerprint() and mp.cluster.device == later.device
    assert priced(later) == pytest.approx(priced(fitted), rel=1e-12)
    mcal.save_cached(c, replace(mc, figures={k: v for k, v in mc.figures.items() if not k.startswith("thread_")}))
    assert mcal.machine_profile(later, allow_profile=False).cluster is later
    assert priced(later) > 1.1 * priced(fitted)  # the probe's figures, where the cache has none
    assert mcal.machine_profile(later, enabled=False).cluster is later


def test_cached_calibration_prices_the_runtime_work_it_measured(tmp_path, monkeypatch) -> None:
    """The first launch measures the CPU runtime's own work on its ranks (the wrappers, EP and
    DTensor dispatch, FSDP2 units by size); the cache keeps it, and every later plan prices with
    those figures of the machine instead of the defaults."""
    from cost_models.calibrate import with_calibration
    from cost_models.cpu_runtime import CPU_DTENSOR_MODULE_S
    from cost_models.dtensor_dispatch import tp_linears
    from cost_models.estimate import estimate
    from cost_models.profile_db import FSDP_UNIT, ProfileDB
    from planner.plan import ParallelConfig, Partition

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    c = parse_cluster("local-cpu:2")
    db = ProfileDB(cluster_fingerprint="", backend="gloo", world=2, runtime={"dtensor_module_s": 4e-3})
    for nbytes, s in ((1 << 18, 2e-3), (1 << 22, 9e-3), (64 << 20, 0.3)):
        db.add_collective(FSDP_UNIT, 2, "intra", nbytes, s)
    mcal.save_cached(c, _fake(c, measured=db.to_dict()))
    prof, _, _ = mcal.machine_profile(c, allow_profile=False)
    assert prof.runtime == {"dtensor_module_s": 4e-3} and prof.measured(FSDP_UNIT)
    assert prof.world == 2 and prof.matches(c.fingerprint()) and prof.calibration == _fake(c).calibration
    defaults = with_calibration(None, prof.calibration, c)  # the same fit without the measured work
    g = load_graph("llama-tiny")

    def price(cs: str, profile):
        cfg = ParallelConfig.parse(cs + ",dtype=fp32")
        return estimate(g, c, cfg, Partition.even(len(g.layers), 1, cfg.recompute), 8, profile=profile)

    tp = [price("tp=2,sp=on,mbs=8", p) for p in (prof, defaults)]  # one micro-batch
    linears = sum(tp_linears(l, tp[0].config) for l in g.layers)  # the norms keep the default figure
    assert tp[0].breakdown["compute"] - tp[1].breakdown["compute"] == pytest.approx(
        linears * (4e-3 - CPU_DTENSOR_MODULE_S), rel=1e-6)
    fsdp = [price("dp=2,zero=fsdp,mbs=4", p) for p in (prof, defaults)]
    assert fsdp[0].step_s != pytest.approx(fsdp[1].step_s, rel=1e-3)  # units at their measured price
    assert mcal.measured_profile(_fake(c), c) is None  # nothing measured (a one-core profile): the defaults


def test_calibration_changes_the_plans_estimate(tmp_path, monkeypatch) -> None:
    from planner.search.planning import plan_model

    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    c = parse_cluster("local-cpu:2")
    g = load_graph("llama-tiny")
    mc = replace(_fake(c), calibration={"comm_latency_s": 5e-3, "step_overhead_s": 0.05})
    mcal.save_cached(c, mc)
    prof, _, _ = mcal.machine_profile(c, allow_profile=False)
    raw, _ = plan_model(g, c, 4, spec="llama-tiny", cluster_spec="local-cpu:2")
    cal, _ = plan_model(g, c, 4, spec="llama-tiny", cluster_spec="local-cpu:2", profile=prof)
    assert raw.estimate["calibration"] == "uncalibrated"
    assert cal.estimate["calibration"] == mc.describe()
    assert cal.estimate["step_s"] > raw.estimate["step_s"] + 0.04


@pytest.mark.slow
def test_demo_profiles_this_machine_once_then_plans_calibrated(tmp_path, monkeypatch) -> None:
    """The first use profiles the machine (real gloo runs) and caches it; the demo prints its
    figures and writes the report; a later plan reuses the cache without launching anything."""
    env = dict(os.environ, AUTOPAR_CALIBRATE="1", AUTOPAR_CACHE_DIR=str(tmp_path / "cache"))
    run = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "planner.entry.cli", "demo", "--model", "llama-tiny", "--cluster",
                        "local-cpu:2", "--global-batch", "4", "--seq-len", "32", "--steps", "4", "--dir", str(run)],
                       capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "first plan on this machine: profiling it" in r.stderr
    out = r.stdout
    for want in ("(calibrated)", "measured/predicted", "one process:", "speedup", "entropy floor", "report: "):
        assert want in out, out
    assert os.path.exists(out.split("report: ")[1].split()[0])
    assert "one plain PyTorch process again" in out + r.stderr  # the baseline on both sides of the run
    recs = [json.loads(l) for l in open(run / "train_log.jsonl")]
    plan = json.loads((run / "plan.json").read_text())
    world = math.prod(int(kv.split("=")[1]) for kv in plan["config"].split(",") if kv.split("=")[0] in ("dp", "pp", "cp", "tp"))
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and len(recs[0]["memory_gib"]) == world  # one per rank
    assert world in (1, 2)  # two single-thread ranks, or one process with both cores
    cache = list((tmp_path / "cache").glob("machine-*.json"))
    assert len(cache) == 1
    d = json.loads(cache[0].read_text())
    one = mcal.one_process_config(d["world"])
    assert len(d["runs"]) == len(mcal.reference_configs(d["world"])) + (one is not None) and d["calibration"]
    assert one is None or d["runs"][-1]["label"] == one.label()  # the run without communication
    assert all(r["measured_s"] > 0 for r in d["runs"])
    runtime = d["measured"]["runtime"]  # the runtime's own work, measured after the layouts
    assert set(runtime) == {"replicate_unit_s", "fsdp_unit_s", "fsdp_reduce_unit_s", "ep_dispatch_s",
                            "dtensor_module_s", "dtensor_norm_s"} and all(0 <= v < 0.1 for v in runtime.values())
    assert 1e-4 < runtime["dtensor_module_s"] < 2e-2  # 1.15-1.18 ms on the 2-core VM
    assert 2e-5 < runtime["dtensor_norm_s"] < 1e-2  # 0.40-0.43 ms
    units = d["measured"]["collectives"]["fsdp_unit/2/intra"]
    assert [u["nbytes"] for u in units] == sorted(u["nbytes"] for u in units) and units[-1]["nbytes"] >= 64 << 20
    before = cache[0].stat().st_mtime
    # a later plan (what `autopar plan` does first) reads the cache and profiles nothing
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", env["AUTOPAR_CACHE_DIR"])
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "1")
    t0 = time.perf_counter()
    later = parse_cluster("local-cpu:2")
    prof, note, _ = mcal.machine_profile(later, progress=lambda m: pytest.fail(m))
    assert time.perf_counter() - t0 < 5 and cache[0].stat().st_mtime == before
    assert note.startswith("calibrated on this machine")
    assert prof.runtime == runtime and prof.measured("fsdp_unit")
    assert set(d["figures"]) == {"gemm_flops", "copy_bps", "thread_speedup", "thread_sync_us"}
    live = mcal.machine_figures(later)  # this process's own probe: the layers priced at the fit's speeds
    for key, fig in (("eff_matmul", "gemm_flops"), ("eff_memory", "copy_bps")):
        assert prof.calibration[key] * live[fig] == pytest.approx(d["calibration"][key] * d["figures"][fig])
    assert {k: v for k, v in prof.calibration.items() if not k.startswith("eff_")} == \
        {k: v for k, v in d["calibration"].items() if not k.startswith("eff_")}
    from planner.search.planning import plan_model
    p, _ = plan_model(load_graph("llama-tiny"), parse_cluster("local-cpu:2"), 4, spec="llama-tiny",
                      cluster_spec="local-cpu:2", profile=prof)
    assert p.estimate["calibration"].startswith(note[:-1]) and len(note) < 120  # the plan keeps the details


def test_demo_calls_a_tie_only_within_the_one_process_steps_middle_half() -> None:
    """The summary's speedup line says "a tie" where the plan's median step lies within the
    one-process steps' interquartile range, and benchmarks/first_run.py reads it back."""
    from benchmarks.first_run import parse_summary
    from planner.entry.demo import DemoResult, summary_lines

    def result(measured: float) -> DemoResult:
        return DemoResult(plan_path="p", report_path="r", label="dp1 threads2", calibration="calibrated on this",
                          predicted_s=0.25, measured_s=measured, single_process_s=0.26,
                          single_process_quartiles=(0.24, 0.28), first_loss=7.0, last_loss=5.0,
                          entropy_floor=4.0, wall_s=40.0)
    for measured, tie in ((0.27, True), (0.24, True), (0.29, False), (0.20, False)):
        text = "\n".join(summary_lines(result(measured)))
        assert result(measured).tie is tie
        got = parse_summary(text)
        assert got["tie"] is tie and got["speedup"] == pytest.approx(0.26 / measured, abs=5e-3), text
