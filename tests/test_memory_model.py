"""One memory model: the ILP's memory of any stage split is ``cost_models.memory.rank_memory``'s.

Random small models and configurations (FSDP and the other DP shardings, every recompute policy,
pp with and without interleaving, TP with sequence parallel, EP on the MoE model), a random split
of the stage groups with a random policy per stage: the ILP's charge per rank
(``planner.search.partition.ilp_rank_memory``), the evaluator's (``evaluate_partition``), the
rule itself and the estimate (closed-form in-flight counts, as the ILP uses) agree.
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.cluster import parse_cluster
from cost_models.estimate import estimate
from cost_models.memory import MemoryRule, chunk_memory, framework_reserve, memory_floor, rank_memory
from planner.frontend.load import load_graph
from planner.plan import RECOMPUTE, ParallelConfig, Partition
from planner.sharding import ZERO
from planner.search.partition import ilp_rank_memory
from planner.search.partition_problem import evaluate_partition
from planner.search.stage_split import expand_groups, partition_problem

CLUSTER = parse_cluster("dgx-h100:8")


@functools.lru_cache(maxsize=None)
def graph(name: str):
    return load_graph(name)


@st.composite
def cases(draw):
    name = draw(st.sampled_from(["llama-tiny", "moe-tiny", "gpt-tiny", "mllm-tiny"]))
    g = graph(name)
    n = len(g.stage_groups())
    pp = draw(st.sampled_from([1, 2, 3]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 and 2 * pp <= n else 1
    sched = "interleaved-1f1b" if vpp > 1 else draw(st.sampled_from(["1f1b", "gpipe", "zb-h1"]))
    tp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    moe = name == "moe-tiny"
    ep = draw(st.sampled_from([1, 2])) if moe and dp * tp >= 2 else 1
    zero = "fsdp" if ep > 1 else draw(st.sampled_from(ZERO))
    cfg = ParallelConfig(dp=dp, pp=pp, tp=tp, ep=ep, vpp=vpp, schedule=sched, zero=zero,
                         sp=tp > 1 and (moe or draw(st.booleans())), mbs=draw(st.sampled_from([1, 2])),
                         recompute=draw(st.sampled_from(RECOMPUTE)))
    m = draw(st.sampled_from([pp, 2 * pp + 1])) * vpp
    S = pp * vpp
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1)))
    bounds = list(zip([0] + cuts, cuts + [n]))
    rec = [draw(st.sampled_from(RECOMPUTE)) for _ in range(S)]
    return g, cfg, m * dp * cfg.mbs, Partition(bounds, rec)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_ilp_memory_of_any_split_is_the_rule(case):
    g, cfg, gb, part = case
    prob = partition_problem(g, CLUSTER, cfg, gb)
    prob.policies = tuple(sorted(set(part.recompute), key=RECOMPUTE.index)) if cfg.recompute == "none" else \
        (cfg.recompute,)
    if cfg.recompute != "none":
        part = Partition(part.bounds, [cfg.recompute] * len(part.bounds))
    layers = expand_groups(part, g.stage_groups())
    rule = MemoryRule(g, cfg)
    reserve = framework_reserve(True)
    want = []
    for r in range(cfg.pp):
        js = range(r, cfg.pp * cfg.vpp, cfg.pp)
        chunks = [chunk_memory(rule, range(*layers.bounds[j]), layers.recompute[j]) for j in js]
        want.append(rank_memory(chunks, [prob.inflight[j] for j in js], reserve).tensors)
    assert evaluate_partition(prob, part).rank_memory == pytest.approx(want, rel=1e-9)
    assert prob.capacity == pytest.approx(CLUSTER.memory_bytes - reserve.fixed)
    assert ilp_rank_memory(prob, part) == pytest.approx(want, rel=1e-6)
    assert memory_floor(g, cfg) <= max(want) * (1 + 1e-9)  # the search's floor is a bound of the same rule
    if cfg.vpp == 1 and len(set(layers.recompute)) == 1:  # the estimate prices the same rule
        e = estimate(g, CLUSTER, cfg.replace(recompute=layers.recompute[0]), layers, gb, fast=True)
        assert [x.tensors for x in e.memory] == pytest.approx(want, rel=1e-9)


def test_the_working_set_moves_a_boundary():
    """The terms the ILP once left out are charged: the largest layer's weight gradient and the
    backward working set are part of every rank's memory (a split that ignored them could be
    chosen though it does not fit)."""
    g = graph("llama-tiny")
    cfg = ParallelConfig(dp=2, pp=2, zero="ddp")
    prob = partition_problem(g, CLUSTER, cfg, 8)
    assert all(t > 0 for t in prob.transient) and any(p["none"] > 0 for p in prob.peak)
    part = Partition.even(len(g.stage_groups()), 2, "none")
    linear = [sum(prob.static[i] + prob.inflight[j] * prob.act[i]["none"] for i in range(*part.bounds[j]))
              for j in range(2)]
    got = evaluate_partition(prob, part).rank_memory
    assert all(x > y for x, y in zip(got, linear))


def test_a_kept_rule_is_the_rule_of_every_config_sharing_its_key():
    """``pipeline_memory.rule_of`` keeps one MemoryRule per the fields it keys on; every config that
    differs only elsewhere (schedule, recompute, sp, fp8, chunks, ...) must get the figures a fresh
    rule gives it, so a field MemoryRule starts reading without joining the key fails here."""
    from cost_models.memory import LayerTable
    from cost_models.pipeline_memory import rule_of

    g = load_graph("moe-tiny")
    base = ParallelConfig(dp=2, pp=2, tp=2, ep=2, zero="fsdp", dtype="bf16")
    table = LayerTable(g, base)
    others = [dict(schedule="interleaved-1f1b", vpp=2), dict(recompute="full"), dict(sp=True), dict(mbs=2),
              dict(attention="eager"), dict(threads=2), dict(fp8="tensorwise"), dict(compile=True),
              dict(schedule="zb-h1"), dict(seq_chunks=2), dict(loss="fused")]
    for zero in ZERO:
        for replicas in (1, 2):
            kept = rule_of(g, base.replace(zero=zero), table, replicas)
            for kw in others:
                cfg = base.replace(zero=zero, **kw)
                fresh = MemoryRule(g, cfg, table, replicas)
                got = rule_of(g, cfg, table, replicas)
                assert got is kept, kw
                assert (got.f, got.fe, got.units, got.cast, got.id) == (fresh.f, fresh.fe, fresh.units, fresh.cast,
                                                                        fresh.id), (zero, replicas, kw)
