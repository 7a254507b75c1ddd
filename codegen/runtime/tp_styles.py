"""The plan's tensor-parallel roles as torch ParallelStyle objects, written once as source text.

The plan records each module's role (``planner.plan.TP_ROLES``); training applies a
``ParallelStyle`` per module. :func:`style_source` is the one statement of which style a
role gets: the emitted program writes that text as its TP plan's literals (so a user edits
a layout where they see it, as in torchtitan), and :func:`style_for` builds the object by
evaluating the same text over :data:`STYLE_NAMES` alone (no builtins), so the in-process
API and the program cannot apply different styles. The module around each row-parallel linear
shares its hidden-state input among its column linears (``ReplicateRegionInput``; under
sequence parallelism gathered from the sequence shard first, ``GatherSequenceInput``).

:func:`role_of` reads a style back as the role the adapters' local-size fix-ups need (which
modules are column-parallel, which norms run on the sequence shard), for styles a user
wrote too.
"""
from __future__ import annotations

import importlib
from typing import Collection, Mapping, Optional

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from codegen.runtime.tensor_parallel import PackedColwise, ReplicatedEmbedding, VocabParallelEmbedding
from planner.plan import TP_ROLES

# every name a style's source text may use, by the module the emitted program imports it from
IMPORTS = {"torch.distributed.tensor": ("Replicate", "Shard"),
           "torch.distributed.tensor.parallel": ("ColwiseParallel", "RowwiseParallel", "SequenceParallel"),
           "codegen.runtime.tensor_parallel": ("GatherSequenceInput", "PackedColwise", "ReplicatedEmbedding",
                                               "ReplicateRegionInput", "VocabParallelEmbedding")}
STYLE_NAMES = {name: getattr(importlib.import_module(module), name) for module, names in IMPORTS.items()
               for name in names}
# the style of the module around each row-parallel linear, by whether sequence parallelism is on
REGION_INPUT = {True: "GatherSequenceInput()", False: "ReplicateRegionInput()"}
COLUMN_ROLES = ("column", "packed_qkv")  # the roles whose linears take the region's replicated input


def style_source(role: str, sp: bool) -> Optional[str]:
    """The ParallelStyle (as Python source) for a module of ``role``; None where the module
    is left as it is (a norm without sequence parallelism). ``sp``: the residual stream
    between blocks is sharded by sequence (dim 1)."""
    if role not in TP_ROLES:
        raise ValueError(f"unknown tensor-parallel role {role!r}: use one of {', '.join(TP_ROLES)}")
    seq = "Shard(1)" if sp else "Replicate()"
    return {"column": "ColwiseParallel()",
            "row": f"RowwiseParallel(output_layouts={seq})",
            "packed_qkv": "PackedColwise()",
            "vocab_embed": f"VocabParallelEmbedding(output_layouts={seq})",
            "embed": f"ReplicatedEmbedding(sp={sp})",
            "vocab_head": f"ColwiseParallel(input_layouts={seq}, output_layouts=Shard(-1), use_local_output=False)",
            "norm": "SequenceParallel()" if sp else None}[role]


def region_parents(layout: Mapping[str, str], units: Collection[str] = ()) -> list[str]:
    """The modules of the plan's ``{fqn: role}`` layout that get :data:`REGION_INPUT`: the parent of
    every row-parallel linear that also holds the column linears feeding it (the attention / MLP
    module; not a module around the row linear alone, such as BERT's output module, whose input is
    the sharded activation), unless that parent is a layer unit of ``units`` (a block holding its
    linears directly, whose norms and residual take the input as it comes)."""
    columns = [fqn for fqn, role in layout.items() if role in COLUMN_ROLES]
    out: list[str] = []
    for fqn, role in layout.items():
        parent = fqn.rpartition(".")[0]
        if (role == "row" and parent and parent not in units and parent not in out
                and any(c.startswith(f"{parent}.") for c in columns)):
            out.append(parent)
    return out


def ungathered_columns(layout: Mapping[str, str], units: Collection[str] = ()) -> list[str]:
    """The column linears of ``layout`` that no :func:`region_parents` module holds: under sequence
    parallelism nothing gathers their input from the sequence shard, so the layout cannot run
    sequence parallel (the planner's ``sp`` limit, ``planner/frontend/load.py``): a block holding
    its linears directly; BERT's intermediate linear, whose row linear sits in a sibling module."""
    regions = region_parents(layout, units)
    return [fqn for fqn, role in layout.items()
            if role in COLUMN_ROLES and not any(fqn.startswith(f"{r}.") for r in regions)]


def sources_for(layout: Mapping[str, str], sp: bool, units: Collection[str] = ()) -> dict[str, str]:
    """``{module fqn: style source}`` for the plan's ``{fqn: role}`` layout: each role's
    :func:`style_source`, and :data:`REGION_INPUT` on each of :func:`region_parents` (after its row
    linear's style) unless the layout styles it itself."""
    regions = set(region_parents(layout, units))
    out: dict[str, str] = {}
    for fqn, role in layout.items():
        src = style_source(role, sp)
        if src is not None:
            out[fqn] = src
        parent = fqn.rpartition(".")[0]
        if role == "row" and parent in regions:
            out.setdefault(parent, REGION_INPUT[sp])
    return out


def style_for(source: str) -> ParallelStyle:
    """The style object ``source`` (one of :func:`style_source`'s texts) writes."""
    return eval(source, {"__builtins__": {}}, dict(STYLE_NAMES))  # noqa: S307 - our own texts, names above only


def styles_for(layout: Mapping[str, str], sp: bool, units: Collection[str] = ()) -> dict[str, ParallelStyle]:
    """``{module fqn: ParallelStyle}`` for the plan's layout (see :func:`sources_for`)."""
    return {fqn: style_for(src) for fqn, src in sources_for(layout, sp, units).items()}


def role_of(style: ParallelStyle) -> Optional[str]:
    """The role ``style`` gives its module (None: the region input around row linears)."""
    if isinstance(style, PackedColwise):
        return "packed_qkv"
    if isinstance(style, ColwiseParallel):
        return "column" if style.use_local_output else "vocab_head"
    if isinstance(style, RowwiseParallel):  # torch's vocabulary-parallel embedding too, where a user writes it
        return "vocab_embed" if style.input_layouts == (Replicate(),) else "row"
    if isinstance(style, SequenceParallel):
        return "norm"
    if isinstance(style, ReplicatedEmbedding):
        return "embed"
    if isinstance(style, VocabParallelEmbedding):
        return "vocab_embed"
    return None


def roles_of(styles: Mapping[str, ParallelStyle]) -> dict[str, str]:
    """``{fqn: role}`` of the styled modules (the region inputs left out)."""
    return {fqn: role for fqn, s in styles.items() if (role := role_of(s)) is not None}
