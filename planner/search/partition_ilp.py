"""The segment-compressed stage ILP (the mathematics: planner/search/partition.py's docstring):
variables, constraints and objective for one PartitionProblem, a warm start from a split, and
the split read back from a solution."""
from __future__ import annotations

import math

from cost_models.pipeline import zb_h1_bubble_terms
from planner.plan import Partition
from planner.search.partition_problem import PartitionProblem, Segment, chunk_overshoot, quiet_pulp_deprecations


class PartitionILP:
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
        tie = self.tie = self._tie_break()
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
            sj = pr.slow[j]  # the stage's device over the reference (mixed clusters)
            f = pulp.lpSum(segs[k].fwd[qi[q]] * sj / tscale * z[j, k, q] for k, q in terms)
            if j < S - 1:
                f = f + pulp.lpSum(segs[k].p2p / tscale * self.u[j, k] for k in range(K) if (j, k) in self.u)
            bb = pulp.lpSum(segs[k].bwd[qi[q]] * sj / tscale * z[j, k, q] for k, q in terms)
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
        # cost_models.pipeline.linear_step, as linear constraints
        if pr.schedule == "zb-h1":
            beta, gamma = zb_h1_bubble_terms(pr.wgrad_frac)
            G = [pulp.LpVariable(f"G_{j}", lowBound=0) for j in range(S)]
            self.G, self.FB, self.beta = G, (Fj, Bj), (beta, gamma)
            for j in range(S):
                prob += G[j] >= Fj[j] + beta * Bj[j], f"Ga_{j}"
                prob += G[j] >= gamma * Bj[j], f"Gb_{j}"
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

    def objective_s(self) -> float:
        """The solved step objective in seconds, without the tie-break term."""
        import pulp

        return (pulp.value(self.prob.objective) - pulp.value(self.tie)) * self.tscale

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
            beta, gamma = self.beta
            for j in range(S):
                f, b = pulp.value(Fj[j]), pulp.value(Bj[j])
                self.G[j].varValue = max(f + beta * b, gamma * b)

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
