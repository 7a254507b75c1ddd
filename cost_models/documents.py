"""Packed documents: the statistics of a document-length distribution packed into rows.

Training data is documents of very different lengths packed into micro-batch rows of ``S``
tokens (the token budget, the graph's ``seq_len``), with document masks: attention never
crosses a document boundary. This module simulates the packing and says what it changes
for the cost model (``planner.graph.DocumentMix``):

- **Packing** (:func:`pack`): concatenate-and-split. Documents longer than ``S`` are first
  cut into ``S``-token pieces; the documents follow each other in a deterministic shuffled
  order (seed 0; a histogram is expanded into its counts) and fill rows of ``S`` tokens; a
  document that crosses a row end continues as a new document in the next row. The last,
  partial row is dropped. At most ``max_rows(S)`` rows are simulated (a random sample of a
  larger source: without replacement from the shuffled documents, or with replacement
  from the histogram when it holds more than ``EXPAND_LIMIT`` documents).
- **attention_share**: sum over the rows' documents of L^2 over rows x S^2, the causal
  attention work relative to one document filling every row. Causal work is L(L+1)/2 pairs,
  about L^2/2, so the halving the cost model already applies stays (1.0: no saving).
- **The busiest rank** (:func:`busiest_share`): a fixed layout's ranks hold different rows
  (dp) and different zigzag chunks of a row (cp); their attention work differs, and each
  micro-batch waits for the busiest. The cost model prices a layout's attention at the
  busiest rank's share, averaged over the simulated rows' micro-batches (the mean share
  is the useful work, what MFU counts).
- **mean_tokens**: the token-weighted mean document length, sum(L^2) / sum(L) (= share x S).
- **Ring visiting share** (:func:`visiting_share`): context parallelism cuts each row into
  ``2 cp`` zigzag chunks (cp rank i holds chunks i and 2cp-1-i; with a Ulysses degree u,
  ring rank j attends with the chunks of cp ranks j u .. j u + u - 1, as
  codegen/runtime/context_parallel.py does). The share of the causal (query, key) pairs,
  diagonal included, whose key lies on another ring rank than its query: the work of the
  ring's visiting blocks. With short documents almost all of it stays on a rank's own
  blocks. :func:`ring_hiding` is that share over the share of one document filling the row
  (the ring's K/V transfers hide behind the visiting blocks' work; 1.0 exactly for one
  document of ``S``, so plans without documents do not move; 1.0 too for a row the ring
  cannot split into ``2 cp`` chunks, which the feasibility rule rejects anyway).

Cost: packing is linear in the simulated documents (at most
``MAX_ROWS`` rows); a visiting share visits only the documents that cross one of the
``rows x (2 cp - 1)`` chunk boundaries, in as many of the (random) rows as keep that near
``BOUNDARY_BUDGET``, and is cached per (mix, cp, ulysses); the busiest rank's share counts every row's pieces
once per ring degree (numpy, cached).
"""
from __future__ import annotations

import bisect
import random
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import numpy as np

from planner.batch_layout import row_rank_pairs
from planner.feasibility import sequence_problem
from planner.graph import DocumentMix

MAX_TOKENS = 2**24      # simulate about this many tokens ...
MIN_ROWS = 64           # ... but at least this many rows
MAX_ROWS = 1024         # ... and at most this many
EXPAND_LIMIT = 2**20    # a histogram with more documents is sampled with replacement
BOUNDARY_BUDGET = 2**14  # a visiting share examines about this many chunk boundaries ...
MIN_VISIT_ROWS = 8       # ... in at least this many rows
SEED = 0
SAMPLE_LENGTHS = 64     # source lengths a plan keeps for synthetic runs (quantile_lengths)


