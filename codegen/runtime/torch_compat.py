"""Every private torch API autopar uses, in one place (checked on torch 2.13.0, CPU build).

No other module of ours names a torch attribute or module starting with ``_``
(``tests/test_torch_private.py`` walks the code and fails on one); when torch moves one of
these, this module is the one place to change. Each entry, and why we need it:

- :data:`StridedShard` (``torch.distributed.tensor.placement_types._StridedShard``): a
  packed q/k/v projection (GPT-2's ``c_attn``) sharded so each tp rank keeps its heads of
  every part; the public ``Shard`` would give rank 0 all of q (``tensor_parallel.py``).
- :data:`funcol` (``torch.distributed._functional_collectives``): the autograd-aware
  all-to-all (``all_to_all_single_autograd``, ``wait_tensor``) of Ulysses attention and of
  expert parallelism's token exchange; no public differentiable all-to-all exists.
- :func:`replicate` / :func:`ddp_replicate` / :func:`replicate_ddp_class`
  (``torch.distributed._composable.replicate_with_fsdp`` and ``._composable.replicate``):
  replicate (DDP semantics) applied in place, keeping the model's fqns, with FSDP2's
  machinery under a pipeline or TP and DDP's reducer otherwise; ``DistributedDataParallel``
  wraps (renames) the module.
- :func:`foreach_norm` / :func:`foreach_mul_` (``torch._foreach_norm``, ``torch._foreach_mul_``):
  the per-group gradient norms and the clipping scale on local shards, as
  ``torch.nn.utils.clip_grad_norm_`` does internally (it cannot reduce over our groups).
- :func:`checkpoint_generator` (``torch.utils.checkpoint._checkpoint_without_reentrant_generator``
  and ``_DEFAULT_DETERMINISM_MODE``): non-reentrant checkpointing driven by forward
  pre/post hooks (fqns unchanged; a block recomputed twice by zero-bubble schedules), as
  torch's composable ``checkpoint`` does internally.
- :func:`saved_attention_ops` / :func:`saved_collective_ops` (``aten._scaled_dot_product_*``,
  ``torch.ops._c10d_functional.*``): the ops selective per-op recompute always keeps.
- :func:`flatten_mesh` (``DeviceMesh._flatten``): the dp x cp mesh gradients are reduced
  over, one dimension for FSDP2 / replicate.
- :func:`live_process_groups` (``torch.distributed.distributed_c10d._world.pg_map``): the
  process groups that exist now, so a build can destroy exactly the ones it created.
- :func:`clear_dtensor_caches` (``torch._C._clear_DTensor_sharding_propagator_cache``, the C++
  dispatch fast path's; ``DTensor._op_dispatcher.sharding_propagator``'s
  ``propagate_op_sharding`` cache, ``_redistribute._gen_transform_infos`` and the redistribute
  planner cache): a DeviceMesh compares equal to another of the same shape and names whatever
  its process groups, so DTensor's sharding cache hands a new build output specs holding an
  older build's mesh; once that build's groups are destroyed the cached specs name groups that
  no longer exist (``Could not resolve the process group``). Cleared when groups are destroyed.
- :func:`apply_style` / :func:`apply_as_linear` (``ParallelStyle._apply`` and a linear style's
  ``_prepare_input_fn`` / ``_prepare_output_fn``; our partition functions replace its ``_partition_linear_fn``): one of torch's TP styles
  applied to a module from inside another style (a subclassed embedding keeps torch's row-wise
  path), and a Colwise/Rowwise subclass's partition run on a transformers ``Conv1D`` (weight
  ``[in, out]``), which torch's own ``_apply`` refuses (``codegen/runtime/tensor_parallel.py``).
- :func:`module_hook_dicts` (``nn.Module._forward_pre_hooks`` and the other hook dicts): a
  closed build removes the hooks it registered on a model's modules, by id, whoever
  registered them (``codegen/runtime/installs.py``).
- :data:`FakeTensorMode` (``torch._subclasses.fake_tensor``), :func:`observe_ops` (a
  ``TorchDispatchMode`` of ``torch.utils._python_dispatch``) and :func:`is_traceable_wrapper_subclass`,
  :func:`tree_map` / :func:`tree_flatten` (``torch.utils._pytree``): capture on fake tensors and
  every op-level log (the capture, the adapters' sequential check, the memory benchmark, tests).
  ``observe_ops(..., resized=...)`` also reports ``UntypedStorage.resize_`` (FSDP2 frees and
  regrows its unsharded parameters below the dispatcher), by replacing that method while the
  block runs: the one patch of a torch class autopar makes (a measuring tool's), undone on exit.
- :func:`preload_dynamo` (``torch._dynamo``): the plan-speed benchmark times its import apart.
- :func:`op_argument_names` (``OpOverload._schema``): an ATen op's argument names, so the
  capture reads a kernel's ``is_causal`` by name wherever its schema puts it.
- :func:`schedule_runtime` (``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``,
  ``_Action`` and ``_prepare_schedule_with_comms``): runs a pipeline schedule given as per-rank
  action lists (autopar's schedule IR, ``planner/schedule_ir.py``, in torch's action strings),
  adding the sends / receives, FSDP unshard / reshard and gradient reductions itself; torch's
  public schedule classes each fix their own order.
- :func:`children_registry` (``nn.Module._modules``): a module's child registry itself, so a
  capture can drop children from a deep copy keeping their names (``planner/frontend/trace.py``)
  and a stage view can swap children on a shallow copy without touching the model's own
  registry (``codegen/runtime/adapters/hf_stage.py``); ``add_module`` writes into the registry
  the copy shares.
- :func:`storage_key` (``UntypedStorage._cdata``): a storage's identity (fake tensors' storages
  have no data pointer), so the capture counts each saved storage once.
- :func:`local_tensor` (``DTensor._local_tensor``): a DTensor parameter's or gradient's local
  shard as the storage itself (collectives write into it in place; ``to_local()`` is an autograd
  op returning an alias that must not be written through).
- :func:`own_outputs` (``Tensor._is_view``): a pipeline stage's outputs that are views made
  tensors of their own, as a forward hook: torch's split backward (``stage_backward_input``)
  detaches the stage outputs in place, which a view refuses (a transformers model's final norm can
  return an alias of its result when it ends a stage).
- :func:`all_gather_into` / :func:`reduce_scatter_into`: the flat-tensor all-gather and
  reduce-scatter under the name the running torch has (2.13 renamed ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` to ``all_gather_single`` / ``reduce_scatter_single``; the GPU box's
  2.11 has only the old names).
- :func:`split_backward` (``torch.distributed.pipelining._backward``'s ``stage_backward_input`` and
  ``stage_backward_weight``): a backward run as the schedule runtime runs an I then a W, so the
  profiler times what splitting costs beyond one whole backward (``cost_models/profiler.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

CHECKED_ON = ("2.13.0",)

__all__ = ["CHECKED_ON", "FakeTensorMode", "StridedShard", "checkpoint_generator",
           "all_gather_into", "children_registry", "clear_dtensor_caches", "ddp_replicate", "flatten_mesh", "foreach_mul_", "foreach_norm", "funcol",
           "is_traceable_wrapper_subclass", "live_process_groups", "local_tensor", "module_hook_dicts", "observe_ops", "own_outputs",
           "preload_dynamo", "reduce_scatter_into", "replicate",
           "replicate_ddp_class", "saved_attention_ops", "saved_collective_ops", "schedule_runtime",
           "set_children_registry", "split_backward", "storage_key", "tree_flatten",
           "tree_map"]


def own_outputs(module: torch.nn.Module, args: Any, out: Any) -> Any:
    """Forward hook: ``out`` with every tensor that is a view cloned (None: nothing to change; module
    docstring)."""
    if isinstance(out, torch.Tensor):
        return out.clone() if out._is_view() else None
    if isinstance(out, tuple) and any(isinstance(t, torch.Tensor) and t._is_view() for t in out):
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t for t in out)
    return None


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None):
    """All-gather ``inp`` of every rank of ``group`` into the flat ``out`` (module docstring)."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group=None):
    """Sum the flat ``inp`` over ``group`` and scatter it, this rank's part into ``out`` (module docstring)."""
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, inp, group=group)


