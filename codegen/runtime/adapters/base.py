"""The adapter contract's shared pieces: :class:`Unit`, :class:`ModelAdapter` and :class:`StageModule`.

See the package docstring (``codegen/runtime/adapters/__init__.py``) for the contract
itself; this module holds what every implementation shares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from codegen.runtime.installs import Installs

UNIT_KINDS = ("before", "block", "after", "head")
IGNORE_INDEX = -100
AttentionImpl = Callable[..., torch.Tensor]  # fn(q, k, v, *, causal, scale=None) -> out [B, H, S, D]


@dataclass(frozen=True)
class Unit:
    """One layer unit: the plan's layer ``name`` (a module fqn) and where it sits in the
    forward: ``before`` the repeated blocks, a ``block``, ``after`` them, or the ``head``."""
    name: str
    kind: str


def has_submodule(root: nn.Module, fqn: str) -> bool:
    try:
        root.get_submodule(fqn)
        return True
    except AttributeError:
        return False


def attach(root: nn.Module, fqn: str, mod: nn.Module) -> None:
    """Register ``mod`` under ``fqn`` inside ``root``, creating plain containers on the way,
    so a stage module's parameters keep the full model's fqns."""
    parts = fqn.split(".")
    parent = root
    for p in parts[:-1]:
        if p not in dict(parent.named_children()):
            parent.add_module(p, nn.Module())
        parent = parent.get_submodule(p)
    parent.add_module(parts[-1], mod)


class StageModule(nn.Module):
    """A pipeline stage: a contiguous run of the model's units under their own fqns.

    Calling protocol (every adapter's stage follows it; ``codegen/runtime/train.py`` relies on it):

    - the first stage is called with the adapter's :meth:`ModelAdapter.inputs`, later stages
      with what the previous stage returned (hidden states, a tensor or a tuple);
    - the last stage, given the keyword ``labels`` (per-position targets, ``-100`` ignored),
      returns the SUMMED token loss of its micro-batch (an fp32 scalar);
    - per-step state travels as keyword arguments of every stage's forward (the pipeline
      schedule splits them per micro-batch): ``positions`` [mbs, S] (each row's token
      positions: global ones under context parallelism, per-document ones with packed
      documents; None: ``arange(S)``) and ``doc_start`` [mbs, S] (packed documents, else None);
      :meth:`take_step` reads them;
    - ``loss_kernel`` (``"fused"`` | ``"eager"``), ``sp`` (sequence parallel on) and
      ``documents`` (the build's packed-document context, which the attention reads:
      ``codegen/runtime/documents.py``) are set once by ``parallelize``.
    """

    def __init__(self, units: Sequence[str], all_units: Sequence[str], recompute: str = "none"):
        super().__init__()
        self.units = list(units)
        self.recompute = recompute
        self.documents = None  # the build's Documents (codegen/runtime/documents.py), set by split_stages
        self.chunks = None  # the build's sequence-chunk store (codegen/runtime/seq_chunks.py), set by split_stages
        self.loss_kernel = "eager"
        self.sp = False
        first, last = all_units.index(self.units[0]), all_units.index(self.units[-1])
        if list(all_units[first:last + 1]) != self.units:
            raise ValueError(f"stage units {self.units} are not a contiguous run of the model's units")
        self.is_first = first == 0
        self.is_last = last == len(all_units) - 1


    def take_step(self, positions: Optional[torch.Tensor], doc_start: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This call's per-step arguments: points the build's documents context at ``doc_start``
        (when given) and returns the positions the units get: ``positions`` per row [mbs, S] with
        packed documents, one row [S] without (every row's are the same), or None."""
        if doc_start is not None and self.documents is not None:
            self.documents.set(doc_start)
        if self.chunks is not None and positions is not None:  # sequence chunks: where this chunk starts
            self.chunks.at(int(positions[0, 0]))
        if positions is None or doc_start is not None:
            return positions
        return positions[0]


