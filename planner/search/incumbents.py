"""The step times a variant's floor must beat to matter to the search (its pruning thresholds).

The search solves in full the ``keep`` variants with the best fast estimates (``solve_top``),
plus, on a cluster with a WAN, the best *protected* variant outside them (one a generated
schedule may run with a pipeline boundary on the WAN: ``space._wan_generated``). A variant
whose floor (a lower bound of its fast estimate) is strictly above

- the ``keep``-th best estimate found so far can be neither of the best ``keep``;
- and, for a protected one, also above the ``keep + 1``-th best protected estimate so far:
  then ``keep + 1`` protected variants beat it, so it is not the best protected one outside
  the best ``keep`` either.

Both thresholds only fall as estimates arrive, so pruning against them never drops a
variant the unpruned search would solve: the pruned and the unpruned search solve the same
variants and return the same plan (tests/test_search_pruning.py). Strict ``>``: a variant
whose floor ties the threshold may tie its estimate and win on the name.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class Incumbents:
    """The best estimates so far (seconds), overall and of the protected variants."""

    keep: int                                          # the search's solve_top (at least 1)
    prune: bool = True                                 # False: nothing is pruned (tests compare)
    best: list[float] = field(default_factory=list)    # the ``keep`` smallest, ascending
    protected: list[float] = field(default_factory=list)  # the ``keep + 1`` smallest protected, ascending

    def add(self, step_s: float, protected: bool) -> None:
        """One fitting variant's fast estimate (``protected``: it is one, priced)."""
        _push(self.best, step_s, self.keep)
        if protected:
            _push(self.protected, step_s, self.keep + 1)

    def threshold(self, protected: bool) -> float:
        """A floor strictly above this is pruned (module docstring); ``protected``: the variant may be
        a protected one (a superset of them is fine: it only keeps more)."""
        if not self.prune:
            return math.inf
        overall = self.best[-1] if len(self.best) >= self.keep else math.inf
        if not protected:
            return overall
        return max(overall, self.protected[-1] if len(self.protected) > self.keep else math.inf)


def _push(xs: list[float], x: float, n: int) -> None:
    """Insert ``x`` into ascending ``xs``, keeping the ``n`` smallest."""
    bisect.insort(xs, x)
    del xs[n:]


FASTER_BY = 1e-9  # relative margin a candidate's step must beat an incumbent's by (float noise is not a win)


def faster(candidate_s: float, incumbent_s: float) -> bool:
    """Whether a candidate of ``candidate_s`` seconds replaces one of ``incumbent_s``: strictly faster
    beyond :data:`FASTER_BY` (the search's refinements keep what they were given on a tie: the ILP's
    warm start, a built-in schedule, the split and warm-up before a move)."""
    return candidate_s < incumbent_s * (1 - FASTER_BY)


def fastest_fitting(estimates):
    """The fastest of ``estimates`` (cost_models.estimate.Estimate) that fits, or None."""
    return min((e for e in estimates if e.fits), key=lambda e: e.step_s, default=None)