def preload_dynamo() -> None:
    """Import ``torch._dynamo`` now: torch loads it lazily on the first ``nn.Module`` built under a
    device context (~0.9 s), which a timing of the capture would otherwise count
    (``benchmarks/plan_speed.py`` counts it as import time)."""
    import importlib

    importlib.import_module("torch._dynamo")


def replicate():
    """``replicate`` on FSDP2's machinery (``_composable.replicate_with_fsdp``)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as fn
    return fn


def ddp_replicate():
    """``replicate`` through DDP's reducer (``_composable.replicate``)."""
    from torch.distributed._composable.replicate import replicate as fn
    return fn


def replicate_comm_hooked(module: torch.nn.Module) -> bool:
    """Whether the DDP reducer :func:`ddp_replicate` put on ``module`` has a communication hook
    (its state's private ``_ddp._comm_hooks``)."""
    return bool(getattr(ddp_replicate().state(module)._ddp, "_comm_hooks", None))


# ATen op base names (:func:`op_base_name`) the capture classifies a layer and its tensor-parallel
# roles by, private ones among them (checked on torch 2.13.0): the fused attention kernels, the
# SDPA entry points that dispatch to them, softmax / log-softmax, the norms, and the reshape /
# cast ops between a weight and its matmul.
CPU_FLASH_ATTENTION_OP = "_scaled_dot_product_flash_attention_for_cpu"
EFFICIENT_ATTENTION_OP = "_scaled_dot_product_efficient_attention"
FUSED_ATTENTION_OPS = frozenset({
    CPU_FLASH_ATTENTION_OP, EFFICIENT_ATTENTION_OP, "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"})
