"""A document-length distribution for planning (``autopar plan --seq-lens FILE``).

Accepted files (lengths in tokens, positive integers; counts non-negative integers):

- a list of document lengths: one integer per line, or a JSON list ``[1834, 912, ...]``;
- a histogram: a JSON object ``{"1834": 12, "4096": 3}`` or lines ``length,count``
  (CSV; a first line of names such as ``length,count`` is skipped; blank lines and
  ``#`` comments are skipped in both line formats).

Every problem is one line (``AutoparError``) naming the file, the line and the fix, raised
before any model is captured. The token budget of a micro-batch row is ``--seq-len``, by
default the longest document rounded up to a multiple of ``BUDGET_QUANTUM`` tokens (so the
zigzag chunks of context parallelism up to cp = 64 split it); longer documents are cut into
budget-sized pieces (cost_models/documents.py, which also packs them).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Mapping, Union

from planner.errors import AutoparError
from planner.graph import ModelGraph

BUDGET_QUANTUM = 128
_FORMATS = ("one length per line, a JSON list of lengths, a JSON object {\"length\": count} "
            "or length,count lines")
SeqLens = Union[str, "os.PathLike[str]", Mapping[Any, Any], list, tuple]


def _positive(x: Any, what: str, where: str, zero_ok: bool = False) -> int:
    """``x`` as an integer >= 1 (>= 0 with ``zero_ok``), else a one-line error."""
    raw = x
    if isinstance(x, str):
        x = x.strip()
        ok = x.isdigit()
        x = int(x) if ok else x
    else:
        ok = isinstance(x, int) and not isinstance(x, bool)
    if not ok or x < (0 if zero_ok else 1):
        need = "a non-negative integer" if zero_ok else "a positive integer"
        raise AutoparError(f"--seq-lens {where}: {what} {raw!r} is not {need}; write {_FORMATS}")
    return x


def _add(hist: dict[int, int], length: int, count: int) -> None:
    if count:
        hist[length] = hist.get(length, 0) + count


def _from_json(data: Any, where: str) -> dict[int, int]:
    hist: dict[int, int] = {}
    if isinstance(data, list):
        for i, x in enumerate(data):
            _add(hist, _positive(x, f"entry {i}", where), 1)
    elif isinstance(data, dict):
        for k, v in data.items():
            _add(hist, _positive(k, "length", where), _positive(v, f"count of length {k}", where, zero_ok=True))
    else:
        raise AutoparError(f"--seq-lens {where}: JSON {type(data).__name__} is not a list of lengths or a "
                           f"{{\"length\": count}} object; write {_FORMATS}")
    return hist


def _from_lines(text: str, where: str) -> dict[int, int]:
    hist: dict[int, int] = {}
    fields_per_line = None
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [p.strip() for p in line.replace("\t", ",").split(",")]
        if fields_per_line is None and not parts[0].isdigit() and all(p.isidentifier() for p in parts):
            fields_per_line = len(parts)  # a header such as "length,count"
            continue
        if len(parts) not in (1, 2):
            raise AutoparError(f"--seq-lens {where} line {i}: {line!r} has {len(parts)} fields; write {_FORMATS}")
        if fields_per_line is not None and len(parts) != fields_per_line:
            raise AutoparError(f"--seq-lens {where} line {i}: {line!r} mixes lengths and length,count lines; "
                               "use one of the two formats throughout")
        fields_per_line = len(parts)
        length = _positive(parts[0], "length", f"{where} line {i}")
        count = _positive(parts[1], "count", f"{where} line {i}", zero_ok=True) if len(parts) == 2 else 1
        _add(hist, length, count)
    return hist


def read_seq_lens(path: str) -> dict[int, int]:
    """The histogram {length: documents} of the file at ``path`` (module docstring)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise AutoparError(f"--seq-lens {path}: no such file; give the path of a file of document lengths") from None
    except (OSError, UnicodeDecodeError) as e:
        raise AutoparError(f"--seq-lens {path}: unreadable ({e}); give a text file of document lengths") from None
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{") or path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AutoparError(f"--seq-lens {path}: not valid JSON ({e.msg} at line {e.lineno}); write "
                               f"{_FORMATS}") from None
        hist = _from_json(data, path)
    else:
        hist = _from_lines(text, path)
    if not hist:
        raise AutoparError(f"--seq-lens {path}: no document lengths in it; write {_FORMATS}")
    return hist


def as_histogram(seq_lens: SeqLens) -> tuple[dict[int, int], str]:
    """(histogram, source name) of what the Python API takes as ``seq_lens``: a path, a list of
    lengths or a {length: count} mapping."""
    if isinstance(seq_lens, (str, os.PathLike)):
        return read_seq_lens(os.fspath(seq_lens)), os.path.basename(os.fspath(seq_lens))
    if isinstance(seq_lens, (list, tuple, Mapping)):
        hist = _from_json(dict(seq_lens) if isinstance(seq_lens, Mapping) else list(seq_lens), "seq_lens")
        if not hist:
            raise AutoparError("seq_lens: no document lengths given; pass a list of lengths or {length: count}")
        return hist, "seq_lens"
    raise AutoparError(f"seq_lens: {type(seq_lens).__name__} is not a path, a list of lengths or a "
                       "{length: count} mapping")


def default_budget(hist: Mapping[int, int]) -> int:
    """The token budget of a row when ``--seq-len`` is not given: the longest document,
    rounded up to a multiple of ``BUDGET_QUANTUM``."""
    return -(-max(hist) // BUDGET_QUANTUM) * BUDGET_QUANTUM


def with_documents(graph: ModelGraph, hist: Mapping[int, int], source: str = "") -> ModelGraph:
    """A copy of ``graph`` (layers shared) whose sequences are rows of the packed documents of
    ``hist`` (``ModelGraph.documents``, cost_models/documents.py), at the graph's
    ``seq_len`` as the budget. One-line error when the documents do not fill one row."""
    from cost_models.documents import document_mix
    from planner.feasibility import documents_problem

    causal = all(l.attention.causal for l in graph.layers if l.attention is not None)
    if (why := documents_problem(graph.limits, causal)) is not None:
        raise AutoparError(f"{graph.name}: {why}")
    total = sum(k * v for k, v in hist.items())
    if total < graph.seq_len:
        raise AutoparError(f"--seq-lens {source or 'seq_lens'}: the documents hold {total} tokens, fewer than one "
                           f"row of {graph.seq_len} (the budget); pass a smaller --seq-len or more documents")
    return replace(graph, documents=document_mix(hist, graph.seq_len, source=source))


def describe(graph: ModelGraph) -> str:
    """One line on the graph's documents for the CLI's progress (empty without)."""
    d = graph.documents
    if d is None:
        return ""
    cut = f"; {d.cut} longer than the budget cut into {d.seq_len}-token pieces" if d.cut else ""
    return (f"documents: {d.documents:,} (median {d.median}, p90 {d.p90}, longest {d.longest} tokens) packed into "
            f"rows of {d.seq_len} tokens{cut}; attention work {d.attention_share * 100:.1f}% of one document per row")
