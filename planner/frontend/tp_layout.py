"""Tensor-parallel layout of a model, derived from its ModelGraph.

The plan carries this as ``{module fqn: role}`` so codegen needs nothing but the plan:

- ``column``      nn.Linear split by output features (q/k/v, MLP up/gate, fc1)
- ``row``         nn.Linear split by input features (attention output, MLP down, fc2)
- ``packed_qkv``  one linear computing ``[q | k | v]`` (GPT-2's ``c_attn``)
- ``vocab_embed`` token embedding split by vocabulary rows
- ``embed``       an embedding not split (learned positions); with SP its output is
                  sharded along the sequence like the token embedding's
- ``vocab_head``  output projection split by vocabulary, loss computed vocabulary-parallel
- ``norm``        replicated weights; with sequence parallel it runs on a sequence shard
"""
from __future__ import annotations

from planner.graph import ModelGraph


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def tp_layout(graph: ModelGraph) -> dict[str, str]:
    """{fqn: role} for every module tensor parallelism touches, in layer order."""
    out: dict[str, str] = {}
    for layer in graph.layers:
        for lin in layer.linears:
            fqn = _join(layer.name, lin.name)
            if lin.role in ("column", "row", "packed_qkv"):
                out[fqn] = lin.role
            elif lin.role == "vocab":
                out[fqn] = "vocab_head"
        for op in layer.ops:
            fqn = _join(layer.name, op.name)
            if op.kind == "embedding":
                out[fqn] = "vocab_embed" if op.tp_style == "vocab" else "embed"
            elif op.kind == "norm":
                out[fqn] = "norm"
    return out
