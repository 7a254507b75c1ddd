"""How the tests start their worker processes (torchrun launches and single processes).

One function, :func:`run_launch`, so every launch gets the same environment and the same
handling of a crash:

- ``PYTHONFAULTHANDLER=1``: a rank killed by a fatal signal prints every thread's Python stack
  (what was running when the C++ side crashed), so a crash in CI can be located;
- every launch runs under SCHED_BATCH (``planner.entry.launch.batch_scheduling``, as ``autopar run``
  runs ranks that outnumber the cores): a gloo rank woken by a peer's message does not preempt the
  one computing. The 4-process parity launch (tests/dist_worker.py, 93 runs on 2 cores) took
  163 s instead of 190 s;
- a launch in which a rank was *killed by a signal* (segmentation fault, abort, bus error: a
  crash inside torch / gloo, not a failed assertion or a Python exception) runs once more,
  with a fresh port, and the crash is reported as a pytest warning with its stack. A launch
  that fails in any other way, or crashes twice, fails the test. A crash once in 2026-12 CI
  (one rank of the 4-process parity launch, SIGSEGV inside an FSDP all-gather's step) failed
  the 177 tests sharing that launch; 4 reruns here did not reproduce it.
"""
from __future__ import annotations

import os
import re
import subprocess
import warnings
from typing import Callable, Optional, Union

from planner.entry.launch import batch_scheduling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torchrun's failure summary ("Signal 11 (SIGSEGV) received by PID ...") or a plain process's rc
CRASH = re.compile(r"Signal \d+ \((SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE)\) received")
CRASH_RCS = {-11, -6, -7, -4, -8}

Cmd = Union[list[str], Callable[[], list[str]]]


class LaunchCrashed(Warning):
    """A worker launch lost a rank to a fatal signal and was run again."""


def crashed(proc: subprocess.CompletedProcess) -> bool:
    """Whether a rank (or the process itself) was killed by a fatal signal."""
    return proc.returncode in CRASH_RCS or (proc.returncode != 0 and CRASH.search(proc.stderr or "") is not None)


def run_launch(cmd: Cmd, *, env: Optional[dict] = None, timeout: float = 600, cwd: str = ROOT,
               retries: int = 1) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a list, or a function returning one: called again for a retry, so a
    torchrun launch gets a fresh port) to the end, output captured as text; ``env`` defaults
    to this process's. Returns the completed process (the caller checks its return code and
    output); a crash (module docstring) runs again up to ``retries`` times."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    for attempt in range(retries + 1):
        args = cmd() if callable(cmd) else cmd
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=batch_scheduling)
        if not crashed(proc) or attempt == retries:
            return proc
        warnings.warn(LaunchCrashed(f"{' '.join(args[-3:])}: a rank was killed by a signal (rc {proc.returncode}); "
                                    f"running the launch again. Its stderr's end:\n{proc.stderr[-3000:]}"))
    raise AssertionError("unreachable")


def free_port() -> int:
    """A TCP port free on the loopback now (torchrun's rendezvous port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, worker, args: tuple) -> None:
    """One rank of :func:`spawn_gloo`: join the gloo group, run ``worker(rank, world, *args)``,
    leave it and end through the gloo exit abort (codegen/runtime/mesh.py ``exit_process``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from codegen.runtime.mesh import exit_process
    exit_process(0)


def spawn_gloo(worker, world: int, *args) -> None:
    """Run the module-level function ``worker(rank, world, *args)`` on ``world`` gloo ranks spawned
    from this process (torch.multiprocessing); a rank's exception fails the call."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_rank, args=(world, free_port(), worker, args), nprocs=world, join=True)


def run_worker(worker: str, world: int, out: str, timeout: float = 600) -> dict:
    """Launch ``tests/<worker>`` on ``world`` gloo ranks (one intra-op thread each) writing its
    JSON results to ``out``; assert the launch succeeded and return the results."""
    import json
    import sys

    def cmd() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                f"--master-port={free_port()}", os.path.join(ROOT, "tests", worker), out]
    proc = run_launch(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), timeout=timeout)
    assert proc.returncode == 0 and os.path.exists(out), proc.stderr[-4000:]
    with open(out) as fh:
        return json.load(fh)
