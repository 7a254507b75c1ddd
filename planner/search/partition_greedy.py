"""A fast stage split, the ILP's warm start: a greedy min-max split with per-rank recompute
policies, returning the ILP's PartitionResult (the ILP warm-starts from it; see
planner/search/partition.py for the model, planner/search/partition_problem.py for the even split).
"""
from __future__ import annotations

import bisect
import itertools
import math
import time
from typing import Callable, Sequence

from planner.search.partition_problem import (MEM_TOL, PartitionProblem, PartitionResult, chunk_overshoot,
                                              evaluate_partition)
from planner.plan import Partition


# ---------------------------------------------------------------------------------------
# greedy heuristic
# ---------------------------------------------------------------------------------------
class _Prefix:
    """Prefix sums per policy for O(1) range costs."""

    def __init__(self, pr: PartitionProblem):
        self.pr = pr
        L = pr.n_layers
        self.T: dict[str, list[float]] = {}
        self.A: dict[str, list[float]] = {}
        self.F: dict[str, list[float]] = {}
        for q in pr.policies:
            t, a, f = [0.0], [0.0], [0.0]
            for i in range(L):
                t.append(t[-1] + pr.fwd[i][q] + pr.bwd[i][q])
                f.append(f[-1] + pr.fwd[i][q])
                a.append(a[-1] + pr.act[i][q])
            self.T[q], self.A[q], self.F[q] = t, a, f
        s = [0.0]
        for i in range(L):
            s.append(s[-1] + pr.static[i])
        self.Sx = s
        self.once = any(pr.transient) or any(any(d.values()) for d in pr.peak)

    def time(self, q: str, j: int, lo: int, hi: int) -> float:
        T = (self.T[q][hi] - self.T[q][lo]) * self.pr.slow[j]
        return T + (self.pr.out_p2p[hi - 1] if j < self.pr.n_stages - 1 else 0.0)

    def mem(self, q: str, j: int, lo: int, hi: int) -> float:
        """Stage j's bytes as a rank of its own (exact for v = 1; for v > 1 the sum over a rank's
        chunks over-counts what the rank holds once, a safe side for a heuristic)."""
        pr = self.pr
        once = chunk_overshoot(pr, lo, hi, q) + max(pr.transient[lo:hi], default=0.0) if self.once else 0.0
        return (self.Sx[hi] - self.Sx[lo] + pr.inflight[j] * (self.A[q][hi] - self.A[q][lo])
                + pr.extra[j] + once)


