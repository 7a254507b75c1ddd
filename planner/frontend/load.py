"""From a model to a ModelGraph the planner can trust: resolve, build on meta, capture.

A spec is a zoo preset (``llama3-8b``), a TOML file of hyperparameters, ``hf:<preset>``
(a HuggingFace model built from a config) or ``package.module:function`` returning an
``nn.Module``. Models are built on the meta device, so nothing is allocated.

:func:`graph_of` is the one door from an ``nn.Module`` to a ModelGraph (``autopar`` and
``auto_parallelize`` both use it): the model's runtime adapter
(``codegen/runtime/adapters``) names the layer units the runtime will run, capture records
the step on fake tensors as an FX graph, and the graph is annotated with what the runtime
cannot run for this model (``limits``), where a pipeline stage may begin, and the
tensor-parallel roles of its linears (the model's own TP plan where it has one, checked
against the dataflow analysis of the FX graph).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn as nn

from planner.frontend.positions import max_positions
from planner.frontend.trace import capture_fx
from planner.errors import AutoparError, first_line
from planner.feasibility import model_problem
from planner.plan import ModelFacts
from planner.graph import BLOCK_KINDS, ModelGraph


def example_for_module(model: nn.Module, batch: int, seq_len: int) -> dict[str, Any]:
    """A token batch for a user model: ``input_ids`` (and ``labels`` when ``forward`` takes
    them) over the vocabulary of its first ``nn.Embedding``."""
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise AutoparError("cannot make an example batch for a model without an nn.Embedding; "
                           "call planner.capture(model, example) with your own example inputs")
    params = inspect.signature(model.forward).parameters
    ex: dict[str, Any] = {"input_ids": torch.zeros(batch, seq_len, dtype=torch.long, device="meta")}
    if "labels" in params:
        ex["labels"] = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    if "use_cache" in params:
        ex["use_cache"] = False
    return ex


def graph_of(model: nn.Module, example: dict[str, Any] | tuple, *, name: str, seq_len: int | None = None,
             config: dict[str, Any] | None = None, hidden: int | None = None, vocab: int | None = None,
             module_spec: Any = None, loss_fn=None) -> ModelGraph:
    """Capture ``model`` on ``example`` through its runtime adapter (see the module docstring)."""
    return graph_and_fx_of(model, example, name=name, seq_len=seq_len, config=config, hidden=hidden, vocab=vocab,
                           module_spec=module_spec, loss_fn=loss_fn)[0]


def graph_and_fx_of(model: nn.Module, example: dict[str, Any] | tuple, *, name: str, seq_len: int | None = None,
                    config: dict[str, Any] | None = None, hidden: int | None = None, vocab: int | None = None,
                    module_spec: Any = None, loss_fn=None):
    """:func:`graph_of` and the captured torch.fx graph. A plain module's units are the
    capture's own (execution order); its sequential forward is checked against the
    model's once."""
    from codegen.runtime.adapters import adapter_for, adapter_kind

    kw = dict(name=name, config=config, hidden=hidden, vocab=vocab, loss_fn=loss_fn)
    adapter = None
    try:
        if module_spec is None and adapter_kind(model) == "module" and getattr(model, "autopar_spec", None) is None:
            graph, fx = capture_fx(model, example, **kw)
            adapter = adapter_for(model, order=[l.name for l in graph.layers], seq_len=seq_len)
        else:
            adapter = adapter_for(model, module_spec, seq_len=seq_len)
            if why := model_problem(ModelFacts(limits=adapter.limits())):  # before a capture that may not even run
                raise AutoparError(why)
            graph, fx = capture_fx(model, example, units=adapter.capture_units(), **kw)
        if adapter.kind == "module":
            adapter.check_sequential(example)
        graph.adapter = adapter.kind
        graph.limits = adapter.limits()
        graph.max_seq_len = max_positions(model, fx)
        starts = dict(zip(adapter.units, adapter.stage_starts()))
        for layer in graph.layers:
            layer.stage_start = starts.get(layer.name, True)
        _set_tp_roles(graph, fx, adapter)
    except ValueError as e:
        raise AutoparError(f"{name}: {e}") from e  # the traceback under --debug
    except Exception as e:  # after the capture: reading its graph (one line, not a traceback)
        raise AutoparError(f"{name}: capture failed (reading the captured graph): {first_line(e)}; report this "
                           "model to autopar, or rerun with --debug") from e
    finally:
        if adapter is not None:
            adapter.close()  # the capture leaves nothing on the model or in transformers' registries
    return graph, fx


