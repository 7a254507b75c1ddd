"""Tensor (and sequence) parallelism with DTensor: the styles torch lacks, and applying a TP plan.

The plan's ``{fqn: role}`` layout becomes ``{fqn: ParallelStyle}`` in
``codegen/runtime/tp_styles.py``; the roles (``planner.plan.TP_ROLES``):

- ``column``      a linear split by output features (q/k/v, MLP up/gate, fc1)
- ``row``         a linear split by input features (attention output, MLP down, fc2)
- ``packed_qkv``  one linear whose output is ``[q | k | v]`` in three equal parts (GPT-2's
                  ``c_attn``): each rank keeps its heads of every part (``_StridedShard``)
- ``vocab_embed`` token embedding split by vocabulary rows, looked up on each rank's own rows
                  (:class:`VocabParallelEmbedding`)
- ``embed``       an embedding not split (learned positions): replicated weights, every
                  tensor argument replicated (positions may come as a keyword, as OPT's do);
                  with SP its output is cut to the rank's sequence shard (dim -2)
- ``vocab_head``  output projection split by vocabulary; the loss is vocabulary-parallel
- ``norm``        replicated weights; with sequence parallel it runs on a sequence shard

Linears are ``nn.Linear`` or transformers' ``Conv1D`` (weight stored ``[in, out]``).
The parent of every ``row`` linear (the attention / MLP module) shares its hidden-state input
(first positional argument, or ``hidden_states=``) among its column linears as one
``Replicate`` DTensor (:class:`ReplicateRegionInput`: one all-reduce of their input gradients
in the backward; the module's own code keeps the local tensor); under sequence parallelism
it gathers it from the sequence shard first (:class:`GatherSequenceInput`). Where a column
linear sits in no such module (a block holding its linears directly, BERT's intermediate
linear: ``tp_styles.ungathered_columns``) the layout cannot run sequence parallel (the
planner's ``sp`` limit, ``planner/frontend/load.py``); without SP it takes its input as it
comes. Attention modules must reshape with the local head count
(``view(B, S, -1, head_dim)``), so sharding q/k/v by output features shards heads; kv heads
are sharded, never replicated, so tp must divide them (the planner's feasibility rule).

The vocabulary-parallel head returns a DTensor ``Shard(-1)`` of logits; compute the loss
inside :func:`loss_context` (``loss_parallel()`` when TP is on).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from codegen.runtime.torch_compat import StridedShard, apply_as_linear, apply_style


def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D``: a linear whose weight is stored ``[in, out]``."""
    return type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    p = getattr(module, name, None)
    if p is not None:
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement]),
                                                     requires_grad=p.requires_grad))