class ModelAdapter:
    """What the runtime asks of a model (see the package docstring). Subclasses set
    ``model`` and ``unit_list`` and implement the methods that raise here."""

    kind = "abstract"

    def __init__(self, model: nn.Module, unit_list: Sequence[Unit]):
        self.model = model
        self.unit_list = list(unit_list)
        self.facts = None  # the plan's ModelFacts (head counts, limits), given to adapter_for
        # what this adapter and the build using it install on the model and in the process;
        # undone by close() (codegen/runtime/installs.py)
        self.installs = Installs(model)
        for u in self.unit_list:
            if u.kind not in UNIT_KINDS:
                raise ValueError(f"unit {u.name}: kind {u.kind!r} is not one of {UNIT_KINDS}")

    # ---- structure -------------------------------------------------------------------
    @property
    def units(self) -> list[str]:
        """Unit names in execution order (what a plan's stages list)."""
        return [u.name for u in self.unit_list]

    @property
    def blocks(self) -> list[str]:
        """The repeated blocks (the units FSDP, replicate and recompute wrap one by one)."""
        return [u.name for u in self.unit_list if u.kind == "block"]

    def capture_units(self) -> list[tuple[str, nn.Module, Optional[str]]]:
        """``(name, module, stack)`` per unit for ``planner.frontend.trace`` (``stack``: the path of
        the list holding a block, so repeated blocks are captured once)."""
        blocks = set(self.blocks)
        return [(u, self.model.get_submodule(u), u.rpartition(".")[0] if u in blocks else None) for u in self.units]

    def unit_kind(self, name: str) -> str:
        return next(u.kind for u in self.unit_list if u.name == name)

    def stage_starts(self) -> list[bool]:
        """Per unit, whether a pipeline stage may start there (True everywhere by default)."""
        return [True] * len(self.unit_list)

    def tied(self) -> list[tuple[str, str]]:
        """(first owner, other owner) fqns of parameters shared by two units."""
        owner: dict[int, str] = {}
        pairs = []
        for u in self.units:
            for n, p in self.model.get_submodule(u).named_parameters(remove_duplicate=False):
                full = f"{u}.{n}"
                if id(p) in owner and owner[id(p)] != full:
                    pairs.append((owner[id(p)], full))
                else:
                    owner.setdefault(id(p), full)
        return pairs

    def limits(self) -> dict[str, str]:
        """Features this model cannot run with (``"tp"``, ``"sp"``, ``"cp"``, ``"pp"``,
        ``"fused_loss"``, ``"any"``) mapped to the reason, one line each."""
        return {}

    def head_linear(self) -> str:
        """The fqn of the head's bias-free Linear (the head unit itself, or its one Linear), whose
        rows vocabulary passes split (``codegen/runtime/vocab_passes.py``); raises ValueError naming
        what the head is instead."""
        name = self.units[-1]
        head = self.model.get_submodule(name)
        found = [(n, m) for n, m in head.named_modules() if isinstance(m, nn.Linear)]
        if len(found) != 1 or found[0][1].bias is not None:
            raise ValueError(f"the head {name} is not one bias-free nn.Linear ({len(found)} Linear modules)")
        return f"{name}.{found[0][0]}" if found[0][0] else name

    # ---- per-run behaviour -------------------------------------------------------------
    def build_stage(self, units: Sequence[str], recompute: str) -> StageModule:
        raise NotImplementedError

    def attention_modules(self, block: nn.Module) -> list[nn.Module]:
        """The modules of ``block`` whose attention :meth:`set_attention` replaces."""
        raise NotImplementedError

    def set_attention(self, block: nn.Module, impl: AttentionImpl) -> None:
        """Make ``block``'s attention run ``impl`` (on this model instance only)."""
        raise NotImplementedError

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The first stage's positional inputs from a batch (rows already selected)."""
        return (batch["input_ids"],)

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-position targets [B, S] (``-100`` = ignored) from the GLOBAL batch."""
        return batch["labels"]

    def materialize(self, units: Sequence[str], device: torch.device, seed: Optional[int]) -> None:
        """Allocate and initialise ``units`` of a model built on ``meta`` (no-op otherwise)."""
        if any(p.is_meta for u in units for p in self.model.get_submodule(u).parameters()):
            raise NotImplementedError(f"{type(self).__name__} cannot materialize a meta-built model; "
                                      "build it on a real device")

    def tp_fixups(self, stage: StageModule, tp_mesh, layout: dict[str, str], sp: bool) -> None:
        """Instance state that must follow tensor-parallel sharding (local sizes); default none."""

    def close(self) -> None:
        """Undo what this adapter and the build using it installed (:attr:`installs`): the model's
        attributes and hooks, registry entries, process groups. The model is not trained again."""
        self.installs.close()
