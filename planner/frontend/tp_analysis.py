"""Tensor-parallel roles of a model's block linears, read by dataflow from the captured FX graph.

:func:`analyze` walks the forward ATen nodes of each block unit in the graph of
:func:`planner.frontend.trace.capture_fx` (one block per class of repeated blocks) and never looks
at module or parameter names except to name what it found. Rules:

- **Linear**: an ``mm`` / ``addmm`` / ``bmm`` / ``linear`` / ``matmul`` node one of whose
  operands comes from a parameter placeholder through only t / transpose / view / permute /
  expand (and casts). nn.Linear is ``t`` + ``mm``/``addmm`` between views; transformers'
  Conv1D is ``addmm(bias, x, weight)`` with the weight stored ``[in, out]``. The module fqn
  is the weight's fqn without ``.weight``.
- **Attention output**: an SDPA-family op (and its getitems), or the matmul that multiplies
  a softmax (through dropout, casts, views) by V.
- **row / column**: a linear's data input is traced backwards, inside the unit, through
  shape ops (view, transpose, split getitems, cat, ...) and pointwise ops (tagged
  ``pointwise``: add, mul, activations, ...). If it reaches an attention output or the
  output of a column (or packed) linear, the input carries the sharded feature dimension:
  ``row``. Otherwise ``column``. A row linear's output is whole (all-reduced), so tracing
  stops there (a residual add of it does not make the next linear row), as it does at
  reductions (norm statistics), other matmuls and anything outside the unit.
- **packed_qkv**: a column linear whose output, before the reshape into heads, is split
  on its last dim into three equal parts (GPT-2's ``c_attn``). Other feature splits
  before the head reshape (GQA-packed q|k|v of unequal parts such as phi3's ``qkv_proj``,
  a gate|up pair such as phi3's ``gate_up_proj``) are *problems*: contiguous column
  sharding would hand each rank a slice that mixes the parts. A per-head interleaved
  projection (GPT-NeoX: view to ``[.., heads, 3*hd]`` first, then chunk) is a plain column.
- **Reductions**: a reduction over the last dim of a column linear's output before the
  head reshape (OLMo2's q_norm/k_norm over the whole projection, a softmax router) is a
  problem: each rank would reduce over its shard only.
- **A residual inside the region module** (sequence parallelism only): under SP the module
  around a row linear that also holds its column linears (``codegen.runtime.tp_styles.region_parents``)
  takes its input gathered whole, while the row linear's output leaves as the rank's sequence
  shard; a pointwise op inside that module joining the two (``x + self.down(...)`` inside an MLP
  module) cannot run. Found by following the row linear's output forward through shape and
  pointwise ops of its module's part (``node.meta["part"]``) and each other operand of such an op
  backwards through any op of the part: one that comes from the value the capture saw handed to
  the part as its hidden-state input (``hidden_input_of``, what the runtime gathers; a residual
  handed in as another argument, as BLOOM's, stays the shard and joins it) is such a join,
  recorded in ``sp_problems``. Only a block's direct children are checked (the capture marks their
  inputs). One tensor handed in both ways (BLOOM with ``apply_residual_connection_post_layernorm``)
  is not marked: inside the module the two are one node, and the runtime gathers only the first.
- **Heads**: (query heads, kv heads, head dim) from the reshapes into heads, the view
  ``[.., h*d] -> [.., h, d']`` found tracing q and k back from the attention op; head
  dim is the last dim of q at the attention op.

``planner/frontend/load.py`` gives every captured block linear its role from here (repeated
blocks from their class's representative) unless the model's own TP plan names it, and a
problem makes tensor parallelism a limit of the model; ``planner/frontend/tp_layout.py`` turns the
roles into the plan's ``{fqn: role}`` layout.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from codegen.runtime.torch_compat import (CAST_OPS, LOG_SOFTMAX_OPS, NORM_OPS, RESHAPE_OPS, SDPA_OPS, SOFTMAX_OPS,
                                          op_base_name)
from codegen.runtime.tp_styles import region_parents
from planner.frontend.fx_graph import unit_nodes
from planner.graph import BLOCK_KINDS, ModelGraph
from planner.frontend.layer_kinds import ATTN_OPS

_MATMULS = {"mm", "addmm", "bmm", "linear", "matmul"}
_WEIGHT_PATH = RESHAPE_OPS | CAST_OPS | {"t", "transpose", "permute", "expand", "alias", "detach", "contiguous",
                                         "clone"}
_SHAPE_OPS = RESHAPE_OPS | CAST_OPS | {
    "transpose", "t", "permute", "expand", "clone", "contiguous", "unsqueeze", "squeeze", "slice", "split",
    "split_with_sizes", "chunk", "unbind", "getitem", "alias", "detach", "cat", "select", "narrow", "native_dropout",
    "dropout", "type_as"}
_SDPA = ATTN_OPS | SDPA_OPS
_REDUCTIONS = SOFTMAX_OPS | LOG_SOFTMAX_OPS | {"mean", "sum", "var", "var_mean", "std", "std_mean", "amax", "amin",
                                               "max", "min", "norm", "linalg_vector_norm", "logsumexp", "prod"}


@dataclass
class TPAnalysis:
    """What :func:`analyze` found in the representative block of each class."""
    roles: dict[str, str] = field(default_factory=dict)     # linear module fqn -> column | row | packed_qkv
    problems: dict[str, str] = field(default_factory=dict)  # layer name -> why TP cannot shard it correctly
    heads: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # layer -> (q heads, kv heads, head dim)
    sp_problems: dict[str, str] = field(default_factory=dict)  # layer name -> why SP cannot run it


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _op(n: fx.Node) -> str:
    if n.target is operator.getitem:
        return "getitem"
    return op_base_name(n.target) or getattr(n.target, "__name__", str(n.target))


def _shape(n) -> tuple:
    return tuple(n.meta.get("shape", ())) if isinstance(n, fx.Node) else ()


def _passes(n: fx.Node) -> bool:
    """Shape op or pointwise op: carries its input's feature layout to its output."""
    return _op(n) in _SHAPE_OPS or torch.Tag.pointwise in getattr(n.target, "tags", ())