def _conv1d_colwise(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    _distribute(module, "weight", device_mesh, Shard(1))
    _distribute(module, "bias", device_mesh, Shard(0))


def _conv1d_rowwise(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    _distribute(module, "weight", device_mesh, Shard(0))
    _distribute(module, "bias", device_mesh, Replicate())


def _packed_colwise(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    out_dim = 1 if is_conv1d(module) else 0
    _distribute(module, "weight", device_mesh, StridedShard(out_dim, split_factor=3))
    _distribute(module, "bias", device_mesh, StridedShard(0, split_factor=3))


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for ``Conv1D``: weight ``[in, out]`` split on dim 1, bias on dim 0."""

    def _apply(self, module, device_mesh):
        return apply_as_linear(self, module, device_mesh, _conv1d_colwise)


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for ``Conv1D``: weight ``[in, out]`` split on dim 0, bias replicated."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.desired_input_layouts = (Shard(-1),)

    def _apply(self, module, device_mesh):
        return apply_as_linear(self, module, device_mesh, _conv1d_rowwise)


class PackedColwise(ColwiseParallel):
    """A column linear computing ``[q | k | v]`` (three equal parts): every rank keeps chunk r
    of each part, ``StridedShard(split_factor=3)``, and gets its local ``[q_r | k_r | v_r]``
    (already this rank's part of each: no redistribution of the output)."""

    def _apply(self, module, device_mesh):
        return apply_as_linear(self, module, device_mesh, _packed_colwise, local_output=True)


def region_input_key(args: tuple, kwargs: dict) -> int | str | None:
    """Where a TP region module's call holds the hidden state :class:`ReplicateRegionInput` shares
    (and gathers under SP): ``0`` (its first positional argument, a floating-point tensor), else
    ``"hidden_states"`` (that keyword, likewise), else None. The capture marks the same value
    (``planner/frontend/trace.py``), so the planner's SP check reads what the runtime gathers."""
    def hidden(x) -> bool:  # a hidden state (not ids or a mask)
        return isinstance(x, torch.Tensor) and x.is_floating_point()

    if args and hidden(args[0]):
        return 0
    return "hidden_states" if hidden(kwargs.get("hidden_states")) else None


class ReplicateRegionInput(ParallelStyle):
    """Tensor parallelism without sequence parallelism: the module around a row-parallel linear
    (the attention / MLP module) hands its sharded children its replicated hidden-state input (its
    first positional argument, or the ``hidden_states`` keyword) as one ``Replicate`` DTensor, as
    torchtitan's ``PrepareModuleInput`` gives it, where the TP plan shards all of the module's
    parameters (every one a DTensor: its q, k, v and output linears, say). Its column-parallel
    linears take it as it is, their input gradients stay ``Partial`` and add up as such, and the
    backward all-reduces their sum once (Megatron's f operator). Given a local tensor, each column
    linear wraps it again and all-reduces its own input gradient (q, k and v: three all-reduces of
    the whole activation instead of one).

    Only a child module called on the input itself gets the DTensor; the module's own code keeps
    the local tensor, so a residual inside it (``x + self.down(...)``) adds plain tensors, and its
    gradient joins the all-reduced one at the input. A child called on anything derived from the
    input (after a dropout, say) takes that as a local tensor, with its own all-reduce. A module
    holding parameters the plan leaves whole (a user's norm or scale beside its linears, a q/k
    norm) gets nothing of this: each column linear takes its input as it comes.

    :class:`GatherSequenceInput` is the same under sequence parallelism, where the input comes as
    the sequence shard and is gathered first."""

    sequence_sharded = False  # True: the input arrives as the rank's sequence shard [B, S/tp, ..]

    def replicated(self, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """The whole input as a ``Replicate`` DTensor (gathered from the sequence shard, a local
        tensor or a ``SequenceParallel`` norm's DTensor, when :attr:`sequence_sharded`)."""
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1) if self.sequence_sharded else Replicate()], run_check=False)
        return x.redistribute(mesh, [Replicate()])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        held: dict[str, tuple[torch.Tensor, DTensor]] = {}  # while the module runs: (its input, that as a DTensor)

        def prepare(mod, x):
            # read at each forward: the children's styles apply after this one, and FSDP's unsharded
            # parameters are in place only while the module runs
            if not all(isinstance(p, DTensor) for p in mod.parameters()):
                return self.replicated(x, device_mesh).to_local() if self.sequence_sharded else x
            whole = self.replicated(x, device_mesh)
            local = whole.to_local() if self.sequence_sharded else x
            held["input"] = (local, whole)
            return local

        children_hooked = False

        def hook(mod, args, kwargs):
            nonlocal children_hooked
            if not children_hooked:  # at the first forward, after the build's FSDP units registered theirs
                # prepend: before the child's own style's hook and before a per-linear FSDP unit's pre-forward
                # (data_parallel.module_units), which would hand the child a new alias of the input
                for sub in mod.modules():
                    if sub is not mod and next(sub.parameters(recurse=False), None) is not None:
                        sub.register_forward_pre_hook(child, with_kwargs=True, prepend=True)
                children_hooked = True
            key = region_input_key(args, kwargs)
            if key == 0:
                return (prepare(mod, args[0]), *args[1:]), kwargs
            if key is not None:
                return args, dict(kwargs, hidden_states=prepare(mod, kwargs["hidden_states"]))
            if self.sequence_sharded:
                raise ValueError(f"sequence parallel: {type(mod).__name__} got no hidden-state tensor to gather")
            return None  # nothing to share: each column linear takes its input as it comes

        def child(mod, args, kwargs):  # a sharded child called on the module's input takes the DTensor
            if "input" not in held:
                return None
            local, whole = held["input"]
            if args and args[0] is local:
                return (whole, *args[1:]), kwargs
            if kwargs.get("hidden_states") is local:
                return args, dict(kwargs, hidden_states=whole)
            return None

        module.register_forward_pre_hook(hook, with_kwargs=True)
        # always_call: a recompute that stops early (recompute.checkpoint_block) raises inside the module
        module.register_forward_hook(lambda mod, args, out: held.clear(), always_call=True)
        return module


class GatherSequenceInput(ReplicateRegionInput):
    """Sequence parallel: :class:`ReplicateRegionInput` for an input that arrives as the sequence
    shard ``[B, S/tp, ..]`` (a local tensor, or a ``SequenceParallel`` norm's DTensor): gathered to
    the full sequence, differentiably. The module's code gets the gathered input as a local tensor;
    where the plan shards all its parameters, the children called on it get it as a ``Replicate``
    DTensor, and the backward reduce-scatters their summed input gradients once (with a local tensor
    each column linear all-reduced its own full-sequence input gradient: moe-fid dp2 tp2 ep4 fsdp sp
    on local-cpu:4 made 14 such all-reduces a step, torch.profiler, 2026-12-06). A residual inside
    the module cannot run here: its output is the row linear's sequence shard, its input the whole
    sequence."""

    sequence_sharded = True


class ReplicatedEmbedding(ParallelStyle):
    """A learned-position table kept whole on every tp rank (weights a ``Replicate`` DTensor,
    so their gradient is reduced over tp); its output is the rank's sequence shard under SP."""

    def __init__(self, sp: bool):
        super().__init__()
        self.sp = sp

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, device_mesh, [Replicate()]),
                                                         requires_grad=p.requires_grad))

        def rep(x):
            return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) \
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x

        def pre(mod, args, kwargs):
            return tuple(rep(a) for a in args), {k: rep(v) for k, v in kwargs.items()}

        def post(mod, args, kwargs, out):
            if self.sp:
                out = out.redistribute(device_mesh, [Shard(out.dim() - 2)])
            return out.to_local()

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)
        return module