def _furthest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Largest e in [lo, hi] with ok(e) for monotone (true then false) ok; lo - 1 if none."""
    if not ok(lo):
        return lo - 1
    a, b = lo, hi
    while a < b:
        mid = (a + b + 1) // 2
        if ok(mid):
            a = mid
        else:
            b = mid - 1
    return a


def _greedy_split(px: _Prefix, T: float, budget: list[float] | None,
                  pols: Sequence[str]) -> list[tuple[int, int]] | None:
    """Furthest-first packing: each stage takes as many layers as one policy allows with
    stage time <= T (and stage memory <= budget[j]); None if the last stage overflows."""
    pr = px.pr
    L, S = pr.n_layers, pr.n_stages
    bounds, a = [], 0
    for j in range(S):
        max_end = L - (S - 1 - j)
        if j == S - 1:
            if not any(px.time(q, j, a, L) <= T and (budget is None or px.mem(q, j, a, L) <= budget[j])
                       for q in pols):
                return None
            bounds.append((a, L))
            break
        best = a
        for q in pols:
            Tq = px.T[q]
            # time without p2p is monotone: bisect on prefix sums
            e = bisect.bisect_right(Tq, Tq[a] + T, lo=a + 1, hi=max_end + 1) - 1
            if budget is not None and e > a:
                e = min(e, _furthest(a + 1, e, lambda x, q=q: px.mem(q, j, a, x) <= budget[j]))
            while e > best and px.time(q, j, a, e) > T:   # p2p is not monotone: step back
                e -= 1
            best = max(best, e)
        if best == a:
            return None
        bounds.append((a, best))
        a = best
    return bounds


def _rank_policies(pr: PartitionProblem, px: _Prefix, bounds: list[tuple[int, int]]) -> tuple[list[str], bool]:
    """Per rank, the policy combination of its chunks that fits and minimises its load
    (this minimises M and sum t together); if none fits, the least-memory one."""
    S, pp, P = pr.n_stages, pr.pp, pr.policies
    rec = [P[0]] * S
    ok_all = True
    cap = pr.capacity * (1 + MEM_TOL)
    for r in range(pp):
        js = list(range(r, S, pp))
        tq = {(j, q): px.time(q, j, *bounds[j]) for j in js for q in P}
        mq = {(j, q): px.mem(q, j, *bounds[j]) for j in js for q in P}
        best, best_key, least, least_mem = None, None, None, math.inf
        if len(P) ** len(js) <= 729:
            combos = itertools.product(P, repeat=len(js))
        else:   # too many: uniform choices plus per-chunk min-memory
            combos = [tuple([q] * len(js)) for q in P]
        for combo in combos:
            mem = sum(mq[j, q] for j, q in zip(js, combo))
            load = sum(tq[j, q] for j, q in zip(js, combo))
            if mem < least_mem:
                least, least_mem = combo, mem
            if mem <= cap:
                key = (load, tuple(P.index(q) for q in combo))
                if best_key is None or key < best_key:
                    best, best_key = combo, key
        if best is None:
            ok_all = False
            best = least
        for j, q in zip(js, best):
            rec[j] = q
    return rec, ok_all


def _minmax_time_split(px: _Prefix, budget: list[float] | None, pols: Sequence[str]) -> list[tuple[int, int]] | None:
    pr = px.pr
    hi = max(px.T[q][-1] for q in pols) + max(pr.out_p2p) + 1e-12
    best = _greedy_split(px, hi, budget, pols)
    if best is None:
        return None
    lo = 0.0
    for _ in range(40):
        if hi - lo <= 1e-6 * hi:
            break
        mid = 0.5 * (lo + hi)
        b = _greedy_split(px, mid, budget, pols)
        if b is None:
            lo = mid
        else:
            hi, best = mid, b
    return best


def _minmax_mem_split(px: _Prefix) -> list[tuple[int, int]]:
    """Split minimising the largest stage memory, each stage under its least-memory
    policy. Exact minimum of the worst rank memory for v = 1 (stage memory grows with
    its range, so furthest-first packing decides each threshold); best effort for v > 1."""
    pr = px.pr
    L, S, P = pr.n_layers, pr.n_stages, pr.policies

    def split(Mx: float):
        bounds, a = [], 0
        for j in range(S):
            if j == S - 1:
                if not any(px.mem(q, j, a, L) <= Mx for q in P):
                    return None
                bounds.append((a, L))
                break
            e = max(_furthest(a + 1, L - (S - 1 - j), lambda x, q=q: px.mem(q, j, a, x) <= Mx) for q in P)
            if e <= a:
                return None
            bounds.append((a, e))
            a = e
        return bounds

    hi = max(px.mem(q, j, 0, L) for j in range(S) for q in P) + 1.0
    lo, best = 0.0, split(hi)
    for _ in range(100):
        if hi - lo <= 1e-12 * hi:
            break
        mid = 0.5 * (lo + hi)
        b = split(mid)
        if b is None:
            lo = mid
        else:
            hi, best = mid, b
    return best


def greedy_partition(problem: PartitionProblem) -> PartitionResult:
    """Fast heuristic: min-max stage time splits (binary search on the bottleneck time,
    furthest-first packing) — one memory-aware (per-chunk budget capacity / v), one per
    fixed policy — then per rank the fastest policy combination that fits; the best by
    objective wins. Infeasible: the min-max-memory split with its shortfall."""
    t0 = time.perf_counter()
    pr = problem
    px = _Prefix(pr)
    S = pr.n_stages
    cands: list[list[tuple[int, int]]] = []
    if math.isfinite(pr.capacity):
        budget = [pr.capacity / pr.v] * S     # per chunk; exact for v = 1 (mem includes extra)
        b = _minmax_time_split(px, budget, pr.policies)
        if b is not None:
            cands.append(b)
    for q in pr.policies:
        b = _minmax_time_split(px, None, (q,))
        if b is not None and b not in cands:
            cands.append(b)
    best: PartitionResult | None = None
    for bounds in cands:
        rec, ok = _rank_policies(pr, px, bounds)
        if not ok:
            continue
        res = evaluate_partition(pr, Partition(bounds, rec), solver="greedy")
        if res.feasible and (best is None or res.objective_s < best.objective_s * (1 - 1e-12)):
            best = res
    if best is None:
        bounds = _minmax_mem_split(px)
        rec, _ = _rank_policies(pr, px, bounds)
        best = evaluate_partition(pr, Partition(bounds, rec), solver="greedy")
        if best.shortfall is None:      # fits after all (rounding at the edge)
            best.status = "feasible"
    best.solve_s = time.perf_counter() - t0
    return best
