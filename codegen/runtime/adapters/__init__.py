"""Model adapters: how the runtime reaches into a model it did not write.

The runtime (``train.py``, tensor / pipeline / data parallel, recompute, checkpoints) never
names a model's attributes; it asks the model's :class:`ModelAdapter`:

``units`` / ``unit_list``
    The layer units in execution order, each a module fqn of the model and a kind:
    ``before`` the repeated blocks (embeddings, position tables), a ``block``, ``after``
    them (final norm) or the ``head``. A plan's pipeline stages list these names, and the
    planner's captured layers carry the same names. ``stage_starts()`` says where a stage
    may begin (a transformers model's embedding prologue stays in one stage).
``tied()``
    Pairs of parameter fqns that are one parameter (a tied embedding and head). Under
    pipeline parallelism the first and last stage each hold a copy and the runtime sums
    their gradients (as Megatron does).
``limits()``
    What cannot run for this model (``tp``, ``sp``, ``cp``, ``pp``, ``fused_loss`` or
    ``any``), each with its one-line reason. The planner reads the same dictionary
    (captured into the ModelGraph), so it never proposes what the runtime refuses.
``build_stage(units, recompute)``
    An ``nn.Module`` holding those units under their own fqns whose forward runs them (the
    calling protocol is :class:`StageModule`'s): the first stage takes ``inputs(batch)``,
    later stages the previous stage's output; the last, given ``labels``, returns the
    summed token loss. Modules every stage needs (rotary embeddings) are kept by each.
``set_attention(block, impl)``
    Make one block's attention run ``impl(q, k, v, *, causal, scale)`` (flash kernel, ring
    attention for CP, selective recompute; ``codegen/runtime/attention.py`` builds it),
    on this model instance only: nothing process-wide is patched.
``inputs(batch)`` / ``targets(batch)``
    The first stage's tensors and the per-position targets (a transformers model's labels
    are shifted here, before any sequence sharding).
``materialize(units, device, seed)``
    Allocate and initialise a meta-built model's units (per-parameter seeding, so a stage
    gets the numbers the whole model would have).
``tp_fixups(stage, tp)``
    Instance sizes that must follow TP sharding (e.g. a packed q/k/v split size).

The tensor-parallel layout itself is data: ``{module fqn: role}`` in the plan (roles in
``codegen/runtime/tensor_parallel.py``), taken from the model's own TP plan where it has
one and from the captured graph's dataflow otherwise (``planner/frontend/tp_layout.py``).

Implementations: a model's own, returned by its ``autopar_adapter()`` method (autopar's reference
models: ``planner/zoo/adapter.py``), :class:`~codegen.runtime.adapters.hf.HFAdapter` (any transformers causal LM,
found through the library's own metadata) and
:class:`~codegen.runtime.adapters.module.ModuleAdapter` (a user's ``nn.Module`` with a
repeated block stack, or an explicit :class:`~codegen.runtime.adapters.module.ModuleSpec`).
:func:`adapter_for` picks one.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import nn

from codegen.runtime.adapters.base import IGNORE_INDEX, ModelAdapter, StageModule, Unit
from planner.vocab_passes import model_units

__all__ = ["IGNORE_INDEX", "ModelAdapter", "StageModule", "Unit", "adapter_for", "adapter_kind"]


def adapter_kind(model: nn.Module) -> str:
    """``zoo`` (a model that brings its own adapter: ``autopar_adapter()``), ``hf`` (a
    transformers causal LM) or ``module``."""
    from codegen.runtime.adapters.hf import is_hf_causal_lm

    if _own_adapter(model) is not None:
        return _own_adapter(model)().kind
    return "hf" if is_hf_causal_lm(model) else "module"


def _own_adapter(model: nn.Module):
    """The model's own adapter factory (a method ``autopar_adapter()`` of its class), or None."""
    hook = getattr(type(model), "autopar_adapter", None)
    return getattr(model, "autopar_adapter") if callable(hook) else None


def adapter_for(model: nn.Module, spec: Optional[Any] = None, *, order: Optional[Sequence[str]] = None,
                seq_len: Optional[int] = None, facts: Optional[Any] = None) -> ModelAdapter:
    """The adapter of ``model``. ``spec``: an explicit ``ModuleSpec`` for a plain module
    (also read from ``model.autopar_spec``); ``order``: the unit names in execution order (a
    plan's layers; how a plain module's units are known at run time); ``seq_len``: tokens
    per sequence (decides whether a sliding window is active); ``facts``: the plan's
    ``ModelFacts`` (head counts a plain module's TP fix-ups read)."""
    adapter = _adapter_of_kind(model, spec, model_units(order) if order is not None else None, seq_len)
    adapter.facts = facts
    return adapter


def _adapter_of_kind(model: nn.Module, spec: Optional[Any], order: Optional[Sequence[str]],
                     seq_len: Optional[int]) -> ModelAdapter:
    if spec is None and _own_adapter(model) is not None:
        return _own_adapter(model)()
    kind = "module" if spec is not None else adapter_kind(model)
    if kind == "hf":
        from codegen.runtime.adapters.hf import HFAdapter
        return HFAdapter(model, order=order, seq_len=seq_len)
    from codegen.runtime.adapters.module import ModuleAdapter, units_in_order

    if spec is None and getattr(model, "autopar_spec", None) is None and order is not None:
        return ModuleAdapter(model, units=units_in_order(model, order))
    return ModuleAdapter(model, spec)
