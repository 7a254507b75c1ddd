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
        G_j = max(F_j + (1 - a - min(a, 1-a)) B_j,  (1 - a) B_j),  a = wgrad_frac

(zb-h1 splits the backward into input-gradient ``(1-a) B_j`` and weight-gradient
``a B_j``; ``G_j`` is the per-stage bubble increment ``max(f + b - min(w, b), b)`` of
Qi et al. 2023.) For ``v = 1`` the first form is the classic
``sum_j t_j + (m-1) max_j t_j``. For uniform stages (``t_j = t``) and zero p2p all forms
equal the closed forms of ``cost_models.pipeline.estimate_step`` exactly:
``(m + pp - 1) t`` (gpipe/1f1b), ``(m v + pp - 1) t`` with ``t`` per chunk
(interleaved), ``m (f+b+w) + (pp-1) max(f + b - min(w,b), b)`` (zb-h1, m >= pp).
For uneven stages they are the standard linear approximation (bottleneck throughput
plus the sum-of-stages pipeline fill).

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

from planner.search.partition_greedy import greedy_partition
from planner.search.partition_problem import (PartitionProblem, PartitionResult, quiet_pulp_deprecations, Segment,
                                       chunk_overshoot, segment_classes, evaluate_partition, even_partition, segments,
                                       step_objective)
from planner.plan import Partition

__all__ = [
    "PartitionProblem", "PartitionResult", "solve_partition", "greedy_partition",
    "even_partition", "evaluate_partition", "step_objective", "segments",
]


# ---------------------------------------------------------------------------------------
# ILP
# ---------------------------------------------------------------------------------------
def _quiet_highs():
    """pulp.HiGHS that keeps highspy's construction banner off stdout and accepts a
    start solution (the variables' current values) like CBC's warmStart."""
    import pulp

    base = getattr(pulp, "HiGHS", None)
    if base is None or not base().available():
        return None

    class _HiGHS(base):  # type: ignore[misc, valid-type]
        warm: bool = False

        def createAndConfigureSolver(self, lp):  # noqa: N802 - pulp's name
            import os
            import sys
            sys.stdout.flush()
            saved = os.dup(1)
            try:
                with open(os.devnull, "w") as devnull:
                    os.dup2(devnull.fileno(), 1)
                    super().createAndConfigureSolver(lp)
            finally:
                os.dup2(saved, 1)
                os.close(saved)

        def buildSolverModel(self, lp):  # noqa: N802
            super().buildSolverModel(lp)
            if self.warm:
                import highspy
                cols = lp.variables()
                if all(v.varValue is not None for v in cols):
                    sol = highspy.HighsSolution()
                    sol.col_value = [float(v.varValue) for v in cols]
                    sol.value_valid = True
                    try:
                        lp.solverModel.setSolution(sol)
                    except Exception:  # pragma: no cover - older highspy
                        pass

    return _HiGHS


@quiet_pulp_deprecations
def _pick_solver(name: str, time_limit: float, gap_rel: float, warm: bool = False):
    import pulp

    name = name.lower()
    if name not in ("auto", "cbc", "highs"):
        raise ValueError(f"solver={name!r}: choose auto, cbc or highs")
    if name in ("auto", "highs"):
        cls = _quiet_highs()
        if cls is not None:
            s = cls(msg=False, timeLimit=time_limit, gapRel=gap_rel, threads=1, random_seed=0)
            s.warm = warm
            return s, "highs"
        cmd = getattr(pulp, "HiGHS_CMD", None)
        if cmd is not None:
            s = cmd(msg=False, timeLimit=time_limit, gapRel=gap_rel, threads=1)
            if s.available():
                return s, "highs"
        if name == "highs":
            from planner.errors import AutoparError

            raise AutoparError("solver=highs: HiGHS is not available: pip install 'autopar[highs]' (highspy) "
                               "or use solver='auto' (CBC)")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap_rel, threads=1,
                             warmStart=warm, options=["randomSeed 1", "randomCbcSeed 1"]), "cbc"