class VocabParallelEmbedding(ParallelStyle):
    """A token embedding (``nn.Embedding``) split by vocabulary rows over the tp ranks: its weight
    a ``Shard(0)`` DTensor, as torch's ``RowwiseParallel`` leaves it (so checkpoints, a tied
    column-parallel head, FSDP over dp and the optimizer see the same parameter), but the lookup
    runs on the rank's own rows (:func:`vocab_parallel_lookup`). Its output, a plain tensor, is
    ``output_layouts``'s local part: ``Shard(1)`` the rank's sequence shard (SP), ``Replicate()``
    the whole ``[B, S, H]``.

    Why not ``RowwiseParallel(input_layouts=Replicate())``: DTensor has no row-sharded strategy
    for the lookup's backward (``embedding_dense_backward``, torch 2.13), so every tp rank builds
    the gradient of the whole table and copies its rows out of it (issue 26: 1.55 s of a 5.4 s
    gpt-small dp2 tp2 sp step on 4 CPU ranks). Here the backward touches the local rows only."""

    def __init__(self, *, output_layouts: Placement):
        super().__init__()
        self.output_layouts = output_layouts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.max_norm is not None or module.scale_grad_by_freq \
                or module.sparse:
            raise ValueError(f"vocabulary-parallel embedding: {type(module).__name__} is not a plain nn.Embedding "
                             "(no max_norm, scale_grad_by_freq or sparse); give it the 'embed' role instead")
        if type(module).forward is not nn.Embedding.forward:  # its own forward (e.g. Gemma's scaled lookup): DTensor's path
            return apply_style(RowwiseParallel(input_layouts=Replicate(), output_layouts=self.output_layouts), module,
                               device_mesh)
        _distribute(module, "weight", device_mesh, Shard(0))

        def forward(ids: torch.Tensor) -> torch.Tensor:  # the weight read at each call: FSDP2 swaps it
            return vocab_parallel_lookup(ids, module.weight, module.padding_idx, device_mesh, self.output_layouts)

        module.forward = forward  # an attribute of the instance, removed by the build's Installs at close
        return module


