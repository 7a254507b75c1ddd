"""What every distributed test worker does around its runs (tests/*_worker.py): a failed run
becomes a result, results go to one JSON file from rank 0, and the worker ends through
``exit_process`` (the gloo exit abort, codegen/runtime/mesh.py)."""
from __future__ import annotations

import json
import traceback
from typing import Any

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
