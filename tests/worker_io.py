"""What every distributed test worker does around its runs (tests/*_worker.py): a failed run
becomes a result, results go to one JSON file from rank 0, and the worker ends through
``exit_process`` (the gloo exit abort, codegen/runtime/mesh.py)."""
from __future__ import annotations

import json
import traceback
from typing import Any, Callable

import torch.distributed as dist

from codegen.runtime.mesh import exit_process, teardown


def failure(exc: BaseException) -> dict[str, str]:
    """Print the traceback and return the run's result: ``{"error": "Type: message"}``."""
    traceback.print_exc()
    return {"error": f"{type(exc).__name__}: {exc}"}


def report(key: str, result: Any, width: int = 300) -> None:
    """One progress line on rank 0."""
    if dist.get_rank() == 0:
        print(key, json.dumps(result)[:width], flush=True)


def write_results(results: dict, out: str) -> None:
    """Rank 0 writes ``results`` to ``out`` (again after each run: a crash keeps what ran)."""
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)


def finish(results: dict, out: str) -> None:
    """Write the results, tear the process groups down and exit 0."""
    write_results(results, out)
    teardown()
    exit_process(0)


def made_once(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0 only, its result (or its error, raised on every rank) broadcast.
    For what the planner decides in a worker (a stage split): it reads this machine's speed live
    (``local-cpu:N``), so ranks deciding alone may decide differently and hang; autopar plans
    once and broadcasts too (planner/entry/api.py)."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, fn())]
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            box = [(False, f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise RuntimeError(f"on rank 0: {value}")
    return value
