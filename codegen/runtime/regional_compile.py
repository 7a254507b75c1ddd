"""Regional compilation (``ParallelConfig.compile``): each repeated block's forward through
``torch.compile``, as torchtitan compiles its transformer blocks - one graph, compiled once and
reused by every block of the same code, instead of the whole model.

The block's ``forward`` is compiled, not the module's call: the hooks other parts of the build
put on the block (FSDP2's gather and reduce, recomputation, tensor-parallel input and output
layouts) stay eager around it, and the module and its parameter names are unchanged (nothing is
wrapped, checkpoints and the adapters see the same fqns). The compiled forward is an attribute
of the block instance, which the build's ``Installs`` removes at close.

On CPUs inductor generates C++ and needs a compiler (``planner.search.candidates.compile_problem``
refuses the plan without one). The first step of a compiled plan pays the compilation: it shows
in that step's logged ``step_s``, and it is not part of the step time the plan predicts (the
comparison skips the warm-up steps: ``planner.report.data.compare_run``).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def compile_blocks(blocks: Iterable[nn.Module]) -> int:
    """``torch.compile`` each block's forward in place (module docstring); returns how many."""
    n = 0
    for block in blocks:
        block.forward = torch.compile(block.forward)
        n += 1
    return n