def _set_tp_roles(graph: ModelGraph, fx, adapter) -> None:
    """Give each block linear its TP role: the dataflow analysis of the FX graph (a block
    linear it does not classify stays replicated), overridden by the model's own TP plan
    where it has one (a disagreement is a warning); heads from the analysis's reshapes; a
    block the analysis cannot shard correctly makes ``tp`` a limit. The linears of a MoE
    layer (router, shared experts) stay replicated: under TP each rank runs the layer on
    its own sequence shard (``planner.feasibility.ep_problem``)."""
    from planner.graph import AttentionDims, op_tp_style, tp_flops_frac
    from planner.frontend.tp_analysis import analyze

    analysis = analyze(fx, graph)
    plan = adapter.tp_layout_from_plan() if hasattr(adapter, "tp_layout_from_plan") else {}
    disagree = []
    for layer in graph.layers:
        rep = layer.repeat_of or layer.name  # the analysis saw the first block of each class
        block = layer.kind in BLOCK_KINDS
        for lin in layer.linears:
            if layer.in_moe(lin.name):
                lin.role = "replicated"
                continue
            fqn = f"{layer.name}.{lin.name}" if lin.name else layer.name
            found = analysis.roles.get(f"{rep}.{lin.name}" if lin.name else rep)
            own = plan.get(fqn)
            if own is not None and found is not None and own != found:
                disagree.append(f"{fqn}: its TP plan says {own}, the dataflow says {found}")
            if block:  # outside blocks (embeddings, head) the capture's vocabulary roles stand
                lin.role = own or found or "replicated"
        for op in layer.ops:  # compute and memory shard what the runtime shards
            op.tp_style = op_tp_style(op, layer.ops, layer.linears)
        layer.tp_flops_frac = tp_flops_frac(layer.ops)
        heads = analysis.heads.get(rep)
        if block and heads is not None:
            a = layer.attention
            seq = a.seq_len if a is not None else graph.seq_len
            layer.attention = AttentionDims(heads[0], heads[1], heads[2], seq, a.kv_len if a else seq,
                                            a.causal if a else True)
    if disagree:
        warnings.warn(f"{graph.name}: {len(disagree)} tensor-parallel roles differ from autopar's analysis "
                      f"(the model's plan is used): {'; '.join(disagree[:3])}", stacklevel=2)
    _limits_from_roles(graph, analysis)


def _limits_from_roles(graph: ModelGraph, analysis) -> None:
    """Limits the TP roles imply (see :data:`planner.plan.FEATURES`)."""
    if analysis.problems and "tp" not in graph.limits:
        layer, why = next(iter(analysis.problems.items()))
        graph.limits["tp"] = f"{layer}: {why}"
    packed = next((f"{l.name}.{lin.name}" for l in graph.layers for lin in l.linears if lin.role == "packed_qkv"), None)
    if packed is not None:
        # the packed projection's TP shard is strided (_StridedShard); FSDP2 would shard its
        # bias on that same dimension and describe the global layout wrongly
        graph.limits.setdefault("fsdp_with_tp", f"{packed} is a packed q/k/v projection whose tensor-parallel "
                                                "shard FSDP cannot shard again")
        if graph.adapter == "module":  # the adapter rewrites head counts only (ModuleAdapter.tp_fixups)
            graph.limits.setdefault("tp", f"{packed} is a packed q/k/v projection, which a plain module splits by "
                                          "its global width (sizes autopar does not rewrite)")
    if "sp" not in graph.limits:
        from codegen.runtime.tp_styles import ungathered_columns  # torch's TP styles: only where roles are read

        # under SP the module around a row linear gathers the sequence shard for the column linears it
        # holds (the runtime's rule, codegen.runtime.tp_styles): a column linear outside every such module
        # would take the shard as the whole sequence
        for layer in (l for l in graph.layers if l.kind in BLOCK_KINDS):
            lost = ungathered_columns({lin.name: lin.role for lin in layer.linears})  # names below the block
            if lost:
                graph.limits["sp"] = (f"{layer.name}.{lost[0]} is a column-parallel linear that no attention / MLP "
                                      "module of its block holds beside a row-parallel linear, so nothing gathers "
                                      "the sequence shard for it")
                break
    if analysis.sp_problems and "sp" not in graph.limits and "tp" not in graph.limits:  # SP runs under TP only
        graph.limits["sp"] = next(iter(analysis.sp_problems.values()))


