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
   forward and one backward under a ``TorchDispatchMode`` that sees every ATen op
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
"""
from __future__ import annotations

import copy
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from planner.errors import AutoparError
from planner.fx_graph import GraphBuilder, unit_costs
from planner.graph import AttentionDims, Layer, Linear, ModelGraph, Op
from planner.layer_kinds import ATTN_OPS, is_linear, layer_kind, lin_dims, part_kind

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

@dataclass
class _PartRec:
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    ops: set = field(default_factory=set)
    linears: list = field(default_factory=list)  # (name, module) in execution order


@dataclass
class _UnitRec:
    name: str
    module: nn.Module
    parts: "OrderedDict[str, _PartRec]" = field(default_factory=OrderedDict)
    bwd_bytes: float = 0.0
    fwd_kernels: int = 0
    bwd_kernels: int = 0
    fwd_ops: int = 0
    bwd_ops: int = 0
    act_bytes: float = 0.0
    act_bytes_tp: float = 0.0
    act_core: float = 0.0
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    io_hidden: int = 0
    attention: AttentionDims | None = None
    ran: bool = False

    def part(self, name: str) -> _PartRec:
        return self.parts.setdefault(name, _PartRec())


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


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Sees every ATen op: appends it to the FX graph (``builder``, when set) with its FLOPs,
    bytes and (unit, part, phase), and notes which op kinds each part ran."""

    def __init__(self) -> None:
        super().__init__()
        self.unit: _UnitRec | None = None      # innermost running unit
        self.part = ""
        self.backward = False
        self.last_op = ""
        self.builder: GraphBuilder | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.last_op = str(func.overloadpacket.__name__)
        out = func(*args, **kwargs)
        unit = self.unit
        name = self.last_op
        if self.builder is not None:
            flops = 0.0
            fn = flop_registry.get(func.overloadpacket)
            if fn is not None:
                flops = float(fn(*args, **kwargs, out_val=out))
            elif "scaled_dot_product" in name or "flash_attn" in name:
                flops = _attention_flops(name, args)
            is_view = func.is_view or name in ("view", "_unsafe_view", "expand", "t", "transpose", "permute",
                                                 "detach", "alias", "slice", "select", "unsqueeze", "squeeze")
            # views move nothing; neither do ops that return no tensor (device / shape queries)
            moves = not is_view and bool(_tensors(out))
            nb = sum(_nbytes(t) for t in _tensors((args, kwargs, out))) if moves else 0
            self.builder.record(func, args, kwargs, out, dict(
                unit=unit.name if unit is not None else None, part=self.part, op=name, flops=flops, bytes=nb,
                phase="bwd" if self.backward else "fwd"))
        if unit is None:
            return out
        unit.part(self.part)
        if not self.backward:
            unit.part(self.part).ops.add(name)
            if name in ATTN_OPS and unit.attention is None:
                q, k = args[0], args[1]
                causal = bool(kwargs.get("is_causal", args[4] if len(args) > 4 and isinstance(args[4], bool)
                                         else False))
                unit.attention = AttentionDims(heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[-1],
                                               seq_len=q.shape[-2], kv_len=k.shape[-2], causal=causal)
        return out


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
            kept = [(n, c) for n, c in m._modules.items() if id(c) not in drop]
            m._modules = OrderedDict(kept)
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
    ts = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
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


