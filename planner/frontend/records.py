"""What capture records per layer unit, and the ModelGraph assembled from it (planner/frontend/trace.py
runs the model; this module only turns its records into Layers).

- :class:`PartRecord` / :class:`UnitRecord`: FLOPs, bytes, op counts, saved bytes and linears of
  each part (attention, MLP, norm, ...) of a unit, as the fake run saw them.
- :func:`assemble`: one Layer per unit in execution order, repeated blocks copying their
  representative's record, tied weights counted at their first owner.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from codegen.runtime.torch_compat import tree_flatten

from planner.errors import AutoparError, first_line
from planner.graph import AttentionDims, Layer, Linear, ModelGraph, MoEDims, Op, tp_flops_frac
from planner.frontend.layer_kinds import layer_kind, lin_dims, part_kind


@dataclass
class PartRecord:
    """One part of a unit (a child module, or "" for the unit's own ops): FLOPs and bytes (of the
    captured batch), the ATen op kinds it ran, its linears."""
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    act: float = 0.0  # saved-for-backward bytes of its ops (each storage once)
    ops: set = field(default_factory=set)
    linears: list = field(default_factory=list)  # (name, module) in execution order


@dataclass
class UnitRecord:
    """One layer unit of the fake run: its parts, backward bytes, kernel and op counts, saved
    activation bytes (all, TP-split, attention core), input / output bytes, hidden width at
    its boundary and the attention it ran (bytes for the captured batch)."""
    name: str
    module: nn.Module
    parts: "OrderedDict[str, PartRecord]" = field(default_factory=OrderedDict)
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
    matmuls: list = field(default_factory=list)  # Matmul per MATMUL_OPS call of the forward

    def part(self, name: str) -> PartRecord:
        return self.parts.setdefault(name, PartRecord())


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure (tuples, lists, dicts, model outputs)."""
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


@dataclass
class UnitRun:
    """What the fake run produced: the units (path, module, stack) of the ORIGINAL model, their
    signatures, each stack's first member per signature, the records of the units that ran and
    the order in which they first ran."""
    units: list[tuple[str, nn.Module, str | None]]
    sigs: dict[str, str]
    reps: dict[tuple[str, str], str]
    recs: dict[str, UnitRecord]
    order: list[str]


@dataclass(frozen=True)
class _UnitParams:
    """A unit's parameters on the original model; tied weights counted at their first owner."""
    n: int
    nbytes: int
    tied_to: str | None   # "<owner unit>.<param>" of a shared weight
    n_tied: int


def _unit_params(units) -> tuple[dict[str, _UnitParams], set[int]]:
    """Each unit's parameters (a tied weight counted at its first owner), and the ids of the
    parameters some unit owns."""
    owner: dict[int, str] = {}
    params: dict[str, _UnitParams] = {}
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
        params[path] = _UnitParams(n, nb, tied, n_tied)
    return params, set(owner)


def _full_order(run: UnitRun) -> list[tuple[str, str]]:
    """(unit path, the path of the unit whose record it copies) in execution order: the first
    member of a stack to run emits the whole stack."""
    units_by_path = {p: s for p, _, s in run.units}
    out: list[tuple[str, str]] = []
    emitted: set[str] = set()
    for path in run.order:
        stack = units_by_path[path]
        if stack is None:
            out.append((path, path))
        elif stack not in emitted:
            emitted.add(stack)
            out.extend((p2, run.reps[(stack, run.sigs[p2])]) for p2, _, s2 in run.units if s2 == stack)
    return out


def _batch_and_seq(example, recs: dict[str, UnitRecord]) -> tuple[int, int]:
    """Sequences and tokens per sequence of the example: the first 2-D integer input's batch;
    the longest causal attention's length (any attention's, else that input's width)."""
    ex_t = [t for t in tensors(example) if t.dtype in (torch.int64, torch.int32) and t.dim() == 2]
    batch = int(ex_t[0].shape[0]) if ex_t else 1
    seq = max((r.attention.seq_len for r in recs.values() if r.attention is not None and r.attention.causal),
              default=0)
    if not seq:
        seq = max((r.attention.seq_len for r in recs.values() if r.attention), default=0) or (
            int(ex_t[0].shape[1]) if ex_t else 1)
    return batch, seq


