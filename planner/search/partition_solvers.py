"""The MILP solvers the stage ILP (planner/search/partition_ilp.py) runs on: PuLP's CBC or HiGHS,
single-threaded and seeded, quiet; solving a model and bounding its LP relaxation."""
from __future__ import annotations

import math

from planner.search.partition_problem import quiet_pulp_deprecations


def quiet_highs():
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
def pick_solver(name: str, time_limit: float, gap_rel: float, warm: bool = False):
    import pulp

    name = name.lower()
    if name not in ("auto", "cbc", "highs"):
        raise ValueError(f"solver={name!r}: choose auto, cbc or highs")
    if name in ("auto", "highs"):
        cls = quiet_highs()
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


@quiet_pulp_deprecations
def run_model(model, solver_name: str, time_limit: float, gap_rel: float, warm: bool = False):
    """Solve; returns (status, sol_status, solver label, solver's gap or None)."""
    solver, label = pick_solver(solver_name, time_limit, gap_rel, warm)
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
def lp_bound(model, solver_name: str, time_limit: float) -> float | None:
    import pulp

    saved = {v.name: (v.cat, v.varValue) for v in model.prob.variables()}
    for v in model.prob.variables():
        v.cat = pulp.LpContinuous
    try:
        solver, _ = pick_solver(solver_name, time_limit, 1e-9)
        model.prob.solve(solver)
        if model.prob.status == pulp.LpStatusOptimal:
            return float(pulp.value(model.prob.objective))
        return None
    finally:
        for v in model.prob.variables():
            v.cat, v.varValue = saved[v.name]
