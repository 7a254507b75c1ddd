"""The runtime's boundaries: from the planner's feasibility rules it imports the one public
predicate (``problems``), its argument types, the sequence layout over cp ranks and the micro-batch count it cuts by,
nothing else (a per-axis part or a helper
would restate the rule's composition); it imports nothing of the zoo (the zoo is built on the
runtime's primitives, codegen/runtime/layers.py)."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNTIME = os.path.join(ROOT, "codegen", "runtime")
PREDICATE = {"problems", "Batch", "Nodes", "ClusterShape",
             "sequence_chunks", "sequence_problem",  # how a sequence lies over the cp ranks, which the runtime cuts
             "microbatches"}  # how many micro-batches the rows are cut into (one rule, not restated)


def runtime_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every ``from X import name`` in codegen/runtime (lazy ones too)."""
    out = []
    for dirpath, _, files in os.walk(RUNTIME):
        for f in (f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            rel = os.path.relpath(path, ROOT)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    out += [(rel, node.module, a.name) for a in node.names]
                elif isinstance(node, ast.Import):
                    out += [(rel, a.name, "") for a in node.names]
    return out


def test_runtime_uses_only_the_feasibility_predicate():
    bad = [f"{f}: {name}" for f, mod, name in runtime_imports() if mod == "planner.feasibility" and name not in PREDICATE]
    assert not bad, f"the runtime may import only {sorted(PREDICATE)} from planner.feasibility: {bad}"


def test_runtime_imports_nothing_of_the_zoo():
    bad = [f"{f}: {mod} {name}" for f, mod, name in runtime_imports()
           if mod == "planner.zoo" or mod.startswith("planner.zoo.") or (mod == "planner" and name == "zoo")]
    assert not bad, bad
