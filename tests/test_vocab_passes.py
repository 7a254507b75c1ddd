"""Vocabulary passes (planner/vocab_passes.py): the graph they make, their rows, the generator on
several stages per rank, the memory a schedule holds per stage, and their pricing
(planner/search/vocab_schedule.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cost_models.pipeline import simulate, simulate_schedule
from planner import vocab_passes as vp
from planner.schedule_check import check, held_at_peak, peak_activations
from planner.schedule_ir import builtin, looped
from planner.search.schedule_gen import generate


@pytest.fixture(scope="module")
def llama_tiny():
    from planner.frontend.load import load_graph
    return load_graph("llama-tiny", batch=1, seq_len=32)


@settings(max_examples=80, deadline=None)
@given(vocab=st.integers(1, 3000), p=st.integers(2, 16))
def test_rows_are_torch_chunks_split(vocab, p):
    chunks = torch.arange(vocab).chunk(p)
    for j in range(p):
        lo, hi = vp.shard_rows(vocab, p, j)
        want = chunks[j].tolist() if j < len(chunks) else []
        assert list(range(lo, hi)) == want


def test_passes_keep_the_heads_work_and_weights(llama_tiny):
    head = llama_tiny.layers[-1]
    g2 = vp.with_vocab_passes(llama_tiny, 4)
    passes = g2.layers[-4:]
    assert [x.name for x in passes] == [vp.pass_unit(head.name, j, 4) for j in range(4)]
    assert [vp.parse_unit(x.name) for x in passes] == [vp.VocabPass(head.name, j, 4) for j in range(4)]
    assert sum(x.fwd_flops for x in passes) == pytest.approx(head.fwd_flops)
    assert sum(x.params for x in passes) == pytest.approx(head.params, abs=4)
    assert sum(x.linears[0].out_features for x in passes) == head.vocab
    assert all(x.act_bytes >= head.input_bytes for x in passes)  # each pass saves the hidden states it reads
    assert g2.layers[:-4] == llama_tiny.layers[:-1]
    assert vp.model_units([x.name for x in g2.layers]) == [x.name for x in llama_tiny.layers]
    assert vp.pass_count([x.name for x in g2.layers]) == 4
    with pytest.raises(ValueError, match="last 2 units"):
        vp.pass_count(["a", vp.pass_unit("h", 1, 2), vp.pass_unit("h", 0, 2)])


def test_what_cannot_have_passes_is_named(llama_tiny):
    from planner.frontend.load import load_graph
    assert "tied" in vp.problem(load_graph("gpt-small", batch=1, seq_len=64), 2)
    assert "pp >= 2" in vp.problem(llama_tiny, 1)
    assert "no rows" in vp.problem(llama_tiny, llama_tiny.layers[-1].vocab * 3 // 4 + 1)  # ceil rows run out
    with pytest.raises(ValueError, match="already has vocabulary passes"):
        vp.with_vocab_passes(vp.with_vocab_passes(llama_tiny, 2), 2)


def test_held_at_peak_counts_each_stage():
    s = builtin("interleaved-1f1b", 2, 4, 2)
    act = [1.0, 1.0, 10.0, 10.0]  # the second round's stages are the heavy ones
    for r in range(2):
        held = held_at_peak(s, r, act)
        assert set(held) == set(s.stages_of(r))
        assert sum(act[k] * n for k, n in held.items()) == peak_activations(s, act)[r]


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 5), mult=st.integers(1, 3), data=st.data())
def test_generated_schedules_on_two_stages_per_rank_are_valid_and_within_memory(p, mult, data):
    m = p * mult
    times = st.floats(0.1, 3.0, allow_nan=False)
    f = data.draw(st.lists(times, min_size=2 * p, max_size=2 * p))
    act = data.draw(st.lists(st.floats(0.1, 2.0), min_size=2 * p, max_size=2 * p))
    limit = [sum(act[s] for s in (r, r + p)) * data.draw(st.floats(1.0, 4.0)) for r in range(p)]
    s = generate(f, [2 * x for x in f], m, act=act, limit=limit, stage_rank=looped(p, 2))
    check(s)
    assert all(peak <= lim + 1e-9 for peak, lim in zip(peak_activations(s, act), limit))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 8), (8, 32)])
def test_passes_beat_the_best_builtin_on_a_heavy_head(p, m):
    """A head 1.5x a block stage: every schedule of the whole-head split is bound by its rank; the
    passes under the generated schedule are >= 1.15x faster, and no slower than interleaved 1F1B
    on the same stages (at that order's memory)."""
    f = [1.0] * (p - 1) + [2.5]
    best = min(simulate(n, p, m, f, [2 * x for x in f], p2p=0.02).step_s for n in ("1f1b", "zb-h1"))
    vf = [1.0] * p + [1.5 / p] * p
    vb = [2 * x for x in vf]
    gen = simulate_schedule(generate(vf, vb, m, p2p=0.02, stage_rank=looped(p, 2)), vf, vb, p2p=0.02).step_s
    assert best / gen >= 1.15
    assert gen <= simulate("interleaved-1f1b", p, m, vf, vb, p2p=0.02, v=2).step_s


def test_llama3_8b_at_pp32_prices_faster_with_passes_and_fits():
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.stage_split import passes_body, split_and_estimate
    from planner.search.vocab_schedule import vocab_pass_estimates
    g, c = load_graph("llama3-8b", batch=1, seq_len=8192), parse_cluster("dgx-h100:8")
    e, _ = split_and_estimate(g, c, ParallelConfig(dp=2, pp=32, schedule="1f1b", zero="zero1").validate(), 512,
                              generate=True, vocab_passes=False)
    v = vocab_pass_estimates(g, c, e, passes_body(g, e.config))
    gen = v["generated"]
    assert gen.fits and gen.schedule_ir.v == 2 and gen.config.vpp == 2 and gen.config.vocab_passes
    assert e.step_s / gen.step_s >= 1.15
    assert all(m.total <= gen.capacity for m in gen.memory)


def test_layouts_that_cannot_have_passes_are_refused_in_one_line():
    from planner.errors import PlanError
    from planner.plan import ParallelConfig
    ok = dict(pp=2, vpp=2, schedule="custom", vocab_passes=True)
    assert ParallelConfig(**ok).validate().label().endswith("vocab-passes")
    for bad, words in ((dict(pp=1, vpp=1), "pp >= 2"), (dict(vpp=1), "vpp=2"), (dict(tp=2), "data and pipeline"),
                       (dict(zero="fsdp"), "fsdp"), (dict(loss="fused"), "loss=eager"), (dict(seq_chunks=2), None)):
        with pytest.raises(PlanError) as err:
            ParallelConfig(**{**ok, **bad}).validate()
        assert "\n" not in str(err.value) and (words is None or words in str(err.value))
    with pytest.raises(PlanError, match="vpp=2"):
        ParallelConfig.parse("pp=2,vocab_passes=on")


def test_the_search_chooses_passes_where_they_are_faster():
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.stage_split import split_and_estimate
    g, c = load_graph("benchmarks/vocab256k.toml", batch=1, seq_len=8192), parse_cluster("dgx-h100:2")
    e, info = split_and_estimate(g, c, ParallelConfig(dp=1, pp=16, schedule="1f1b", zero="zero1").validate(), 256,
                                 generate=True)
    assert e.config.vocab_passes and "vocabulary passes" in info["schedule"], info
    assert len(e.partition.bounds) == 32 and e.partition.bounds[-1][1] == len(g.layers) - 1 + 16
    g = load_graph("llama3-8b", batch=1, seq_len=8192)
    e, info = split_and_estimate(g, parse_cluster("dgx-h100:8"),
                                 ParallelConfig(dp=4, pp=16, schedule="1f1b", zero="zero1").validate(), 512, generate=True)
    assert e.config.vocab_passes and "vocabulary passes" in info["schedule"], info  # (pp32: past GEN_MAX_WORK)


def test_the_runtime_refuses_a_pass_over_a_tied_head():
    from dataclasses import replace

    from codegen.runtime.adapters import adapter_for
    from codegen.runtime.vocab_passes import build_pass
    from planner import zoo
    tied = adapter_for(zoo.build_model(replace(zoo.preset("gpt-tiny"), tie_embeddings=True), device="meta"))
    with pytest.raises(ValueError, match="shares its weight"):
        build_pass(tied, vp.pass_unit("head", 0, 2), vp.VocabPass("head", 0, 2))
    untied = adapter_for(zoo.build_model(zoo.preset("gpt-tiny"), device="meta"))
    assert build_pass(untied, vp.pass_unit("head", 1, 2), vp.VocabPass("head", 1, 2)).is_last