SDPA_OPS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                      "_scaled_dot_product_fused_attention_overrideable"})
SOFTMAX_OPS = frozenset({"_softmax", "_safe_softmax", "softmax"})
LOG_SOFTMAX_OPS = frozenset({"_log_softmax", "log_softmax"})
NORM_OPS = frozenset({"native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm"})
RESHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view"})
CAST_OPS = frozenset({"_to_copy", "to"})


def op_base_name(target: Any) -> str | None:
    """An aten op's name without namespace or overload (``mm`` for ``aten.mm.default``): the
    private ``_opname`` of torch's ``OpOverload`` / ``OpOverloadPacket``; None for other callables."""
    return getattr(target, "_opname", None)


def replicate_ddp_class() -> type:
    """The class a module becomes under :func:`ddp_replicate` (``_composable.replicate.DDP``)."""
    from torch.distributed._composable.replicate import DDP
    return DDP


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """Each tensor's ``ord``-norm (one fused kernel)."""
    return torch._foreach_norm(tensors, ord)


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor by ``scale`` in place."""
    torch._foreach_mul_(tensors, scale)


def checkpoint_generator(module: torch.nn.Module, contexts, *args, **kwargs):
    """torch's non-reentrant checkpoint as a generator: ``next()`` before the forward, again
    after it (``contexts() -> (forward ctx, recompute ctx)``; preserving RNG state; default
    determinism check; no debug)."""
    from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator
    return _checkpoint_without_reentrant_generator(module, True, contexts, _DEFAULT_DETERMINISM_MODE, False, True,
                                                   *args, **kwargs)


def saved_attention_ops() -> set:
    """ATen's fused attention kernels (their outputs are what selective recompute keeps)."""
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_cudnn_attention.default}


def op_argument_names(op: Any) -> list[str]:
    """The names of an ATen op overload's arguments, in schema order."""
    return [a.name for a in op._schema.arguments]


def saved_collective_ops() -> set:
    """The functional collectives whose outputs selective recompute keeps (reduce-scatter, all-to-all)."""
    ops = torch.ops._c10d_functional
    return {ops.reduce_scatter_tensor.default, ops.all_to_all_single.default}


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh`` (a multi-dimensional DeviceMesh slice) as one dimension called ``name``."""
    return mesh._flatten(name)


def live_process_groups() -> list:
    """The process groups this process has now (the default one included), oldest first."""
    from torch.distributed import distributed_c10d as c10d
    return list(c10d._world.pg_map)


def module_hook_dicts(module: torch.nn.Module) -> dict[str, dict]:
    """``{name: dict}`` of ``module``'s hook registries (forward / backward / state-dict hooks
    and their flag sets keyed by hook id), as ``nn.Module.__init__`` creates them."""
    return {k: v for k, v in module.__dict__.items() if k.startswith("_") and "hooks" in k and isinstance(v, dict)}


def children_registry(module: torch.nn.Module) -> dict:
    """``module``'s child registry (``{name: child}``, the dict itself: writes change the module)."""
    return module._modules


