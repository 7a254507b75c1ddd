"""How long a sequence a model's learned positions cover (``ModelFacts.max_seq_len``).

A learned position table is an embedding whose lookup indices the forward computes itself:
in the captured step (``planner/frontend/fx_graph.py``) an ``aten.embedding`` on a
parameter whose indices descend from no input of the step (``arange``, or transformers
OPT's ``cumsum`` of a mask of ones), unlike the token embedding, which looks up the token
ids. A sequence longer than such a table indexes past its last row (``IndexError: index out
of range in self`` in every rank); ``planner.feasibility.length_problem`` refuses it at
plan time. RoPE and ALiBi models have no such table: no limit.

The limit is the model's own metadata where it states one (a transformers config's
``max_position_embeddings`` or ``n_positions``: exact also where the table holds a few
extra rows, OPT's offset of 2), else the rows of the largest such table (the zoo's GPT, a
user's nanoGPT ``wpe``).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

CONFIG_KEYS = ("max_position_embeddings", "n_positions")  # transformers' names for the learned positions


def position_tables(fx_graph: fx.Graph) -> dict[str, int]:
    """``{parameter fqn: rows}`` of the embeddings looked up with indices the forward computed
    itself (see the module docstring)."""
    out: dict[str, int] = {}
    for n in fx_graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.embedding.default or n.meta.get("phase") != "fwd":
            continue
        weight, indices = n.args[0], n.args[1]
        if not (isinstance(weight, fx.Node) and "param" in weight.meta and isinstance(indices, fx.Node)):
            continue
        if not _reads_an_input(indices):
            out[weight.meta["param"]] = int(weight.meta["shape"][0])
    return out


def _reads_an_input(node: fx.Node) -> bool:
    """Whether ``node`` descends from a placeholder of the step that is not a parameter."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and "param" not in n.meta:
            return True
        todo.extend(n.all_input_nodes)
    return False


def max_positions(model: nn.Module, fx_graph: fx.Graph) -> int:
    """Tokens ``model``'s learned positions cover: 0 without a learned position table; its
    config's ``max_position_embeddings`` / ``n_positions`` where it has one, else the rows
    of its largest position table."""
    tables = position_tables(fx_graph)
    if not tables:
        return 0
    cfg = getattr(model, "config", None)
    stated = next((getattr(cfg, k) for k in CONFIG_KEYS if isinstance(getattr(cfg, k, None), int)), None)
    return int(stated) if stated else max(tables.values())
