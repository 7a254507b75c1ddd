"""Launching a plan on this machine: torchrun commands, the checks before any process
starts, and the emit-and-run loop (``autopar run``, ``autopar demo``, the benchmarks)."""
from __future__ import annotations

import sys

from typing import Callable

from planner.errors import AutoparError


def progress(msg: str) -> None:
    print(f"[autopar] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(threads: int = 0, backend: str = "gloo") -> dict:
    """The environment of the worker processes autopar launches on this machine: ``threads``
    intra-op threads per rank (a plan's ``ParallelConfig.threads``; 0: one, torchrun's own
    default for several processes) unless the user set ``OMP_NUM_THREADS``; on a ``backend``
    gloo cluster, glibc's allocator settings for CPU ranks (``codegen.runtime.cpu_env``) unless
    the user set their own. The emitted program sets a plan's threads itself too
    (``codegen.runtime.mesh.init_distributed``). A rank that crashes inside torch prints its
    Python stack (``PYTHONFAULTHANDLER``, unless set)."""
    import os

    from codegen.runtime.cpu_env import allocator_env

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(threads, 1))),
               PYTHONFAULTHANDLER=os.environ.get("PYTHONFAULTHANDLER", "1"))
    return env | allocator_env(backend, os.environ)


def cpu_scheduling(nproc: int, threads: int, backend: str) -> "Callable[[], None] | None":
    """The ``preexec_fn`` of a local launch whose CPU ranks (``backend`` gloo) outnumber this
    machine's cores (``nproc x threads``): it runs the launch under SCHED_BATCH, which its ranks
    inherit, so a rank woken by a peer's message does not preempt the one computing. Measured on
    2 cores: a 1 KB all_reduce over 4 gloo ranks 1.2 ms instead of 5.7 ms; gpt-mini dp2 x tp2 on
    local-cpu:4, 12 steps, median 0.556 / 0.575 s instead of 0.650 / 0.727 s (two runs each).
    None elsewhere (GPU ranks, or no more ranks than cores), and where the policy cannot be set."""
    import os

    if backend != "gloo" or not hasattr(os, "SCHED_BATCH") or nproc * max(threads, 1) <= len(os.sched_getaffinity(0)):
        return None
    return batch_scheduling


def batch_scheduling() -> None:
    """Put the calling process (and the children it starts after) under SCHED_BATCH where the OS
    has it and allows it (:func:`cpu_scheduling`); elsewhere nothing changes."""
    import os

    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # not permitted: the default policy, only slower
        pass


