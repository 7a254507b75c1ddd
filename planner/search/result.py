"""What a search returns: the plan's estimate, the runner-ups, what was rejected and why, and its tallies."""
from __future__ import annotations

from dataclasses import dataclass, field

from cost_models.estimate import Estimate


@dataclass
class SearchResult:
    best: Estimate
    alternatives: list[Estimate]                  # next best (fit), ranked
    rejected: dict[str, list[str]]                # reason -> example configurations
    rejected_counts: dict[str, int]
    considered: int = 0
    pruned: int = 0
    estimated: int = 0
    fully_solved: int = 0
    solve_s: float = 0.0
    partition_info: dict = field(default_factory=dict)
    split_note: str = ""                          # how the best's stage groups moved (split_moves.split_note)
