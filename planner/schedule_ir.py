"""The pipeline schedule IR: per pp rank, the ordered actions of each virtual stage and micro-batch.

Leaf contract (imports only ``planner.errors``): the simulator (``cost_models/pipeline.py``)
prices a :class:`Schedule`, the runtime (``codegen/runtime/pipeline_parallel.py``) runs the same
one through torch's schedule runtime, and the planner reads and writes it as a file
(``planner/schedule_file.py``; checked by ``planner/schedule_check.py``). One order, priced and run.

Actions (:data:`KINDS`), torch's names and string form ``<stage><kind><micro-batch>``:

- ``F``: forward of a stage on a micro-batch;
- ``B``: its full backward (input and weight gradients in one pass);
- ``I``: the input-gradient half of the backward (what the previous stage waits for);
- ``W``: the weight-gradient half (after ``I`` of the same stage and micro-batch).

An :class:`Overlap` runs a forward and a backward as one step (DualPipe's overlapped F+B;
torch's ``OVERLAP_F_B``, written ``(0F2;1B0)OVERLAP_F_B``): the runtime issues the forward then
the backward, so the simulator prices it as the two in that order.

Placement: virtual stage ``s`` of ``S = p v`` lives on rank ``stage_rank[s]``: looped
(``s % p``, :func:`looped`) for gpipe / 1f1b / interleaved / zb-h1, or V-shaped (stage ``s`` and
``2p - 1 - s`` on rank ``s``, :func:`v_shape`) for DualPipeV.

Dependencies (the same for every schedule)::

    F(s, mb)  after F(s-1, mb)                          (s > 0)
    B/I(s, mb) after B/I(s+1, mb)  (s < S-1), after F(S-1, mb) (s = S-1)
    W(s, mb)  after I(s, mb)

Sequence chunks (Seq1F1B / TeraPipe; ``Schedule.seq_chunks = k > 1``): each micro-batch's
sequence is cut into k chunks, and the IR's units (the ``mb`` of an action) are (micro-batch,
chunk) pairs, unit ``u = mb k + j`` (:func:`unit`). Causal attention of chunk j reads the keys
and values of chunks < j of the same sequence, and its backward produces their gradients, so on
every stage two more dependencies hold (:func:`chunk_deps`)::

    F(s, u)    after F(s, u-1)        (j > 0: the earlier chunk's keys/values exist)
    B/I(s, u)  after B/I(s, u+1)      (j < k-1: the later chunks' gradients to this chunk's
                                       keys/values are in; Seq1F1B's reverse chunk order)

Built-in orders (:data:`BUILTINS`, :func:`builtin`): see each generator's docstring.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Union

from planner.errors import PlanError

KINDS = ("F", "B", "I", "W")          # compute actions (module docstring)
BACKWARDS = ("B", "I")                # the actions a previous stage's backward waits for
DEEP_1F1B = "1f1b-deep"               # 1F1B with deeper warm-ups (:func:`deep_warmup`), run as a plan's own schedule


class ScheduleError(PlanError):
    """A bad schedule (file, request, or an order that deadlocks); one-line message."""


class Action(NamedTuple):
    """One compute action: ``kind`` (F, B, I or W) of virtual stage ``stage`` on micro-batch ``mb``
    (a named tuple: the built-in schedules make tens of thousands per search, at half a frozen
    dataclass's cost)."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


@dataclass(frozen=True)
class Overlap:
    """A forward and a backward issued as one step (forward first)."""

    fwd: Action
    bwd: Action

    def __str__(self) -> str:
        return f"({self.fwd};{self.bwd})OVERLAP_F_B"

    @property
    def parts(self) -> tuple[Action, Action]:
        return (self.fwd, self.bwd)


Step = Union[Action, Overlap]


def parts(step: Step) -> tuple[Action, ...]:
    """The compute actions of one step, in the order they run."""
    return step.parts if isinstance(step, Overlap) else (step,)


@dataclass(frozen=True)
class Schedule:
    """A whole schedule: ``ranks[r]`` is rank r's ordered steps; ``stage_rank[s]`` the rank of
    virtual stage s; ``n_microbatches`` micro-batches (or sequence chunks) per step."""

    name: str
    n_microbatches: int
    stage_rank: tuple[int, ...]
    ranks: tuple[tuple[Step, ...], ...]
    seq_chunks: int = 1  # k: units are (micro-batch, chunk) pairs, n_microbatches = sequences x k

    @property
    def n_sequences(self) -> int:
        """Micro-batches (whole sequences): the units over the chunks per sequence."""
        return self.n_microbatches // self.seq_chunks

    @property
    def p(self) -> int:
        """pp ranks."""
        return len(self.ranks)

    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def v(self) -> int:
        """Virtual stages per rank (the most any rank holds)."""
        return max(self.stage_rank.count(r) for r in range(self.p)) if self.stage_rank else 0

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` holds, in stage order."""
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def actions(self, rank: int) -> list[Action]:
        """Rank ``rank``'s compute actions in the order they run (overlaps expanded)."""
        return [a for st in self.ranks[rank] for a in parts(st)]

    def uses(self, kind: str) -> bool:
        return any(a.kind == kind for r in range(self.p) for a in self.actions(r))


def unit(mb: int, chunk: int, k: int) -> int:
    """The IR unit (an action's ``mb``) of chunk ``chunk`` of micro-batch ``mb`` with k chunks each."""
    return mb * k + chunk


def chunk_deps(a: Action, k: int) -> tuple[tuple[str, int, int], ...]:
    """The sequence-chunk dependencies of ``a`` (module docstring) as ``(kind, stage, unit)``:
    kind ``F`` or ``BI`` (a B or an I); none with k = 1 or for a W."""
    j = a.mb % k
    if a.kind == "F" and j > 0:
        return (("F", a.stage, a.mb - 1),)
    if a.kind in BACKWARDS and j < k - 1:
        return (("BI", a.stage, a.mb + 1),)
    return ()


def backward_unit(n: int, k: int) -> int:
    """The unit of a stage's n-th backward in the built-in chunk orders: micro-batches in order,
    each one's chunks last to first (the reverse chunk order of :func:`chunk_deps`)."""
    return (n // k) * k + (k - 1 - n % k)


def looped(p: int, v: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % p`` (``p v`` stages)."""
    return tuple(s % p for s in range(p * v))


def v_shape(p: int) -> tuple[int, ...]:
    """``2p`` stages, stage ``s`` and ``2p - 1 - s`` on rank ``s`` (down the ranks and back)."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


# ---- built-in orders ------------------------------------------------------------------------
def gpipe(p: int, m: int, k: int = 1) -> Schedule:
    """All forwards, then all backwards (GPipe); with k sequence chunks over the m k units,
    each micro-batch's chunks backward last to first (:func:`backward_unit`)."""
    n = m * k
    ranks = [[Action("F", r, u) for u in range(n)] + [Action("B", r, backward_unit(i, k)) for i in range(n)]
             for r in range(p)]
    return _make("gpipe", n, looped(p, 1), ranks, k)


def one_f_one_b(p: int, m: int, k: int = 1, extra: tuple[int, ...] = ()) -> Schedule:
    """``w = min(p-1-r, m)`` warm-up forwards, then (F, B) pairs, then the remaining backwards
    (PipeDream-flush; torch's ``Schedule1F1B``). With k sequence chunks (Seq1F1B) the same over
    the ``m k`` units, forwards in unit order, backwards each micro-batch's chunks last to first
    (:func:`backward_unit`), and ``k - 1`` more warm-up forwards: the last chunk of a sequence
    must be forwarded before the sequence's first backward. ``extra[r]``: rank r's further
    warm-up forwards (:func:`deep_warmup`; named :data:`DEEP_1F1B`): more units in flight, which hide
    a slow boundary's round trip."""
    ranks, n = [], m * k
    units = [backward_unit(i, k) for i in range(n)]
    more = tuple(extra) + (0,) * (p - len(extra))
    for r in range(p):
        w = min(one_f_one_b_warmup(p, r, k, n) + more[r], n)
        fwd, bwd = [Action("F", r, u) for u in range(n)], [Action("B", r, u) for u in units]
        order: list[Step] = fwd[:w]
        for pair in zip(fwd[w:], bwd):  # the steady (F, B) pairs
            order.extend(pair)
        ranks.append(order + bwd[n - w:])
    return _make(DEEP_1F1B if any(more) else "1f1b", n, looped(p, 1), ranks, k)


def one_f_one_b_warmup(p: int, r: int, k: int, n: int) -> int:
    """1F1B's warm-up forwards on rank ``r`` of ``p`` over ``n`` units of ``k`` sequence chunks."""
    return min(p - 1 - r + k - 1, n)


def deep_warmup(p: int, cut: int, depth: int) -> tuple[int, ...]:
    """Per rank, the extra warm-up forwards that put ``depth`` more units in flight on every rank
    up to ``cut`` (the rank before a slow boundary, e.g. a WAN cut: its units' round trip
    through the ranks after it takes ``2 hop`` longer than 1F1B's warm-up covers). Every rank
    before ``cut`` takes the same extra: a rank's warm-up must stay deeper than its successor's
    (with the same depth the pair falls into lockstep, each waiting on the other: on a pp8 of
    forward 1, backward 2 and hop 0.1 the simulator prices one more unit on rank 3 alone 1.6x
    slower than on ranks 0-3)."""
    if not 0 <= cut < p or depth < 0:
        raise ScheduleError(f"deep warm-up: cut {cut} must be a rank of 0..{p - 1} and depth {depth} >= 0")
    return tuple(depth if r <= cut else 0 for r in range(p))


def deepened_by(s: Schedule) -> tuple[int, ...]:
    """Per rank, the warm-up forwards of ``s`` (one stage per rank) beyond 1F1B's (:func:`one_f_one_b`):
    what :func:`deep_warmup` added (0 where the rank warms up as 1F1B does)."""
    k, n = s.seq_chunks, s.n_microbatches
    out = []
    for r in range(s.p):
        acts = s.actions(r)
        first_b = next((i for i, a in enumerate(acts) if a.kind != "F"), len(acts))
        w = one_f_one_b_warmup(s.p, r, k, n)  # its first backward follows one more forward (while any is left)
        out.append(max(0, first_b - w - (1 if w < n else 0)))
    return tuple(out)


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (torch's ``ScheduleInterleaved1F1B``; m a multiple of p):
    the k-th forward runs chunk ``(k // p) % v`` on micro-batch ``(k // (p v)) p + k % p``,
    backwards the same with the chunk reversed; ``min(2 (p-1-r) + (v-1) p, m v)`` warm-up
    forwards, then (F, B) pairs, then the rest. ``v = 1`` is :func:`one_f_one_b`'s order."""
    if v == 1:
        return _make("interleaved-1f1b", m, looped(p, 1), one_f_one_b(p, m).ranks)
    total, group = m * v, p * v
    ranks = []
    for r in range(p):
        def fwd(k: int) -> Action:
            return Action("F", ((k // p) % v) * p + r, (k // group) * p + k % p)

        def bwd(k: int) -> Action:
            return Action("B", (v - 1 - (k // p) % v) * p + r, (k // group) * p + k % p)

        w = min(2 * (p - 1 - r) + (v - 1) * p, total)
        order: list[Step] = [fwd(k) for k in range(w)]
        for k in range(total - w):
            order += [fwd(w + k), bwd(k)]
        order += [bwd(k) for k in range(total - w, total)]
        ranks.append(order)
    return _make("interleaved-1f1b", m, looped(p, v), ranks)


def zb_h1(p: int, m: int) -> Schedule:
    """Zero bubble H1 (Qi et al. 2023; torch's ``ScheduleInterleavedZeroBubble`` with one stage
    per rank when m >= p): the 1f1b order of F and I; rank r holds back its W's by r
    micro-batches (in the steady phase W(j - r) follows I(j)), runs one held-back W after each
    cool-down I and the rest at the end."""
    ranks = []
    for r in range(p):
        w = min(p - 1 - r, m)
        order: list[Step] = [Action("F", r, mb) for mb in range(w)]
        nxt = 0  # next micro-batch whose W has not been placed
        for j in range(m - w):
            order += [Action("F", r, w + j), Action("I", r, j)]
            if j - nxt >= r:
                order.append(Action("W", r, nxt))
                nxt += 1
        for mb in range(m - w, m):
            order.append(Action("I", r, mb))
            if nxt <= mb:
                order.append(Action("W", r, nxt))
                nxt += 1
        order += [Action("W", r, mb) for mb in range(nxt, m)]
        ranks.append(order)
    return _make("zb-h1", m, looped(p, 1), ranks)


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto p ranks, 2p stages V-shaped; torch's
    ``ScheduleDualPipeV``; m >= 2p): rank r fills with forwards of its first stage, then of both,
    then starts zero-bubble backwards of its second stage, runs the steady phase as overlapped
    forward-of-one-stage + backward-of-the-other steps, and drains with backwards (the later half
    split into I and W, the W's filling the tail)."""
    if m < 2 * p:
        raise ScheduleError(builtin_problem("dualpipev", p, m))
    return _make("dualpipev", m, v_shape(p), [_DualPipeRank(p, r).order(m) for r in range(p)])


class _DualPipeRank:
    """One rank's DualPipeV order, built phase by phase with per-stage counters."""

    def __init__(self, p: int, r: int):
        self.p, self.r = p, r
        self.a, self.b = r, 2 * p - 1 - r  # first-leg and second-leg stage
        self.next_f = {self.a: 0, self.b: 0}
        self.next_bw = {self.a: 0, self.b: 0}
        self.pending_w: deque[Action] = deque()
        self.out: list[Step] = []

    def f(self, s: int) -> Action:
        self.next_f[s] += 1
        return Action("F", s, self.next_f[s] - 1)

    def bw(self, s: int, split: bool) -> Action:
        mb = self.next_bw[s]
        self.next_bw[s] += 1
        if split:
            self.pending_w.append(Action("W", s, mb))
        return Action("I" if split else "B", s, mb)

    def w(self) -> None:
        if self.pending_w:
            self.out.append(self.pending_w.popleft())

    def order(self, m: int) -> list[Step]:
        p, r, a, b, out = self.p, self.r, self.a, self.b, self.out
        out += [self.f(a) for _ in range(2 * (p - 1 - r))]
        for _ in range(r + 1):
            out += [self.f(a), self.f(b)]
        for _ in range(p - 1 - r):
            out.append(self.bw(b, True))
            self.w()
            out.append(self.f(b))
        for i in range(m - 2 * p + r + 1):
            if i == 0 and r == p - 1:  # the turn of the V: not overlapped
                out += [self.f(a), self.bw(b, False)]
            else:
                out.append(Overlap(self.f(a), self.bw(b, False)))
            out.append(Overlap(self.f(b), self.bw(a, False)))
        for _ in range(p - 1 - r):
            out.append(self.bw(b, False))
            out.append(Overlap(self.f(b), self.bw(a, False)))
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            out.append(self.bw(b, split))
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            out.append(self.bw(a, split))
        for _ in range(p - 1 - r):
            self.w()
            out.append(self.bw(a, split))
        while self.pending_w:
            self.w()
        return out


BUILTINS: dict[str, Callable[..., Schedule]] = {
    "gpipe": lambda p, m, v, k=1: gpipe(p, m, k),
    "1f1b": lambda p, m, v, k=1: one_f_one_b(p, m, k),
    "interleaved-1f1b": interleaved,
    "zb-h1": lambda p, m, v: zb_h1(p, m),
    "dualpipev": lambda p, m, v: dualpipev(p, m),
}
V_SCHEDULES = ("dualpipev",)  # two stages per rank, V-shaped placement
CHUNK_SCHEDULES = ("gpipe", "1f1b")  # built-ins with a sequence-chunk order (full backwards, one stage per rank)


def seq_chunks_problem(k: int, schedule: str, pp: int, vpp: int = 1, cp: int = 1) -> str | None:
    """Why ``k`` sequence chunks cannot run with this pipeline (one line with the fix), or None:
    k a positive integer; k > 1 only with pp > 1, one stage per rank and a schedule of
    :data:`CHUNK_SCHEDULES` (a chunk's keys/values get their gradients in its full backward),
    and not with context parallel (both split the sequence)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return f"seq_chunks={k!r}: must be a positive integer (1: whole sequences)"
    if k == 1:
        return None
    if cp > 1:
        return f"seq_chunks={k} with cp={cp}: chunks and context parallel both split the sequence; set one of them to 1"
    if pp == 1:
        return f"seq_chunks={k} splits sequences into pipeline units: it needs pp > 1 (or set seq_chunks=1)"
    if schedule not in CHUNK_SCHEDULES + ("custom",) or vpp > 1:
        return (f"seq_chunks={k} runs with schedule {' or '.join(CHUNK_SCHEDULES)} (or a custom one in chunks) "
                f"and vpp=1, not {schedule}"
                f"{f' vpp={vpp}' if vpp > 1 else ''}; pick one of those or set seq_chunks=1")
    return None


def stages_per_rank(name: str, v: int) -> int:
    """Virtual stages per rank of built-in ``name`` asked with ``v`` chunks: 2 for the V
    schedules, ``v`` for interleaved, else 1."""
    return 2 if name in V_SCHEDULES else (v if name == "interleaved-1f1b" else 1)


def placement(name: str, p: int, v: int) -> tuple[int, ...]:
    """The rank of each virtual stage under built-in ``name``."""
    return v_shape(p) if name in V_SCHEDULES else looped(p, stages_per_rank(name, v))


def seq_chunks_batch_problem(k: int, seq_len: int, documents: bool, limits: Mapping[str, str],
                             recompute: str = "none") -> str | None:
    """The batch's, the model's and the runtime's side of ``k`` sequence chunks (one line with the
    fix), or None: the sequence divides into k equal chunks; no packed documents (nor so per-batch
    assignment, which only runs them: the earlier chunks' keys/values carry no document mask);
    autopar's attention runs in place of the model's (limits ``attention``, ``cp``, ``any``), as
    for CP; no recomputation or offload (``recompute``: the runtime finds a chunk's keys/values by
    the order of its forwards, which a replayed forward breaks: codegen/runtime/seq_chunks.py)."""
    if k == 1:
        return None
    if recompute != "none":
        return (f"seq_chunks={k} with recompute={recompute}: autopar's runtime runs sequence chunks without "
                "recomputation or offload only; set recompute=none or seq_chunks=1")
    if seq_len % k:
        return f"seq_chunks={k} must divide the sequence length {seq_len}; pick a divisor of it (e.g. 2 or 4)"
    if documents:
        return (f"seq_chunks={k} with packed documents (--seq-lens): a chunk's attention to the earlier chunks "
                "has no document mask; plan without --seq-lens or set seq_chunks=1")
    for key in ("attention", "cp", "any"):
        if key in limits:
            return f"seq_chunks={k} runs autopar's attention in place of the model's, but {limits[key]}; set seq_chunks=1"
    return None


def builtin_problem(name: str, p: int, m: int, v: int = 1) -> str | None:
    """Why built-in ``name`` cannot be made for ``p`` ranks, ``m`` micro-batches and ``v``
    chunks per rank (one line with the fix), or None. ``v`` is 1 or 2 for the V schedules
    (their two stages per rank)."""
    if name not in BUILTINS:
        return f"unknown pipeline schedule {name!r}: use one of {', '.join(BUILTINS)}"
    for k, val in (("p", p), ("m", m), ("v", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            return f"pipeline {k} must be a positive integer, got {val!r}"
    if name in V_SCHEDULES:
        if v > 2:
            return f"{name} runs 2 stages per rank, not v = {v}"
        if m < 2 * p:
            return f"{name} needs at least 2 pp = {2 * p} micro-batches, got {m}; raise the global batch or lower pp"
    elif v > 1 and name != "interleaved-1f1b":
        return f"v = {v} chunks per rank needs schedule 'interleaved-1f1b', not {name!r}"
    if name == "interleaved-1f1b" and v > 1 and m % p:
        return (f"interleaved-1f1b needs micro-batches divisible by pp: m = {m}, pp = {p}; "
                f"pick a global batch giving a multiple of {p}")
    return None


def builtin(name: str, p: int, m: int, v: int = 1, k: int = 1) -> Schedule:
    """Built-in schedule ``name`` over ``p`` ranks and ``m`` micro-batches (``v`` chunks per
    rank for interleaved-1f1b; 1 or 2 for the V schedules), each micro-batch cut into ``k``
    sequence chunks (``m k`` units; :data:`CHUNK_SCHEDULES`)."""
    if (why := builtin_problem(name, p, m, v) or (seq_chunks_problem(k, name, max(p, 2), v) if k != 1 else None)):
        raise ScheduleError(why)
    return BUILTINS[name](p, m, v, k) if k > 1 else BUILTINS[name](p, m, v)


def layout_problem(s: Schedule, pp: int, vpp: int, m: int, k: int = 1) -> str | None:
    """Why schedule ``s`` cannot run a pipeline of ``pp`` ranks, ``pp * vpp`` stages and ``m``
    micro-batches each cut into ``k`` sequence chunks (one line with the fix), or None."""
    have, want = (s.p, s.n_stages, s.n_sequences), (pp, pp * vpp, m)
    if have == want and s.seq_chunks == k:
        return None
    if have == want:
        return (f"schedule {s.name!r} cuts each micro-batch into {s.seq_chunks} sequence chunks, the layout into {k}; "
                f"set seq_chunks={s.seq_chunks}")
    return (f"schedule {s.name!r} has {have[0]} ranks, {have[1]} stages and {have[2]} micro-batches; this layout has "
            f"pp={want[0]}, {want[1]} stages (pp x vpp) and {want[2]} micro-batches (global batch / (dp x mbs)); "
            "set pp, vpp, dp and mbs to match it")


def _make(name: str, m: int, stage_rank: tuple[int, ...], ranks, k: int = 1) -> Schedule:
    return Schedule(name=name, n_microbatches=m, stage_rank=tuple(stage_rank),
                    ranks=tuple(tuple(order) for order in ranks), seq_chunks=k)
