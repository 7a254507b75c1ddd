"""Sequence chunks (Seq1F1B): the IR's chunk order, its check, the simulator's per-chunk times and
memory, the config / feasibility rules, the search's candidates, and the runtime: its chunk
attention against whole-sequence attention, and parity with one process (loss and gradients,
fp32) for k = 2 and 4 on 2 and 4 gloo ranks (one launch per world size, tests/seq_chunks_worker.py)."""
from __future__ import annotations

import os
import sys

import pytest

from cost_models import pipeline as pm
from cost_models.pipeline_memory import inflight_closed, seqs_bound
from cost_models.seq_chunks import chunk_seconds, chunk_share, per_unit, searched_chunks
from planner import schedule_ir as ir
from planner.errors import PlanError
from planner.feasibility import Batch, problems
from planner.plan import ModelFacts, ParallelConfig
from planner.schedule_check import check
from planner.schedule_ir import Action, Schedule, ScheduleError


@pytest.mark.parametrize("name", ir.CHUNK_SCHEDULES)
def test_chunk_orders_check_and_keep_the_chunk_order(name):
    for p in range(1, 6):
        for m in range(1, 6):
            for k in (1, 2, 3, 4):
                s = check(ir.builtin(name, p, m, 1, k))
                assert s.n_microbatches == m * k and s.n_sequences == m and s.seq_chunks == k
                for r in range(p):
                    acts = s.actions(r)
                    fwd = [a.mb for a in acts if a.kind == "F"]
                    bwd = [a.mb for a in acts if a.kind == "B"]
                    assert fwd == list(range(m * k))  # chunks forward in order
                    for mb in range(m):  # each sequence's chunks backward last to first
                        assert [u for u in bwd if u // k == mb] == [ir.unit(mb, j, k) for j in reversed(range(k))]


def test_one_f_one_b_chunks_warm_up_k_minus_1_more_forwards():
    s = ir.builtin("1f1b", 4, 8, 1, 2)
    for r in range(4):
        acts = s.actions(r)
        first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
        assert first_b == min(4 - 1 - r + 2 - 1, 16) + 1


def test_chunk_order_violations_are_deadlocks_in_one_line():
    f_swapped = Schedule("x", 2, (0,), ((Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 1),
                                         Action("B", 0, 0)),), seq_chunks=2)
    with pytest.raises(ScheduleError, match=r"rank 0 waits forever at 0F1 for 0F0") as e:
        check(f_swapped)
    assert "\n" not in str(e.value)
    b_in_order = Schedule("x", 2, (0,), ((Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0),
                                          Action("B", 0, 1)),), seq_chunks=2)
    with pytest.raises(ScheduleError, match=r"at 0B0 for 0B/I1"):
        check(b_in_order)
    # the same order without chunks is fine: the dependencies are the chunks'
    check(Schedule("x", 2, (0,), b_in_order.ranks))
    with pytest.raises(ScheduleError, match="do not divide its 3 units"):
        check(Schedule("x", 3, (0,), ((Action("F", 0, 0),),), seq_chunks=2))


def test_chunk_share_sums_to_one_and_grows_with_the_index():
    for k in (1, 2, 4, 8):
        for a in (0.0, 0.3, 1.0):
            shares = [chunk_share(j, k, a) for j in range(k)]
            assert sum(shares) == pytest.approx(1.0)
            assert shares == sorted(shares)
            if a == 0.0:
                assert all(x == pytest.approx(1 / k) for x in shares)
    assert chunk_seconds(4.0, 2.0, 0, 2) == pytest.approx(4.0 * (0.5 / 2 + 0.5 / 4))
    assert chunk_seconds(4.0, 2.0, 1, 2) == pytest.approx(4.0 * (0.5 / 2 + 0.5 * 3 / 4))


