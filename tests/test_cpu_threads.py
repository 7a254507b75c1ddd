"""CPU clusters: threads per rank as part of the plan, and the CPU runtime's own work priced.

Clusters here are built from a fixed description (no measurement), so every figure is
deterministic: two cores, two processes, a measured 1.8x GEMM speedup on two threads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cost_models import cpu_runtime
from cost_models.cluster import Cluster, load_preset
from cost_models.dtensor_dispatch import dtensor_dispatch_s
from cost_models.shared_cores import rank_speed, ranks_cluster, thread_scaling
from planner.feasibility import degrees_problem, layout_threads, rank_counts, rank_threads
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Plan
from planner.search.planning import evaluate_config, plan_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu(n: int = 2, cores: int = 2, speedup: float = 1.8, sync_us: float = 0.0) -> Cluster:
    """``n`` gloo processes on ``cores`` cores, per-process figures as detect() writes them."""
    share = min(1.0, cores / n)
    return Cluster.from_dict({
        "name": f"local-cpu:{n}", "nodes": 1, "devices_per_node": n, "backend": "gloo",
        "device": {"name": "cpu-test", "memory_gib": 8.0 / n, "mem_bw_gbs": 10.0 * share,
                   "peak_tflops": {"fp32": 0.1 * share}},
        "intra": {"bandwidth_gbs": 1.0, "latency_us": 130.0}, "inter": {"bandwidth_gbs": 1.0, "latency_us": 130.0},
        "detected": True, "cores_per_node": cores, "thread_speedup": speedup, "thread_sync_us": sync_us})


# ---------------------------------------------------------------------- threads per rank

def test_ranks_times_threads_is_the_cores() -> None:
    c = cpu(2, 2)
    assert rank_counts(c) == [2, 1]
    assert [rank_threads(0, c.cores_per_node, r) for r in rank_counts(c)] == [1, 2]
    assert layout_threads(c, 1) == 2 and layout_threads(c, 2) == 0  # 0: the default, one thread
    four = cpu(4, 2)  # more processes than cores: one thread each, never fewer
    assert rank_counts(four) == [4, 2, 1] and rank_threads(0, 2, 4) == 1
    assert [r * max(1, layout_threads(four, r)) for r in (2, 1)] == [2, 2]
    # a GPU cluster runs its device count, nothing else
    gpu = load_preset("dgx-h100", 1)
    assert rank_counts(gpu) == [8] and layout_threads(gpu, 8) == 0
    assert degrees_problem(ParallelConfig(dp=4), gpu) is not None
    assert degrees_problem(ParallelConfig(threads=2), c) is None
    assert "runs 2 or 1 processes" in degrees_problem(ParallelConfig(dp=4), c)


def test_thread_speed_is_the_measured_scaling() -> None:
    c = cpu(2, 2, speedup=1.8)
    assert thread_scaling(c, 1) == 1.0 and thread_scaling(c, 2) == pytest.approx(1.8)
    assert thread_scaling(c, 8) == pytest.approx(1.8)  # no more than the cores
    assert rank_speed(c, 1, 2) == pytest.approx(1.8)  # one process, both cores' threads
    assert rank_speed(c, 2, 1) == pytest.approx(1.0)  # what detect() measured
    assert rank_speed(cpu(4, 2), 2, 1) == pytest.approx(2.0)  # a core each instead of half of one
    one = ranks_cluster(c, ParallelConfig(threads=2))
    assert one.devices_per_node == 1 and one.peak_flops("fp32") == pytest.approx(1.8 * c.peak_flops("fp32"))
    assert one.memory_bytes == pytest.approx(2 * c.memory_bytes, rel=1e-6)
    assert ranks_cluster(c, ParallelConfig(dp=2)) is c  # the detected layout: the cluster itself
    gpu = load_preset("dgx-h100", 1)
    assert ranks_cluster(gpu, ParallelConfig(dp=8, threads=4)) is gpu


def test_thread_probe_outlasts_a_spell_that_holds_a_core() -> None:
    """The thread speed-up probe (``machine.thread_speedup``) keeps taking pairs past its first
    ones while they read under ``RETRY_BELOW`` of the cores (at most ``RETRY_BELOW_MAX``), for up to
    ``retry_s``: a spell that
    held a core through the first pairs does not become the machine's figure."""
    from cost_models.machine import best_of_pairs

    def probe(reads):
        it = iter(reads)
        return lambda: next(it, 1.0)

    spell = [1.0] * 12 + [1.98]  # 12 pairs while something holds a core, then the machine
    assert best_of_pairs(probe(spell), 8, 1.7, retry_s=10.0) == 1.98
    assert best_of_pairs(probe(spell), 8, 1.7, retry_s=0.0) == 1.0  # the 8 pairs alone: the spell
    assert best_of_pairs(probe([1.6] * 4 + [1.9]), 8, 1.7, retry_s=0.0) == 1.9  # a good pair among the 8