def torchrun_cmd(nproc: int, module_args: list[str]) -> list[str]:
    """torchrun on this machine: N processes, a free local port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *module_args]


def check_plan(plan, *, import_user_code: bool = True) -> None:
    """Refuse a plan made for another model (fingerprint of the model its spec names now)
    or, for ``local-cpu:N`` plans, for another machine. A ``package.module:function``
    spec is imported only when ``import_user_code`` (running the program imports it anyway)."""
    import re

    from planner.frontend.load import load_graph

    from planner.feasibility import Batch, Nodes, problems

    from codegen.runtime.recipe import runtime_problem

    found = problems(plan.config, plan.facts, Batch.of_plan(plan.batch), Nodes.of_plan(plan.cluster, plan.config.world))
    found += [w for w in [runtime_problem(plan.config, [str(s.get("recompute")) for s in plan.stages])] if w]
    if found:
        raise AutoparError(f"plan {plan.config.label()} cannot run for {plan.model.get('name')}: "
                           f"{'; '.join(found)}; plan again with `autopar plan`")
    spec = plan.model.get("spec")
    if isinstance(spec, str) and (import_user_code or not re.fullmatch(r"[\w.]+:\w+", spec.strip())):
        g = load_graph(spec, batch=1, seq_len=plan.batch["seq_len"])
        plan.check_fingerprints(model_fp=g.fingerprint())
    if import_user_code and plan.cluster.get("backend") == "nccl" and plan.cluster.get("nodes", 1) == 1:
        import torch

        if not torch.cuda.is_available():
            raise AutoparError(f"plan is for {plan.cluster.get('name')!r} (nccl, CUDA GPUs) but this machine has no "
                               "CUDA device: run it on that cluster, or plan for this machine with --cluster local-cpu:N")
    cspec = plan.cluster.get("spec")
    if isinstance(cspec, str) and cspec.startswith("local-cpu:"):
        from cost_models.cluster import parse_cluster

        plan.check_fingerprints(cluster_fp=parse_cluster(cspec).fingerprint())


def prepare_run(plan_path: str, *, steps: int, run_dir: str, ckpt_every: int = 0, extra: list[str] | None = None,
                force: bool = True, here: bool = True):
    """Check a plan and emit its program into ``run_dir``; returns (plan, program path, log
    path, the program's arguments). ``here``: the job runs on this machine (its user code is
    imported and a GPU plan needs a GPU here); False for a job script run elsewhere."""
    import os

    from codegen.emit import write_program
    from planner.plan import Plan

    plan = Plan.load(plan_path)
    check_plan(plan, import_user_code=here)
    os.makedirs(run_dir, exist_ok=True)
    prog = os.path.join(run_dir, f"train_{plan.model['name'].replace('-', '_')}.py")
    write_program(plan, prog, force=force)
    log = os.path.join(run_dir, "train_log.jsonl")
    args = ["--steps", str(steps), "--metrics", log, "--ckpt-dir", os.path.join(run_dir, "checkpoints"),
            "--ckpt-every", str(ckpt_every), *(extra or [])]
    return plan, prog, log, args


def data_args(spec: str | None, plan, dtype: str | None = None, eos: int | None = None,
              check: bool = True) -> list[str]:
    """The program's data flags for ``--data spec`` (with ``--data-dtype`` and ``--data-eos``),
    checked before any process starts: a ``package.module:function`` hook as it is; a token file
    or a saved dataset (codegen/runtime/corpus.py) opened and scanned for ids outside ``plan``'s
    model's vocabulary (not with ``check=False``: a job script run on another machine, which the
    program checks there). Raises AutoparError (one line naming the fix)."""
    from codegen.runtime.corpus import check_ids, is_hook, open_tokens

    if spec is None or is_hook(spec):
        if dtype is not None or eos is not None:
            raise AutoparError("--data-dtype and --data-eos describe a token file: name it with --data PATH")
        return ["--data", spec] if spec else []
    if not check:
        return ["--data", spec, *(["--data-dtype", dtype] if dtype else []),
                *(["--data-eos", str(eos)] if eos is not None else [])]
    vocab = int(plan.model.get("vocab") or 0)
    src = open_tokens(spec, vocab, int(plan.batch["seq_len"]), dtype, eos)
    check_ids(src, vocab)
    if (plan.batch.get("documents") or {}).get("lengths") and not src.marks_documents:
        progress(f"--data {spec}: the plan packs documents (--seq-lens) but the data marks none: plain rows "
                 "(give --data-eos ID, the id that ends each document)")
    return ["--data", spec, *(["--data-dtype", dtype] if dtype else []),
            *(["--data-eos", str(eos)] if eos is not None else [])]


def run_plan(plan_path: str, *, steps: int, run_dir: str, ckpt_every: int = 0, max_restarts: int = 0,
             extra: list[str] | None = None, force: bool = True, timeout_s: float | None = None,
             rig_mbit: float | None = None) -> tuple[int, str]:
    """Emit and launch a plan's program on this machine with torchrun; returns (rc, log path).
    ``timeout_s``: kill the job (torchrun and its workers) after that many seconds; rc is then 124.
    ``rig_mbit``: run the ranks as two regions of half the world each, in two network namespaces
    joined by a link of that many Mbit/s (0: no limit; planner/entry/netns_rig.py).

    A relaunch loop (not torchrun's elastic restart, which cannot reconnect gloo workers)
    restarts a job whose process died, up to ``max_restarts`` times; the program resumes
    from its newest complete checkpoint."""
    plan, prog, log, args = prepare_run(plan_path, steps=steps, run_dir=run_dir, ckpt_every=ckpt_every,
                                        extra=extra, force=force)
    worker = [prog, *args]
    if plan.cluster.get("nodes", 1) > 1:
        print("run on every node (set NODE_RANK and MASTER_ADDR), or write a Slurm script with --launcher slurm:")
        print(f"  torchrun --nnodes {plan.cluster['nodes']} --nproc-per-node {plan.cluster['devices_per_node']} "
              f"--node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500 " + " ".join(worker))
        return 0, log
    env = worker_env(plan.config.threads, plan.cluster.get("backend", ""))
    rig = rig_spec(plan.config.world, rig_mbit)
    rc = 1
    for attempt in range(max_restarts + 1):
        env["AUTOPAR_ATTEMPT"] = str(attempt)
        if rig is None:
            rc = run_killable(torchrun_cmd(plan.config.world, worker), env, timeout_s,
                              cpu_scheduling(plan.config.world, plan.config.threads, plan.cluster.get("backend", "")))
        else:
            from planner.entry.netns_rig import Rig, launch_across

            with Rig(rig) as r:
                rc = launch_across(r, worker, env, timeout_s).rc
        if rc == 0:
            break
        if attempt < max_restarts:
            progress(f"job exited with {rc}; relaunching (attempt {attempt + 2} of {max_restarts + 1})")
    return rc, log


def rig_spec(world: int, rig_mbit: float | None):
    """The two-region rig for a ``world``-rank job at ``rig_mbit`` Mbit/s (0: no limit), or None
    without one; refuses (one line) a world it cannot halve and a machine that cannot make it."""
    if rig_mbit is None:
        return None
    from planner.entry.netns_rig import RigSpec, rig_problem

    if world < 2 or world % 2:
        raise AutoparError(f"the two-region rig halves the job's ranks, and this plan has {world}: "
                           "plan for an even number of processes (local-cpu:2 or :4)")
    problem = rig_problem()
    if problem:
        raise AutoparError(f"cannot run on the two-region rig: {problem}; run without --rig-mbit")
    return RigSpec(nproc=world // 2, rate_mbit=rig_mbit or None)


def launch_timed_runs(plan_paths: list[str], out: str, *, world: int, steps: int, warmup: int,
                      timeout_s: float, runtime: bool = False) -> dict:
    """Time ``steps`` steps of each plan (all of ``world`` processes) in one torchrun launch
    (``planner/entry/timed_runs.py``); with ``runtime`` also measure the CPU runtime's own work
    there. Returns what it wrote: ``{"runs": per-plan records, "runtime": a ProfileDB layout}``
    (``runtime`` only where it was measured)."""
    import json
    import os

    env = worker_env()
    cmd = torchrun_cmd(world, ["-m", "planner.entry.timed_runs", out, *plan_paths, "--steps", str(steps),
                               "--warmup", str(warmup), *(["--runtime"] if runtime else [])])
    rc = run_killable(cmd, env, timeout_s, cpu_scheduling(world, 1, "gloo"))
    if rc != 0 or not os.path.exists(out):
        raise AutoparError(f"the calibration runs failed (torchrun exit {rc}; output above): plan with "
                           "--no-calibrate, or set AUTOPAR_CALIBRATE=0")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def run_killable(cmd: list[str], env: dict, timeout_s: float | None,
                 preexec: "Callable[[], None] | None" = None) -> int:
    """Run ``cmd`` in its own process group; past ``timeout_s`` kill the whole group (rc 124).
    ``preexec``: run in the child before ``cmd`` (:func:`cpu_scheduling`)."""
    import os
    import signal
    import subprocess

    p = subprocess.Popen(cmd, env=env, start_new_session=timeout_s is not None, preexec_fn=preexec)
    try:
        return p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        progress(f"job killed after {timeout_s:.0f} s (timeout)")
        return 124


def compare_run(plan_path: str, log: str) -> dict:
    """Predicted against measured for a finished run (``planner.report.data.compare_run``)."""
    from planner.plan import Plan
    from planner.report.data import compare_run as compare, load_run_log

    return compare(Plan.load(plan_path), load_run_log(log))
