"""CPU ranks start with glibc's allocator settings (codegen/runtime/cpu_env.py): in the launch
environment autopar builds and in the emitted program's run line; never over the user's own."""
from __future__ import annotations

from codegen.runtime.cpu_env import MALLOC_ENV, allocator_env, run_prefix
from planner.entry.launch import worker_env


def test_gloo_launches_carry_the_allocator_settings(monkeypatch) -> None:
    for k in MALLOC_ENV:
        monkeypatch.delenv(k, raising=False)
    env = worker_env(1)
    assert all(env[k] == v for k, v in MALLOC_ENV.items())
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 64 << 20 and int(env["MALLOC_TRIM_THRESHOLD_"]) == 256 << 20
    assert not set(MALLOC_ENV) & set(worker_env(1, "nccl"))  # GPU ranks: glibc's defaults


def test_the_users_allocator_settings_stand(monkeypatch) -> None:
    """Setting either key leaves both to the user (the trim threshold alone, with glibc's 128 KiB
    mmap threshold, ran slower than either)."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    env = worker_env(1)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "1048576" and "MALLOC_TRIM_THRESHOLD_" not in env
    assert allocator_env("gloo", {"MALLOC_TRIM_THRESHOLD_": "0"}) == {} and allocator_env("gloo") == MALLOC_ENV
    assert allocator_env("nccl") == {}


def test_the_run_line_says_them_on_cpu_only() -> None:
    assert run_prefix("gloo") == "MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=67108864 "
    assert run_prefix("nccl") == ""


def test_the_emitted_cpu_program_says_how_to_run_it() -> None:
    from codegen.emit import header
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.planning import build_plan, evaluate_config

    g, c = load_graph("gpt-tiny"), parse_cluster("local-cpu:2")
    e, _ = evaluate_config(g, c, ParallelConfig(dp=2, dtype="fp32"), 8)
    text = header(build_plan(g, c, e, spec="gpt-tiny", cluster_spec="local-cpu:2"))
    assert f"Run: {run_prefix('gloo')}torchrun --nproc-per-node 2 " in text
