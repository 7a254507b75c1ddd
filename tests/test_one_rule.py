"""Each cost rule is stated by one function; these tests fail when a module restates one inline.

The rules (README, "Architecture"): sequence shards (``ParallelConfig.seq_shards``), the experts'
groups (``ParallelConfig.expert_mesh``), the framework reserve (``cost_models.memory.framework_reserve``),
the zb-h1 weight-gradient split (``cost_models.pipeline.WGRAD_FRAC``).
"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("planner", "cost_models", "codegen")


def sources():
    for pkg in LIBRARY:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    with open(p) as fh:
                        yield os.path.relpath(p, ROOT), fh.read()


def offenders(pattern: str, allowed: set[str]) -> list[str]:
    rx = re.compile(pattern)
    return [f"{path}:{text[:m.start()].count(chr(10)) + 1}" for path, text in sources() if path not in allowed
            for m in rx.finditer(text)]


def test_sequence_shards_stated_once():
    assert not offenders(r"\btp if (cfg\.|self\.|c\.)?sp else 1\b", {"planner/plan.py"}), \
        "use ParallelConfig.seq_shards"


def test_expert_groups_stated_once():
    assert not offenders(r"\*\s*(cfg\.)?tp\s*//\s*(cfg\.)?ep\b", {"planner/plan.py"}), \
        "use ParallelConfig.expert_mesh"


def test_expert_mesh_matches_the_listed_groups():
    from planner.feasibility import expert_groups
    from planner.plan import ParallelConfig

    # (dp, cp, tp, ep) -> (experts' data-parallel degree, ep): the dp x cp x tp ranks in groups of ep
    for (dp, cp, tp, ep), want in {(2, 2, 1, 2): (2, 2), (1, 1, 4, 2): (2, 2), (2, 1, 2, 4): (1, 4),
                                   (4, 2, 2, 8): (2, 8)}.items():
        edp, e = ParallelConfig(dp=dp, cp=cp, tp=tp, ep=ep).expert_mesh
        assert (edp, e) == want
        groups, edp_groups = expert_groups(dp, cp, ep, tp)
        assert (len(groups), len(groups[0]), len(edp_groups), len(edp_groups[0])) == (edp, e, e, edp)
        assert sorted(r for g in groups for r in g) == list(range(dp * cp * tp))


def test_reserve_chosen_once():
    assert not offenders(r"\bRESERVE_(GPU|CPU)\b", {"cost_models/memory.py"}), "use cost_models.memory.framework_reserve"
    assert not offenders(r"""(\.get\(|\[)["']mem_reserve_(gib|frac)""", {"cost_models/memory.py"}), \
        "read the calibrated reserve through cost_models.memory.framework_reserve"


def test_zb_h1_split_stated_once():
    assert not offenders(r"wgrad\w*\s*(:\s*float\s*)?=\s*0\.5|1\.0 - a - min\(a|x / 2 for x in b", set()), \
        "use cost_models.pipeline.WGRAD_FRAC / split_backward / zb_h1_bubble_terms"


def test_pipeline_bubble_stated_once():
    """The bubble of a schedule ((pp - 1) x a stage's time, / v interleaved) is the step-time model's
    (cost_models/pipeline.py); the search's floor calls its linear form."""
    assert not offenders(r"\(\s*(pp|p|cfg\.pp)\s*-\s*1\s*\)\s*\*\s*\w+\s*/\s*\d", {"cost_models/pipeline.py"}), \
        "use cost_models.pipeline.linear_step / estimate_step"
