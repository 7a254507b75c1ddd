"""The search's memory-first check prices one rank per group of ranks holding the same chunks
(``cost_models.pipeline_memory.fullest_rank``): it must name the same rank, bytes and capacity as
the full per-rank memory (``fast_memory``), ties included; and the search's one enumeration of a
tuple's variants (``candidates.variants``) is what it yields with and without the
dominated ones."""
from __future__ import annotations

import pytest

from cost_models.cluster import parse_cluster
from cost_models.layer_costs import LayerCosts
from cost_models.pipeline_memory import fast_memory, fullest_rank
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Partition
from planner.search.candidates import Point, batch_of, facts_of, variant_choices, variant_config, variant_count, variants
from planner.search.pins import Pins
from planner.search.stage_split import even_split
from split_cases import uneven_split

G = load_graph("llama3-8b", batch=1, seq_len=4096)


def _middle_heavy(pp: int, v: int) -> Partition:
    """Equal middle stages of the repeated blocks, the first and last stages light (the embedding
    with the remainder; the final norm and head): equal middle ranks, the fullest under gpipe."""
    n, S = len(G.layers), pp * v
    if S < 3:
        return even_split(G, S)
    q, rem = divmod(n - 3, S - 2)  # the blocks between the embedding and the norm + head
    bounds = [(0, 1 + rem)] + [(1 + rem + j * q, 1 + rem + (j + 1) * q) for j in range(S - 2)] + [(n - 2, n)]
    return Partition(bounds, ["none"] * S)


@pytest.mark.parametrize("cluster", ["dgx-h100:2", "two-region-h100:1"])
def test_fullest_rank_is_the_first_fullest_of_every_rank(cluster):
    c = parse_cluster(cluster)
    checked = ties = 0
    for pp, sched, v, k in [(2, "1f1b", 1, 1), (4, "1f1b", 1, 2), (4, "zb-h1", 1, 1), (4, "gpipe", 1, 1),
                            (4, "interleaved-1f1b", 2, 1), (2, "interleaved-1f1b", 4, 1), (8, "1f1b", 1, 4)]:
        for zero, rc, gb in [("ddp", "none", 64), ("fsdp", "full", 64), ("zero1", "selective", 16)]:
            cfg = ParallelConfig(dp=16 // pp, pp=pp, tp=1, mbs=1, schedule=sched, vpp=v, zero=zero, recompute=rc,
                                 dtype="bf16", seq_chunks=k)
            costs = LayerCosts(G, c, cfg, None)
            for part in (even_split(G, pp * v, rc), uneven_split(len(G.layers), pp * v), _middle_heavy(pp, v)):
                part = Partition(part.bounds, [rc] * len(part.bounds))
                memory, cap = fast_memory(G, cfg, part, gb, costs)
                totals = [x.total for x in memory]
                r = max(range(pp), key=lambda q: totals[q])
                assert fullest_rank(G, cfg, part, gb, costs) == (r, totals[r], cap), (cfg.label(), part.bounds)
                ties += totals.count(totals[r]) > 1
                checked += 1
    assert checked == 63 and ties  # gpipe holds as many micro-batches on every rank: equal middle ranks tie


def test_undominated_variants_are_the_others_less_gpipe_and_sp_off():
    """``variants(dominated=False)`` is ``variants()`` in the same order less what 1F1B (over gpipe)
    and sequence parallel (over none) dominate, chunked and low-comm copies included."""
    facts, batch = facts_of(G), batch_of(G, 64)
    for p, pins in [(Point(2, 4, 1, 2, 1, 32, 1, (1,)), Pins()), (Point(1, 4, 2, 2, 1, 64, 1, (1, 2)), Pins()),
                    (Point(8, 1, 1, 2, 1, 8, 1, (1,)), Pins())]:
        every = list(variants(p, 1, facts, batch, "bf16", "eager", pins=pins, seq_chunks=(1, 2, 4)))
        kept = list(variants(p, 1, facts, batch, "bf16", "eager", dominated=False, pins=pins, seq_chunks=(1, 2, 4)))
        sp_ok = any(c.sp for c in every)
        assert kept == [c for c in every if c.schedule != "gpipe" and (c.sp or not sp_ok)]
        assert len(kept) < len(every)
        # the search counts them without building them, and builds one from its choice
        assert variant_count(p, facts, batch, "bf16", pins=pins, seq_chunks=(1, 2, 4)) == len(every)
        choices = list(variant_choices(p, facts, batch, "bf16", pins=pins, seq_chunks=(1, 2, 4)))
        assert [variant_config(p, 1, ch, facts, "bf16", "eager") for ch in choices] == every