def _param_of(n) -> str | None:
    """fqn of the parameter ``n`` comes from through layout-only ops, else None."""
    while isinstance(n, fx.Node):
        if n.op == "placeholder":
            return n.meta.get("param")
        if n.op != "call_function" or _op(n) not in _WEIGHT_PATH or not n.args:
            return None
        n = n.args[0]
    return None


def _linear_operands(n: fx.Node) -> tuple[str, fx.Node] | None:
    """(weight fqn, data input) when ``n`` is a linear, else None."""
    ops = list(n.args[1:3]) if _op(n) == "addmm" else list(n.args[:2])
    found = [(_param_of(a), a) for a in ops]
    weights = [(p, a) for p, a in found if p is not None]
    data = [a for p, a in found if p is None and isinstance(a, fx.Node)]
    if len(weights) != 1 or len(data) != 1:
        return None
    return weights[0][0], data[0]


def _find(starts, unit: set[fx.Node], step, hit) -> fx.Node | None:
    """First node satisfying ``hit``, breadth-first from ``starts`` through shape/pointwise ops
    inside ``unit``; ``step`` gives the next nodes (inputs: upstream, users: downstream)."""
    frontier, seen = list(starts), set()
    while frontier:
        m = frontier.pop(0)
        if m in seen or m not in unit:
            continue
        seen.add(m)
        if hit(m):
            return m
        if _passes(m):
            frontier.extend(step(m))
    return None


def _inputs(n: fx.Node) -> list[fx.Node]:
    return n.all_input_nodes


def _users(n: fx.Node) -> list[fx.Node]:
    return list(n.users)


