"""The one feasibility predicate (planner/feasibility.py): each rule refuses what it should with
its one line, and every user of the rule agrees with it - the search's enumeration, the
runtime's ``check_runnable`` and ``autopar evaluate`` (property tests that fail on drift)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.runtime.recipe import check_runnable
from cost_models.cluster import load_preset
from planner.errors import AutoparError, PlanError
from planner.feasibility import (LOAD_BALANCES, Batch, Nodes, default_attention, microbatches, problems,
                                 schedule_problem, sequence_problem)
from planner.plan import FEATURES, RECOMPUTE, SCHEDULES, ModelFacts, ParallelConfig
from planner.search.candidates import ZEROS, configurations, divisors

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
FACTS = ModelFacts(heads=(8,), kv_heads=(4,), hidden=64, units=8, seq_len=32)
ONE_NODE = Nodes("box", 1, 8)
FIXES = ("; use ", ": use ", ": make ", "; pick ", ": choose ", "; raise ", "; plan ")  # how a line names its fix


def only(cfg: ParallelConfig, facts: ModelFacts = FACTS, batch: Batch | None = None,
         cluster: Nodes | None = None) -> str:
    """The one problem of ``cfg`` (every other rule satisfied)."""
    found = problems(cfg, facts, batch or Batch(64, facts.seq_len), cluster or Nodes("box", 1, cfg.world))
    assert len(found) == 1, found
    assert "\n" not in found[0]
    return found[0]


# ---------------------------------------------------------------------- each rule, with its message

def test_a_layout_that_fits_has_no_problem():
    cfg = ParallelConfig(dp=2, pp=2, cp=2, tp=2, sp=True, ulysses=2, schedule="interleaved-1f1b", vpp=2,
                         zero="fsdp", recompute="selective")
    assert problems(cfg, FACTS, Batch(16, 32), Nodes("box", 2, 8)) == []


@pytest.mark.parametrize("cfg, facts, batch, cluster, words", [
    (ParallelConfig(dp=4), FACTS, None, ONE_NODE, "dp*pp*cp*tp = 4 but box has 8 devices"),
    (ParallelConfig(tp=8), FACTS, None, Nodes("box", 2, 4), "tp=8 exceeds 4 devices per node"),
    (ParallelConfig(tp=8), dataclasses.replace(FACTS, kv_heads=(2,)), None, None, "does not divide the 2 kv heads"),
    (ParallelConfig(tp=8), dataclasses.replace(FACTS, heads=(12,)), None, None,
     "tp=8 does not divide 12 heads / hidden 64"),
    (ParallelConfig(tp=2), dataclasses.replace(FACTS, limits={"tp": "no TP plan"}), None, None, "tp=2: no TP plan"),
    (ParallelConfig(cp=4), FACTS, Batch(64, 36), None, "cp=4 does not split sequence 36 into 2*cp zigzag"),
    (ParallelConfig(cp=4), FACTS, Batch(64, 34, load_balance="contiguous"), None,
     "cp=4 does not split sequence 34 into cp contiguous"),
    (ParallelConfig(cp=8, ulysses=8), FACTS, None, None, "ulysses=8 x tp=1 does not divide the 4 (kv) heads"),
    (ParallelConfig(cp=2), dataclasses.replace(FACTS, limits={"cp": "own attention"}), None, None,
     "cp=2: own attention"),
    (ParallelConfig(pp=16), dataclasses.replace(FACTS, units=8), None, None, "pp=16 exceeds the 8 pipeline stages"),
    (ParallelConfig(pp=4, vpp=4, schedule="interleaved-1f1b"), FACTS, None, None, "pp*vpp = 16 virtual stages"),
    (ParallelConfig(pp=2), dataclasses.replace(FACTS, limits={"pp": "no stages"}), None, None, "pp=2: no stages"),
    (ParallelConfig(dp=2, ep=2, zero="fsdp"), FACTS, None, None, "ep=2: the model has no routed experts"),
    (ParallelConfig(dp=4, ep=4, zero="fsdp"), dataclasses.replace(FACTS, experts=6), None, None,
     "ep=4 does not divide the 6 experts"),
    (ParallelConfig(dp=2, ep=4, zero="fsdp"), dataclasses.replace(FACTS, experts=8), None, None,
     "ep=4 does not divide dp x cp x tp = 2"),
    (ParallelConfig(tp=2), dataclasses.replace(FACTS, experts=8), None, None, "use sp=on"),
    (ParallelConfig(dp=4, ep=4, zero="ddp"), dataclasses.replace(FACTS, experts=8), None, None, "use zero=fsdp"),
    (ParallelConfig(tp=4, sp=True), FACTS, Batch(64, 34), None, "seq_len/cp = 34 divisible by tp=4"),
    (ParallelConfig(tp=2, sp=True), dataclasses.replace(FACTS, limits={"sp": "no SP"}), None, None,
     "sequence parallel: no SP"),
    (ParallelConfig(loss="fused"), dataclasses.replace(FACTS, limits={"fused_loss": "no head"}), None, None,
     "loss=fused: no head"),
    (ParallelConfig(attention="flash"), dataclasses.replace(FACTS, limits={"flash_attention": "sdpa"}), None, None,
     "attention=flash: sdpa"),
    (ParallelConfig(dp=2, tp=2, zero="fsdp"), dataclasses.replace(FACTS, limits={"fsdp_with_tp": "x"}), None, None,
     "use zero=ddp or zero1"),
    (ParallelConfig(pp=2, schedule="zb-h1", recompute="selective-op"), FACTS, None, None, "split backward"),
    (ParallelConfig(dp=4), FACTS, Batch(6, 32), None, "global batch 6 not divisible by dp=4"),
    (ParallelConfig(dp=2, mbs=4), FACTS, Batch(6, 32), None, "global batch 6 is not divisible by dp*mbs = 8"),
    (ParallelConfig(pp=4), FACTS, Batch(3, 32), None, "3 micro-batches for pp=4"),
    (ParallelConfig(pp=4, vpp=2, schedule="interleaved-1f1b"), FACTS, Batch(6, 32), None,
     "interleaved-1f1b needs micro-batches divisible by pp: m = 6, pp = 4"),
    (ParallelConfig(pp=4, schedule="zb-h1"), FACTS, Batch(9, 32), None, "zb-h1 runs 9 micro-batches in 2 rounds"),
    (ParallelConfig(dp=2), dataclasses.replace(FACTS, max_seq_len=16), None, None,
     "seq_len 32 exceeds the 16 positions the model learned"),
    (ParallelConfig(tp=2, attention="eager"), dataclasses.replace(FACTS, limits={"attention": "its own"}), None, None,
     "tp=2: tensor parallelism splits the heads inside autopar's attention, but its own; use tp=1"),
    (ParallelConfig(cp=2, attention="eager"), dataclasses.replace(FACTS, limits={"attention": "its own"}), None, None,
     "cp=2: context parallelism runs autopar's attention, but its own; use cp=1"),
    (ParallelConfig(dp=2), dataclasses.replace(FACTS, limits={"attention": "its own"}), None, None,
     "attention=flash runs autopar's attention, but its own; use attention=eager"),
    (ParallelConfig(dp=2, attention="eager", recompute="selective"),
     dataclasses.replace(FACTS, limits={"attention": "its own"}), None, None, "recompute=selective checkpoints"),
    (ParallelConfig(attention="eager"), dataclasses.replace(FACTS, limits={"attention": "its own"}),
     Batch(64, 32, documents=True), None, "packed documents (--seq-lens, cu_seqlens) mask by document in"),
    (ParallelConfig(), dataclasses.replace(FACTS, limits={"any": "no adapter"}), None, None,
     "cannot run on autopar's runtime: no adapter"),
    (ParallelConfig(), dataclasses.replace(FACTS, limits={"cp": "own attention"}), Batch(64, 32, documents=True),
     None, "packed documents (--seq-lens, cu_seqlens) need autopar's attention"),
])
def test_each_rule_refuses_with_its_line(cfg, facts, batch, cluster, words):
    line = only(cfg, facts, batch, cluster)
    assert words in line
    if "cannot run on autopar's runtime" not in line:  # the adapter's reason: no layout avoids it
        assert any(f in line for f in FIXES), line


def test_own_attention_leaves_data_and_pipeline_parallelism():
    """A model whose attention autopar cannot substitute (limit ``attention``) still runs every
    layout of data and pipeline parallelism with its own attention, eager, no selective recompute."""
    f = dataclasses.replace(FACTS, limits={"attention": "its own"})
    for cfg in (ParallelConfig(dp=4, zero="fsdp", recompute="full", attention="eager"),
                ParallelConfig(dp=2, pp=2, schedule="zb-h1", attention="eager"),
                ParallelConfig(pp=4, vpp=2, schedule="interleaved-1f1b", recompute="selective-op", attention="eager")):
        assert problems(cfg, f, Batch(64, 32), Nodes("box", 1, 4)) == [], cfg.label()


def test_torch_schedule_rules_are_stated_as_torch_states_them():
    """Schedule1F1B: m >= pp; the round-based schedules: m divisible by max(1, m // pp) rounds;
    interleaving over vpp > 1 chunks (the order priced): m a multiple of pp."""
    assert schedule_problem("gpipe", 4, 1, 9) is None
    assert schedule_problem("1f1b", 4, 1, 9) is None
    assert schedule_problem("1f1b", 4, 1, 3)
    assert schedule_problem("zb-h1", 4, 1, 9) and schedule_problem("zb-h1", 4, 1, 10) is None
    assert schedule_problem("interleaved-1f1b", 4, 1, 9) and schedule_problem("interleaved-1f1b", 4, 1, 6) is None
    assert schedule_problem("interleaved-1f1b", 4, 2, 6) and schedule_problem("interleaved-1f1b", 4, 2, 8) is None
    assert schedule_problem("zb-h1", 1, 1, 1) is None


def test_sequence_split_honours_the_load_balance():
    assert sequence_problem(36, 4, "zigzag") and sequence_problem(36, 4, "contiguous") is None
    assert sequence_problem(32, 4, "zigzag") is None and sequence_problem(7, 1) is None
    with pytest.raises(PlanError, match="load_balance='ring'"):
        sequence_problem(32, 2, "ring")


def test_microbatches_is_the_one_division():
    assert microbatches(ParallelConfig(dp=2, mbs=2), 16) == 4
    with pytest.raises(PlanError, match="not divisible by dp\\*mbs = 4: choose a global batch that is a multiple"):
        microbatches(ParallelConfig(dp=2, mbs=2), 6)
    with pytest.raises(PlanError, match="positive number of sequences"):
        microbatches(ParallelConfig(), 0)


# ---------------------------------------------------------------------- random models, clusters, batches

@st.composite
def facts_st(draw) -> ModelFacts:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    kv = draw(st.sampled_from(divisors(heads)))
    limits = draw(st.dictionaries(st.sampled_from([k for k in FEATURES if k != "any"]), st.just("not here"),
                                  max_size=2))
    if draw(st.integers(0, 20)) == 0:
        limits["any"] = "no adapter"
    return ModelFacts(heads=(heads,), kv_heads=(kv,), hidden=heads * draw(st.sampled_from([4, 6, 8])),
                      units=draw(st.integers(1, 10)), seq_len=draw(st.sampled_from([12, 16, 24, 32, 33, 48])),
                      limits=limits, experts=draw(st.sampled_from([0, 0, 2, 4, 6, 8])),
                      max_seq_len=draw(st.sampled_from([0, 0, 0, 16, 64])))


@st.composite
def request_st(draw, load_balance: bool = False):
    """(facts, batch, cluster) of a random model, batch and cluster of at most 8 devices."""
    f = draw(facts_st())
    dpn = draw(st.sampled_from([1, 2, 3, 4, 8]))
    nodes = draw(st.sampled_from([n for n in (1, 2, 4) if n * dpn <= 8]))
    lb = draw(st.sampled_from(LOAD_BALANCES)) if load_balance else "zigzag"
    batch = Batch(draw(st.integers(1, 24)), f.seq_len, documents=draw(st.integers(0, 4)) == 0, load_balance=lb)
    return f, batch, Nodes("c", nodes, dpn)


def _schedules(pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    return [(s, 1) for s in SCHEDULES if s != "interleaved-1f1b"] + [("interleaved-1f1b", v) for v in (2, 4)]


def search_domain(f: ModelFacts, world: int, loss: str, attention: str, global_batch: int) -> list[ParallelConfig]:
    """Every configuration within the search's deliberate space choices (planner/search/candidates.py:
    mbs <= 8 and, without a pipeline, the whole replica batch; no zero2, ddp alone without dp x cp,
    interleaving with v in {2, 4}, 1f1b without a pipeline, the default attention kernel), feasible
    or not."""
    out = []
    for tp, cp, pp in itertools.product(divisors(world), repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        zeros = ("ddp",) if dp * cp == 1 else ZEROS
        sps = (False, True) if tp > 1 else (False,)
        whole = [global_batch // dp] if pp == 1 and global_batch % dp == 0 and global_batch // dp > 8 else []
        for ep, u, mbs, (sched, v), zero, rc, sp in itertools.product(
                divisors(dp * cp * tp), divisors(cp), [*range(1, 9), *whole], _schedules(pp), zeros, RECOMPUTE, sps):
            out.append(ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, ulysses=u, mbs=mbs, schedule=sched, vpp=v,
                                      zero=zero, recompute=rc, sp=sp, dtype="fp32", loss=loss, attention=attention))
    return out


@pytest.mark.slow
@PROPS
@given(request_st(), st.sampled_from(["eager", "fused"]), st.randoms(use_true_random=False))
def test_search_enumerates_exactly_what_the_predicate_accepts(req, loss, rnd):
    """(a) Within the search's space choices, a configuration is enumerated (degree tuples x
    variants, no pins) iff ``problems`` finds nothing wrong with it."""
    f, batch, cluster = req
    enumerated = list(configurations(f, cluster, batch, dtype="fp32", loss=loss))
    assert len(enumerated) == len(set(enumerated))
    for cfg in enumerated:
        assert problems(cfg, f, batch, cluster) == [], cfg.label()
    attention = default_attention(f.limits)
    domain = search_domain(f, cluster.world, loss, attention, batch.global_batch)
    found = set(enumerated)
    for cfg in rnd.sample(domain, min(len(domain), 400)):
        why = problems(cfg, f, batch, cluster)
        assert (cfg in found) == (why == []), (cfg.label(), why)
    assert found <= set(domain)


DEGREES = [t for t in itertools.product((1, 2, 3, 4, 8), repeat=4) if math.prod(t) <= 8]


def random_config(rnd: random.Random) -> ParallelConfig:
    """Any valid configuration of up to 8 devices, feasible or not."""
    dp, pp, cp, tp = rnd.choice(DEGREES)
    sched = rnd.choice(SCHEDULES)
    return ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, ep=rnd.choice([1, 2, 4]), ulysses=rnd.choice(divisors(cp)),
                          mbs=rnd.choice([1, 2, 3]), schedule=sched,
                          vpp=rnd.choice([1, 2]) if sched == "interleaved-1f1b" else 1,
                          zero=rnd.choice(ZEROS + ("zero2",)),
                          recompute=rnd.choice(RECOMPUTE), sp=tp > 1 and rnd.random() < 0.5,
                          loss=rnd.choice(["eager", "fused"]), attention=rnd.choice(["eager", "flash"]))


@PROPS
@given(request_st(load_balance=True), st.randoms(use_true_random=False))
def test_runtime_check_refuses_exactly_what_the_predicate_refuses(req, rnd):
    """(b) ``check_runnable`` (called without building anything) raises iff ``problems`` is not
    empty, naming every problem."""
    f, batch, cluster = req
    runnable = list(configurations(f, cluster, batch, dtype="bf16", loss="eager"))  # problems() == [] (test a)
    for cfg in [random_config(rnd) for _ in range(30)] + rnd.sample(runnable, min(len(runnable), 10)):
        found = problems(cfg, f, batch, cluster)
        if found:
            with pytest.raises(ValueError) as err:
                check_runnable(cfg, None, f, batch, cluster)
            assert all(p in str(err.value) for p in found) and "\n" not in str(err.value)
        else:
            check_runnable(cfg, None, f, batch, cluster)


def test_runtime_check_reads_the_adapters_units_and_limits():
    """With the model's adapter, its own units (not the plan's) bound the pipeline."""
    from codegen.runtime.adapters import adapter_for
    from planner import zoo

    model = zoo.load_model_spec("gpt-tiny").build("meta")
    adapter = adapter_for(model, seq_len=32)
    n = len(adapter.units)
    cfg = ParallelConfig(pp=n + 1, dtype="fp32")
    facts = dataclasses.replace(FACTS, units=100)
    with pytest.raises(ValueError, match=f"exceeds the {n} pipeline stages"):
        check_runnable(cfg, adapter, facts, Batch(4 * (n + 1), 32), Nodes("box", 1, n + 1))
    check_runnable(cfg, None, facts, Batch(4 * (n + 1), 32), Nodes("box", 1, n + 1))


@functools.lru_cache(maxsize=1)
def _tiny():
    from planner.frontend.load import load_graph

    return load_graph("llama-tiny", batch=1, seq_len=32)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.randoms(use_true_random=False), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 16))
def test_evaluate_reports_the_predicates_problems(rnd, world, dpn, global_batch):
    """(c) ``autopar evaluate`` reports the same problems; where they leave nothing to price it
    refuses with all of them."""
    from planner.search.candidates import batch_of, facts_of
    from planner.search.planning import evaluate_config

    g = _tiny()
    nodes, dpn = (world // dpn, dpn) if world % dpn == 0 else (1, world)
    cluster = dataclasses.replace(load_preset("dgx-h100"), nodes=nodes, devices_per_node=dpn)
    facts, batch = facts_of(g), batch_of(g, global_batch)
    runnable = list(configurations(facts, cluster, batch, dtype="bf16", loss="eager"))
    cfg = rnd.choice(runnable) if runnable and rnd.random() < 0.5 else random_config(rnd)
    found = problems(cfg, facts, batch, cluster)
    try:
        _, reported = evaluate_config(g, cluster, cfg, global_batch, even_split=True)
    except AutoparError as e:
        assert found and "; ".join(found) in str(e)
    else:
        assert reported == found
