"""What is priced is what runs: torch's schedule runtime, built by codegen/runtime (torch_compat.
schedule_runtime) from a schedule IR, runs each rank's compute actions in exactly the IR's order
(the sends, receives, unshard / reshard and gradient reductions it adds aside), for the
built-ins, DualPipeV, a generated schedule and a user's file. No processes: the runtime's lowering
is plain Python over stand-in stages."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from codegen.runtime.torch_compat import schedule_runtime
from planner.schedule_file import parse_csv
from planner.schedule_ir import builtin, parts
from planner.search.schedule_gen import generate

COMPUTE = ("F", "B", "I", "W", "OVERLAP_F_B")


def _ran(s, rank: int) -> list[str]:
    stages = [SimpleNamespace(num_stages=s.n_stages, group_size=s.p, group_rank=rank, stage_index=j, submod=None)
              for j in s.stages_of(rank)]
    order = {r: [str(st) for st in steps] for r, steps in enumerate(s.ranks)}
    rt = schedule_runtime(stages, s.n_microbatches, None, False, order)
    acts = rt.pipeline_order_with_comms[rank]
    assert {a.stage_index: r for r in range(s.p) for a in rt.pipeline_order[r] if a.sub_actions is None} == \
        dict(enumerate(s.stage_rank))  # each stage where the IR places it
    return [str(a) for a in acts if a.computation_type.value in COMPUTE]


@pytest.mark.parametrize("s", [builtin("gpipe", 2, 4), builtin("1f1b", 4, 8), builtin("interleaved-1f1b", 2, 4, 2),
                               builtin("zb-h1", 4, 4), builtin("dualpipev", 2, 4), builtin("dualpipev", 4, 8),
                               generate([1.0, 1.0, 1.0, 2.5], [2.0, 2.0, 2.0, 5.0], 4),
                               parse_csv("0F0,0F1,0I0,0F2,0B1,0W0,0B2\n1F0,1I0,1F1,1B1,1W0,1F2,1B2\n")],
                         ids=lambda s: f"{s.name}-p{s.p}")
def test_the_runtime_runs_the_ir_order(s):
    for r in range(s.p):
        assert _ran(s, r) == [str(st) for st in s.ranks[r]]
        assert sum(len(parts(st)) for st in s.ranks[r]) == len(s.actions(r))
