"""``cost_models.pipeline_memory.memory_bound`` is a lower bound of the exact memory-first check
(``fullest_rank``) on every split the search may price: over a grid of degrees, schedules, DP
sharding, recompute policies, sequence chunks, splits (even, uneven, middle-heavy) and two
clusters (one with a WAN, where FSDP is replicated across the regions), the bound never exceeds
the fullest rank's bytes, so it never rejects a variant the exact check accepts; and it is tight
enough to reject some layouts (else the search would gain nothing from it)."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.layer_costs import LayerCosts
from cost_models.pipeline_memory import fullest_rank, memory_bound
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Partition
from planner.search.stage_split import even_split
from split_cases import uneven_split

G = load_graph("llama3-8b", batch=1, seq_len=4096)


def _splits(pp: int, v: int, rc: str) -> list[Partition]:
    """The even split, one whose stages all differ in size, and one with a heavy middle."""
    n, S = len(G.layers), pp * v
    heavy = [(0, 1)] + [(1 + j, 2 + j) for j in range(S - 2)] + [(S - 1, n)] if S > 1 else [(0, n)]
    return [even_split(G, S, rc), uneven_split(n, S, rc), Partition(heavy, [rc] * S)]


@pytest.mark.parametrize("cluster", ["dgx-h100:2", "two-region-h100:1"])
def test_memory_bound_never_exceeds_the_fullest_rank(cluster):
    c = parse_cluster(cluster)
    checked = rejects = 0
    for pp, sched, v, k in [(1, "1f1b", 1, 1), (2, "1f1b", 1, 1), (4, "1f1b", 1, 2), (4, "zb-h1", 1, 1),
                            (4, "gpipe", 1, 1), (4, "interleaved-1f1b", 2, 1), (2, "interleaved-1f1b", 4, 1),
                            (8, "1f1b", 1, 4)]:
        for zero, rc, gb, mbs in [("ddp", "none", 64, 1), ("fsdp", "full", 64, 1), ("zero1", "selective", 64, 2),
                                  ("fsdp", "offload", 64, 1), ("ddp", "selective-op", 128, 4)]:
            cfg = ParallelConfig(dp=16 // pp, pp=pp, tp=1, mbs=mbs, schedule=sched, vpp=v, zero=zero, recompute=rc,
                                 dtype="bf16", seq_chunks=k)
            costs = LayerCosts(G, c, cfg, None)
            low, cap = memory_bound(G, cfg, gb, costs)
            for part in _splits(pp, v, rc):
                _, need, cap2 = fullest_rank(G, cfg, part, gb, costs)
                assert cap == cap2 and low <= need, (cfg.label(), part.bounds, low, need)
                checked += 1
            rejects += low > cap
    assert checked == 120 and rejects  # DDP's full states of 8B at pp1-2 do not fit 80 GB


def test_memory_bound_is_none_where_the_schedule_is_simulated():
    c = parse_cluster("dgx-h100:2")
    cfg = ParallelConfig(dp=4, pp=4, schedule="dualpipev", vpp=2, zero="fsdp")
    assert memory_bound(G, cfg, 64, LayerCosts(G, c, cfg, None)) is None


def test_no_fit_error_names_the_same_exact_need_as_without_the_bound(monkeypatch):
    """Where nothing fits, the variants the bound rejected are priced exactly (least bound first), so
    the error's leanest need is the one the exact check alone finds."""
    import planner.search.space as space
    from planner.errors import AutoparError
    from planner.search.planning import plan_model

    c = parse_cluster("dgx-h100:1")

    def message() -> str:
        with pytest.raises(AutoparError) as e:
            plan_model(G, c, 64, spec="llama3-8b", cluster_spec="dgx-h100:1", fix="tp=1,pp=1,zero=ddp")
        return str(e.value)

    bounded = message()
    monkeypatch.setattr(space, "memory_bound", lambda *a, **k: None)
    assert bounded == message() and "the best needs at least" not in bounded