def set_children_registry(module: torch.nn.Module, children: dict) -> None:
    """Give ``module`` its own child registry ``children`` (a shallow copy stops sharing the original's)."""
    module._modules = children


def storage_key(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage, equal for tensors sharing it (fake tensors included)."""
    return t.untyped_storage()._cdata


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (its own storage), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribute plans (they hold meshes)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def schedule_runtime(stages: list, n_microbatches: int, loss_fn, scale_grads: bool, order: dict[int, list[str]]):
    """torch's schedule runtime over this rank's ``stages`` running ``order`` (pp rank -> that
    rank's compute actions as torch's strings, ``1F0``, ``1I0``, ``(0F2;1B0)OVERLAP_F_B``, for
    EVERY rank: each rank lowers the whole schedule to add the matching sends and receives;
    each stage's rank is read from where its actions are)."""
    from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

    sched = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    actions = {r: [_Action.from_str(a) for a in row] for r, row in order.items()}
    sched.pipeline_order = actions
    sched._prepare_schedule_with_comms(actions)
    return sched


def split_backward(output: torch.Tensor, output_grad: torch.Tensor | None, inputs: list[torch.Tensor],
                   params: list[torch.nn.Parameter]) -> None:
    """The backward of ``output`` as torch's schedule runtime runs a split one: the input gradients
    (``inputs``' ``.grad``, an I action), then the weight gradients (``params``' ``.grad``, a W)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    _, groups = stage_backward_input([output], None if output_grad is None else [output_grad], inputs, iter(params))
    stage_backward_weight(iter(params), groups)


def apply_style(style: Any, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """``style`` (a torch ``ParallelStyle``) applied to ``module`` alone, as ``parallelize_module`` does."""
    return style._apply(module, device_mesh)


def apply_as_linear(style: Any, module: torch.nn.Module, device_mesh: Any,
                    partition: Callable[[str, torch.nn.Module, Any], None], local_output: bool = False
                    ) -> torch.nn.Module:
    """A ColwiseParallel / RowwiseParallel (subclass) run on ``module`` whatever its type (torch's
    ``_apply`` accepts ``nn.Linear`` and ``nn.Embedding`` only): ``partition(name, module, mesh)``
    distributes its parameters, then the style's own input preparation and, unless
    ``local_output`` (the output already the rank's local part, returned as is), its output's."""
    from functools import partial

    from torch.distributed.tensor import distribute_module

    def local(mod, outputs, mesh):
        return outputs.to_local()

    output = local if local_output else partial(style._prepare_output_fn, style.output_layouts, style.use_local_output)
    return distribute_module(module, device_mesh, partition,
                             partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
                             output)


OpSeen = Callable[[Any, tuple, dict, Any], None]  # (ATen op, args, kwargs, its output)


class _OpObserver(TorchDispatchMode):
    """Runs every ATen op as called: ``before(op)`` first, ``after(op, args, kwargs, out)`` once it
    returned; with ``resized``, ``resized(storage)`` after each ``UntypedStorage.resize_``."""

    def __init__(self, after: OpSeen, before: Callable[[Any], None] | None,
                 resized: Callable[[Any], None] | None):
        super().__init__()
        self.after, self.before, self.resized, self.resize = after, before, resized, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.before is not None:
            self.before(func)
        out = func(*args, **kwargs)
        self.after(func, args, kwargs, out)
        return out

    def __enter__(self):
        if self.resized is not None:
            self.resize = orig = torch.UntypedStorage.resize_

            def resize_(st, size):
                out = orig(st, size)
                self.resized(st)
                return out
            torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self.resize is not None:
            torch.UntypedStorage.resize_, self.resize = self.resize, None
        return super().__exit__(*exc)


def observe_ops(after: OpSeen, before: Callable[[Any], None] | None = None,
                resized: Callable[[Any], None] | None = None):
    """A context manager (``with observe_ops(seen):``) under which every ATen op below autograd runs
    as called and is reported: ``before(op)`` first (what was running when an op raises), then
    ``after(op, args, kwargs, out)``; ``resized(storage)`` after each storage resize (module docstring)."""
    return _OpObserver(after, before, resized)