def _attention_outputs(nodes: list[fx.Node], unit: set[fx.Node]) -> tuple[set[fx.Node], list[tuple]]:
    """Nodes holding attention outputs, and (q, k) per attention op (SDPA or softmax @ V)."""
    outs: set[fx.Node] = set()
    qk: list[tuple] = []
    is_matmul = lambda m: _op(m) in _MATMULS  # noqa: E731
    for n in nodes:
        if _op(n) in _SDPA and len(n.args) >= 3:
            outs.add(n)
            outs.update(u for u in n.users if _op(u) == "getitem")
            qk.append((n.args[0], n.args[1]))
        elif _op(n) in SOFTMAX_OPS:
            scores = _find(_inputs(n), unit, _inputs, is_matmul)   # q @ k^T
            pv = _find(_users(n), unit, _users, is_matmul)          # probabilities @ v
            if pv is not None:
                outs.add(pv)
            if scores is not None and len(scores.args) >= 2:
                qk.append((scores.args[0], scores.args[1]))
    return outs, qk


def _is_head_view(n: fx.Node) -> bool:
    """``[.., h*d] -> [.., h, d]``: the reshape into heads."""
    if _op(n) not in RESHAPE_OPS or not isinstance(n.args[0], fx.Node):
        return False
    i, o = _shape(n.args[0]), _shape(n)
    return (len(i) >= 1 and len(o) > len(i) and o[-2] * o[-1] == i[-1]
            and math.prod(o[:-2]) == math.prod(i[:-1]))


def _reduces_last(n: fx.Node, nd: int) -> bool:
    """Does ``n`` reduce over the last of its input's ``nd`` dims (norms, mean, softmax, ...)?"""
    if _op(n) in NORM_OPS:
        return True
    if _op(n) not in _REDUCTIONS or torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return False
    d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    dims = [d] if isinstance(d, int) else list(d) if isinstance(d, (list, tuple)) else []
    return not dims or any(isinstance(x, int) and x % nd == nd - 1 for x in dims)


def _feature_use(lin: fx.Node, unit: set[fx.Node]) -> tuple[list[int] | None, bool]:
    """Follow ``lin``'s output, while its last dim is the output features and before the
    reshape into heads: (sizes of a split on that dim or None, reduced over that dim?)."""
    feats = _shape(lin)[-1]
    frontier, seen, reduced = [lin], set(), False
    while frontier:
        n = frontier.pop(0)
        if n in seen:
            continue
        seen.add(n)
        nd = len(_shape(n))
        slices = []
        for u in n.users:
            if u not in unit:
                continue
            op = _op(u)
            if op in ("split", "split_with_sizes", "chunk", "unbind") and _last(u, nd):
                return [_shape(g)[-1] for g in u.users if _op(g) == "getitem"], reduced
            if op in ("slice", "narrow") and _last(u, nd):
                slices.append(_shape(u)[-1])
            elif _reduces_last(u, nd):
                reduced = True
            elif _passes(u) and not _is_head_view(u) and _shape(u)[-1:] == (feats,):
                frontier.append(u)
        if len(slices) > 1:
            return slices, reduced
    return None, reduced


def _last(u: fx.Node, nd: int) -> bool:
    """Does split/chunk/slice node ``u`` cut the last of ``nd`` dims?"""
    i = 1 if _op(u) in ("slice", "narrow", "unbind") else 2
    d = u.args[i] if len(u.args) > i else u.kwargs.get("dim", 0)
    return isinstance(d, int) and nd > 0 and d % nd == nd - 1


def _from_input(n, label: str, part: str, unit: set[fx.Node]) -> bool:
    """Whether ``n`` is, or comes backwards through any op of ``part`` from, the value handed to
    the part (``label``: ``unit.part``) as its hidden-state input (``fx_graph`` meta
    ``hidden_input_of``): under SP that input is gathered whole, and so is all that the module
    derives from it (through a norm, say) but its row linear's output."""
    frontier, seen = [n], set()
    while frontier:
        m = frontier.pop()
        if not isinstance(m, fx.Node) or m in seen:
            continue
        seen.add(m)
        if label in m.meta.get("hidden_input_of", ()):
            return True
        if m.op == "call_function" and m in unit and m.meta.get("part", "") == part:
            frontier.extend(m.all_input_nodes)
    return False


