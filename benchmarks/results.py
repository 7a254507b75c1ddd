"""Where every benchmark's result goes: indented JSON under ``benchmarks/results/`` by default."""
from __future__ import annotations

import json
from typing import Any

from planner.files import write_atomic


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` to ``path`` as indented JSON, atomically, creating the folder and
    replacing an earlier result (``planner.files.write_atomic``)."""
    write_atomic(path, json.dumps(obj, indent=1, default=str), force=True)


def autopar(*args: str) -> None:
    """Run one ``autopar`` command in this process (``planner.entry.cli.main``); a failure ends
    the benchmark with the command that failed."""
    from planner.entry.cli import main as cli

    if cli(list(args)) != 0:
        raise SystemExit(f"autopar {' '.join(args)} failed")