def test_simulated_chunk_times_and_the_uniform_closed_form():
    p, m, f, b = 4, 8, 1.0, 2.0
    base = pm.simulate("1f1b", p, m, f, b)
    for k in (2, 4):
        r = pm.simulate("1f1b", p, m, f, b, seq_chunks=k)
        assert r.step_s == pytest.approx((m * k + p - 1) * (f + b) / k)  # the bubble shrinks k-fold
        assert r.busy_s == pytest.approx(base.busy_s)  # chunking adds no work
        assert r.m == m and r.seq_chunks == k
    k, af, ab = 2, 0.6, 1.2
    r = pm.simulate("1f1b", p, m, f, b, seq_chunks=k, attn_fwd=af, attn_bwd=ab)
    for e in r.events:
        total, attn = (f, af) if e.kind == "F" else (b, ab)
        assert e.end - e.start == pytest.approx(chunk_seconds(total, attn, e.mb % k, k))
    assert r.busy_s == pytest.approx(base.busy_s)
    # the chunk order holds in the simulated times too
    ends = {(e.stage, e.kind, e.mb): (e.start, e.end) for e in r.events}
    for (st, kind, u), (start, _) in ends.items():
        if kind == "F" and u % k:
            assert start >= ends[(st, "F", u - 1)][1]
        if kind == "B" and u % k < k - 1:
            assert start >= ends[(st, "B", u + 1)][1]


def test_inflight_units_match_the_closed_form_and_memory_is_per_unit():
    for p, m, k in ((4, 8, 2), (4, 8, 4), (3, 2, 4), (2, 1, 2)):
        r = pm.simulate("1f1b", p, m, 1.0, 2.0, seq_chunks=k)
        assert r.peak_inflight_chunks == [inflight_closed("1f1b", p, m, 1, rr, k) for rr in range(p)]
        assert all(seqs <= seqs_bound(u, k) for seqs, u in zip(r.peak_inflight, r.peak_inflight_chunks))
        g = pm.simulate("gpipe", p, m, 1.0, 2.0, seq_chunks=k)
        assert g.peak_inflight_chunks == [m * k] * p
    from cost_models.memory import ChunkMemory
    mem = ChunkMemory(weights=8.0, grads=8.0, optimizer=16.0, pinned=1.0, act=4.0, peak=2.0, work=2.0, transient=3.0,
                      host=4.0)
    u = per_unit(mem, 4)
    assert (u.act, u.peak, u.work, u.host) == (1.0, 0.5, 0.5, 1.0)
    assert (u.weights, u.grads, u.optimizer, u.pinned, u.transient) == (8.0, 8.0, 16.0, 1.0, 3.0)


def test_config_rules_one_line_each():
    assert ParallelConfig.parse("pp=2,seq_chunks=2").seq_chunks == 2
    assert "seq-chunks2" in ParallelConfig.parse("pp=2,seq_chunks=2").label()
    assert "seq_chunks" not in ParallelConfig.parse("pp=2").to_str()  # a quiet default: old plans read as before
    for cfg, msg in (("seq_chunks=2", "needs pp > 1"), ("pp=2,seq_chunks=0", "positive integer"),
                     ("pp=2,cp=2,seq_chunks=2", "both split the sequence"),
                     ("pp=2,schedule=zb-h1,seq_chunks=2", "gpipe or 1f1b"),
                     ("pp=2,vpp=2,schedule=interleaved-1f1b,seq_chunks=2", "vpp=1")):
        with pytest.raises(PlanError, match=msg) as e:
            ParallelConfig.parse(cfg)
        assert "\n" not in str(e.value)


def test_feasibility_refuses_what_chunks_cannot_cut():
    from planner.feasibility import Nodes
    cfg = ParallelConfig.parse("dp=1,pp=2,seq_chunks=4")
    facts = ModelFacts(units=8)
    nodes = Nodes("n", 1, 2)
    assert not [p for p in problems(cfg, facts, Batch(4, 1024), nodes) if "seq_chunks" in p]
    assert any("must divide the sequence length 1022" in p for p in problems(cfg, facts, Batch(4, 1022), nodes))
    assert any("packed documents" in p for p in problems(cfg, facts, Batch(4, 1024, True), nodes))
    limited = ModelFacts(units=8, limits={"attention": "its attention is its own"})
    assert any("autopar's attention" in p for p in problems(cfg, limited, Batch(4, 1024), nodes))


def test_chunks_without_recompute_only_one_line():
    """The runtime finds a chunk's keys/values by the order of its forwards: no recompute or
    offload, refused by the feasibility rule (the search, evaluate, run) and per stage by the runtime."""
    from codegen.runtime.recipe import runtime_problem
    from planner.feasibility import Nodes
    cfg = ParallelConfig.parse("pp=2,seq_chunks=2,recompute=full")
    found = [p for p in problems(cfg, ModelFacts(units=8), Batch(4, 1024), Nodes("n", 1, 2)) if "seq_chunks" in p]
    assert found and "recompute=full" in found[0] and "\n" not in found[0]
    assert runtime_problem(ParallelConfig.parse("pp=2,seq_chunks=2"), ["none", "none"]) is None
    why = runtime_problem(ParallelConfig.parse("pp=2,seq_chunks=2"), ["none", "offload"])
    assert "recompute=offload" in why and "seq_chunks=1" in why
    assert runtime_problem(ParallelConfig.parse("pp=2"), ["full", "offload"]) is None