def graph_of_config(cfg, *, batch: int = 1, seq_len: int | None = None) -> ModelGraph:
    """Capture the zoo model a ``ModelConfig`` describes (built on meta), as :func:`load_graph`
    does for a preset or a model TOML file."""
    from planner import zoo

    return _config_graph_and_fx(zoo.build_model(cfg, device="meta"), cfg, cfg.name, batch, seq_len, zoo_batch=True)[0]


def _config_graph_and_fx(model: nn.Module, cfg, name: str, batch: int, seq_len: int | None, *, zoo_batch: bool):
    """Capture a model that has a ModelConfig: the zoo's example batch, or (transformers) the
    module's own signature."""
    from planner import zoo

    s = seq_len or cfg.seq_len
    ex = zoo.example_batch(cfg, batch, s, device="meta") if zoo_batch else example_for_module(model, batch, s)
    config = {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, bool))}
    return graph_and_fx_of(model, ex, name=name, seq_len=s, config=config, hidden=cfg.hidden, vocab=cfg.vocab)


def load_graph(spec: str, *, batch: int = 1, seq_len: int | None = None) -> ModelGraph:
    """Capture the model named by ``spec`` at ``batch`` sequences of ``seq_len`` tokens
    (default: the preset's training length)."""
    return load_graph_and_fx(spec, batch=batch, seq_len=seq_len)[0]


def load_graph_and_fx(spec: str, *, batch: int = 1, seq_len: int | None = None):
    """:func:`load_graph` and the captured torch.fx graph."""
    from planner import zoo

    if batch < 1:
        raise AutoparError(f"--batch must be a positive integer, got {batch}")
    if seq_len is not None and seq_len < 1:
        raise AutoparError(f"--seq-len must be a positive integer, got {seq_len}")
    ms = zoo.load_model_spec(spec)
    with torch.device("meta"):
        model = ms.factory()
    if not isinstance(model, nn.Module):
        raise AutoparError(f"model spec {spec!r} returned {type(model).__name__}, not an nn.Module; "
                           "make the function return the model")
    cfg = ms.cfg
    if cfg is not None:
        hf = spec.strip().startswith("hf:")
        return _config_graph_and_fx(model, cfg, ms.name, batch, seq_len, zoo_batch=not hf)
    from codegen.runtime.adapters import adapter_kind

    s = seq_len or 128
    ex = example_for_module(model, batch, s)
    if adapter_kind(model) == "module":  # a plain module takes the token ids; the logits stand in for the loss
        return graph_and_fx_of(model, (ex["input_ids"],), name=ms.name, seq_len=s,
                               loss_fn=lambda out: out.float().sum())
    return graph_and_fx_of(model, ex, name=ms.name, seq_len=s)


def with_moe_imbalance(graph: ModelGraph, factor: float) -> ModelGraph:
    """``graph`` with every MoE layer's expected load imbalance (``MoEDims.imbalance``: the
    busiest expert-parallel rank's tokens over the mean) set to ``factor``, in place; 1.0
    (balanced) is the default. One-line errors for a factor below 1 or a model without
    routed experts."""
    if factor == 1.0:
        return graph
    if not factor >= 1.0:
        raise AutoparError(f"--moe-imbalance {factor}: must be >= 1.0 (the busiest rank's tokens over the mean)")
    moe = [l.moe for l in graph.layers if l.moe is not None]
    if not moe:
        raise AutoparError(f"--moe-imbalance: {graph.name} has no routed experts; drop the option")
    for m in moe:
        m.imbalance = float(factor)
    return graph