def test_search_weighs_one_process_with_every_thread() -> None:
    """On two cores the search prices one process with two threads beside two processes, and
    the faster the threads scale the cheaper it is; with perfect scaling it wins."""
    g = load_graph("gpt-tiny")
    slow, fast = cpu(2, 2, speedup=1.0), cpu(2, 2, speedup=2.0)
    one = ParallelConfig(mbs=8, threads=2, dtype="fp32")
    e_slow, found = evaluate_config(g, slow, one, 8)
    e_fast, _ = evaluate_config(g, fast, one, 8)
    assert found == [] and e_fast.step_s < e_slow.step_s
    plan, res = plan_model(g, fast, 8, spec="gpt-tiny", cluster_spec="local-cpu:2", top_k=50)
    worlds = {e.config.world for e in [res.best, *res.alternatives]}
    assert worlds == {1, 2}
    if res.best.config.world == 1:
        assert plan.config.threads == 2 and plan.config.label().endswith("threads2")
    picked_one = next(e for e in [res.best, *res.alternatives] if e.config.world == 1)
    assert picked_one.config.threads == 2
    # priced with the threads: the same layout on one thread's speed is slower
    e1, _ = evaluate_config(g, fast, picked_one.config.replace(threads=1), 8)
    assert e1.step_s > picked_one.step_s
    # while another process holds a core each parallel op waits a scheduler slice for its
    # second thread (measured thread_sync_us): one process then loses to two
    busy = cpu(2, 2, speedup=2.0, sync_us=5000.0)
    e_busy, _ = evaluate_config(g, busy, picked_one.config, 8)
    n_ops = sum(l.fwd_ops + l.bwd_ops for l in g.layers)
    assert e_busy.step_s - picked_one.step_s == pytest.approx(n_ops * 5e-3 * picked_one.microbatches, rel=0.05)
    _, res_busy = plan_model(g, busy, 8, spec="gpt-tiny", cluster_spec="local-cpu:2")
    assert res_busy.best.config.world == 2
    e_two, _ = evaluate_config(g, busy, ParallelConfig(dp=2, mbs=4, dtype="fp32"), 8)
    e_two_free, _ = evaluate_config(g, fast, ParallelConfig(dp=2, mbs=4, dtype="fp32"), 8)
    assert e_two.step_s == pytest.approx(e_two_free.step_s)  # one thread each: no wake-ups


def test_plan_without_threads_loads_and_writes_as_before(tmp_path) -> None:
    g = load_graph("gpt-tiny")
    c = cpu(2, 2)
    plan, _ = plan_model(g, c, 8, spec="gpt-tiny", cluster_spec="local-cpu:2")
    d = json.loads(plan.to_json())
    d["config"] = ",".join(x for x in d["config"].split(",") if not x.startswith("threads="))
    d["parallel"].pop("threads", None)
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    old = Plan.load(str(p))
    assert old.config.threads == 0
    assert "threads" not in old.config.to_str() and "threads" not in old.to_dict()["parallel"]
    assert ParallelConfig.parse("dp=2,threads=2").threads == 2
    with pytest.raises(Exception, match="threads=-1"):
        ParallelConfig(threads=-1).validate()


