"""A pipeline stage of a transformers causal LM, and how its attention is routed.

A stage runs the model's OWN forward (``LlamaForCausalLM.forward`` and the base model's
loop over its decoder layers) on a *view*: a shallow copy of the LM and of every module
on the way down to the units, in which the units this stage does not own are replaced by
placeholders (:class:`Placeholder`), keeping layer indices (hybrid models read
``config.layer_types[i]``). The prologue (position ids, rotary tables, masks) therefore
runs as the library wrote it on every stage; placeholders steer the hidden state:

- a unit before the stage's range returns zeros (an embedding the stage does not hold),
  the identity (an earlier decoder layer), or, for the one unit right before the range,
  the hidden state received from the previous stage;
- the first unit after the range raises :class:`StageOutput` with its input, which the
  stage returns (the rest of the forward never runs);
- the last stage runs to the end: the LM's forward returns the logits after the model's
  own post-processing (soft-capping, logit scaling, head bias) and the stage sums the
  token cross-entropy; with the fused loss the head is a placeholder that hands its
  input to the fused linear + cross-entropy kernel instead.

Later stages call the LM with ``inputs_embeds`` of zeros (the right shape for the
prologue; the value is discarded) and every stage passes ``position_ids`` (global
positions under context parallelism). The stage module itself holds the owned units
under their fqns (FSDP, TP and checkpoints see ``model.layers.3...``); the view is not a
registered child.

Attention goes through :func:`autopar_attention`, registered in transformers'
``AttentionInterface`` under a name of this build (``autopar_<tag>``, removed when the build
closes) and bound to the build's ``{attention module: implementation}`` dict (the adapter's),
so only this model's modules see it and nothing is stamped on them. Models that keep their
own attention (sliding windows, soft-capping) use ``autopar_masked_<tag>_<their
implementation>`` instead: transformers builds their masks as for that implementation and
:func:`autopar_masked_attention` calls their function, under selective recompute when the
block's policy asks for it.
"""
from __future__ import annotations

import copy
import functools
import inspect
import re
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from codegen.runtime import kernels as kern, torch_compat
from codegen.runtime.adapters.base import StageModule, attach

ATTN_NAME = "autopar"                # + _<tag>: causal attention through the runtime's implementation, no masks
ATTN_MASKED_PREFIX = "autopar_masked_"  # + <tag>_<the model's own implementation name>: its attention, its masks


class StageOutput(Exception):
    """Raised by the first placeholder after a stage's range, carrying the hidden state."""

    def __init__(self, hidden):
        super().__init__("stage output")
        self.hidden = hidden


class Placeholder(nn.Module):
    """Stands in for a unit a stage does not own (no parameters). ``mode``: ``zeros`` (an
    embedding: a zero scalar, broadcast by the prologue's additions), ``identity`` (returns
    its first argument, as a decoder layer that is skipped), ``inject`` (returns the hidden
    state received from the previous stage), ``stop`` (raises :class:`StageOutput`)."""

    def __init__(self, mode: str, stage: "HFStage", name: str, as_tuple: bool = False):
        super().__init__()
        self.mode, self.name = mode, name
        self.as_tuple = as_tuple  # a decoder layer of a model whose loop takes [0] of each layer's output
        object.__setattr__(self, "_stage", stage)  # not a child module

    def forward(self, *args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()), None)
        if self.mode == "zeros":
            return torch.zeros((), dtype=self._stage.dtype, device=self._stage.device)
        if self.mode == "identity":
            return (first,) if self.as_tuple else first
        if self.mode == "inject":
            x = self._stage.received_as(self.name)
            return (x,) if self.as_tuple else x
        raise StageOutput(first)


@functools.lru_cache(maxsize=None)
def layers_return_tuples(cls: type) -> bool:
    """Whether the forward of ``cls`` (the module looping over the decoder layers) takes ``outputs[0]`` of each
    decoder layer (Falcon, Bloom, MPT: a layer returns (hidden state, attention weights))
    rather than the hidden state itself (the library's current convention)."""
    try:
        return re.search(r"=\s*\w*outputs\[0\]", inspect.getsource(cls.forward)) is not None
    except (OSError, TypeError):
        return False


def module_view(module: nn.Module, replace: dict[str, nn.Module], prefix: str = "") -> nn.Module:
    """A shallow copy of ``module`` whose descendants at the paths of ``replace`` are swapped
    (copies are made only along those paths; everything else is the model's own module)."""
    out = copy.copy(module)
    out.__dict__ = dict(module.__dict__)
    children = dict(torch_compat.children_registry(module))
    torch_compat.set_children_registry(out, children)
    for name, child in list(children.items()):
        path = f"{prefix}{name}"
        if path in replace:
            children[name] = replace[path]
        elif child is not None and any(r.startswith(path + ".") for r in replace):
            children[name] = module_view(child, replace, path + ".")
    return out


