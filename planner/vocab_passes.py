"""Vocabulary passes: the output head split by vocabulary into one pipeline stage per pp rank.

A 128K-256K-vocabulary head costs as much as several blocks, and the stage that holds it bounds
every pipeline schedule of a layer split (no order of the same stages is faster than its busiest
rank: ``cost_models.pipeline.order_floor``). Splitting the head's vocabulary over the pp ranks
(Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary Parallelism") gives each rank
``1/p`` of it. Here the split is expressed as pipeline stages, so the schedule IR, the
simulator and torch's schedule runtime run it unchanged: after the blocks' last stage come ``p``
*vocabulary passes*, pass ``j`` on pp rank ``j`` (placement ``looped(p, v + 1)``: the passes are
every rank's last virtual stage), each holding rows ``shard_rows(V, p, j)`` of the head's weight.

What flows between passes, per token (float32 but the hidden states)::

    h                    the final hidden states (every pass reads them; passed on unchanged)
    lse_j = logaddexp(lse_{j-1}, logsumexp(h W_j^T))      running log-sum-exp of the logits
    t_j   = t_{j-1} + (h W_j^T)[label]  if label in pass j's rows, else t_{j-1}

and the last pass returns ``sum over labelled tokens of (lse - t)``: the summed cross-entropy of
the whole vocabulary, exactly (``logaddexp`` is associative). Autograd through the chain gives
each pass its weight rows' gradient and sums ``dh`` over the passes on the way back, so the
backward is the pipeline's own.

This module is the one statement of the passes' names (:func:`pass_unit`, :func:`parse_unit`),
rows (:func:`shard_rows`), what a graph becomes (:func:`with_vocab_passes`) and what can run them
(:func:`problem`). The cost model prices them (``planner/search/vocab_schedule.py``,
``benchmarks/schedule_gen.py``); the runtime does not run them yet, so the search does not put
them in a plan. Leaf contract: imports only the graph contract.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import NamedTuple, Optional

from planner.graph import Layer, Matmul, ModelGraph

_UNIT = re.compile(r"^(?P<head>.+)\[vocab (?P<j>\d+)/(?P<p>\d+)\]$")
_SIGNATURE = re.compile(r"(?P<head>.+)/vocab(?P<rows>\d+)of(?P<vocab>\d+)")  # a pass's layer signature
PASS_OUT_FLOATS = 2  # per token besides h: the running log-sum-exp and target logit (float32)


class VocabPass(NamedTuple):
    """Pass ``j`` of ``p`` over the head module ``head`` (a unit / layer name)."""
    head: str
    j: int
    p: int


def pass_unit(head: str, j: int, p: int) -> str:
    """The unit (layer) name of pass ``j`` of ``p`` of the head ``head``: ``head[vocab j/p]``."""
    return f"{head}[vocab {j}/{p}]"


def parse_unit(name: str) -> Optional[VocabPass]:
    """The pass a unit name names, or None for any other unit."""
    m = _UNIT.match(name)
    return VocabPass(m["head"], int(m["j"]), int(m["p"])) if m else None


def shard_rows(vocab: int, p: int, j: int) -> tuple[int, int]:
    """Half-open rows ``[lo, hi)`` of a ``vocab``-row head that pass ``j`` of ``p`` holds: ``torch.chunk``'s
    split (``ceil(vocab / p)`` rows each, the last ones fewer or none), so they are the local rows of a
    ``Shard(0)`` DTensor over the pp ranks."""
    step = -(-vocab // p)
    return min(j * step, vocab), min((j + 1) * step, vocab)


def problem(graph: ModelGraph, pp: int) -> Optional[str]:
    """Why ``graph`` cannot run its head as ``pp`` vocabulary passes (None: it can)."""
    if pp < 2:
        return "vocabulary passes need pp >= 2"
    head = graph.layers[-1] if graph.layers else None
    if head is None or head.kind != "head" or not head.vocab:
        return "the model's last layer is not a head with a vocabulary"
    if head.tied_to:
        return (f"the head is tied to {head.tied_to}: vocabulary passes split an untied head "
                "(untie the embedding, or plan without them)")
    if shard_rows(head.vocab, pp, pp - 1)[0] >= head.vocab:
        return f"a {head.vocab}-token vocabulary leaves the last of {pp} passes no rows: use fewer pp ranks"
    if len(head.linears) != 1 or head.linears[0].bias:
        return "the head is not one bias-free linear layer (the passes split its weight's rows)"
    if any(parse_unit(l.name) for l in graph.layers):
        return "the graph already has vocabulary passes"
    return None


def _pass_layer(head: Layer, j: int, p: int, first_name: str, dtype_bytes: int) -> Layer:
    """Layer ``j`` of the ``p`` passes: the head's work, weights and saved logits over ``p`` (its rows),
    the hidden states it reads saved whole, and the hidden states plus two floats per token out."""
    lo, hi = shard_rows(head.vocab, p, j)
    frac = (hi - lo) / head.vocab
    saved_in = head.input_bytes
    tokens = head.input_bytes / max(1, head.linears[0].in_features * dtype_bytes)
    return replace(
        head, name=pass_unit(head.name, j, p), signature=_pass_signature(head.signature, hi - lo, head.vocab),
        repeat_of=None if j == 0 or hi - lo != shard_rows(head.vocab, p, 0)[1] else first_name,
        fwd_flops=head.fwd_flops * frac, bwd_flops=head.bwd_flops * frac,
        fwd_bytes=head.fwd_bytes * frac + saved_in, bwd_bytes=head.bwd_bytes * frac + saved_in,
        params=round(head.params * frac), param_bytes=round(head.param_bytes * frac),
        act_bytes=max(0.0, head.act_bytes - saved_in) * frac + saved_in,
        act_bytes_tp=max(0.0, head.act_bytes_tp - saved_in) * frac + saved_in,
        output_bytes=head.input_bytes + PASS_OUT_FLOATS * 4 * tokens,
        ops=[replace(o, fwd_flops=o.fwd_flops * frac, bwd_flops=o.bwd_flops * frac, fwd_bytes=o.fwd_bytes * frac,
                     params=round(o.params * frac)) for o in head.ops],
        linears=[replace(x, out_features=hi - lo) for x in head.linears],
        matmuls=[Matmul(m.linear, m.out_elems * frac, m.flops * frac) for m in head.matmuls],
        vocab=hi - lo, stage_start=True)


def _pass_signature(head_signature: str, rows: int, vocab: int) -> str:
    return f"{head_signature}/vocab{rows}of{vocab}"


class HeadShare(NamedTuple):
    """A pass's share of its head: the head's layer signature and the fraction of its rows."""
    signature: str
    fraction: float


def head_share(signature: str) -> Optional[HeadShare]:
    """The head a vocabulary pass's layer signature takes its share of, or None for another layer's
    (the cost model prices a pass the profile has not measured from its head's measured time)."""
    m = _SIGNATURE.fullmatch(signature)
    return HeadShare(m["head"], int(m["rows"]) / int(m["vocab"])) if m else None


def with_vocab_passes(graph: ModelGraph, pp: int) -> ModelGraph:
    """``graph`` with its head replaced by ``pp`` vocabulary passes (layers named :func:`pass_unit`),
    each a pipeline stage of its own; raises ValueError naming :func:`problem`'s reason."""
    if (why := problem(graph, pp)):
        raise ValueError(why)
    head = graph.layers[-1]
    first = pass_unit(head.name, 0, pp)
    passes = [_pass_layer(head, j, pp, first, graph.dtype_bytes) for j in range(pp)]
    return replace(graph, layers=list(graph.layers[:-1]) + passes,
                   notes=list(graph.notes) + [f"head {head.name} as {pp} vocabulary passes"])


def pass_count(names) -> int:
    """How many vocabulary passes a list of unit / layer names ends with (0: none)."""
    names = list(names)
    found = [v for v in map(parse_unit, names) if v is not None]
    if not found:
        return 0
    p = found[0].p
    if [v.j for v in found] != list(range(p)) or names[-p:] != [pass_unit(found[0].head, j, p) for j in range(p)]:
        raise ValueError(f"vocabulary passes must be the last {p} units, in order: got {[str(n) for n in names][-p:]}")
    return p


def model_units(names) -> list[str]:
    """The model's own units of a plan's unit names: its vocabulary passes (if any) as the one head."""
    names = list(names)
    p = pass_count(names)
    return names if p == 0 else names[:-p] + [parse_unit(names[-1]).head]


def layout_problem(cfg) -> Optional[str]:
    """Why layout ``cfg`` (a ``ParallelConfig``, read by its fields) cannot have its head as
    vocabulary passes (one line with the fix), or None: the passes are every rank's last virtual
    stage of a looped pipeline of the plan's own schedule (``vpp = 2``: the blocks one stage per
    rank), with data and pipeline parallelism only."""
    if cfg.vocab_passes is not True:
        return f"vocab_passes={cfg.vocab_passes!r}: must be on or off"
    if cfg.pp < 2:
        return "vocab_passes=on needs pp >= 2 (one pass per pp rank)"
    if cfg.vpp != 2 or cfg.schedule != "custom":
        return ("vocab_passes=on runs the blocks one stage per rank and the passes as each rank's second: "
                "vpp=2 with the plan's own schedule (schedule=custom); plan again to get one")
    if cfg.tp > 1 or cfg.cp > 1 or cfg.ep > 1 or cfg.seq_chunks > 1 or cfg.dp_shares:
        return "vocab_passes=on runs with data and pipeline parallelism only (tp, cp, ep and seq_chunks 1, no dp_shares)"
    if cfg.zero == "fsdp":
        return "vocab_passes=on shards the head over the pp ranks; fsdp would shard it again: use zero=zero1, zero2 or ddp"
    if cfg.loss == "fused":
        return "vocab_passes=on computes each pass's log-sum-exp eagerly: use loss=eager"
    return None


def stage_layers(model_layers, vocab_passes: bool, pp: int) -> list[str]:
    """The layer names a plan's stages split: the model's, its head as the ``pp`` passes with them."""
    names = list(model_layers)
    return names[:-1] + [pass_unit(names[-1], j, pp) for j in range(pp)] if vocab_passes else names


def graph_for(graph: ModelGraph, vocab_passes: bool, pp: int) -> ModelGraph:
    """The graph a layout prices and splits: ``graph`` with its head as ``pp`` passes when the layout
    has them (and the graph does not yet), else ``graph``."""
    if not vocab_passes or pass_count([layer.name for layer in graph.layers]):
        return graph
    return with_vocab_passes(graph, pp)
