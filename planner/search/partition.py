r"""Pipeline-stage partitioning: stage boundaries and per-stage recompute under memory.

Given one parallel configuration (``pp`` ranks, ``v`` virtual chunks per rank, ``m``
micro-batches, a schedule), split the ``L`` layers into ``S = pp * v`` contiguous,
non-empty virtual stages (virtual stage ``j`` runs on rank ``j % pp``; rank ``r``
holds chunks ``r, r + pp, ...``) and pick one recompute policy per virtual stage,
minimising the step time subject to every rank's memory capacity.

Inputs are plain floats (:class:`PartitionProblem`); the answer is a
:class:`PartitionResult` wrapping a :class:`planner.plan.Partition`. Four entry points
share one evaluation (:func:`evaluate_partition`), so their numbers compare directly:

- :func:`solve_partition`   the ILP (PuLP; CBC by default, HiGHS on request)
- :func:`greedy_partition`  a fast heuristic split: the ILP's warm start and fallback
- :func:`even_partition`    equal layer counts, one policy (``--even-split``)
- :func:`evaluate_partition` the numbers of a given split

Model
=====
Per layer ``i`` and policy ``q``: ``fwd[i][q]``, ``bwd[i][q]`` (backward incl. any
recompute) seconds per micro-batch, ``act[i][q]`` activation bytes kept per in-flight
micro-batch, ``static[i]`` bytes (weights, grads, optimizer state) and ``out_p2p[i]``,
the seconds the stage ending at layer ``i`` is charged per micro-batch for the
boundary after it (pass send + receive of both directions if both should count;
``cost_models.pipeline`` charges one transfer to each of F and B).

Virtual stage ``j`` with layers ``I_j`` and policy ``q_j``::

    F_j = sum_{i in I_j} fwd[i][q_j] + (out_p2p[last(I_j)] if j < S-1 else 0)
    B_j = sum_{i in I_j} bwd[i][q_j]
    t_j = F_j + B_j                                   (``stage_time``)
    R_r = sum_{j : j % pp == r} t_j                   (rank load per micro-batch)
    M   = max_r R_r

Objective (seconds per step). The bottleneck rank runs ``m`` micro-batches of its load,
``m * M``; the fill/drain bubble is one micro-batch's trip through the other stages,
shrunk ``v`` times by interleaving::

    gpipe, 1f1b, interleaved-1f1b:   T = m * M + (sum_j t_j - M) / v
    zb-h1:                           T = m * M + (pp-1)/pp * sum_j G_j
        G_j = max(F_j + beta B_j,  gamma B_j)    (``cost_models.pipeline.zb_h1_bubble_terms``)

(zb-h1 splits the backward into input-gradient ``(1-a) B_j`` and weight-gradient
``a B_j``; ``G_j`` is the per-stage bubble increment ``max(f + b - min(w, b), b)`` of
Qi et al. 2023.) For ``v = 1`` the first form is the classic
``sum_j t_j + (m-1) max_j t_j``. For uniform stages (``t_j = t``) and zero p2p all forms
equal the closed forms of ``cost_models.pipeline.estimate_step`` exactly:
``(m + pp - 1) t`` (gpipe/1f1b), ``(m v + pp - 1) t`` with ``t`` per chunk
(interleaved), ``m (f+b+w) + (pp-1) max(f + b - min(w,b), b)`` (zb-h1, m >= pp).
For uneven stages they are the standard linear approximation (bottleneck throughput
plus the sum-of-stages pipeline fill): ``cost_models.pipeline.linear_step``, bounded like the
simulator by ``throughput_floor`` below and ``estimate_step`` above (tests/test_step_model.py);
the simulator judges the split it proposes (``planner.search.stage_split.split_and_estimate``).

Memory of rank ``r`` (``cost_models.memory.rank_memory``, the one memory rule; the inputs are
its per-group figures, ``planner.search.stage_split.partition_problem``)::

    mem_r = sum_{j % pp == r} [ sum_{i in I_j} static[i] + inflight[j] * sum_{i in I_j} act[i][q_j] + extra[j] ]
          + max_{j % pp == r} O_j + max_{j % pp == r, i in I_j} transient[i]
    O_j   = the overshoot of stage j's layers composed in order, o <- max(o - act[i][q_j], peak[i][q_j])
    mem_r <= capacity

(``peak`` and ``transient`` default to 0: then the rank's memory is linear.) In the ILP the two
maxima are continuous ``X_r``, ``T_r`` bounded below through binaries ``p_jk`` (segment k has
layers in stage j): ``T_r >= transient_k p_jk``; ``X_r >= X_j >= peak_kq - sum_{k' > k} act_k'q
z_jk'q - peak_kq (2 - p_jk - y_jq)`` (within a segment its last layer in the stage is the
worst). They are least at the maxima, so the constraint charges every split exactly
(``ilp_rank_memory``; tests/test_memory_model.py). ``inflight[j] >= 1`` when peaks are given.

ILP with segment compression
----------------------------
Consecutive layers with the same class and identical cost entries form a *segment*
``k`` = layers ``[s_k, e_k)``, ``n_k = e_k - s_k`` (a 126-block transformer is one
segment). The model decides, per stage, *how many* layers of each segment it takes;
its size is O(#segments x #stages), independent of the layer count.

Boundary ``j`` (``j = 0..S-2``, the number of layers in stages ``0..j``) is
``b_j = sum_k (s_k u_jk + w_jk)`` with binaries ``u_jk`` (boundary j falls in segment
k, i.e. ``s_k < b_j <= e_k``), ``sum_k u_jk = 1``, and integers
``u_jk <= w_jk <= n_k u_jk``. The number of segment-k layers in stages ``0..j`` is
then linear: ``C_jk = n_k sum_{k' > k} u_jk' + w_jk`` (``C_{-1,k} = 0``,
``C_{S-1,k} = n_k``), and stage j takes ``x_jk = C_jk - C_{j-1,k}`` of them.
Ordering and non-emptiness: ``b_j >= b_{j-1} + 1``, ``b_{S-2} <= L - 1``. The last
layer of stage j lies in the segment holding boundary j, so its p2p is
``sum_k out_p2p_k u_jk``.

Policy: binaries ``y_jq``, ``sum_q y_jq = 1``; the product ``x_jk y_jq`` is the
continuous ``z_jkq`` with ``sum_q z_jkq = x_jk``, ``0 <= z_jkq <= cap_jk y_jq``
(exact: only the chosen policy's ``z`` can be non-zero, and it must equal ``x_jk``).
``F_j, B_j, t_j, mem_r`` are linear in ``z`` and ``u``; ``M >= R_r`` (and
``G_j >=`` both of its terms for zb-h1) are continuous, and the objective is linear
since its coefficients ``m - 1/v`` (of M) and ``1/v`` (of t_j) are >= 0.

Tie-breaking: a tiny secondary term ``eps * (sum_j (j+1) b_j + sum_j rank(q_j))``
prefers early boundaries and the first-listed policy among equal-cost choices; the
solver runs single-threaded, so the same problem yields the same Partition.

When no split fits, a second ILP with the same structure minimises the worst rank
overrun ``max_r (mem_r - capacity)``; the result is ``status="infeasible"`` with that
best-effort split and ``shortfall = {"rank", "stage", "bytes", ...}``.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from planner.plan import Partition
from planner.search.partition_greedy import greedy_partition
from planner.search.partition_ilp import PartitionILP
from planner.search.partition_problem import (PartitionProblem, PartitionResult, evaluate_partition, even_partition,
                                              quiet_pulp_deprecations, segment_classes, segments, step_objective)
from planner.search.partition_solvers import lp_bound, run_model
from planner.search.incumbents import faster

__all__ = [
    "PartitionProblem", "PartitionResult", "solve_partition", "greedy_partition",
    "even_partition", "evaluate_partition", "step_objective", "segments",
]


@quiet_pulp_deprecations
def ilp_rank_memory(problem: PartitionProblem, partition: Partition) -> list[float]:
    """Bytes per pp rank the ILP's memory constraint charges for ``partition``: the split's
    variables fixed at their values, the rank maxima (``X``, ``T``) the least the constraints
    allow (an LP). What the property tests hold equal to ``cost_models.memory.rank_memory``."""
    import pulp

    pr = replace(problem, capacity=math.inf)  # no constraint to meet; bytes scaled by the problem's own size
    model = PartitionILP(pr, segment_classes(pr), "time")
    model.set_start(partition)
    free = {v.name for v in [*model.X.values(), *model.Xr, *model.Tr]}
    for v in model.prob.variables():
        if v.name not in free:
            v.lowBound = v.upBound = v.varValue
    model.prob.setObjective(pulp.lpSum(model.mem_rank))
    if free:
        model.prob.solve(pulp.PULP_CBC_CMD(msg=False, threads=1))
        if model.prob.status != pulp.LpStatusOptimal:
            raise RuntimeError(f"the ILP rejects its own split {partition}: {pulp.LpStatus[model.prob.status]}")
    return [pulp.value(e) * model.mscale for e in model.mem_rank]


def _infeasible(pr: PartitionProblem, res: PartitionResult) -> PartitionResult:
    res.status, res.gap = "infeasible", math.nan
    if res.shortfall is None:     # rounding at the edge: a zero overrun on the fullest rank
        r = max(range(pr.pp), key=lambda i: res.rank_memory[i])
        res.shortfall = {"rank": r, "stage": r, "bytes": 0.0, "gib": 0.0,
                         "rank_memory": res.rank_memory[r], "capacity": pr.capacity,
                         "virtual_stages": list(range(r, pr.n_stages, pr.pp))}
    return res


def solve_partition(problem: PartitionProblem, *, solver: str = "cbc", time_limit: float = 10.0,
                    gap_rel: float = 1e-4, warm_start: bool = True) -> PartitionResult:
    """The stage ILP. ``solver``: "cbc" (default, bundled with PuLP), "highs", or "auto"
    (HiGHS when installed, else CBC). Single-threaded and deterministic.

    Steps: the greedy heuristic first (milliseconds); if it finds no fitting split, the
    smallest achievable worst-rank overrun decides feasibility (exact furthest-first
    packing for v = 1, the memory ILP for v > 1) and an infeasible problem returns at
    once with ``status="infeasible"``, the best-effort split and its ``shortfall``.
    Otherwise the time ILP runs, warm-started from the greedy split.

    ``status`` is "optimal" (within ``gap_rel``) or "feasible (gap X%)" when the time
    limit stopped the search (gap from the solver, or against the LP bound). If the
    solver returns nothing in time, the greedy answer comes back, labelled so."""
    t0 = time.perf_counter()
    segs = segment_classes(problem)
    start, decided = _feasibility_phase(problem, segs, solver, time_limit)
    if decided is not None:
        res = decided
    elif (fast := _fastest_policy_split(problem, solver, time_limit, gap_rel, warm_start)) is not None:
        res = fast
    else:
        model = PartitionILP(problem, segs, "time")
        res = _time_phase(problem, model, start, solver, time_limit, gap_rel, warm_start)
        res.n_vars, res.n_constraints = model.n_vars, model.n_constraints
    res.solve_s = time.perf_counter() - t0
    res.n_segments = len(segs)
    return res


SHORTCUT_TIME_SHARE = 0.25  # of the time limit, for the fastest policy's ILP (unproven in time: the full ILP runs)


def _fastest_policy(pr: PartitionProblem) -> str | None:
    """The policy no slower than every other on every layer, forward and backward; None if none is."""
    for q in pr.policies:
        if all(f[q] <= f[p] and b[q] <= b[p] for f, b in zip(pr.fwd, pr.bwd) for p in pr.policies):
            return q
    return None


def _fastest_policy_split(pr: PartitionProblem, solver: str, time_limit: float, gap_rel: float,
                          warm_start: bool) -> PartitionResult | None:
    """With several policies one of which (``q``) is the fastest on every layer (``none``): the split
    that is time-optimal under ``q`` alone with memory ignored, when it fits under ``q``. The
    objective only grows with any stage's time, so ``T(split, q) <= T(split, any policies)`` and
    no split under any policies beats it: it solves the whole problem with one small
    single-policy ILP instead of the per-stage policy choice (Llama-3 70B, pp4 v2 across two regions:
    0.05 s against 0.5 s under HiGHS). None where this does not apply, or that ILP is not proven
    optimal within :data:`SHORTCUT_TIME_SHARE` of the time limit."""
    q = _fastest_policy(pr) if len(pr.policies) > 1 else None
    if q is None or not greedy_partition(replace(pr, policies=(q,))).feasible:  # q fits no split: skip at once
        return None
    free = solve_partition(replace(pr, policies=(q,), capacity=math.inf), solver=solver,
                           time_limit=time_limit * SHORTCUT_TIME_SHARE, gap_rel=gap_rel, warm_start=warm_start)
    if free.partition is None or free.status != "optimal":
        return None
    res = evaluate_partition(pr, free.partition, solver=free.solver)
    if not res.feasible:
        return None
    res.status, res.gap, res.ilp_objective_s = free.status, free.gap, free.ilp_objective_s
    res.n_vars, res.n_constraints = free.n_vars, free.n_constraints
    return res


@quiet_pulp_deprecations
def _feasibility_phase(pr: PartitionProblem, segs: list, solver: str,
                       time_limit: float) -> tuple[PartitionResult, PartitionResult | None]:
    """(the time ILP's start, or the answer when no split fits): the greedy split; when it does
    not fit, the exact min-max-memory split decides (v = 1) or the memory ILP (v > 1)."""
    import pulp

    greedy = greedy_partition(pr)
    if greedy.feasible:
        return greedy, None
    if pr.v == 1:     # greedy's fallback is the exact min-max-memory split
        return greedy, _infeasible(pr, greedy)
    mm = PartitionILP(pr, segs, "memory")
    st2, sol2, label, _ = run_model(mm, solver, min(time_limit, 1.0), 1e-3)
    best_effort = None
    if sol2 in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        best_effort = evaluate_partition(pr, mm.extract(), solver=label)
        if best_effort.feasible:
            return best_effort, None     # fits: a start for the time ILP
        proven = st2 == pulp.LpStatusOptimal and sol2 == pulp.LpSolutionOptimal
        lb = None if proven else lp_bound(mm, solver, time_limit)
        if proven or (lb is not None and lb > 1e-9):
            res = _infeasible(pr, best_effort)
            res.n_vars, res.n_constraints = mm.n_vars, mm.n_constraints
            return greedy, res
    if best_effort is not None and max(best_effort.rank_memory) < max(greedy.rank_memory):
        greedy = best_effort
    return greedy, None


@quiet_pulp_deprecations
def _time_phase(pr: PartitionProblem, model: PartitionILP, start: PartitionResult, solver: str, time_limit: float,
                gap_rel: float, warm_start: bool) -> PartitionResult:
    """The time ILP from ``start`` (warm when it fits): its split, never worse than the start,
    labelled with its optimality gap; the start when the solver finds nothing."""
    import pulp

    warm = warm_start and start.feasible
    if warm:
        model.set_start(start.partition)
    status, sol_status, label, gap = run_model(model, solver, time_limit, gap_rel, warm)
    if sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if status == pulp.LpStatusInfeasible and not start.feasible:   # v > 1, memory ILP undecided
            return _infeasible(pr, start)
        res = start   # time limit without any solution: the heuristic's answer
        res.status, res.gap = ("feasible (gap unknown)", math.nan) if res.feasible else ("infeasible", math.nan)
        res.solver = f"{label}+greedy"
        return res
    res = evaluate_partition(pr, model.extract(), solver=label)
    res.ilp_objective_s = model.objective_s()
    if start.feasible and faster(start.objective_s, res.objective_s):
        res = evaluate_partition(pr, start.partition, solver=label)   # never worse than the start
    proven = status == pulp.LpStatusOptimal and sol_status == pulp.LpSolutionOptimal
    if gap is None:
        if proven:
            gap = 0.0
        else:
            obj = pulp.value(model.prob.objective)
            lb = lp_bound(model, solver, time_limit)
            gap = max(0.0, (obj - lb) / abs(obj)) if (lb is not None and obj) else math.nan
    if res.shortfall is not None:   # solver tolerance at the capacity edge
        res = _infeasible(pr, res)
    elif (proven and (gap is None or gap <= gap_rel)) or gap <= gap_rel:
        res.status = "optimal"
    else:
        res.status = f"feasible (gap {100 * gap:.1f}%)"
    res.gap = gap
    return res
