"""Capture: ``nn.Module`` + example inputs -> ModelGraph, without allocating weights.

How it works
------------
1. **Layer units.** The model's module tree is cut into *units*, the pieces a
   pipeline stage boundary may fall between: every element of an ``nn.ModuleList``
   / ``nn.Sequential`` stack (transformer blocks, vision blocks) and every other
   child on the way down to those stacks (embeddings, norms, heads, projectors).
2. **Repeated blocks once.** Units of one stack with the same *signature* (class,
   parameter names/shapes/dtypes, buffers, primitive attributes) are one class;
   only its first member is run, the others copy its record. A stack is assumed
   to run its members in list order (what every transformer does).
3. **Fake execution.** A structural copy of the model whose parameters are
   ``FakeTensor`` s on the CPU device (no storage is ever allocated) runs one
   forward and one backward under ``torch_compat.observe_ops``, which sees every ATen op
   - the same op-level view ``torch.export`` records - and attributes it to the
   current unit and part (attention, MLP, norm, ...). Fake CPU tensors (not meta)
   make ``scaled_dot_product_attention`` pick the flash kernel a real run picks, so
   what autograd saves is what a real run saves.
   - FLOPs per op come from ``torch.utils.flop_counter`` 's registry (matmuls,
     convolutions, attention; other ops count 0 FLOPs).
   - Memory traffic per op = bytes of its tensor inputs and outputs (views: 0).
   - Saved-for-backward bytes come from ``saved_tensors_hooks`` on that very
     forward: each storage counted once, parameters excluded.
   - Backward ops are attributed by gradient hooks on each unit's (and part's)
     outputs: when the gradient of a unit's output is ready, that unit's backward
     is running (the engine runs one thread per device, so this is sequential).
   - Root-level ops outside every unit (an HF model's loss, concatenation of image
     and text tokens) belong to the unit that ran last (the first unit, before any).
   - A module with a ``static_shapes = False`` attribute (the zoo's MoE layer: its rows per
     expert depend on the routing) gets ``True`` on the fake copy and runs its static-shape
     path (for MoE: the balanced load).
"""
from __future__ import annotations

import copy
import hashlib
import time
from typing import Any, Callable

import torch
import torch.nn as nn
from codegen.runtime.torch_compat import RESHAPE_OPS, children_registry, observe_ops, storage_key, tree_map
from torch.utils.flop_counter import flop_registry

from planner.frontend.records import UnitRecord, UnitRun, assemble, nbytes, tensors
from planner.errors import AutoparError, first_line
from planner.frontend.fx_graph import GraphBuilder, unit_costs
from planner.graph import MATMUL_OPS, AttentionDims, Matmul, ModelGraph
from planner.frontend.layer_kinds import ATTN_OPS, is_linear, kernel_causal, part_kind

_VIEW_OPS_TAG = torch.Tag.view_copy if hasattr(torch.Tag, "view_copy") else None


# ---------------------------------------------------------------- units ---------

def _is_stack(m: nn.Module) -> bool:
    return isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1


def _has_stack(m: nn.Module) -> bool:
    return any(_is_stack(c) for c in m.modules())