class HFStage(StageModule):
    """A run of a transformers causal LM's units (see the module docstring)."""

    def __init__(self, adapter, units: Sequence[str], recompute: str):
        super().__init__(units, adapter.units, recompute)
        self.adapter = adapter
        lm = adapter.model
        for u in self.units:
            attach(self, u, lm.get_submodule(u))
        self.dtype, self.device = next(lm.parameters()).dtype, None  # the device is the inputs' (set per call)
        self.hidden_size = adapter.hidden_size
        self._received = None
        self.tp_mesh = None        # set by tp_fixups under tensor parallelism
        self.sp_units: set[str] = set()
        all_units = adapter.units
        first, last = all_units.index(self.units[0]), all_units.index(self.units[-1])
        replace: dict[str, nn.Module] = {}
        tuples = layers_return_tuples(type(lm.get_submodule(adapter.layers_path.rpartition(".")[0])))
        for i, u in enumerate(all_units):
            if first <= i <= last:
                continue
            kind = adapter.unit_kind(u)
            if i == first - 1:
                mode = "inject"
            elif i < first:
                mode = "zeros" if kind == "before" else "identity"
            else:
                mode = "stop" if i == last + 1 else "identity"
            replace[u] = Placeholder(mode, self, u, as_tuple=tuples and kind == "block")
        object.__setattr__(self, "_view", module_view(lm, replace))
        # the last stage's view for the fused loss: the head hands its input over instead
        stop_head = dict(replace, **{adapter.head_name: Placeholder("stop", self, adapter.head_name)})
        object.__setattr__(self, "_view_fused", module_view(lm, stop_head) if self.is_last else None)

    def received_as(self, name: str):
        """The received hidden state as the unit ``name`` would have output it: under
        sequence parallel, a unit run as ``SequenceParallel`` (a norm) outputs a DTensor."""
        x = self._received
        if name in self.sp_units and self.tp_mesh is not None and not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.tp_mesh, [Shard(1)], run_check=False)
        return x

    def _call_view(self, view: nn.Module, args, positions: Optional[torch.Tensor]):
        """The model's forward on ``view``: token ids on the first stage, zeros of the hidden
        shape elsewhere; positions always explicit (under sequence parallel the embedding
        output holds S/tp tokens, from which the model would derive the wrong ones)."""
        kw = dict(use_cache=False)
        x = args[0]
        self.device = x.device
        if self.is_first:
            kw["input_ids"] = x
            b, s = x.shape
        else:
            self._received = x
            b, s = x.shape[0], self._local_seq(x)
            kw["inputs_embeds"] = torch.zeros(b, s, self.hidden_size, dtype=self.dtype, device=x.device)
        pos = positions if positions is not None else torch.arange(s, device=x.device)
        kw["position_ids"] = pos if pos.dim() == 2 else pos.unsqueeze(0)  # [B, S]: per-document positions
        return view(**kw)

    def _local_seq(self, x: torch.Tensor) -> int:
        """Tokens of this rank's sequence: the received tensor's, times tp under sequence parallel."""
        return x.shape[1] * (self.tp_mesh.size() if self.sp and self.tp_mesh is not None else 1)

    def forward(self, *args: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, doc_start: Optional[torch.Tensor] = None):
        fused = self.is_last and labels is not None and self.loss_kernel == "fused"
        pos = self.take_step(positions, doc_start)
        try:
            out = self._call_view(self._view_fused if fused else self._view, args, pos)
        except StageOutput as done:
            if fused:  # the head's input: the final hidden state after the model's own epilogue
                head = self.get_submodule(self.adapter.head_name)
                return kern.linear_loss(head.weight, done.hidden, labels, sp=False)
            return _to_wire(done.hidden)
        finally:
            self._received = None
        if labels is None:
            return out.logits
        return kern.logits_loss(out.logits, labels)


def _to_wire(x):
    """What a stage sends: local tensors (a DTensor's local shard: the residual stream under SP)."""
    return x.to_local() if isinstance(x, DTensor) else x


# ------------------------------------------------------------------ attention routing

def autopar_attention(impls: dict, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs):
    """transformers attention function (``impls`` bound by :func:`register_attention`): the
    runtime's implementation for ``module`` (``fn(q, k, v, *, causal, scale)`` on [B, H, S, D]),
    returning ([B, S, H, D], None); a module without one gets SDPA."""
    impl: Optional[Callable] = impls.get(module)
    if impl is None:
        from codegen.runtime.layers import sdpa_attention
        impl = sdpa_attention
    out = impl(query, key, value, causal=getattr(module, "is_causal", True), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def autopar_masked_attention(own: dict, module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers attention function for models that keep their own attention (sliding
    windows, soft-capping; ``own`` bound by :func:`register_attention`): ``module``'s
    original function, under its wrapper (selective recompute or None)."""
    fn, wrap = own[module]
    if wrap is None:
        return fn(module, query, key, value, attention_mask, **kwargs)
    return wrap(lambda q, k, v: fn(module, q, k, v, attention_mask, **kwargs), query, key, value)


def register_attention(installs, impls: dict, own: dict, original: Optional[str] = None) -> str:
    """Register, under names unique to this build (``installs.tag``; removed when it closes),
    :func:`autopar_attention` over ``impls`` or, with ``original``, :func:`autopar_masked_attention`
    over ``own`` with that implementation's mask builder in transformers' registries; returns
    the name to select. No existing entry is changed."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if original is None:
        name = f"{ATTN_NAME}_{installs.tag}"
        installs.register(AttentionInterface, name, functools.partial(autopar_attention, impls))
        return name
    name = f"{ATTN_MASKED_PREFIX}{installs.tag}_{original}"
    installs.register(AttentionInterface, name, functools.partial(autopar_masked_attention, own))
    installs.register(ALL_MASK_ATTENTION_FUNCTIONS, name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name