def max_rows(seq_len: int) -> int:
    """Rows simulated at a budget of ``seq_len`` tokens: ``MAX_TOKENS / seq_len`` within
    [``MIN_ROWS``, ``MAX_ROWS``]."""
    return max(MIN_ROWS, min(MAX_ROWS, MAX_TOKENS // max(seq_len, 1)))


def cut(lengths: Iterable[int], seq_len: int) -> Iterator[int]:
    """Each length, documents longer than ``seq_len`` as ``seq_len``-token pieces and a rest."""
    for n in lengths:
        while n > seq_len:
            yield seq_len
            n -= seq_len
        if n > 0:
            yield n


def pack(lengths: Iterable[int], seq_len: int, rows: int | None = None) -> list[int]:
    """Concatenate-and-split ``lengths`` (in the order given) into rows of ``seq_len`` tokens:
    the documents' pieces, row after row, each row summing to ``seq_len``; at most ``rows``
    rows, the last partial row dropped. ValueError when not one row fills."""
    pieces: list[int] = []
    fill = done = kept = 0
    for n in lengths:
        while n > 0:
            take = min(n, seq_len - fill)
            pieces.append(take)
            fill += take
            n -= take
            if fill == seq_len:
                fill, done, kept = 0, done + 1, len(pieces)
                if rows is not None and done >= rows:
                    return pieces
    if not kept:
        raise ValueError(f"the documents hold {sum(pieces)} tokens, fewer than one row of {seq_len}")
    return pieces[:kept]


def _percentile(hist: Mapping[int, int], q: int) -> int:
    """The nearest-rank ``q`` percentile (``q`` in 1..100) of the document lengths (by count)."""
    n = sum(hist.values())
    rank = max(1, -(-q * n // 100))  # ceil(q n / 100)
    seen = 0
    for length in sorted(hist):
        seen += hist[length]
        if seen >= rank:
            return length
    return max(hist)


def quantile_lengths(hist: Mapping[int, int], n: int = SAMPLE_LENGTHS) -> tuple[int, ...]:
    """``n`` document lengths at the count quantiles (i + 1/2) / n of ``hist``: drawn uniformly,
    they follow the source's distribution (what an ``autopar run`` on synthetic data packs)."""
    total, out, seen = sum(hist.values()), [], 0
    want = iter(range(n))
    i = next(want)
    for length in sorted(hist):
        seen += hist[length]
        while i is not None and (i + 0.5) * total / n <= seen:
            out.append(length)
            i = next(want, None)
    return tuple(out)


def _draw(hist: Mapping[int, int], seq_len: int, rng: random.Random) -> Iterator[int]:
    """Documents of ``hist`` in a shuffled order: the expanded histogram shuffled (then
    exhausted), or, above ``EXPAND_LIMIT`` documents, drawn with replacement for ever."""
    lengths = sorted(hist)
    n = sum(hist.values())
    if n <= EXPAND_LIMIT:
        docs = [length for length in lengths for _ in range(hist[length])]
        rng.shuffle(docs)
        yield from docs
        return
    cum, total = [], 0
    for length in lengths:
        total += hist[length]
        cum.append(total)
    while True:
        yield from rng.choices(lengths, cum_weights=cum, k=4096)


def document_mix(hist: Mapping[int, int], seq_len: int, source: str = "") -> DocumentMix:
    """The :class:`DocumentMix` of a histogram {length: documents} packed into rows of
    ``seq_len`` tokens in a deterministic shuffled order (module docstring). ValueError for
    an empty histogram, a length, count or budget below 1, or fewer tokens than one row."""
    hist = {int(k): int(v) for k, v in hist.items() if v}
    if seq_len < 1 or not hist or min(hist) < 1 or min(hist.values()) < 0:
        raise ValueError("document lengths must be positive integers with positive counts, and the budget too")
    return pack_mix(_draw(hist, seq_len, random.Random(SEED)), seq_len, hist, source)


def pack_mix(lengths: Iterable[int], seq_len: int, hist: Mapping[int, int] | None = None,
             source: str = "") -> DocumentMix:
    """The :class:`DocumentMix` of ``lengths`` packed in the order given (cut, then
    :func:`pack`, at most ``max_rows(seq_len)`` rows); the source's figures (counts, median,
    p90, longest, documents cut) from ``hist``, by default the histogram of ``lengths``."""
    if hist is None:
        lengths = list(lengths)
        hist = {}
        for n in lengths:
            hist[n] = hist.get(n, 0) + 1
    pieces = pack(cut(lengths, seq_len), seq_len, max_rows(seq_len))
    rows = sum(pieces) // seq_len
    square = sum(p * p for p in pieces)
    tokens = sum(k * v for k, v in hist.items())
    sampled = sum(hist.values()) > EXPAND_LIMIT or tokens // seq_len > rows  # the source fills more rows
    return DocumentMix(
        seq_len=seq_len, documents=sum(hist.values()), tokens=tokens, median=_percentile(hist, 50),
        p90=_percentile(hist, 90), longest=max(hist), cut=sum(v for k, v in hist.items() if k > seq_len),
        rows=rows, sampled=sampled, attention_share=square / (rows * seq_len * seq_len),
        mean_tokens=square / (rows * seq_len), pieces=tuple(pieces), source=source,
        lengths=quantile_lengths(hist))


# ---------------------------------------------------------------- the ring's visiting work

def _pairs(n: int) -> int:
    """Causal (query, key) pairs of ``n`` tokens, diagonal included."""
    return n * (n + 1) // 2


def _ring_owner(chunk: int, cp: int, ulysses: int) -> int:
    """The ring rank holding zigzag chunk ``chunk`` of ``2 cp``."""
    rank = chunk if chunk < cp else 2 * cp - 1 - chunk
    return rank // ulysses


def _rows_for(cp: int, rows: int) -> int:
    """Rows a visiting share of a ``2 cp``-chunk ring examines: all of the mix's rows up to
    ``BOUNDARY_BUDGET`` chunk boundaries in all, at least ``MIN_VISIT_ROWS`` (the rows are a
    random sample already; a ring of many small chunks needs fewer of them)."""
    return min(rows, max(MIN_VISIT_ROWS, BOUNDARY_BUDGET // (2 * cp)))


def _crossing_visits(mix: DocumentMix, cp: int, ulysses: int, starts: list[int], rows: int) -> int:
    """Causal pairs of the mix's first ``rows`` rows whose key and query lie on different ring
    ranks: only documents that cross a chunk boundary have any."""
    s = mix.seq_len
    c = s // (2 * cp)
    crossing: set[int] = set()
    for row in range(rows):
        for k in range(1, 2 * cp):
            b = row * s + k * c
            i = bisect.bisect_right(starts, b) - 1
            if starts[i] < b:
                crossing.add(i)
    visits = 0
    for i in crossing:
        a = starts[i] % s
        e = a + mix.pieces[i]
        own: dict[int, int] = {}
        for chunk in range(a // c, (e - 1) // c + 1):
            o = _ring_owner(chunk, cp, ulysses)
            own[o] = own.get(o, 0) + min(e, (chunk + 1) * c) - max(a, chunk * c)
        visits += _pairs(mix.pieces[i]) - sum(_pairs(n) for n in own.values())
    return visits


_CACHE: dict[tuple, tuple[DocumentMix, Any]] = {}
_LAYOUT: dict[tuple, tuple[DocumentMix, Any]] = {}
T = TypeVar("T")


def per_mix(store: dict[tuple, tuple[DocumentMix, Any]], mix: DocumentMix, key: tuple, compute: Callable[[], T],
            limit: int) -> T:
    """``compute()`` kept in ``store`` for this ``mix`` object and ``key`` (a mix holds lists, so it
    is keyed by identity, the object kept beside its result so a reused id misses); ``store`` is
    emptied when it holds more than ``limit``. Every per-mix cache of the cost models uses it."""
    k = (id(mix), *key)
    hit = store.get(k)
    if hit is None or hit[0] is not mix:
        if len(store) > limit:
            store.clear()
        hit = store[k] = (mix, compute())
    return hit[1]


def _layout(mix: DocumentMix) -> tuple[list[int], list[int]]:
    """(each piece's first token, the causal pairs of the first k rows for k = 0..rows), cached per mix."""
    def compute() -> tuple[list[int], list[int]]:
        starts, row_pairs, t, acc = [], [0], 0, 0
        for p in mix.pieces:
            starts.append(t)
            t += p
            acc += _pairs(p)
            if t % mix.seq_len == 0:
                row_pairs.append(acc)
        return starts, row_pairs
    return per_mix(_LAYOUT, mix, (), compute, 64)


def visiting_pairs(mix: DocumentMix, cp: int, ulysses: int = 1) -> tuple[int, int]:
    """(visiting, all) causal pairs of the mix's rows (the first ``_rows_for(cp)`` of them)
    under context parallelism ``cp`` with Ulysses degree ``ulysses`` (module docstring), cached
    per (mix, cp, ulysses). ValueError when the row does not split into ``2 cp`` chunks."""
    if why := sequence_problem(mix.seq_len, cp):
        raise ValueError(why)
    def compute() -> tuple[int, int]:
        starts, row_pairs = _layout(mix)
        rows = _rows_for(cp, mix.rows)
        return (0 if cp // ulysses <= 1 else _crossing_visits(mix, cp, ulysses, starts, rows)), row_pairs[rows]
    return per_mix(_CACHE, mix, (cp, ulysses), compute, 1024)


def full_row_pairs(seq_len: int, cp: int, ulysses: int = 1) -> tuple[int, int]:
    """(visiting, all) causal pairs of one document filling a row of ``seq_len`` tokens: each
    of the ``r = cp / ulysses`` ring ranks holds ``seq_len / r`` of its tokens."""
    r = max(cp // ulysses, 1)
    return _pairs(seq_len) - r * _pairs(seq_len // r), _pairs(seq_len)


def visiting_share(mix: DocumentMix, cp: int, ulysses: int = 1) -> float:
    """Share of the mix's causal attention work on the ring's visiting blocks (0 without a ring)."""
    v, t = visiting_pairs(mix, cp, ulysses)
    return v / t if t else 0.0


def full_row_share(seq_len: int, cp: int, ulysses: int = 1) -> float:
    """:func:`visiting_share` of one document filling every row (about 1 - ulysses / cp)."""
    v, t = full_row_pairs(seq_len, cp, ulysses)
    return v / t


def ring_hiding(mix: DocumentMix, cp: int, ulysses: int = 1) -> float:
    """The mix's visiting share over one full document's (exact ratio of integers: 1.0 for
    rows of one ``seq_len`` document; 1.0 without a ring). The cost model's window for the
    ring's transfers is the attention core's time times this (cost_models/context_parallel.py)."""
    if cp // ulysses <= 1 or sequence_problem(mix.seq_len, cp):  # no ring, or one the runtime cannot run
        return 1.0
    v, t = visiting_pairs(mix, cp, ulysses)
    vf, tf = full_row_pairs(mix.seq_len, cp, ulysses)
    return (v * tf) / (t * vf)


_BUSY: dict[tuple[int, int], tuple[DocumentMix, np.ndarray]] = {}


def _rank_pairs(mix: DocumentMix, ring: int) -> np.ndarray:
    """Causal pairs per simulated row and ring rank (``[rows, ring]``), cached per (mix, ring)."""
    key = (id(mix), ring)
    hit = _BUSY.get(key)
    if hit is None or hit[0] is not mix:
        if len(_BUSY) > 256:
            _BUSY.clear()
        hit = _BUSY[key] = (mix, row_rank_pairs(mix.pieces, mix.seq_len, ring)[0])
    return hit[1]


def busiest_share(mix: DocumentMix, dp: int, cp: int, ulysses: int = 1, mbs: int = 1) -> float:
    """The attention share a fixed layout's step pays: the mix's ``attention_share`` times the
    busiest rank's attention work over the mean rank's, micro-batch by micro-batch. Each
    micro-batch gives ``dp`` ranks ``mbs`` consecutive simulated rows each, every row split
    zigzag over ``cp`` ranks (ring ranks hold their chunks' pairs,
    ``planner.batch_layout.row_rank_pairs``; Ulysses' ranks 1 / ``ulysses`` of their ring
    rank's heads, the same work), and every rank's layers wait for the busiest: the ring
    every layer, FSDP's gathers and the pipeline's sends every micro-batch, the gradient
    reduction every step (all ranks hold the same tokens, so the linear work is the same on
    every one). Sums over the micro-batches of the simulated rows (wrapping around when they
    hold fewer rows than one micro-batch); 1 rank: the mean share exactly."""
    ring = max(cp // max(ulysses, 1), 1)
    if ring > 1 and sequence_problem(mix.seq_len, cp):
        ring = 1  # a ring the runtime cannot run: the feasibility rule refuses it anyway
    pairs = _rank_pairs(mix, ring)
    k = dp * mbs
    if pairs.shape[0] == 0 or dp * ring == 1:
        return mix.attention_share
    groups = max(pairs.shape[0] // k, 1)
    take = np.resize(pairs, (groups * k, ring))  # wraps around when the rows are fewer than one micro-batch
    work = take.reshape(groups, dp, mbs, ring).sum(axis=2)
    mean = float(work.mean(axis=(1, 2)).sum())
    return mix.attention_share * float(work.max(axis=(1, 2)).sum()) / mean if mean > 0 else mix.attention_share


def visiting_text(share: float, one_document: float) -> str:
    """The reports' phrase for a ring's visiting share against one full document's."""
    return f"{share:.1%} of the attention work on visiting blocks ({one_document:.1%} with one document per row)"


def summary(mix: DocumentMix, ring: Iterable[tuple[int, int]] = ()) -> dict:
    """What a plan records of the mix (JSON): the source's figures, the budget, the packed
    rows' attention share and, per (cp, ulysses) in ``ring`` that splits the row, the ring's
    visiting share against one full document's and :func:`ring_hiding`."""
    out = {"documents": mix.documents, "tokens": mix.tokens, "median": mix.median, "p90": mix.p90,
           "longest": mix.longest, "budget": mix.seq_len, "cut": mix.cut, "rows": mix.rows, "sampled": mix.sampled,
           "attention_share": mix.attention_share, "mean_tokens": mix.mean_tokens, "source": mix.source,
           "lengths": list(mix.lengths)}
    visits = {}
    for cp, u in ring:
        if cp // u > 1 and sequence_problem(mix.seq_len, cp) is None:
            name = f"cp={cp}" + (f" ulysses={u}" if u > 1 else "")
            visits[name] = {"share": visiting_share(mix, cp, u), "one_document": full_row_share(mix.seq_len, cp, u),
                            "hiding": ring_hiding(mix, cp, u)}
    if visits:
        out["ring_visiting"] = visits
    return out