class _Model:
    """The segment-compressed ILP (see the module docstring)."""

    @quiet_pulp_deprecations
    def __init__(self, pr: PartitionProblem, segs: list[Segment], mode: str):
        import pulp

        self.pr, self.segs, self.mode = pr, segs, mode
        self.Mv = self.tj = self.G = None
        self.prob = pulp.LpProblem(f"partition_{mode}", pulp.LpMinimize)
        S = pr.n_stages
        self.tscale = max(sum(min(pr.fwd[i][q] + pr.bwd[i][q] for q in pr.policies) for i in range(pr.n_layers)) / S,
                          1e-30)
        self.mscale = pr.capacity if math.isfinite(pr.capacity) and pr.capacity > 0 else \
            max(max(sum(pr.static) + max(pr.inflight) * sum(max(a.values()) for a in pr.act), 1.0), 1.0)
        self._boundaries()
        self._policies()
        self._stage_layers()
        fwd, bwd, mem = self._stage_sums()
        self.mem_rank = self._rank_memory(mem)
        tie = self._tie_break()
        if mode == "time":
            self._time_objective(fwd, bwd, mem, tie)
        else:
            self._overrun_objective(tie)

    def _boundaries(self) -> None:
        """Boundary b_j in [j+1, L-S+j+1] as a segment choice u_jk and an offset w_jk inside it;
        boundaries strictly increasing."""
        import pulp

        pr, segs, prob = self.pr, self.segs, self.prob
        L, S = pr.n_layers, pr.n_stages
        self.u: dict[tuple[int, int], pulp.LpVariable] = {}
        self.w: dict[tuple[int, int], pulp.LpVariable] = {}
        b_expr = []
        for j in range(S - 1):
            blo, bhi = j + 1, L - S + j + 1
            ks = [k for k, s in enumerate(segs) if s.start < bhi and s.end >= blo]   # (s_k, e_k] meets [blo, bhi]
            for k in ks:
                s = segs[k]
                self.u[j, k] = pulp.LpVariable(f"u_{j}_{k}", cat="Binary")
                wlo, whi = max(1, blo - s.start), min(s.n, bhi - s.start)
                self.w[j, k] = pulp.LpVariable(f"w_{j}_{k}", lowBound=0, upBound=whi, cat="Integer")
                prob += self.w[j, k] >= wlo * self.u[j, k], f"wlo_{j}_{k}"
                prob += self.w[j, k] <= whi * self.u[j, k], f"whi_{j}_{k}"
            prob += pulp.lpSum(self.u[j, k] for k in ks) == 1, f"one_{j}"
            b_expr.append(pulp.lpSum(s.start * self.u[j, k] + self.w[j, k]
                                     for k, s in enumerate(segs) if (j, k) in self.u))
        for j in range(1, S - 1):
            prob += b_expr[j] - b_expr[j - 1] >= 1, f"order_{j}"
        self.b_expr = b_expr

    def _count(self, j: int, k: int):
        """Layers of segment k in stages 0..j (an expression in u and w)."""
        import pulp

        segs, S = self.segs, self.pr.n_stages
        if j < 0:
            return 0
        if j == S - 1:
            return segs[k].n
        e = pulp.lpSum(segs[k].n * self.u[j, k2] for k2 in range(k + 1, len(segs)) if (j, k2) in self.u)
        if (j, k) in self.w:
            e = e + self.w[j, k]
        return e

    def _policies(self) -> None:
        """One recompute policy y_jq per stage (no variables with a single policy)."""
        import pulp

        P, S = self.pr.policies, self.pr.n_stages
        self.y = {(j, q): pulp.LpVariable(f"y_{j}_{qi}", cat="Binary")
                  for j in range(S) for qi, q in enumerate(P)} if len(P) > 1 else {}
        if len(P) > 1:
            for j in range(S):
                self.prob += pulp.lpSum(self.y[j, q] for q in P) == 1, f"pol_{j}"

    def _stage_layers(self) -> None:
        """z_jkq: layers of segment k in stage j under policy q (the count itself with one policy),
        at most what fits the rank's memory under q when pricing time."""
        import pulp

        pr, segs, prob, mode = self.pr, self.segs, self.prob, self.mode
        L, S, K, pp, P = pr.n_layers, pr.n_stages, len(segs), pr.pp, pr.policies
        z: dict[tuple[int, int, str], object] = {}
        # bytes stage j may use when the other chunks of its rank hold only their extra
        room = [pr.capacity - sum(pr.extra[j2] for j2 in range(j % pp, S, pp)) for j in range(S)]
        for j in range(S):
            lo_l, hi_l = j, L - S + j + 1           # layers stage j may hold: [j, L-S+j+1)
            for k, s in enumerate(segs):
                capjk = min(s.end, hi_l) - max(s.start, lo_l)
                if capjk <= 0:
                    continue
                x = self._count(j, k) - self._count(j - 1, k)
                if len(P) == 1:
                    z[j, k, P[0]] = x
                    continue
                zs = []
                for qi, q in enumerate(P):
                    ub = capjk
                    if mode == "time" and math.isfinite(pr.capacity):
                        # integer rounding: at most N layers of this segment fit the stage
                        per = s.static + pr.inflight[j] * s.act[qi]
                        if per > 0:
                            ub = min(ub, max(0, math.floor(room[j] / per * (1 + 1e-9))))
                    var = pulp.LpVariable(f"z_{j}_{k}_{qi}", lowBound=0, upBound=capjk)
                    prob += var <= ub * self.y[j, q], f"zy_{j}_{k}_{qi}"
                    z[j, k, q] = var
                    zs.append(var)
                prob += pulp.lpSum(zs) == x, f"zx_{j}_{k}"
        if len(P) > 1:   # a stage is non-empty under its chosen policy (valid, tightens the LP)
            for j in range(S):
                for qi, q in enumerate(P):
                    prob += pulp.lpSum(z[j, k, q] for k in range(K) if (j, k, q) in z) >= self.y[j, q], \
                        f"nonempty_{j}_{qi}"
        self.z = z

    def _stage_sums(self) -> tuple[list, list, list]:
        """Per stage: forward (with its outgoing p2p) and backward time over tscale, memory over mscale."""
        import pulp

        pr, segs, z, P = self.pr, self.segs, self.z, self.pr.policies
        S, K, tscale, mscale = pr.n_stages, len(segs), self.tscale, self.mscale
        qi = {q: i for i, q in enumerate(P)}
        Fj, Bj, memj = [], [], []
        for j in range(S):
            terms = [(k, q) for k in range(K) for q in P if (j, k, q) in z]
            f = pulp.lpSum(segs[k].fwd[qi[q]] / tscale * z[j, k, q] for k, q in terms)
            if j < S - 1:
                f = f + pulp.lpSum(segs[k].p2p / tscale * self.u[j, k] for k in range(K) if (j, k) in self.u)
            bb = pulp.lpSum(segs[k].bwd[qi[q]] / tscale * z[j, k, q] for k, q in terms)
            # sum_q z_jkq = x_jk, so the static bytes ride on z as well
            mem = pulp.lpSum((segs[k].static + pr.inflight[j] * segs[k].act[qi[q]]) / mscale * z[j, k, q]
                             for k, q in terms) + pr.extra[j] / mscale
            Fj.append(f)
            Bj.append(bb)
            memj.append(mem)
        return Fj, Bj, memj

    def _rank_memory(self, memj: list) -> list:
        """Per rank, over mscale: its stages' memory plus what it holds once (module docstring):
        ``X_r`` >= every chunk's overshoot, ``T_r`` >= every layer's weight-gradient working set,
        through binaries ``p_jk`` (segment k has layers in stage j). Minimal at the maxima, so
        the rank's memory of any split is ``cost_models.memory.rank_memory``'s."""
        import pulp

        pr, segs, z, P, ms = self.pr, self.segs, self.z, self.pr.policies, self.mscale
        S, K, pp = pr.n_stages, len(segs), pr.pp
        qi = {q: i for i, q in enumerate(P)}
        self.p, self.X, self.Xr, self.Tr = {}, {}, [], []
        if not any(s.transient or any(s.peak) for s in segs):
            return [pulp.lpSum(memj[j] for j in range(r, S, pp)) for r in range(pp)]
        for j in range(S):
            ks = sorted({k for (j2, k, _) in z if j2 == j})
            self.X[j] = pulp.LpVariable(f"X_{j}", lowBound=0)
            for k in ks:
                x = pulp.lpSum(z[j, k, q] for q in P if (j, k, q) in z)
                cap = min(segs[k].n, pr.n_layers)
                self.p[j, k] = pulp.LpVariable(f"p_{j}_{k}", cat="Binary")
                self.prob += x <= cap * self.p[j, k], f"p_{j}_{k}"
                for q in P:
                    pk = segs[k].peak[qi[q]] / ms
                    if pk <= 0:
                        continue
                    after = pulp.lpSum(segs[k2].act[qi[q2]] / ms * z[j, k2, q2]
                                       for k2 in ks if k2 > k for q2 in P if (j, k2, q2) in z)
                    off = 1 - self.p[j, k] + ((1 - self.y[j, q]) if len(P) > 1 else 0)
                    self.prob += self.X[j] >= pk - after - pk * off, f"X_{j}_{k}_{qi[q]}"
        out = []
        for r in range(pp):
            Xr, Tr = pulp.LpVariable(f"Xr_{r}", lowBound=0), pulp.LpVariable(f"Tr_{r}", lowBound=0)
            for j in range(r, S, pp):
                self.prob += Xr >= self.X[j], f"Xr_{r}_{j}"
                for k in range(K):
                    if (j, k) in self.p and segs[k].transient > 0:
                        self.prob += Tr >= segs[k].transient / ms * self.p[j, k], f"Tr_{r}_{j}_{k}"
            self.Xr.append(Xr)
            self.Tr.append(Tr)
            out.append(pulp.lpSum(memj[j] for j in range(r, S, pp)) + Xr + Tr)
        return out

    def _tie_break(self):
        """A tiny term preferring earlier boundaries and lower policy indices among equal optima."""
        import pulp

        pr, P = self.pr, self.pr.policies
        S, L, m, nP = pr.n_stages, pr.n_layers, pr.m, len(pr.policies)
        tie_w = 1e-6 * (m + S)
        tie = pulp.lpSum((j + 1) * self.b_expr[j] for j in range(S - 1)) * (tie_w / max(1, L * S * S))
        if nP > 1:
            tie = tie + pulp.lpSum(qi * self.y[j, q] for j in range(S) for qi, q in enumerate(P)) * \
                (tie_w / (S * nP))
        return tie

    def _time_objective(self, Fj: list, Bj: list, memj: list, tie) -> None:
        """Memory per rank within capacity (with perspective cuts per policy); minimise the
        schedule's step time from the busiest rank M (module docstring)."""
        import pulp

        pr, segs, prob, z, P, mscale = self.pr, self.segs, self.prob, self.z, self.pr.policies, self.mscale
        S, K, pp, v, m = pr.n_stages, len(segs), pr.pp, pr.v, pr.m
        if math.isfinite(pr.capacity):
            for r in range(pp):
                prob += self.mem_rank[r] <= pr.capacity / mscale, f"mem_{r}"
            if len(P) > 1:
                # Perspective cuts (valid, tighten the LP): the part of stage j under
                # policy q fits in what the rank leaves it, scaled by y_jq. Without
                # them the relaxation mixes policies to meet memory exactly.
                qi = {q: i for i, q in enumerate(P)}
                for j in range(S):
                    others = sum(pr.extra[j2] for j2 in range(j % pp, S, pp) if j2 != j)
                    room = (pr.capacity - others - pr.extra[j]) / mscale
                    for q in P:
                        ks = [k for k in range(K) if (j, k, q) in z]
                        prob += pulp.lpSum(
                            (segs[k].static + pr.inflight[j] * segs[k].act[qi[q]]) / mscale * z[j, k, q]
                            for k in ks) <= room * self.y[j, q], f"memq_{j}_{qi[q]}"
        Mv = pulp.LpVariable("M", lowBound=0)
        tj = [Fj[j] + Bj[j] for j in range(S)]
        self.Mv, self.tj = Mv, tj
        for r in range(pp):
            prob += Mv >= pulp.lpSum(tj[j] for j in range(r, S, pp)), f"M_{r}"
        if pr.schedule == "zb-h1":
            a = pr.wgrad_frac
            beta = 1.0 - a - min(a, 1.0 - a)
            G = [pulp.LpVariable(f"G_{j}", lowBound=0) for j in range(S)]
            self.G, self.FB, self.beta = G, (Fj, Bj), beta
            for j in range(S):
                prob += G[j] >= Fj[j] + beta * Bj[j], f"Ga_{j}"
                prob += G[j] >= (1.0 - a) * Bj[j], f"Gb_{j}"
            obj = m * Mv + (pp - 1) / pp * pulp.lpSum(G)
        else:
            obj = (m - 1.0 / v) * Mv + (1.0 / v) * pulp.lpSum(tj)
        prob += obj + tie

    def _overrun_objective(self, tie) -> None:
        """Minimise the worst rank's memory overrun relative to capacity (no layout fits)."""
        import pulp

        pr, prob = self.pr, self.prob
        D = pulp.LpVariable("D")
        for r in range(pr.pp):
            prob += D >= self.mem_rank[r] - pr.capacity / self.mscale, f"D_{r}"
        prob += D + tie * 1e-3

    @property
    def n_vars(self) -> int:
        return len(self.prob.variables())

    @property
    @quiet_pulp_deprecations
    def n_constraints(self) -> int:
        return len(self.prob.constraints)

    def set_start(self, part: Partition) -> None:
        """Give every variable its value under ``part`` (a warm start)."""
        import pulp

        pr, segs, P = self.pr, self.segs, self.pr.policies
        S = pr.n_stages
        for v in self.prob.variables():
            v.varValue = 0.0
        for j, (lo, hi) in enumerate(part.bounds[:-1]):
            for k, sg in enumerate(segs):
                if sg.start < hi <= sg.end and (j, k) in self.u:
                    self.u[j, k].varValue = 1.0
                    self.w[j, k].varValue = float(hi - sg.start)
        for j, ((lo, hi), q) in enumerate(zip(part.bounds, part.recompute)):
            if len(P) > 1:
                self.y[j, q].varValue = 1.0
                for k, sg in enumerate(segs):
                    n = max(0, min(hi, sg.end) - max(lo, sg.start))
                    if (j, k, q) in self.z and n:
                        self.z[j, k, q].varValue = float(n)
        for (j, k), var in self.p.items():
            lo, hi = part.bounds[j]
            var.varValue = float(min(hi, segs[k].end) > max(lo, segs[k].start))
        for j, var in self.X.items():
            var.varValue = chunk_overshoot(pr, *part.bounds[j], part.recompute[j]) / self.mscale
        for r in range(len(self.Xr)):
            js = range(r, S, pr.pp)
            self.Xr[r].varValue = max(self.X[j].varValue for j in js)
            self.Tr[r].varValue = max(pr.transient[i] for j in js for i in range(*part.bounds[j])) / self.mscale
        if self.Mv is not None:
            self.Mv.varValue = max(sum(pulp.value(self.tj[j]) for j in range(r, S, pr.pp)) for r in range(pr.pp))
        if self.G is not None:
            Fj, Bj = self.FB
            a = pr.wgrad_frac
            for j in range(S):
                f, b = pulp.value(Fj[j]), pulp.value(Bj[j])
                self.G[j].varValue = max(f + self.beta * b, (1.0 - a) * b)

    def extract(self) -> Partition:
        pr, S, L = self.pr, self.pr.n_stages, self.pr.n_layers
        cuts = [int(round(e.value())) for e in self.b_expr]
        bounds, a = [], 0
        for c in cuts + [L]:
            bounds.append((a, c))
            a = c
        P = pr.policies
        if len(P) == 1:
            rec = [P[0]] * S
        else:
            rec = [max(P, key=lambda q, j=j: (self.y[j, q].value() or 0.0, -P.index(q))) for j in range(S)]
        return Partition(bounds, rec)