def find_units(model: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """(path, module, stack path or None) for every unit, in definition order."""
    out: list[tuple[str, nn.Module, str | None]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        for name, c in m.named_children():
            path = prefix + name
            if _is_stack(c):
                for n2, cc in c.named_children():
                    out.append((f"{path}.{n2}", cc, path))
            elif _has_stack(c):
                visit(c, path + ".")
            else:
                out.append((path, c, None))

    if _has_stack(model):
        visit(model, "")
    else:
        out.append(("", model, None)) if not list(model.children()) else visit(model, "")
    return out


def _primitive_attrs(m: nn.Module) -> tuple:
    items = []
    for k, v in sorted(vars(m).items()):
        if k.startswith("_") or "idx" in k or "index" in k:
            continue
        if isinstance(v, (int, float, bool, str)) or v is None:
            items.append((k, v))
    return tuple(items)


def signature(m: nn.Module) -> str:
    """Structural signature: equal for units a stack may run interchangeably."""
    key = []
    for name, sub in m.named_modules():
        key.append((name, type(sub).__qualname__, _primitive_attrs(sub)))
    for n, p in m.named_parameters():
        key.append((n, tuple(p.shape), str(p.dtype), p.requires_grad))
    for n, b in m.named_buffers():
        key.append((n, tuple(b.shape), str(b.dtype)))
    return hashlib.sha256(repr(key).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- recording -----

def _attention_flops(name: str, args: tuple) -> float:
    """FLOPs of an attention kernel the FLOP registry lacks (e.g. the CPU flash kernel):
    forward 4*B*H*Sq*Skv*D (Q K^T and P V), backward twice that (the registry's convention)."""
    ts = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if name.endswith("_backward"):
        if len(ts) < 3:
            return 0.0
        q, k = ts[1], ts[2]
        mult = 2.0
    else:
        if len(ts) < 2:
            return 0.0
        q, k = ts[0], ts[1]
        mult = 1.0
    b, h, sq, d = q.shape
    return mult * 4.0 * b * h * sq * k.shape[-2] * d


def part_module(unit: nn.Module, part: str) -> nn.Module:
    """The child ``part`` of a unit's module (the unit itself for ``""`` or a name it lacks)."""
    child = getattr(unit, part, None) if part else None
    return child if isinstance(child, nn.Module) else unit


class _Recorder:
    """Sees every ATen op (:meth:`watching`): appends it to the FX graph (``builder``, when set)
    with its FLOPs, bytes and (unit, part, phase), and notes which op kinds each part ran."""

    def __init__(self) -> None:
        self.unit: UnitRecord | None = None      # innermost running unit
        self.part = ""
        self.backward = False
        self.last_op = ""
        self.linear = ""                         # the Linear running (path relative to its unit)
        self.builder: GraphBuilder | None = None

    def watching(self):
        """The context under which every op is recorded (``torch_compat.observe_ops``)."""
        return observe_ops(self.seen, before=self.starting)

    def starting(self, func) -> None:
        self.last_op = str(func.overloadpacket.__name__)  # named in the error when the op raises

    def seen(self, func, args, kwargs, out) -> None:
        unit = self.unit
        name = self.last_op
        if self.builder is not None:
            flops = 0.0
            fn = flop_registry.get(func.overloadpacket)
            if fn is not None:
                flops = float(fn(*args, **kwargs, out_val=out))
            elif "scaled_dot_product" in name or "flash_attn" in name:
                flops = _attention_flops(name, args)
            is_view = func.is_view or name in RESHAPE_OPS or name in (
                "expand", "t", "transpose", "permute", "detach", "alias", "slice", "select", "unsqueeze", "squeeze")
            # views move nothing; neither do ops that return no tensor (device / shape queries)
            moves = not is_view and bool(tensors(out))
            nb = sum(nbytes(t) for t in tensors((args, kwargs, out))) if moves else 0
            self.builder.record(func, args, kwargs, out, dict(
                unit=unit.name if unit is not None else None, part=self.part, op=name, flops=flops, bytes=nb,
                phase="bwd" if self.backward else "fwd"))
        if unit is None:
            return
        unit.part(self.part)
        if not self.backward:
            unit.part(self.part).ops.add(name)
            if name in MATMUL_OPS:
                fn = flop_registry.get(func.overloadpacket)
                unit.matmuls.append(Matmul(self.linear, float(out.numel()),
                                           float(fn(*args, **kwargs, out_val=out)) if fn is not None else 0.0))
            if name in ATTN_OPS and unit.attention is None:
                q, k = args[0], args[1]
                causal = kernel_causal(func, args, kwargs, part_module(unit.module, self.part))
                unit.attention = AttentionDims(heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[-1],
                                               seq_len=q.shape[-2], kv_len=k.shape[-2], causal=causal)


# ---------------------------------------------------------------- capture -------

def _fake_copy(model: nn.Module, fake_mode, keep: set[int], members: set[int]) -> nn.Module:
    """Structural copy of ``model`` with fake CPU parameters/buffers; block-stack members
    (``members``: ids of the units that are stack members) whose id is not in ``keep`` are
    left out (their lists are shortened). Other lists (an MLP written as nn.Sequential)
    are copied whole."""
    memo: dict[int, Any] = {}
    with fake_mode:
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                           requires_grad=p.requires_grad)
        for b in model.buffers():
            if id(b) not in memo:
                memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")
    dropped = []
    for m in model.modules():
        if _is_stack(m):
            for c in m.children():
                if id(c) in members and id(c) not in keep:
                    memo[id(c)] = c  # not copied; removed from the copy below
                    dropped.append(id(c))
    clone = copy.deepcopy(model, memo)
    drop = set(dropped)
    for m in clone.modules():
        if _is_stack(m):
            reg = children_registry(m)
            for n in [n for n, c in reg.items() if id(c) in drop]:
                del reg[n]
    return clone


def _to_fake(obj: Any, fake_mode) -> Any:
    def conv(x):
        if isinstance(x, torch.Tensor):
            with fake_mode:
                t = torch.empty(x.shape, dtype=x.dtype, device="cpu")
                if x.dtype in (torch.int64, torch.int32):
                    t = torch.zeros(x.shape, dtype=x.dtype, device="cpu")
            return t
        return x
    return tree_map(conv, obj)


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    ts = [t for t in tensors(out) if t.is_floating_point() and t.requires_grad]
    if not ts:
        raise AutoparError("capture: the model's output has no differentiable tensor; "
                           "pass labels in the example batch or a loss_fn")
    return sum(t.float().sum() for t in ts)


def capture(model: nn.Module, example: dict[str, Any] | tuple, *, name: str | None = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, config: dict[str, Any] | None = None,
            hidden: int | None = None, vocab: int | None = None,
            units: list[tuple[str, nn.Module, str | None]] | None = None) -> ModelGraph:
    """Capture ``model`` on ``example`` (a dict of keyword inputs or a tuple of positional
    ones; tensors may be on any device, meta included: only shapes and dtypes are read).

    ``model`` is not modified and no real weight or activation is allocated.
    ``loss_fn(output) -> scalar`` turns the output into the loss when the model does
    not return one. ``units``: (path, module, stack path or None) per layer unit, as the
    model's runtime adapter sees them (default :func:`find_units`). Returns a ModelGraph for
    the batch and sequence of ``example``; :func:`capture_fx` also returns the FX graph.
    """
    return capture_fx(model, example, name=name, loss_fn=loss_fn, config=config, hidden=hidden, vocab=vocab,
                      units=units)[0]


def _representatives(units: list[tuple[str, nn.Module, str | None]]):
    """(signature per unit path, first unit path per (stack, signature), ids of the modules to
    run): of each stack's members with one signature only the first runs."""
    sigs = {path: signature(m) for path, m, _ in units}
    reps: dict[tuple[str, str], str] = {}        # (stack, sig) -> first unit path
    keep: set[int] = set()
    for path, m, stack in units:
        if stack is None or (stack, sigs[path]) not in reps:
            if stack is not None:
                reps[(stack, sigs[path])] = path
            keep.add(id(m))
    return sigs, reps, keep


class _UnitHooks:
    """Module hooks on the fake clone that keep ``rec.unit`` / ``rec.part`` on the unit and part
    running (forward: pre/post hooks on units, their children and linears; backward: gradient
    hooks on their outputs) and count what autograd saves per unit (:meth:`pack`)."""

    def __init__(self, rec: "_Recorder", recs: dict[str, UnitRecord], clone: nn.Module, hidden: int | None):
        self.rec, self.recs, self.hidden = rec, recs, hidden
        self.order: list[str] = []          # unit paths in the order they first ran
        self.handles: list = []
        self.stack: list[tuple[UnitRecord | None, str]] = []
        self.open: list[UnitRecord] = []    # the units whose forward is running (outermost first)
        self.saved_seen: set[int] = set()
        # the storages counted, held until the capture ends: a saved tensor whose graph node is
        # freed early (a branch the loss does not reach) would free its storage, and a later one
        # allocated at the same address would be taken for it (captures varied run to run)
        self.saved_alive: list = []
        self.param_storages = {storage_key(p) for p in clone.parameters()}
        self.lin_names: dict[int, str] = {}
        self.tp_parts: dict[str, set[str]] = {}   # unit -> its parts TP splits (from the first forward)

    def install(self) -> None:
        for u in self.recs.values():
            self.handles.append(u.module.register_forward_pre_hook(self.unit_pre(u), with_kwargs=True))
            self.handles.append(u.module.register_forward_hook(self.unit_post(u), with_kwargs=True))
            for pname, child in u.module.named_children():
                self.handles.append(child.register_forward_pre_hook(self.part_pre(u, pname, None), with_kwargs=True))
                self.handles.append(child.register_forward_hook(self.part_post(u, pname)))
            for lname, sub in u.module.named_modules():
                if is_linear(sub):
                    self.lin_names[id(sub)] = lname
                    top = lname.split(".")[0] if lname else ""
                    self.handles.append(sub.register_forward_pre_hook(self.part_pre(u, top, sub), with_kwargs=True))
                    self.handles.append(sub.register_forward_hook(self.linear_post()))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def unit_pre(self, u: UnitRecord):
        def hook(mod, args, kwargs):
            rec = self.rec
            self.stack.append((rec.unit, rec.part))
            self.open.append(u)
            rec.unit, rec.part = u, ""
            if not u.ran:
                u.ran = True
                self.order.append(u.name)
                u.input_bytes = sum(nbytes(t) for t in tensors((args, kwargs)) if t.is_floating_point())
        return hook

    def unit_post(self, u: UnitRecord):
        def hook(mod, args, kwargs, out):
            rec = self.rec
            outs = tensors(out)
            if not u.output_bytes:
                u.output_bytes = sum(nbytes(t) for t in outs)
                fl = [t for t in outs if t.is_floating_point() and t.dim() >= 1]
                u.io_hidden = int(fl[0].shape[-1]) if fl else 0
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self.enter_backward(u, ""))
            rec.unit, rec.part = self.stack.pop()
            self.open.pop()
            if not any(o is rec.unit for o in self.open):  # back at the root: what follows (an HF
                rec.unit, rec.part = u, ""  # model's loss after its head) belongs to the unit that ran last
        return hook

    def part_pre(self, u: UnitRecord, pname: str, lin: nn.Module | None):
        from codegen.runtime.tensor_parallel import region_input_key  # torch's TP styles: only when capturing
        def hook(mod, args, kwargs):
            rec = self.rec
            if lin is None and rec.unit is u and rec.part == "" and not rec.backward:
                rec.part = pname
                self.stack.append((u, "<part>"))
                if rec.builder is not None:  # what the runtime's TP region style would take as its input
                    rec.builder.mark_input(args, kwargs, region_input_key(args, kwargs), f"{u.name}.{pname}")
            if lin is not None and not rec.backward:
                rec.linear = self.lin_names[id(lin)]
                p = u.part(rec.part if rec.unit is u else pname)
                if all(l is not lin for _, l in p.linears):
                    p.linears.append((self.lin_names[id(lin)], lin))
        return hook

    def linear_post(self):
        def hook(mod, args, out):
            self.rec.linear = ""
        return hook

    def part_post(self, u: UnitRecord, pname: str):
        def hook(mod, args, out):
            if self.stack and self.stack[-1] == (u, "<part>") and self.rec.part == pname:
                self.stack.pop()
                self.rec.part = ""
            for t in tensors(out):
                if t.requires_grad:
                    t.register_hook(self.enter_backward(u, pname))
        return hook

    def enter_backward(self, u: UnitRecord, pname: str):
        def hook(grad):
            self.rec.unit, self.rec.part = u, pname
            return None
        return hook

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack: count each saved storage once (not parameters) on its unit:
        all of it, the attention-core part (square score-like tensors inside a part) and the
        part inside TP-split parts that is not hidden-sized."""
        rec, u = self.rec, self.rec.unit
        if u is None:
            return t
        try:
            sid = storage_key(t)
        except Exception:
            return t
        if rec.builder is not None:
            rec.builder.mark_saved(t)
        if sid in self.param_storages or sid in self.saved_seen:
            return t
        self.saved_seen.add(sid)
        self.saved_alive.append(t.untyped_storage())
        nb = t.untyped_storage().nbytes()
        u.act_bytes += nb
        u.part(rec.part).act += nb
        hid = u.io_hidden or self.hidden
        core = t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] > 1 and t.dim() >= 3 \
            and t.is_floating_point() and rec.part and t.shape[-1] != hid
        if core:
            u.act_core += nb
        if rec.part in self.tp_parts.get(u.name, ()) and (t.dim() == 0 or t.shape[-1] != (hid or -1)):
            u.act_bytes_tp += nb
        return t

    def note_part_kinds(self, vocab: int | None) -> None:
        """After the first (no-grad) forward: each unit's TP-split parts; then reset the units
        for the recorded run."""
        for u in self.recs.values():
            ch = dict(u.module.named_children())
            kinds = {p: part_kind(r, ch.get(p, u.module if p == "" else None), vocab) for p, r in u.parts.items()}
            self.tp_parts[u.name] = {p for p, (_, s) in kinds.items() if s != "replicated"}
            u.parts.clear(); u.ran = False; u.attention = None; u.output_bytes = 0; u.input_bytes = 0
            u.matmuls.clear()
        self.order.clear()
        self.rec.unit, self.rec.part = None, ""


def capture_fx(model: nn.Module, example: dict[str, Any] | tuple, *, name: str | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, config: dict[str, Any] | None = None,
               hidden: int | None = None, vocab: int | None = None,
               units: list[tuple[str, nn.Module, str | None]] | None = None):
    """:func:`capture`, returning ``(ModelGraph, torch.fx.Graph)``: the graph of the step's
    forward and backward ATen ops the layer costs were summed from (``planner/frontend/fx_graph.py``)."""
    from codegen.runtime.torch_compat import FakeTensorMode
    from planner.frontend.mla import EqualHeadAttention

    t0 = time.perf_counter()
    units = list(units) if units is not None else find_units(model)
    if not units:
        raise AutoparError("capture: the model has no submodules to split into layers; "
                           "wrap its computation in nn.Module children")
    sigs, reps, keep = _representatives(units)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    clone = _fake_copy(model, fake_mode, keep, {id(m) for _, m, stack in units if stack is not None})
    for m in clone.modules():  # data-dependent shapes (MoE routing) take their static path on fake tensors
        if getattr(m, "static_shapes", None) is False:
            m.static_shapes = True
    cmods = dict(clone.named_modules())
    # The units the clone kept; paths inside shortened stacks kept their names (the keys).
    recs: dict[str, UnitRecord] = {}
    for path in (path for path, m, _ in units if id(m) in keep):
        if path not in cmods:
            raise AutoparError(f"capture: unit {path!r} not found in the model copy; "
                               "report this model to autopar")
        recs[path] = UnitRecord(path, cmods[path])

    rec = _Recorder()
    hooks = _UnitHooks(rec, recs, clone, hidden)
    hooks.install()
    args, kwargs = (example, {}) if isinstance(example, tuple) else ((), example)
    fargs, fkwargs = _to_fake(args, fake_mode), _to_fake(kwargs, fake_mode)
    try:
        with fake_mode, EqualHeadAttention():  # MLA's narrower value heads as a fused kernel runs them
            # A first forward without grad-saving fixes each part's kind (for the TP
            # split of saved bytes), a second one records everything.
            with torch.no_grad(), rec.watching():
                clone(*fargs, **fkwargs)
            hooks.note_part_kinds(vocab)
            rec.builder = GraphBuilder({id(p): n for n, p in clone.named_parameters(remove_duplicate=False)})
            with rec.watching(), torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t):
                out = clone(*fargs, **fkwargs)
                loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
                rec.backward = True
                loss.backward()
    except AutoparError:
        raise
    except Exception as e:  # a tracing failure: name the module and the op
        where = rec.unit.name if rec.unit is not None else "(model root)"
        part = f".{rec.part}" if rec.part else ""
        raise AutoparError(f"capture failed in module '{where}{part}' at op aten.{rec.last_op}: "
                           f"{first_line(e)} -- make the forward run on fake tensors "
                           "(no .item()/.tolist()/data-dependent Python control flow), or rerun with --debug") from e
    finally:
        hooks.remove()
    _costs_from_graph(rec.builder.graph, recs)
    graph = assemble(model, UnitRun(units, sigs, reps, recs, hooks.order), example, t0, name, config, hidden, vocab)
    return graph, rec.builder.graph


def _costs_from_graph(fx_graph, recs: dict[str, UnitRecord]) -> None:
    """Each unit part's forward / backward FLOPs and bytes: sums over its FX graph nodes."""
    for (unit, part, phase), c in unit_costs(fx_graph).items():
        if unit not in recs:
            continue
        r = recs[unit].part(part)
        if phase == "fwd":
            r.fwd_flops += c.flops
            r.fwd_bytes += c.bytes
            recs[unit].fwd_kernels += c.kernels
            recs[unit].fwd_ops += c.ops
        else:
            r.bwd_flops += c.flops
            recs[unit].bwd_bytes += c.bytes
            recs[unit].bwd_kernels += c.kernels
            recs[unit].bwd_ops += c.ops