def capture_fx(model: nn.Module, example: dict[str, Any] | tuple, *, name: str | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, config: dict[str, Any] | None = None,
               hidden: int | None = None, vocab: int | None = None,
               units: list[tuple[str, nn.Module, str | None]] | None = None):
    """:func:`capture`, returning ``(ModelGraph, torch.fx.Graph)``: the graph of the step's
    forward and backward ATen ops the layer costs were summed from (``planner/fx_graph.py``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    units = list(units) if units is not None else find_units(model)
    if not units:
        raise AutoparError("capture: the model has no submodules to split into layers; "
                           "wrap its computation in nn.Module children")
    sigs = {path: signature(m) for path, m, _ in units}
    reps: dict[tuple[str, str], str] = {}        # (stack, sig) -> first unit path
    keep: set[int] = set()
    for path, m, stack in units:
        if stack is None or (stack, sigs[path]) not in reps:
            if stack is not None:
                reps[(stack, sigs[path])] = path
            keep.add(id(m))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    clone = _fake_copy(model, fake_mode, keep, {id(m) for _, m, stack in units if stack is not None})
    cmods = dict(clone.named_modules())
    # The units the clone kept; paths inside shortened stacks kept their names (the keys).
    recs: dict[str, _UnitRec] = {}
    for path in (path for path, m, _ in units if id(m) in keep):
        if path not in cmods:
            raise AutoparError(f"capture: unit {path!r} not found in the model copy; "
                               "report this model to autopar")
        recs[path] = _UnitRec(path, cmods[path])

    rec = _Recorder()
    order: list[str] = []
    handles = []
    stack_state: list[tuple[_UnitRec | None, str]] = []
    last_done: list[_UnitRec | None] = [None]
    saved_seen: set[int] = set()
    param_storages = {p.untyped_storage()._cdata for p in clone.parameters()}

    def unit_pre(u: _UnitRec):
        def hook(mod, args, kwargs):
            stack_state.append((rec.unit, rec.part))
            rec.unit, rec.part = u, ""
            if not u.ran:
                u.ran = True
                order.append(u.name)
                ins = _tensors((args, kwargs))
                u.input_bytes = sum(_nbytes(t) for t in ins if t.is_floating_point())
        return hook

    def unit_post(u: _UnitRec):
        def hook(mod, args, kwargs, out):
            outs = _tensors(out)
            if not u.output_bytes:
                u.output_bytes = sum(_nbytes(t) for t in outs)
                fl = [t for t in outs if t.is_floating_point() and t.dim() >= 1]
                u.io_hidden = int(fl[0].shape[-1]) if fl else 0
            for t in outs:
                if t.requires_grad:
                    t.register_hook(_enter_backward(u, ""))
            rec.unit, rec.part = stack_state.pop()
            last_done[0] = u
            if rec.unit is None:
                rec.unit, rec.part = u, ""  # root-level ops after a unit belong to it
        return hook

    def part_pre(u: _UnitRec, pname: str, lin: nn.Module | None):
        def hook(mod, args):
            if lin is None and rec.unit is u and rec.part == "" and not rec.backward:
                rec.part = pname
                stack_state.append((u, "<part>"))
            if lin is not None and not rec.backward:
                p = u.part(rec.part if rec.unit is u else pname)
                if all(l is not lin for _, l in p.linears):
                    p.linears.append((lin_names[id(lin)], lin))
        return hook

    def part_post(u: _UnitRec, pname: str):
        def hook(mod, args, out):
            if stack_state and stack_state[-1] == (u, "<part>") and rec.part == pname:
                stack_state.pop()
                rec.part = ""
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(_enter_backward(u, pname))
        return hook

    def _enter_backward(u: _UnitRec, pname: str):
        def hook(grad):
            rec.unit, rec.part = u, pname
            return None
        return hook

    lin_names: dict[int, str] = {}
    for u in recs.values():
        handles.append(u.module.register_forward_pre_hook(unit_pre(u), with_kwargs=True))
        handles.append(u.module.register_forward_hook(unit_post(u), with_kwargs=True))
        for pname, child in u.module.named_children():
            handles.append(child.register_forward_pre_hook(part_pre(u, pname, None)))
            handles.append(child.register_forward_hook(part_post(u, pname)))
        for lname, sub in u.module.named_modules():
            if is_linear(sub):
                lin_names[id(sub)] = lname
                top = lname.split(".")[0] if lname else ""
                handles.append(sub.register_forward_pre_hook(part_pre(u, top, sub)))

    def pack(t: torch.Tensor):
        u = rec.unit
        if u is None:
            return t
        try:
            sid = t.untyped_storage()._cdata
        except Exception:
            return t
        if rec.builder is not None:
            rec.builder.mark_saved(t)
        if sid in param_storages or sid in saved_seen:
            return t
        saved_seen.add(sid)
        nb = t.untyped_storage().nbytes()
        u.act_bytes += nb
        hid = u.io_hidden or hidden
        core = t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] > 1 and t.dim() >= 3 \
            and t.is_floating_point() and rec.part and t.shape[-1] != hid
        if core:
            u.act_core += nb
        in_tp_part = rec.part in _tp_parts.get(u.name, ())
        if in_tp_part and (t.dim() == 0 or t.shape[-1] != (hid or -1)):
            u.act_bytes_tp += nb
        return t

    _tp_parts: dict[str, set[str]] = {}
    args, kwargs = (example, {}) if isinstance(example, tuple) else ((), example)
    fargs, fkwargs = _to_fake(args, fake_mode), _to_fake(kwargs, fake_mode)
    try:
        with fake_mode:
            # A first forward without grad-saving fixes each part's kind (for the TP
            # split of saved bytes), a second one records everything.
            with torch.no_grad(), rec:
                clone(*fargs, **fkwargs)
            for u in recs.values():
                ch = dict(u.module.named_children())
                kinds = {p: part_kind(r, ch.get(p, u.module if p == "" else None), vocab) for p, r in u.parts.items()}
                _tp_parts[u.name] = {p for p, (_, s) in kinds.items() if s != "replicated"}
                u.parts.clear(); u.ran = False; u.attention = None; u.output_bytes = 0; u.input_bytes = 0
            order.clear()
            rec.unit, rec.part = None, ""
            rec.builder = GraphBuilder({id(p): n for n, p in clone.named_parameters(remove_duplicate=False)})
            with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = clone(*fargs, **fkwargs)
                loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
                rec.backward = True
                loss.backward()
    except AutoparError:
        raise
    except Exception as e:  # a tracing failure: name the module and the op
        where = rec.unit.name if rec.unit is not None else "(model root)"
        part = f".{rec.part}" if rec.part else ""
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AutoparError(f"capture failed in module '{where}{part}' at op aten.{rec.last_op}: "
                           f"{type(e).__name__}: {msg[:200]} -- make the forward run on fake tensors "
                           "(no .item()/.tolist()/data-dependent Python control flow), or rerun with --debug") from e
    finally:
        for h in handles:
            h.remove()
    _costs_from_graph(rec.builder.graph, recs)
    graph = _assemble(model, units, sigs, reps, recs, order, example, t0, name, config, hidden, vocab)
    return graph, rec.builder.graph


def _costs_from_graph(fx_graph, recs: dict[str, _UnitRec]) -> None:
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


def _assemble(model, units, sigs, reps, recs, order, example, t0, name, config, hidden, vocab) -> ModelGraph:
    units_by_path = {p: (m, s) for p, m, s in units}
    # Parameters per unit on the ORIGINAL model, tied weights counted at first owner.
    owner: dict[int, str] = {}
    params: dict[str, tuple[int, int, str | None, int]] = {}
    for path, m, _ in units:
        n = nb = n_tied = 0
        tied = None
        for pn, p in m.named_parameters():
            if id(p) in owner:
                tied = f"{owner[id(p)]}.{pn}"
                n_tied += p.numel()
                continue
            owner[id(p)] = path
            n += p.numel()
            nb += p.numel() * p.element_size()
        params[path] = (n, nb, tied, n_tied)
    root_params = sum(p.numel() for p in model.parameters() if id(p) not in owner)
    # Execution order, expanded: the first member of a stack to run emits the stack.
    full_order: list[tuple[str, str]] = []  # (unit path, rep path)
    emitted_stacks: set[str] = set()
    for path in order:
        m, stack = units_by_path[path]
        if stack is None:
            full_order.append((path, path))
        elif stack not in emitted_stacks:
            emitted_stacks.add(stack)
            for p2, m2, s2 in units:
                if s2 == stack:
                    full_order.append((p2, reps[(stack, sigs[p2])]))
    ex_t = [t for t in _tensors(example) if t.dtype in (torch.int64, torch.int32) and t.dim() == 2]
    batch = int(ex_t[0].shape[0]) if ex_t else 1
    seq = 0
    for r in recs.values():
        if r.attention is not None and r.attention.causal:
            seq = max(seq, r.attention.seq_len)
    if not seq:
        seq = max((r.attention.seq_len for r in recs.values() if r.attention), default=0) or (
            int(ex_t[0].shape[1]) if ex_t else 1)
    if vocab is None:
        embs = [m for p, m, _ in units for m in m.modules() if isinstance(m, nn.Embedding)]
        vocab = max((e.num_embeddings for e in embs), default=None)
    if hidden is None:
        blocks = [r for r in recs.values() if r.attention is not None]
        hidden = blocks[-1].io_hidden if blocks else max((r.io_hidden for r in recs.values()), default=0)
    p0 = next(model.parameters(), None)
    dtype_bytes = p0.element_size() if p0 is not None else 4

    layers: list[Layer] = []
    for i, (path, rep) in enumerate(full_order):
        r = recs[rep]
        mods = dict(r.module.named_children())
        ops, tp_flops, all_flops = [], 0.0, 0.0
        kinds = {}
        linears: list[Linear] = []
        for pname, pr in r.parts.items():
            kind, style = part_kind(pr, mods.get(pname, r.module if pname == "" else None), vocab)
            kinds[pname] = (kind, style)
            pparams = sum(p.numel() for p in mods[pname].parameters()) if pname in mods else 0
            ops.append(Op(name=pname, kind=kind, tp_style=style, fwd_flops=pr.fwd_flops, bwd_flops=pr.bwd_flops,
                          fwd_bytes=pr.fwd_bytes, params=pparams))
            all_flops += pr.fwd_flops + pr.bwd_flops
            if style != "replicated":
                tp_flops += pr.fwd_flops + pr.bwd_flops
            for j, (lname, lin) in enumerate(pr.linears):
                fin, fout = lin_dims(lin)
                if style == "vocab":
                    role = "vocab"
                elif style in ("heads", "col_row"):
                    role = "row" if j == len(pr.linears) - 1 else "column"
                else:
                    role = "replicated"
                linears.append(Linear(lname, fin, fout, getattr(lin, "bias", None) is not None, role))
        attn = r.attention
        if attn is not None:
            cols = [l for l in linears if l.role == "column" and l.in_features == r.io_hidden]
            outs = sorted({l.out_features for l in cols})
            if len(cols) >= 3 and outs and outs[0] % attn.head_dim == 0:
                attn = AttentionDims(attn.heads, min(attn.heads, outs[0] // attn.head_dim), attn.head_dim,
                                     attn.seq_len, attn.kv_len, attn.causal)
        n, nb, tied, n_tied = params[path]
        fwd = sum(o.fwd_flops for o in ops)
        bwd = sum(o.bwd_flops for o in ops)
        layers.append(Layer(
            name=path, kind=layer_kind(path, kinds, i == 0, attn), module_type=type(units_by_path[path][0]).__name__,
            signature=sigs[path], repeat_of=None if rep == path else rep,
            fwd_flops=fwd, bwd_flops=bwd, fwd_bytes=sum(o.fwd_bytes for o in ops), bwd_bytes=r.bwd_bytes,
            params=n, param_bytes=nb, act_bytes=r.act_bytes, act_bytes_tp=r.act_bytes_tp,
            act_bytes_attn_core=r.act_core, input_bytes=r.input_bytes, output_bytes=r.output_bytes,
            tp_flops_frac=(tp_flops / all_flops) if all_flops else 0.0, ops=ops, linears=linears,
            attention=attn, vocab=vocab if any(s == "vocab" for _, s in kinds.values()) else None, tied_to=tied,
            tied_params=n_tied, fwd_kernels=r.fwd_kernels, bwd_kernels=r.bwd_kernels,
            fwd_ops=r.fwd_ops, bwd_ops=r.bwd_ops))
    notes = []
    if root_params:
        notes.append(f"{root_params} parameters outside every layer unit are not counted")
    skipped = [p for p, _, _ in units if p not in {q for q, _ in full_order}]
    if skipped:
        notes.append(f"units never called in the forward: {', '.join(skipped[:5])}")
    return ModelGraph(name=name or type(model).__name__, batch=batch, seq_len=seq, dtype_bytes=dtype_bytes,
                      hidden=int(hidden or 0), vocab=vocab, layers=layers, capture_s=time.perf_counter() - t0,
                      method="fake-tensor forward+backward under a dispatch mode", notes=notes,
                      config=dict(config or {}))
