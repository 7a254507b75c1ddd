"""Does a training script that never calls ``close()`` exit cleanly? Runs it N times in a row.

``python benchmarks/clean_exit.py [--runs 30] [--steps 5]`` launches, N times, ``torchrun
--nproc-per-node 2 benchmarks/clean_exit_script.py``: ``planner.auto_parallelize`` on a tiny
transformers Llama (planned for ``local-cpu:2``), five SGD steps, and the script simply ends
(module-level globals, as users write it): no ``close()``, no ``destroy_process_group``, no
``os._exit``. Prints, per run, the exit
status and whether a rank aborted (``terminate called`` in its output), then how many of the
N runs exited 0. The build's ``atexit`` hook (``codegen/runtime/installs.py``) destroys the
process groups it created before the interpreter tears down; without it, 2 runs in 70
(2026-12-02, this 2-core machine) lost a rank to ``terminate called without an active
exception`` (SIGABRT).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(steps: int, timeout: float, keep: str | None = None) -> tuple[int, bool, float]:
    """(exit status, whether 'terminate called' appeared, seconds) of one torchrun launch; the
    output of a failed one is written to ``keep`` (with Python's fault handler on: every
    thread's Python stack at the abort)."""
    from planner.entry.launch import torchrun_cmd, worker_env

    env = dict(worker_env(), PYTHONPATH=ROOT, PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(torchrun_cmd(2, [os.path.join(ROOT, "benchmarks", "clean_exit_script.py"), str(steps)]),
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, False, time.perf_counter() - t0
    aborted = "terminate called" in proc.stdout + proc.stderr
    if keep and (proc.returncode or aborted):
        with open(keep, "a") as fh:
            fh.write(f"==== exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n")
    return proc.returncode, aborted, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    ap.add_argument("--keep", default=None, help="append the output of failed launches to this file")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    clean = 0
    for i in range(args.runs):
        rc, aborted, secs = launch(args.steps, args.timeout, args.keep)
        clean += rc == 0 and not aborted
        print(f"run {i + 1:2d}: exit {rc}{'  terminate called' if aborted else ''}  {secs:.1f} s", flush=True)
    print(f"{clean}/{args.runs} runs exited 0 without an abort")


if __name__ == "__main__":
    main()