def test_report_says_when_one_process_wins() -> None:
    from planner.report.data import threads_text

    from planner.search.planning import build_plan

    g = load_graph("gpt-tiny")
    c = cpu(2, 2, speedup=2.0)
    e, _ = evaluate_config(g, c, ParallelConfig(mbs=8, threads=2, dtype="fp32"), 8)
    alt, _ = evaluate_config(g, c, ParallelConfig(dp=2, mbs=4, dtype="fp32"), 8)
    one = build_plan(g, c, e, spec="gpt-tiny", cluster_spec="local-cpu:2", alternatives=[alt])
    text = threads_text(one)
    assert text.startswith("one process with 2 threads is fastest") and alt.config.label() in text
    assert one.cluster["cores_per_node"] == 2
    two = build_plan(g, c, alt, spec="gpt-tiny", cluster_spec="local-cpu:2")
    assert threads_text(two) is None  # one thread per rank: nothing to say


# ---------------------------------------------------------------------- program and launcher

def test_program_and_launcher_set_the_plans_threads() -> None:
    from codegen.emit import emit
    from planner.entry.launch import worker_env
    from planner.search.planning import build_plan

    g = load_graph("gpt-tiny")
    c = cpu(2, 2)
    e, _ = evaluate_config(g, c, ParallelConfig(mbs=8, threads=2, dtype="fp32"), 8)
    src = emit(build_plan(g, c, e, spec="gpt-tiny", cluster_spec="local-cpu:2"))
    assert "threads=2" in src and "init_distributed(threads=CONFIG.threads)" in src
    assert "Nodes('local-cpu:2', 1, 2, 2)" in src  # the cores: world 1 runs on this 2-process cluster
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        assert worker_env(2)["OMP_NUM_THREADS"] == "2" and worker_env()["OMP_NUM_THREADS"] == "1"
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


