"""The TP plan written once per block, torchtitan style, and its expansion to ``{fqn: style}``.

The emitted program states the tensor-parallel plan as

- ``BLOCK_TP_PLAN``: per block stack (the module list holding the repeated blocks, e.g.
  ``layers`` or ``vision.blocks``), the style of each module path *inside* one block, the
  same for every block of that stack;
- ``TP_PLAN``: every other module (embedding, final norm, head, blocks of a stack whose
  blocks differ), by its full path.

:func:`tp_plan_for` expands them over the model's units to the ``{module fqn: style}``
mapping ``codegen.runtime.tensor_parallel.apply_tp`` takes (the plan's
``tensor_parallel.layout``); the emitter checks, when it writes the program, that the
expansion is exactly the plan's layout. Pure Python (no torch), so the emitter can use it.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence


def block_stack(unit: str) -> Optional[str]:
    """The stack holding ``unit`` when it is a repeated block (``<stack>.<index>``, e.g.
    ``layers.3`` -> ``layers``), else None."""
    stack, _, idx = unit.rpartition(".")
    return stack if stack and idx.isdigit() else None


def tp_plan_for(units: Sequence[str], block_plan: Mapping[str, Mapping[str, str]],
                rest: Mapping[str, str]) -> dict[str, str]:
    """``{module fqn: style}``: ``block_plan[stack]`` (module path inside a block -> style)
    applied to every unit ``<stack>.<i>`` of ``units``, then the entries of ``rest`` (full
    module paths). A stack of ``block_plan`` without a block in ``units``, or an fqn given
    twice, is an error."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for unit in units:
        stack = block_stack(unit)
        if stack is None or stack not in block_plan:
            continue
        used.add(stack)
        for sub, style in block_plan[stack].items():
            out[f"{unit}.{sub}" if sub else unit] = style
    if set(block_plan) - used:
        raise ValueError(f"TP plan block stacks {sorted(set(block_plan) - used)} have no block among the units")
    for fqn, style in rest.items():
        if fqn in out:
            raise ValueError(f"TP plan entry {fqn!r} is given twice (in a block template and by its path)")
        out[fqn] = style
    return out