def test_units_layout_and_order_check():
    import torch
    from codegen.runtime.seq_chunks import check_order, to_units
    t = torch.arange(2 * 3 * 8).reshape(6, 8)  # m = 2 micro-batches of mbs = 3 rows, S = 8
    u = to_units(t, 2, 4)
    assert u.shape == (2 * 4 * 3, 2)
    for mb in range(2):
        for j in range(4):
            unit = u[(mb * 4 + j) * 3:(mb * 4 + j + 1) * 3]
            assert torch.equal(unit, t[mb * 3:(mb + 1) * 3, j * 2:(j + 1) * 2])
    check_order(ir.builtin("1f1b", 3, 4, 1, 2))
    bad = Schedule("x", 2, (0,), ((Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 1), Action("B", 0, 0)),), 2)
    with pytest.raises(ValueError, match="out of order"):
        check_order(bad)


def test_chunk_attention_equals_whole_sequence_attention():
    """Chunks in order forward, then backward last chunk first (the IR's order): the outputs and
    the q / k / v gradients equal causal attention over the whole sequence (GQA: 4 query heads
    over 2 kv heads)."""
    import torch
    import torch.nn.functional as F
    from codegen.runtime.seq_chunks import ChunkAttention, ChunkStore
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    w = torch.randn_like(out)
    want = torch.autograd.grad((out * w).sum(), (q, k, v))
    for n in (2, 4):
        store, c = ChunkStore(n), 8 // n
        att = ChunkAttention(store, "layers.0")
        outs = []
        for j in range(n):
            store.at(j * c)
            sl = slice(j * c, (j + 1) * c)
            outs.append(att(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True))
        assert torch.allclose(torch.cat(outs, 2), out, atol=1e-12)
        for j in reversed(range(n)):
            (outs[j] * w[:, :, j * c:(j + 1) * c]).sum().backward()
        for t, g in zip((q, k, v), want):
            assert torch.allclose(t.grad, g, atol=1e-12)
            t.grad = None
        store.clear()
        assert not store.kv


def test_search_tries_chunks_on_gpu_clusters_only():
    from cost_models.cluster import parse_cluster
    from planner.search.candidates import Point, variants
    assert searched_chunks(parse_cluster("dgx-h100")) == (1, 2, 4)
    assert searched_chunks(parse_cluster("local-cpu:2")) == (1,)
    facts = ModelFacts(units=8, heads=(8,), kv_heads=(8,), hidden=512)
    found = {(c.schedule, c.seq_chunks) for c in variants(Point(1, 2, 1, 1, 1, 4, 1, (1,), 0), 1, facts,
                                                          Batch(4, 1024), "bf16", "eager", seq_chunks=(1, 2, 4))}
    assert {("1f1b", 2), ("1f1b", 4)} <= found
    assert not any(k > 1 for s, k in found if s not in ir.CHUNK_SCHEDULES)


def _chunked_estimates(cluster: str, layout: str, gb: int, profile=None) -> dict:
    from cost_models.cluster import parse_cluster
    from cost_models.estimate import estimate
    from planner.frontend.load import load_graph
    from planner.search.stage_split import even_split
    g = load_graph("llama-tiny", batch=1, seq_len=256)
    return {k: estimate(g, parse_cluster(cluster), ParallelConfig.parse(f"{layout},recompute=none,seq_chunks={k}"),
                        even_split(g, 2), gb, profile=profile) for k in (1, 2, 4)}


