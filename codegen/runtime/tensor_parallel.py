"""Tensor (and sequence) parallelism from the plan's ``{fqn: role}`` layout, with DTensor.

Roles (see the plan's ``tensor_parallel.layout``): ``column``, ``row``, ``vocab_embed``,
``embed`` (learned positions), ``vocab_head``, ``norm``. The parent of every ``row``
linear (e.g. ``layers.0.attn``, ``layers.0.mlp``) is the attention/MLP module whose
input is re-gathered from the sequence shard under sequence parallelism.

Attention modules reshape with the local head count (``view(B, S, -1, head_dim)``), so
sharding q/k/v by output features shards heads. Grouped-query attention needs
``tp <= kv_heads`` (kv heads are sharded, never replicated); otherwise ``apply_tp``
raises.

The vocabulary-parallel head returns a DTensor ``Shard(-1)`` of logits; compute the loss
inside :func:`loss_context` (``loss_parallel()`` when TP is on).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

ROLES = ("column", "row", "vocab_embed", "embed", "vocab_head", "norm")


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _check_heads(model: nn.Module, layout: dict[str, str], tp: int) -> None:
    for fqn, role in layout.items():
        if role == "column" and fqn.endswith("k_proj"):
            mod = model.get_submodule(fqn)
            head_dim = getattr(model.get_submodule(_parent(fqn)), "head_dim", None)
            if head_dim is None:
                continue
            kv_heads = mod.out_features // head_dim
            q_heads = model.get_submodule(_parent(fqn) + ".q_proj").out_features // head_dim
            if kv_heads % tp or q_heads % tp:
                raise ValueError(f"tp={tp} does not divide the {q_heads} query / {kv_heads} kv heads of "
                                 f"{_parent(fqn)}; choose tp <= kv_heads dividing both (kv heads are not replicated)")


def tp_plan(layout: dict[str, str], sp: bool, arity: dict[str, int] | None = None) -> dict[str, object]:
    """The ``parallelize_module`` plan (fqn -> ParallelStyle) for ``layout``.

    ``arity`` gives the number of positional inputs of each attention/MLP parent
    (default 1); extra inputs (``positions``) pass through untouched.
    """
    arity = arity or {}
    plan: dict[str, object] = {}
    seq = Shard(1) if sp else Replicate()
    for fqn, role in layout.items():
        if role not in ROLES:
            raise ValueError(f"unknown tensor-parallel role {role!r} for {fqn}; roles: {', '.join(ROLES)}")
        if role == "column":
            plan[fqn] = ColwiseParallel()
        elif role == "row":
            plan[fqn] = RowwiseParallel(output_layouts=seq)
            if sp:
                # The attention / MLP module around the row linear gets its input gathered
                # from the sequence shard; ``positions`` (if passed) goes through untouched.
                n_in = arity.get(_parent(fqn), 1)
                plan[_parent(fqn)] = PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * (n_in - 1),
                                                        desired_input_layouts=(Replicate(),) + (None,) * (n_in - 1),
                                                        use_local_output=True)
        elif role == "vocab_embed":
            plan[fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        elif role == "embed":
            # Learned positions [S, d]: sequence is dim 0, matching the token embedding's Shard(1).
            plan[fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate())
        elif role == "vocab_head":
            plan[fqn] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        elif role == "norm" and sp:
            plan[fqn] = SequenceParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, layout: dict[str, str], sp: bool) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` per ``layout``; fqns absent from ``model`` are skipped.

    With ``sp``, the residual stream between blocks is sequence-sharded (local tensors
    [B, S/tp, d]) and the head input is gathered back. Returns ``model``.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return model
    present = {n for n, _ in model.named_modules()}
    layout = {f: r for f, r in layout.items() if f in present}
    if sp and any(f.startswith("vision.") for f in layout):
        raise ValueError("sequence parallel across a vision encoder is not supported; use sp=off for this model")
    _check_heads(model, layout, tp)
    arity = {}
    for fqn, role in layout.items():
        if role == "row":
            parent = _parent(fqn)
            params = inspect.signature(model.get_submodule(parent).forward).parameters.values()
            arity[parent] = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    ties = _tied_params(model)
    parallelize_module(model, tp_mesh, tp_plan(layout, sp, arity))
    _retie(model, ties)
    return model


def _tied_params(model: nn.Module) -> list[tuple[str, str]]:
    """(first owner, other owner) names of parameters shared between modules (e.g. a tied
    embedding and head): ``parallelize_module`` replaces each with its own DTensor."""
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((first[id(p)], name))
        else:
            first[id(p)] = name
    return out


def _retie(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Share the first owner's (sharded) parameter again; both sides must be sharded alike
    (a vocabulary-parallel embedding and head are both Shard(0) over the vocabulary)."""
    for src, dst in ties:
        p = model.get_parameter(src)
        mod_name, _, attr = dst.rpartition(".")
        mod = model.get_submodule(mod_name)
        q = getattr(mod, attr)
        if getattr(p, "placements", None) != getattr(q, "placements", None) or p.shape != q.shape:
            raise ValueError(f"tied parameters {src} and {dst} are sharded differently under TP; untie them")
        setattr(mod, attr, p)


@contextlib.contextmanager
def loss_context(tp: int) -> Iterator[None]:
    """``loss_parallel()`` when tensor parallel (vocab-sharded logits), else nothing."""
    if tp > 1:
        with loss_parallel():
            yield
    else:
        yield