def vocab_shard_rows(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of a ``vocab``-row table that tp rank ``rank`` holds under ``Shard(0)``,
    split as ``torch.chunk`` splits: ceil(vocab / tp) rows a rank, the last ones fewer (or none)."""
    per = -(-vocab // tp)
    start = min(rank * per, vocab)
    return start, min(per, vocab - start)


def vocab_shard_lookup(ids: torch.Tensor, local: torch.Tensor, start: int,
                       padding_idx: int | None = None) -> torch.Tensor:
    """One rank's part of ``embedding(ids, table)`` from its rows ``local`` (the table's rows
    ``start`` on): ids outside them looked up as row 0 and their outputs zeroed, so the sum of the
    ranks' parts is the lookup and each rank's backward builds the gradient of its rows alone.
    ``padding_idx``: the table's (its row gets no gradient), or None."""
    outside = (ids < start) | (ids >= start + local.shape[0])
    pad = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < local.shape[0] else None
    return F.embedding((ids - start).masked_fill(outside, 0), local, pad).masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_parallel_lookup(ids: torch.Tensor, weight: DTensor, padding_idx: int | None, mesh: DeviceMesh,
                          layout: Placement) -> torch.Tensor:
    """``embedding(ids, weight)`` for ``weight`` a ``Shard(0)`` DTensor over the 1-D ``mesh``: the
    rank's part (:func:`vocab_shard_lookup`), the sum over the ranks (a ``Partial`` DTensor)
    redistributed to ``layout`` (``Shard(1)``: a reduce-scatter; ``Replicate()``: an all-reduce) and
    returned as this rank's local tensor. ``ids``: a plain tensor, the same on every tp rank."""
    local = weight.to_local()  # differentiable: the gradient comes back a Shard(0) DTensor of local rows
    start, _ = vocab_shard_rows(weight.shape[0], mesh.size(), mesh.get_local_rank())
    out = vocab_shard_lookup(ids, local, start, padding_idx)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [layout]).to_local()


def for_module(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """``style`` as it applies to ``module``: torch's Colwise/RowwiseParallel know ``nn.Linear``
    and ``nn.Embedding``; on a transformers ``Conv1D`` (weight ``[in, out]``) the same layouts
    run through :class:`Conv1DColwise` / :class:`Conv1DRowwise`."""
    kind = {ColwiseParallel: Conv1DColwise, RowwiseParallel: Conv1DRowwise}.get(type(style))
    if kind is None or not is_conv1d(module):
        return style
    return kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, styles: dict[str, ParallelStyle]) -> nn.Module:
    """Shard ``model`` (a stage module) in place over ``tp_mesh`` per ``styles`` ({module fqn:
    ParallelStyle}, ``codegen/runtime/tp_styles.py``); fqns absent from ``model`` are skipped.
    Returns ``model``."""
    if tp_mesh.size() == 1:
        return model
    present = dict(model.named_modules())
    plan = {f: for_module(s, present[f]) for f, s in styles.items() if f in present}
    ties = tied_params(model)
    parallelize_module(model, tp_mesh, plan)
    _retie(model, ties)
    return model


def tied_params(model: nn.Module) -> list[tuple[str, str]]:
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


def apply_tp_stages(stage_mods: list[nn.Module], tp_mesh: DeviceMesh, styles: dict[str, ParallelStyle]) -> None:
    """:func:`apply_tp` on each of a rank's stage modules, then a parameter two of them share (a
    tied embedding and head both on this rank: a V schedule's first and last stage) shared again."""
    first: dict[int, tuple[int, str]] = {}
    ties = []
    for i, sm in enumerate(stage_mods):
        for name, p in sm.named_parameters(remove_duplicate=False):
            if id(p) in first and first[id(p)][0] != i:
                ties.append((first[id(p)], (i, name)))
            first.setdefault(id(p), (i, name))
    for sm in stage_mods:
        apply_tp(sm, tp_mesh, styles)
    if tp_mesh.size() > 1:
        for (i, src), (j, dst) in ties:
            _retie(stage_mods[j], [(src, dst)], stage_mods[i])


def _retie(model: nn.Module, ties: list[tuple[str, str]], src_model: nn.Module | None = None) -> None:
    """Share the first owner's (sharded) parameter again (of ``src_model``, default ``model``);
    both sides must be sharded alike (a vocabulary-parallel embedding and head are both Shard(0)
    over the vocabulary)."""
    for src, dst in ties:
        p = (src_model or model).get_parameter(src)
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