def _module_residual(rows: dict[str, fx.Node], regions: list[str], layer_name: str,
                     unit: set[fx.Node]) -> str | None:
    """Why SP cannot run the block: a row linear's output joined inside its region module with
    that module's hidden-state input or what it derives from it (module docstring), or None."""
    for fqn, row in rows.items():
        part = fqn[len(layer_name) + 1:].rpartition(".")[0]
        if part not in regions or "." in part:  # the capture marks the hidden input of a block's parts only
            continue
        frontier, mine = list(row.users), {row}
        while frontier:
            m = frontier.pop()
            if m in mine or m not in unit or m.meta.get("part", "") != part or not _passes(m):
                continue
            mine.add(m)
            others = [a for a in m.all_input_nodes if a not in mine]
            if _op(m) not in _SHAPE_OPS and any(_from_input(a, _join(layer_name, part), part, unit) for a in others):
                return (f"{layer_name}.{part} joins its row-parallel linear {fqn.rpartition('.')[2]}'s output with "
                        f"its own input ({_op(m)}: a residual inside the module), which sequence parallelism "
                        "gathers whole while the output stays the sequence shard")
            frontier.extend(m.users)
    return None


def analyze(fx_graph: fx.Graph, model_graph: ModelGraph) -> TPAnalysis:
    """Roles of the linears, problems and head counts of every block class (module docstring)."""
    res = TPAnalysis()
    for layer in model_graph.layers:
        if layer.kind not in BLOCK_KINDS or layer.repeat_of is not None:
            continue
        nodes = unit_nodes(fx_graph, layer.name, "fwd")
        unit = set(nodes)
        attn_out, qk = _attention_outputs(nodes, unit)
        sharded = set(attn_out)                 # nodes whose last dim is split under TP
        linear_nodes: dict[str, fx.Node] = {}   # linear fqn -> its matmul node
        issues: list[str] = []
        for n in nodes:
            if _op(n) not in _MATMULS or n in attn_out:
                continue
            found = _linear_operands(n)
            if found is None:
                continue
            weight, data = found
            fqn = weight.rsplit(".", 1)[0]
            if fqn in res.roles or layer.in_moe(fqn[len(layer.name) + 1:]):  # a MoE layer stays whole
                continue
            linear_nodes[fqn] = n
            if _find([data], unit, _inputs, lambda m: m in sharded) is not None:
                res.roles[fqn] = "row"
                continue
            sizes, reduced = _feature_use(n, unit)
            role = "column"
            if sizes is not None and len(sizes) == 3 and len(set(sizes)) == 1:
                role = "packed_qkv"
            elif sizes is not None:
                issues.append(f"{fqn} output is split on its feature dim into {sizes} before the head reshape "
                              "(fused projections of unequal or paired parts): contiguous column sharding "
                              "would mix the parts")
            if reduced:
                issues.append(f"{fqn} output is reduced over its whole feature dim before the head reshape "
                              "(a norm over the projection): each rank would reduce over its shard only")
            res.roles[fqn] = role
            sharded.add(n)
        if issues:
            res.problems[layer.name] = "; ".join(issues)
        rows = {fqn: n for fqn, n in linear_nodes.items() if res.roles.get(fqn) == "row"}
        local = {fqn[len(layer.name) + 1:]: role for fqn, role in res.roles.items() if fqn.startswith(f"{layer.name}.")}
        why = _module_residual(rows, region_parents(local), layer.name, unit)
        if why is not None:
            res.sp_problems[layer.name] = why
        if qk:
            q, k = qk[0]
            qv, kv = (_find([x], unit, _inputs, _is_head_view) for x in (q, k))
            if qv is not None and kv is not None:
                res.heads[layer.name] = (int(_shape(qv)[-2]), int(_shape(kv)[-2]), int(_shape(q)[-1]))
    return res