def _ops_and_linears(r: UnitRecord, vocab: int | None):
    """A unit record's parts as Ops, its linears with their TP roles, each part's (kind, style)
    and the fraction of its FLOPs that TP splits."""
    mods = dict(r.module.named_children())
    ops = []
    kinds = {}
    linears: list[Linear] = []
    for pname, pr in r.parts.items():
        kind, style = part_kind(pr, mods.get(pname, r.module if pname == "" else None), vocab)
        kinds[pname] = (kind, style)
        pparams = sum(p.numel() for p in mods[pname].parameters()) if pname in mods else 0
        ops.append(Op(name=pname, kind=kind, tp_style=style, fwd_flops=pr.fwd_flops, bwd_flops=pr.bwd_flops,
                      fwd_bytes=pr.fwd_bytes, params=pparams))
        for j, (lname, lin) in enumerate(pr.linears):
            fin, fout = lin_dims(lin)
            if style == "vocab":
                role = "vocab"
            elif style in ("heads", "col_row"):
                role = "row" if j == len(pr.linears) - 1 else "column"
            else:
                role = "replicated"
            linears.append(Linear(lname, fin, fout, getattr(lin, "bias", None) is not None, role))
    return ops, linears, kinds, tp_flops_frac(ops)


def _attention_dims(r: UnitRecord, linears: list[Linear]) -> AttentionDims | None:
    """The recorded attention with its kv heads read off the k/v projections (grouped-query
    attention: the narrower column linears fed by the hidden state)."""
    attn = r.attention
    if attn is None:
        return None
    cols = [l for l in linears if l.role == "column" and l.in_features == r.io_hidden]
    outs = sorted({l.out_features for l in cols})
    # (MLA's latent down-projections are column linears too: a width not dividing the heads is not k/v)
    if len(cols) >= 3 and outs and outs[0] % attn.head_dim == 0 and attn.heads % max(1, outs[0] // attn.head_dim) == 0:
        attn = AttentionDims(attn.heads, min(attn.heads, outs[0] // attn.head_dim), attn.head_dim,
                             attn.seq_len, attn.kv_len, attn.causal)
    return attn


def moe_dims(unit: nn.Module) -> MoEDims | None:
    """The routed experts inside ``unit``: a module with the routed-experts protocol
    (``moe_shape()`` -> (experts, expert FFN width): the zoo's ``RoutedExperts``, a
    transformers model's experts as ``codegen/runtime/adapters/hf_experts.py`` equips them),
    its top-k from the nearest enclosing module (or one of its children) with an integer
    ``top_k``, and shared experts from that module's ``shared_experts``."""
    for name, m in unit.named_modules():
        shape = getattr(m, "moe_shape", None)
        if not callable(shape):
            continue
        experts, ffn = shape()
        part = name.rsplit(".", 1)[0] if "." in name else ""
        holder = unit.get_submodule(part) if part else unit
        top_k = next((c.top_k for c in holder.modules() if isinstance(getattr(c, "top_k", None), int)), None)
        if top_k is None:
            raise AutoparError(f"capture: the experts at {name!r} have no router with an integer top_k")
        return MoEDims(experts, top_k, ffn, shared_experts(holder, m, experts), part)
    return None


def shared_experts(holder: nn.Module, routed: nn.Module, experts: int) -> int:
    """How many always-on experts ``holder`` runs beside its ``routed`` experts: its
    ``shared_experts`` count (the zoo), or, where ``shared_experts`` is the module itself
    (transformers' DeepSeek-V3: one MLP of n_shared_experts x the expert width), its
    parameters in routed experts' worth (the nearest whole number)."""
    shared = getattr(holder, "shared_experts", None)
    if isinstance(shared, nn.Module):
        per_expert = sum(p.numel() for p in routed.parameters()) / max(experts, 1)
        return round(sum(p.numel() for p in shared.parameters()) / per_expert) if per_expert else 0
    return int(shared or 0)


def assemble(model: nn.Module, run: UnitRun, example, t0: float, name: str | None, config: dict | None,
              hidden: int | None, vocab: int | None) -> ModelGraph:
    """The ModelGraph: one Layer per unit in execution order (repeated blocks copy their
    representative's record), with the model-wide batch, sequence, hidden size and vocabulary."""
    units_by_path = {p: m for p, m, _ in run.units}
    params, owned = _unit_params(run.units)
    root_params = sum(p.numel() for p in model.parameters() if id(p) not in owned)
    full_order = _full_order(run)
    batch, seq = _batch_and_seq(example, run.recs)
    if vocab is None:
        embs = [m for p, m, _ in run.units for m in m.modules() if isinstance(m, nn.Embedding)]
        vocab = max((e.num_embeddings for e in embs), default=None)
    if hidden is None:
        blocks = [r for r in run.recs.values() if r.attention is not None]
        hidden = blocks[-1].io_hidden if blocks else max((r.io_hidden for r in run.recs.values()), default=0)
    p0 = next(model.parameters(), None)
    dtype_bytes = p0.element_size() if p0 is not None else 4

    layers: list[Layer] = []
    for i, (path, rep) in enumerate(full_order):
        r = run.recs[rep]
        try:
            ops, linears, kinds, tp_frac = _ops_and_linears(r, vocab)
            attn, moe = _attention_dims(r, linears), moe_dims(r.module)
            if moe is not None and moe.part in r.parts:
                moe.act_bytes = r.parts[moe.part].act
        except AutoparError:
            raise
        except Exception as e:  # one line naming the unit, not a traceback
            raise AutoparError(f"capture failed in module '{path}' (reading its captured ops): {first_line(e)}; "
                               "report this model to autopar, or rerun with --debug") from e
        up = params[path]
        layers.append(Layer(
            name=path, kind=layer_kind(path, kinds, i == 0, attn), module_type=type(units_by_path[path]).__name__,
            signature=run.sigs[path], repeat_of=None if rep == path else rep,
            fwd_flops=sum(o.fwd_flops for o in ops), bwd_flops=sum(o.bwd_flops for o in ops),
            fwd_bytes=sum(o.fwd_bytes for o in ops), bwd_bytes=r.bwd_bytes,
            params=up.n, param_bytes=up.nbytes, act_bytes=r.act_bytes, act_bytes_tp=r.act_bytes_tp,
            act_bytes_attn_core=r.act_core, input_bytes=r.input_bytes, output_bytes=r.output_bytes,
            tp_flops_frac=tp_frac, ops=ops, linears=linears,
            attention=attn, vocab=vocab if any(s == "vocab" for _, s in kinds.values()) else None,
            tied_to=up.tied_to, tied_params=up.n_tied, fwd_kernels=r.fwd_kernels, bwd_kernels=r.bwd_kernels,
            fwd_ops=r.fwd_ops, bwd_ops=r.bwd_ops, moe=moe, matmuls=list(r.matmuls)))
    notes = []
    if root_params:
        notes.append(f"{root_params} parameters outside every layer unit are not counted")
    skipped = [p for p, _, _ in run.units if p not in {q for q, _ in full_order}]
    if skipped:
        notes.append(f"units never called in the forward: {', '.join(skipped[:5])}")
    return ModelGraph(name=name or type(model).__name__, batch=batch, seq_len=seq, dtype_bytes=dtype_bytes,
                      hidden=int(hidden or 0), vocab=vocab, layers=layers, capture_s=time.perf_counter() - t0,
                      method="fake-tensor forward+backward under a dispatch mode", notes=notes,
                      config=dict(config or {}))