def test_estimate_prices_chunks_faster_and_smaller_on_a_pipeline():
    """The full estimate on a 2-stage pipeline (GPU roofline in fp32, 4 micro-batches per replica: no
    fixed per-call part; mixed precision's per-call copies are tests/test_mp_casts.py's): k = 2 and 4
    shrink the step, the bubble and the activations held per rank; the KV store adds to rank 0's
    activations."""
    out = _chunked_estimates("dgx-h100:1", "pp=2,dp=4,dtype=fp32", 16)
    assert out[4].step_s < out[2].step_s < out[1].step_s
    assert out[4].bubble_frac < out[2].bubble_frac < out[1].bubble_frac
    assert out[4].memory[0].activations < out[2].memory[0].activations < out[1].memory[0].activations
    assert out[2].pipeline.peak_inflight_chunks == [3, 2] and out[2].pipeline.seq_chunks == 2


def test_cpu_pipeline_chunks_pay_the_wrappers_per_call_work():
    """On local CPUs the pipeline's stages run under fully_shard (cost_models/cpu_runtime.py), whose
    per-unit work every chunk pays whole: llama-tiny pp2 measured 0.146 s whole and 0.344 s in 4
    chunks (README); the estimate must rank k = 4 slowest, and the busiest rank's busy time grows
    by (k - 1) micro-batches x the wrapper's per-call seconds on its layers."""
    from cost_models.cluster import parse_cluster
    from cost_models.cpu_runtime import wrapper_unit_s
    out = _chunked_estimates("local-cpu:2", "pp=2", 4)
    assert out[1].step_s < out[2].step_s < out[4].step_s
    wf, wb = wrapper_unit_s(parse_cluster("local-cpu:2"), ParallelConfig.parse("pp=2"))
    n = _wrapped_units(out[1])
    assert n == [3, 3]  # each stage: its 2 blocks and the stage root (embedding; final norm and head)
    for k in (2, 4):
        grow = [b4 - b1 for b1, b4 in zip(out[1].pipeline.busy_s, out[k].pipeline.busy_s)]
        assert grow == pytest.approx([4 * (k - 1) * x * (wf + wb) for x in n], rel=1e-6)


def _wrapped_units(est) -> list[int]:
    """The data-parallel wrapper's units on each stage of ``est`` (llama-tiny, as _chunked_estimates)."""
    from cost_models.dp_units import stage_units
    from cost_models.memory import LayerTable
    from planner.frontend.load import load_graph
    g = load_graph("llama-tiny", batch=1, seq_len=256)
    return [stage_units(g, LayerTable(g, est.config), est.config, lo, hi) for lo, hi in est.partition.bounds]


def test_chunk_seconds_charges_the_fixed_part_whole():
    """Every chunk pays ``fixed``; the rest splits as chunk_share; the chunks of a pass sum to
    ``total + (k - 1) fixed``; fixed = 0 is the old split, a fixed part over the total is capped."""
    total, attn, fixed, k = 10.0, 2.0, 3.0, 4
    got = [chunk_seconds(total, attn, j, k, fixed) for j in range(k)]
    assert got == pytest.approx([fixed + chunk_share(j, k, attn / (total - fixed)) * (total - fixed)
                                 for j in range(k)])
    assert sum(got) == pytest.approx(total + (k - 1) * fixed)
    assert chunk_seconds(total, attn, 1, k) == chunk_seconds(total, attn, 1, k, 0.0)
    assert chunk_seconds(total, 0.0, 2, k, 50.0) == total


def test_profile_fixed_share_is_the_affine_intercept():
    """``ProfileDB.layer_fixed_share``: the intercept of the line through the two smallest token
    counts at the sequence length, over the time at the asked batch; (0, 0) from one point."""
    from cost_models.profile_db import ProfileDB
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=2)
    db.add_layer("blk", 1, 64, 1, 1, 0.015, 0.040)   # t(n) = 5 ms + n / 6.4 ms forward
    db.add_layer("blk", 4, 64, 1, 1, 0.045, 0.100)   # backward: 20 ms + n 0.3125 ms
    f, b = db.layer_fixed_share("blk", 1, 64, 1, 1)
    assert f == pytest.approx(0.005 / 0.015) and b == pytest.approx(0.020 / 0.040)
    f4, _ = db.layer_fixed_share("blk", 4, 64, 1, 1)
    assert f4 == pytest.approx(0.005 / 0.045)
    db.add_layer("emb", 1, 64, 1, 1, 0.001, 0.021)   # a backward that does not grow: all fixed
    db.add_layer("emb", 4, 64, 1, 1, 0.004, 0.016)
    assert db.layer_fixed_share("emb", 1, 64, 1, 1) == pytest.approx((0.0, 1.0))
    db.add_layer("one", 1, 64, 1, 1, 0.01, 0.02)
    assert db.layer_fixed_share("one", 1, 64, 1, 1) == (0.0, 0.0)
    # a chunk's own time measured (1 x 16 tokens): the line through it and the whole sequence, so
    # that 4 chunks cost 4 x t(16) as measured
    db.add_layer("blk", 1, 16, 1, 1, 0.006, 0.025)
    f, b = db.layer_fixed_share("blk", 1, 64, 1, 1, k=4)
    assert f * 0.015 == pytest.approx((4 * 0.006 - 0.015) / 3) and b * 0.040 == pytest.approx((4 * 0.025 - 0.040) / 3)
    assert db.layer_fixed_share("blk", 1, 64, 1, 1, k=2) == pytest.approx((0.005 / 0.015, 0.020 / 0.040))