@quiet_pulp_deprecations
def ilp_rank_memory(problem: PartitionProblem, partition: Partition) -> list[float]:
    """Bytes per pp rank the ILP's memory constraint charges for ``partition``: the split's
    variables fixed at their values, the rank maxima (``X``, ``T``) the least the constraints
    allow (an LP). What the property tests hold equal to ``cost_models.memory.rank_memory``."""
    import pulp

    pr = replace(problem, capacity=math.inf)  # no constraint to meet; bytes scaled by the problem's own size
    model = _Model(pr, segment_classes(pr), "time")
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


@quiet_pulp_deprecations
def _run(model: "_Model", solver_name: str, time_limit: float, gap_rel: float, warm: bool = False):
    """Solve; returns (status, sol_status, solver label, solver's gap or None)."""
    solver, label = _pick_solver(solver_name, time_limit, gap_rel, warm)
    model.prob.solve(solver)
    gap = None
    if label == "highs" and getattr(model.prob, "solverModel", None) is not None:
        try:
            g = float(model.prob.solverModel.getInfo().mip_gap)
            gap = g if math.isfinite(g) else None
        except Exception:  # pragma: no cover - HiGHS_CMD or old highspy
            gap = None
    return model.prob.status, model.prob.sol_status, label, gap


@quiet_pulp_deprecations
def _lp_bound(model: "_Model", solver_name: str, time_limit: float) -> float | None:
    import pulp

    saved = {v.name: (v.cat, v.varValue) for v in model.prob.variables()}
    for v in model.prob.variables():
        v.cat = pulp.LpContinuous
    try:
        solver, _ = _pick_solver(solver_name, time_limit, 1e-9)
        model.prob.solve(solver)
        if model.prob.status == pulp.LpStatusOptimal:
            return float(pulp.value(model.prob.objective))
        return None
    finally:
        for v in model.prob.variables():
            v.cat, v.varValue = saved[v.name]


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
    import pulp

    t0 = time.perf_counter()
    pr = problem
    segs = segment_classes(pr)
    greedy = greedy_partition(pr)
    n_vars = n_cons = 0
    if not greedy.feasible:
        if pr.v == 1:     # greedy's fallback is the exact min-max-memory split
            res = _infeasible(pr, greedy)
            res.solve_s = time.perf_counter() - t0
            res.n_segments = len(segs)
            return res
        mm = _Model(pr, segs, "memory")
        st2, sol2, label, _ = _run(mm, solver, min(time_limit, 1.0), 1e-3)
        n_vars, n_cons = mm.n_vars, mm.n_constraints
        best_effort = None
        if sol2 in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            best_effort = evaluate_partition(pr, mm.extract(), solver=label)
            if best_effort.feasible:
                greedy = best_effort     # fits: a start for the time ILP
            else:
                proven = st2 == pulp.LpStatusOptimal and sol2 == pulp.LpSolutionOptimal
                lb = None if proven else _lp_bound(mm, solver, time_limit)
                if proven or (lb is not None and lb > 1e-9):
                    res = _infeasible(pr, best_effort)
                    res.solve_s = time.perf_counter() - t0
                    res.n_vars, res.n_constraints, res.n_segments = n_vars, n_cons, len(segs)
                    return res
        if best_effort is not None and not greedy.feasible and \
                max(best_effort.rank_memory) < max(greedy.rank_memory):
            greedy = best_effort
    model = _Model(pr, segs, "time")
    warm = warm_start and greedy.feasible
    if warm:
        model.set_start(greedy.partition)
    status, sol_status, label, gap = _run(model, solver, time_limit, gap_rel, warm)
    have = sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if have:
        res = evaluate_partition(pr, model.extract(), solver=label)
        if greedy.feasible and greedy.objective_s < res.objective_s * (1 - 1e-9):
            res = evaluate_partition(pr, greedy.partition, solver=label)   # never worse than the start
        proven = status == pulp.LpStatusOptimal and sol_status == pulp.LpSolutionOptimal
        if gap is None:
            if proven:
                gap = 0.0
            else:
                obj = pulp.value(model.prob.objective)
                lb = _lp_bound(model, solver, time_limit)
                gap = max(0.0, (obj - lb) / abs(obj)) if (lb is not None and obj) else math.nan
        if res.shortfall is not None:   # solver tolerance at the capacity edge
            res = _infeasible(pr, res)
        elif (proven and (gap is None or gap <= gap_rel)) or gap <= gap_rel:
            res.status = "optimal"
        else:
            res.status = f"feasible (gap {100 * gap:.1f}%)"
        res.gap = gap
    elif status == pulp.LpStatusInfeasible and not greedy.feasible:   # v > 1, memory ILP undecided
        res = _infeasible(pr, greedy)
    else:   # time limit without any solution: the heuristic's answer
        res = greedy
        res.status, res.gap = ("feasible (gap unknown)", math.nan) if res.feasible else ("infeasible", math.nan)
        res.solver = f"{label}+greedy"
    res.solve_s = time.perf_counter() - t0
    res.n_vars, res.n_constraints, res.n_segments = model.n_vars, model.n_constraints, len(segs)
    return res
