"""The captured training step as a torch.fx graph: forward and backward ATen ops on fake tensors.

:class:`GraphBuilder` turns the op stream that capture's dispatch mode sees into an
``fx.Graph``: every ATen op is a ``call_function`` node whose arguments are the nodes
that produced its tensor inputs (tensor identity is tracked by ``id`` while a tensor lives:
a weak reference forgets it when autograd frees it, so the builder never changes what
autograd does, e.g. whether it may steal a gradient buffer; an in-place op rebinds its
tensor to the new node). Tensors the
step did not produce are placeholders: parameters named by their fqn
(``param:model.layers.0.mlp.up_proj.weight``), other inputs ``input_<n>``.

Node metadata (``node.meta``): ``unit`` (the layer unit that ran it, or None), ``part``
(its child module: ``self_attn``, ``mlp``, ...), ``phase`` (``fwd`` | ``bwd``), ``flops``,
``bytes`` (memory traffic: tensor inputs + outputs, 0 for views), ``shape`` / ``dtype``
of the (first) output, ``saved`` once autograd saves the output for backward, and
``hidden_input_of``: the block parts (``unit.part``) it was handed to as their hidden-state
input (``codegen.runtime.tensor_parallel.region_input_key``: what the runtime's TP region style takes).

Capture's per-layer costs are sums over these nodes (:func:`unit_costs`); ``autopar
graph --fx`` prints one unit's nodes (:func:`format_unit`); the tensor-parallel analysis of
a model autopar did not write reads the forward nodes (``planner/frontend/tp_analysis.py``).
Only the first member of each class of repeated blocks is run, so the graph holds one
block per class.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from codegen.runtime.torch_compat import tree_map


@dataclass
class OpCost:
    """FLOPs, bytes, memory-bound kernels (ops that move bytes and do no FLOPs) and tensor ops
    (every ATen call that makes a tensor, views included: what eager mode dispatches) of one
    (unit, part, phase)."""
    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0
    ops: int = 0


class GraphBuilder:
    """Builds the fx.Graph of a captured step (see the module docstring)."""

    def __init__(self, param_names: dict[int, str]):
        self.graph = fx.Graph()
        self.param_names = param_names      # id(fake parameter) -> fqn
        self.env: dict[int, fx.Node] = {}
        self._inputs = 0

    def _bind(self, t: torch.Tensor, node: fx.Node) -> None:
        """``t`` is now ``node``'s value, until ``t`` is freed (its id may then be reused)."""
        self.env[id(t)] = node
        weakref.finalize(t, self._forget, id(t), node)

    def _forget(self, key: int, node: fx.Node) -> None:
        if self.env.get(key) is node:
            del self.env[key]

    def _node_of(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        node = self.env.get(id(x))
        if node is None:
            name = self.param_names.get(id(x))
            if name is not None:
                node = self.graph.placeholder(f"param:{name}")
                node.meta["param"] = name
            else:
                node = self.graph.placeholder(f"input_{self._inputs}")
                self._inputs += 1
            node.meta.update(shape=tuple(x.shape), dtype=str(x.dtype).replace("torch.", ""))
            self._bind(x, node)
        return node

    def record(self, func, args: tuple, kwargs: dict, out: Any, meta: dict[str, Any]) -> fx.Node:
        """Append ``func(*args, **kwargs) -> out`` with ``meta``; returns its node. Ops that
        return no tensor (device queries) are nodes too, without ``shape`` and with 0 bytes: they
        move no memory."""
        outs = out if isinstance(out, (tuple, list)) else (out,)
        first = next((t for t in outs if isinstance(t, torch.Tensor)), None)
        node = self.graph.call_function(func, tree_map(self._node_of, args), tree_map(self._node_of, kwargs))
        node.meta.update(meta)
        if first is not None:
            node.meta.update(shape=tuple(first.shape), dtype=str(first.dtype).replace("torch.", ""))
        if isinstance(out, torch.Tensor):
            self._bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, t in enumerate(out):
                if isinstance(t, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta.update(meta, flops=0.0, bytes=0.0, shape=tuple(t.shape),
                                     dtype=str(t.dtype).replace("torch.", ""))
                    self._bind(t, item)
        return node

    def mark_input(self, args: tuple, kwargs: dict, key: int | str | None, label: str) -> None:
        """The value at ``key`` of a module call (an index of ``args``, a name of ``kwargs``) was
        handed to ``label`` (``unit.part``) as its hidden-state input: its node's meta
        ``hidden_input_of`` gets ``label``. Nothing where ``key`` is None, or where the same tensor
        is handed in again as another argument (a residual beside it, which the runtime's region
        style leaves as it comes: it replaces only the argument at ``key``)."""
        if key is None:
            return
        t = args[key] if isinstance(key, int) else kwargs[key]
        others = [a for i, a in enumerate(args) if i != key] + [v for k, v in kwargs.items() if k != key]
        if not any(o is t for o in others):
            self._node_of(t).meta.setdefault("hidden_input_of", set()).add(label)

    def mark_saved(self, t: torch.Tensor) -> None:
        node = self.env.get(id(t))
        if node is not None:
            node.meta["saved"] = True


def unit_costs(graph: fx.Graph) -> dict[tuple[str, str, str], OpCost]:
    """(unit, part, phase) -> summed FLOPs and bytes of its nodes."""
    out: dict[tuple[str, str, str], OpCost] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.meta.get("unit") is None:
            continue
        c = out.setdefault((n.meta["unit"], n.meta.get("part", ""), n.meta["phase"]), OpCost())
        c.flops += n.meta.get("flops", 0.0)
        c.bytes += n.meta.get("bytes", 0.0)
        c.kernels += int(n.meta.get("bytes", 0.0) > 0 and not n.meta.get("flops", 0.0))
        c.ops += int(n.target is not operator.getitem and "shape" in n.meta)
    return out


def unit_nodes(graph: fx.Graph, unit: str, phase: str | None = None) -> list[fx.Node]:
    """The call nodes ``unit`` ran (in execution order), optionally of one phase."""
    return [n for n in graph.nodes if n.op == "call_function" and n.meta.get("unit") == unit
            and (phase is None or n.meta.get("phase") == phase)]


def _fmt_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name if a.op != "placeholder" else a.target
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    return repr(a)


def format_unit(graph: fx.Graph, unit: str) -> list[str]:
    """One line per tensor op of ``unit``: phase, part, name = op(args) -> shape, FLOPs, saved."""
    lines = []
    for n in unit_nodes(graph, unit):
        if n.target is operator.getitem or "shape" not in n.meta:  # tuple items, device queries
            continue
        target = getattr(n.target, "__name__", str(n.target))
        args = ", ".join(_fmt_arg(a) for a in n.args)
        flops = n.meta.get("flops", 0.0)
        extra = (f"  {flops:.3g} FLOP" if flops else "") + ("  saved" if n.meta.get("saved") else "")
        lines.append(f"{n.meta['phase']}  {n.meta.get('part') or '-':<12} {n.name} = {target}({args})"
                     f" -> {list(n.meta.get('shape', ()))}{extra}")
    return lines