@pytest.mark.slow
def test_runtime_runs_the_plans_threads() -> None:
    """A real one-rank gloo group: init_distributed(threads=2) runs two intra-op threads even
    under OMP_NUM_THREADS=1 (and leaves the environment's count when the plan sets none)."""
    code = ("import torch, torch.distributed as dist\n"
            "from codegen.runtime.mesh import init_distributed\n"
            "init_distributed(threads=int(__import__('sys').argv[1]))\n"
            "print(torch.get_num_threads())\n"
            "dist.destroy_process_group()\n")
    from planner.entry.launch import free_port

    out = []
    for threads in (2, 0):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   AUTOPAR_NO_PIN="1", PYTHONPATH=ROOT)
        r = subprocess.run([sys.executable, "-c", code, str(threads)], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        out.append(int(r.stdout.split()[-1]))
    assert out == [2, 1]


# ---------------------------------------------------------------------- the runtime's own work

def test_wrapper_work_grows_with_units_and_micro_batches_on_cpu_only() -> None:
    g = load_graph("gpt-tiny")
    c = cpu(2, 2)

    def runtime(cluster, **kw) -> float:
        e, _ = evaluate_config(g, cluster, ParallelConfig(dtype="fp32", **kw), 8)
        return e.breakdown.get("runtime", 0.0)

    few, many = runtime(c, dp=2, zero="fsdp", mbs=4), runtime(c, dp=2, zero="fsdp", mbs=1)
    assert 0 < few < many  # 1 vs 4 micro-batches: four times the per-micro-batch work
    assert many == pytest.approx(4 * few)
    assert runtime(c, dp=2, zero="fsdp", mbs=4) > runtime(c, dp=2, zero="zero1", mbs=4, pp=1, tp=1) == 0.0  # reducer
    assert runtime(c, pp=2, schedule="1f1b", mbs=1) == 0.0  # no data parallelism, no wrapper
    f, b = cpu_runtime.wrapper_unit_s(c, ParallelConfig(dp=2, zero="fsdp"))
    assert f + b == pytest.approx(cpu_runtime.CPU_FSDP_UNIT_S + cpu_runtime.CPU_FSDP_REDUCE_UNIT_S)
    gpu = load_preset("dgx-h100", 1)
    assert cpu_runtime.wrapper_unit_s(gpu, ParallelConfig(dp=8, zero="fsdp")) == (0.0, 0.0)
    e, _ = evaluate_config(load_graph("gpt-small"), gpu, ParallelConfig(dp=8, zero="fsdp", mbs=1, dtype="fp32"), 64)
    assert "runtime" not in e.breakdown  # on GPUs only mixed precision's copies (cost_models/mp_casts.py) are there


def test_dtensor_and_ep_dispatch_priced_per_sharded_op_on_cpu_only() -> None:
    c, gpu = cpu(2, 2), load_preset("dgx-h100", 1)
    g = load_graph("gpt-tiny")
    block = next(l for l in g.layers if l.attention is not None)
    plain = sum(dtensor_dispatch_s(block, c, ParallelConfig(tp=2)))
    with_sp = sum(dtensor_dispatch_s(block, c, ParallelConfig(tp=2, sp=True)))
    assert 0 < plain < with_sp  # sequence parallel shards the norms too: more DTensor modules
    assert dtensor_dispatch_s(block, gpu, ParallelConfig(tp=2, sp=True)) == (0.0, 0.0)
    moe = load_graph("moe-tiny")
    routed = next(l for l in moe.layers if l.moe is not None)
    cfg = ParallelConfig(dp=2, ep=2, zero="fsdp")
    assert sum(cpu_runtime.ep_dispatch_s(routed, c, cfg)) == pytest.approx(cpu_runtime.CPU_EP_DISPATCH_S)
    assert cpu_runtime.ep_dispatch_s(routed, gpu, cfg) == (0.0, 0.0)
    assert cpu_runtime.ep_dispatch_s(routed, c, ParallelConfig(dp=2, zero="fsdp")) == (0.0, 0.0)
    # per MoE layer and micro-batch: more micro-batches, more dispatch
    e4, _ = evaluate_config(moe, c, cfg.replace(mbs=4, dtype="fp32"), 8)
    e1, _ = evaluate_config(moe, c, cfg.replace(mbs=1, dtype="fp32"), 8)
    n_moe = sum(1 for l in moe.layers if l.moe is not None)
    assert e1.breakdown["ep_comm"] - e4.breakdown["ep_comm"] >= 3 * n_moe * cpu_runtime.CPU_EP_DISPATCH_S * 0.99


def test_measured_runtime_work_replaces_the_default_and_calibration_wins(tmp_path) -> None:
    from cost_models.profile_db import ProfileDB

    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=2)
    assert cpu_runtime.figure("fsdp_unit_s", db) == cpu_runtime.CPU_FSDP_UNIT_S
    db.runtime = {"fsdp_unit_s": 4e-3, "ep_dispatch_s": 1e-3}
    db.to_json(tmp_path / "p.json")
    back = ProfileDB.load(tmp_path / "p.json")
    assert back.runtime == db.runtime and cpu_runtime.figure("fsdp_unit_s", back) == 4e-3
    back.calibration = {"fsdp_unit_s": 5e-3}
    assert cpu_runtime.figure("fsdp_unit_s", back) == 5e-3 and cpu_runtime.measured("fsdp_unit_s", back) == 4e-3
    f, b = cpu_runtime.wrapper_unit_s(cpu(2, 2), ParallelConfig(dp=2, zero="fsdp", pp=1), back)
    assert f + b == pytest.approx(5e-3 + cpu_runtime.CPU_FSDP_REDUCE_UNIT_S)
    bad = json.loads((tmp_path / "p.json").read_text())
    bad["runtime"]["fsdp_unit_s"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="runtime holds a negative"):
        ProfileDB.load(tmp_path / "bad.json")


def test_wrapper_work_is_the_priced_configurations_when_layer_costs_are_shared() -> None:
    """The search shares one LayerCosts across configurations of one ``LayerCosts.key`` (which
    leaves out zero and pp): the wrapper's work must be the priced configuration's. FSDP priced
    through costs built for zero1 (DDP's reducer, no wrapper work) once lost all of it (0.096 ->
    0.032 s on gpt-tiny dp2)."""
    from cost_models.estimate import estimate
    from cost_models.layer_costs import LayerCosts
    from planner.plan import Partition

    g, c = load_graph("gpt-tiny"), cpu(2, 2)
    zero1, fsdp = (ParallelConfig(dp=2, zero=z, mbs=1, dtype="fp32") for z in ("zero1", "fsdp"))
    assert LayerCosts.key(zero1) == LayerCosts.key(fsdp)
    part = Partition.even(len(g.layers), 1, "none")
    alone = estimate(g, c, fsdp, part, 8)
    shared = estimate(g, c, fsdp, part, 8, costs=LayerCosts(g, c, zero1, None))
    assert alone.breakdown["runtime"] > 0
    assert shared.breakdown == pytest.approx(alone.breakdown) and shared.step_s == pytest.approx(alone.step_s)