def test_profiler_times_one_chunk_of_each_searched_count():
    from cost_models.seq_chunks import chunk_lengths
    assert chunk_lengths(64) == [32, 16] and chunk_lengths(6) == [3] and chunk_lengths(7) == []


def test_plan_words_say_the_sequences_run_as_chunks():
    from types import SimpleNamespace
    from planner.describe import step_words
    plan = SimpleNamespace(config=ParallelConfig.parse("dp=1,pp=2,seq_chunks=4"), batch={"global": 8, "seq_len": 4096},
                           schedule_ir=None)
    words = step_words(plan)
    assert "cut into 4 chunks of 1024 tokens" in words and "32 units" in words
    assert "chunks of" not in step_words(SimpleNamespace(config=ParallelConfig.parse("pp=2"), batch=plan.batch, schedule_ir=None))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5  # as tests/test_runtime_parity.py (fp32)


@pytest.fixture(scope="module", params=[2, 4])
def launch(request, tmp_path_factory):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from launches import run_worker
    world = request.param
    return world, run_worker("seq_chunks_worker.py", world, str(tmp_path_factory.mktemp("seq_chunks") / f"w{world}.json"))


@pytest.mark.slow
def test_seq_chunks_parity_on_gloo_ranks(launch):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import seq_chunks_worker as W
    world, res = launch
    ks = set()
    for model in W.MODELS:
        for name, kw, _ in W.LAYOUTS[world]:
            r = res[f"{model}/{name}"]
            assert "error" not in r, r.get("error")
            assert r["loss_rel_err"] < TOL and r["grad_rel_err"] < TOL, (model, name, r["worst"], r["grad_rel_err"])
            ks.add(kw["seq_chunks"])
    assert ks == {2, 4}


def test_estimate_charges_every_chunk_the_profiled_fixed_part():
    """With a profile that times every layer on one chunk's tokens (64 of 256) too, k = 4 chunks
    keep each rank's busy time at 4 micro-batches x (4 t(64) - t(256)) more per layer pass, plus
    the wrapper's per-call work: exactly what 4 chunks cost as measured."""
    from cost_models.cluster import parse_cluster
    from cost_models.cpu_runtime import wrapper_unit_s
    from cost_models.profile_db import ProfileDB
    from planner.frontend.load import load_graph
    g = load_graph("llama-tiny", batch=1, seq_len=256)
    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=2, dtype="bf16")  # the plan's dtype
    for layer in g.layers:
        if layer.repeat_of is None:
            for batch, seq, f, b in ((1, 256, 4e-3, 9e-3), (4, 256, 13e-3, 30e-3), (1, 64, 1.5e-3, 4e-3)):
                db.add_layer(layer.signature, batch, seq, 1, 1, f, b)
    out = _chunked_estimates("local-cpu:2", "pp=2", 4, profile=db)
    wf, wb = wrapper_unit_s(parse_cluster("local-cpu:2"), ParallelConfig.parse("pp=2"), db)
    t0 = (4 * 1.5e-3 - 4e-3) / 3 + (4 * 4e-3 - 9e-3) / 3   # forward + backward, per layer and call
    n, units = [hi - lo for lo, hi in out[1].partition.bounds], _wrapped_units(out[1])
    grow = [b4 - b1 for b1, b4 in zip(out[1].pipeline.busy_s, out[4].pipeline.busy_s)]
    assert grow == pytest.approx([4 * 3 * (x * t0 + u * (wf + wb)) for x, u in zip(n, units)], rel=1e-6)
    assert out[4].step_s > out[1].step_s
