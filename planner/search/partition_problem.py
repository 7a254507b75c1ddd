"""The stage-partition problem, its result, and how a given split is scored.

Shared by the ILP (planner/search/partition.py) and the heuristics (planner/search/partition_greedy.py);
the mathematics is in planner/search/partition.py's docstring.
"""
from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

from cost_models.pipeline import WGRAD_FRAC, linear_step
from planner.plan import RECOMPUTE, SCHEDULES, Partition

MEM_TOL = 1e-9          # relative slack when checking capacity


def quiet_pulp_deprecations(fn):
    """PuLP 3.x warns about its 4.0 API (LpVariable, PULP_CBC_CMD, constraints dict) on
    every call; the 2.8+ API used here still works, so keep the noise out of callers."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return fn(*a, **kw)
    return wrapper


# ---------------------------------------------------------------------------------------
# problem and result
# ---------------------------------------------------------------------------------------
@dataclass
class PartitionProblem:
    """One configuration's partitioning problem, in plain floats (seconds, bytes)."""
    fwd: list[dict[str, float]]       # per layer: {policy: forward s per micro-batch}
    bwd: list[dict[str, float]]       # per layer: {policy: backward s per micro-batch, incl. recompute}
    act: list[dict[str, float]]       # per layer: {policy: activation bytes per in-flight micro-batch}
    static: list[float]               # per layer: weights + grads + optimizer bytes
    out_p2p: list[float]              # per layer: s charged to the stage ending at this layer
    classes: list[str]                # per layer: signature; consecutive equal ones form a segment
    pp: int
    v: int
    m: int
    schedule: str                     # gpipe | 1f1b | interleaved-1f1b | zb-h1
    inflight: list[float]             # per virtual stage: micro-batches held at peak
    capacity: float                   # bytes per rank (after reserve and buffers); inf = no limit
    extra: list[float] = field(default_factory=list)   # per virtual stage extra bytes (default 0)
    policies: tuple[str, ...] = RECOMPUTE
    peak: list[dict[str, float]] = field(default_factory=list)  # per layer: {policy: overshoot} (default 0)
    transient: list[float] = field(default_factory=list)        # per layer: weight-gradient working set (default 0)
    wgrad_frac: float = WGRAD_FRAC    # zb-h1: share of bwd that is the weight gradient (W)
    slow: list[float] = field(default_factory=list)  # per virtual stage: its rank's device time over the
    #                                 reference device's (mixed clusters; default 1: every stage alike)

    def __post_init__(self) -> None:
        L = len(self.fwd)
        if L == 0:
            raise ValueError("PartitionProblem: no layers")
        for name in ("bwd", "act", "static", "out_p2p", "classes"):
            if len(getattr(self, name)) != L:
                raise ValueError(f"PartitionProblem.{name}: {len(getattr(self, name))} entries for {L} layers")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        for k in ("pp", "v", "m"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise ValueError(f"PartitionProblem.{k}={getattr(self, k)!r}: must be a positive integer")
        if self.v > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(f"v={self.v} needs schedule=interleaved-1f1b")
        S = self.pp * self.v
        if S > L:
            raise ValueError(f"{S} virtual stages for {L} layers: use at most {L} stages")
        if not self.extra:
            self.extra = [0.0] * S
        if not self.slow:
            self.slow = [1.0] * S
        if len(self.slow) != S or any(not x > 0 for x in self.slow):
            raise ValueError(f"PartitionProblem.slow needs {S} positive entries, got {self.slow}")
        if not self.peak:
            self.peak = [{q: 0.0 for q in self.policies} for _ in range(L)]
        if not self.transient:
            self.transient = [0.0] * L
        if len(self.peak) != L or len(self.transient) != L:
            raise ValueError(f"PartitionProblem.peak/transient need {L} entries, got {len(self.peak)}/{len(self.transient)}")
        if any(x < 1.0 for x in self.inflight) and any(any(d.values()) for d in self.peak):
            raise ValueError("PartitionProblem.inflight: at least one micro-batch per virtual stage when peak is given "
                             "(cost_models.memory.overshoot counts the back-propagated one whole)")
        if len(self.inflight) != S or len(self.extra) != S:
            raise ValueError(f"inflight/extra need {S} entries (one per virtual stage), "
                             f"got {len(self.inflight)}/{len(self.extra)}")
        if not self.policies:
            raise ValueError("PartitionProblem.policies is empty")
        self.policies = tuple(self.policies)
        for i in range(L):
            for name in ("fwd", "bwd", "act", "peak"):
                missing = [q for q in self.policies if q not in getattr(self, name)[i]]
                if missing:
                    raise ValueError(f"layer {i}: {name} lacks policies {missing}")
        if not 0.0 <= self.wgrad_frac <= 1.0:
            raise ValueError(f"wgrad_frac={self.wgrad_frac}: must be in [0, 1]")

    @property
    def n_layers(self) -> int:
        return len(self.fwd)

    @property
    def n_stages(self) -> int:
        return self.pp * self.v


@dataclass
class PartitionResult:
    partition: Partition
    objective_s: float                # step seconds under the module's objective
    stage_time: list[float]           # t_j = F_j + B_j per virtual stage
    rank_memory: list[float]          # bytes per pp rank
    status: str                       # "optimal" | "feasible (gap X%)" | "feasible" | "infeasible"
    gap: float                        # relative optimality gap; nan when unknown (heuristics)
    solve_s: float                    # wall seconds spent
    solver: str                       # "cbc" | "highs" | "greedy" | "even" | "given"
    shortfall: dict | None = None     # when infeasible: {"rank", "stage", "bytes", "gib", ...}
    n_vars: int = 0                   # ILP size (0 for heuristics)
    n_constraints: int = 0
    n_segments: int = 0
    ilp_objective_s: float = math.nan  # the solver's own objective at its split (tie-break aside); nan if not the ILP's

    @property
    def feasible(self) -> bool:
        return self.status != "infeasible"

    @property
    def max_stage_time(self) -> float:
        return max(self.stage_time)


# ---------------------------------------------------------------------------------------
# segments
# ---------------------------------------------------------------------------------------
@dataclass
class Segment:
    """Consecutive layers of one signature: the ILP decides their stage boundaries as one class."""
    start: int
    end: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    act: tuple[float, ...]
    static: float
    p2p: float
    key: tuple
    peak: tuple[float, ...] = ()
    transient: float = 0.0

    @property
    def n(self) -> int:
        return self.end - self.start


def segments(problem: PartitionProblem) -> list[tuple[int, int]]:
    """The decision classes as half-open layer ranges ``[start, end)``."""
    return [(s.start, s.end) for s in segment_classes(problem)]


def segment_classes(pr: PartitionProblem) -> list[Segment]:
    P = pr.policies
    out: list[Segment] = []
    for i in range(pr.n_layers):
        f = tuple(float(pr.fwd[i][q]) for q in P)
        b = tuple(float(pr.bwd[i][q]) for q in P)
        a = tuple(float(pr.act[i][q]) for q in P)
        pk = tuple(float(pr.peak[i][q]) for q in P)
        key = (pr.classes[i], f, b, a, float(pr.static[i]), float(pr.out_p2p[i]), pk, float(pr.transient[i]))
        if out and out[-1].key == key:
            out[-1].end = i + 1
        else:
            out.append(Segment(i, i + 1, f, b, a, float(pr.static[i]), float(pr.out_p2p[i]), key, pk,
                               float(pr.transient[i])))
    return out


# ---------------------------------------------------------------------------------------
# evaluation (the one objective everything shares)
# ---------------------------------------------------------------------------------------
def step_objective(problem: PartitionProblem, stage_fwd: Sequence[float], stage_bwd: Sequence[float]) -> float:
    """The module's objective from per-virtual-stage F_j (incl. p2p) and B_j:
    ``cost_models.pipeline.linear_step``."""
    return linear_step(problem.schedule, problem.pp, problem.m, problem.v, stage_fwd, stage_bwd, problem.wgrad_frac)


def _shortfall(problem: PartitionProblem, rank_memory: list[float]) -> dict | None:
    cap = problem.capacity
    over = [mem - cap for mem in rank_memory]
    r = max(range(len(over)), key=lambda i: (over[i], -i))
    if over[r] <= MEM_TOL * max(1.0, abs(cap)):
        return None
    return {"rank": r, "stage": r, "bytes": over[r], "gib": over[r] / 2**30,
            "rank_memory": rank_memory[r], "capacity": cap,
            "virtual_stages": list(range(r, problem.n_stages, problem.pp))}


def chunk_overshoot(pr: PartitionProblem, lo: int, hi: int, q: str) -> float:
    """The back-propagation overshoot of layers ``[lo, hi)`` as one chunk under ``q``: the
    figures of consecutive runs compose as ``max(first - second's act, second)``
    (``cost_models.memory.ChunkMemory``); 0 for no layers."""
    o = 0.0
    for i in range(lo, hi):
        o = max(o - pr.act[i][q], pr.peak[i][q])
    return o


def rank_once(pr: PartitionProblem, bounds: Sequence[tuple[int, int]], rec: Sequence[str], r: int) -> float:
    """Bytes rank ``r`` holds once beyond its chunks' states and in-flight activations
    (``cost_models.memory.rank_memory``): the largest chunk overshoot and the largest layer's
    weight-gradient working set."""
    js = range(r, pr.n_stages, pr.pp)
    return (max(chunk_overshoot(pr, *bounds[j], rec[j]) for j in js)
            + max(pr.transient[i] for j in js for i in range(*bounds[j])))


def _stage_numbers(pr: PartitionProblem, bounds: Sequence[tuple[int, int]], rec: Sequence[str]):
    S = pr.n_stages
    F, B = [], []
    mem = [rank_once(pr, bounds, rec, r) for r in range(pr.pp)]
    for j, ((lo, hi), q) in enumerate(zip(bounds, rec)):
        f = sum(pr.fwd[i][q] for i in range(lo, hi)) * pr.slow[j] + (pr.out_p2p[hi - 1] if j < S - 1 else 0.0)
        b = sum(pr.bwd[i][q] for i in range(lo, hi)) * pr.slow[j]
        F.append(f)
        B.append(b)
        mem[j % pr.pp] += (sum(pr.static[i] for i in range(lo, hi))
                           + pr.inflight[j] * sum(pr.act[i][q] for i in range(lo, hi)) + pr.extra[j])
    return F, B, mem


def evaluate_partition(problem: PartitionProblem, partition: Partition, *, solver: str = "given",
                       solve_s: float = 0.0) -> PartitionResult:
    """Objective, stage times and rank memory of a given split. ``status`` is "feasible"
    or "infeasible" (with the worst rank's overrun in ``shortfall``)."""
    S = problem.n_stages
    if len(partition.bounds) != S:
        raise ValueError(f"partition has {len(partition.bounds)} stages, problem has {S}")
    partition.validate(problem.n_layers)
    rec = list(partition.recompute)
    for q in rec:
        if q not in problem.policies:
            raise ValueError(f"recompute {q!r} not among policies {problem.policies}")
    F, B, mem = _stage_numbers(problem, partition.bounds, rec)
    short = _shortfall(problem, mem)
    return PartitionResult(
        partition=Partition(list(partition.bounds), rec), objective_s=step_objective(problem, F, B),
        stage_time=[f + b for f, b in zip(F, B)], rank_memory=mem,
        status="infeasible" if short else "feasible", gap=math.nan, solve_s=solve_s,
        solver=solver, shortfall=short)


def even_partition(problem: PartitionProblem, policy: str = "none") -> PartitionResult:
    """Equal layer counts (first stages take the remainder), one policy everywhere."""
    t0 = time.perf_counter()
    part = Partition.even(problem.n_layers, problem.n_stages, policy)
    res = evaluate_partition(problem, part, solver="even")
    res.solve_s = time.perf_counter() - t0
    return res
