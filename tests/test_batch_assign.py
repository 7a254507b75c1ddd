"""The per-batch assignment rule (planner/batch_assign.py): every token placed exactly once, within
memory, on groups the runtime can form, deterministically and fast, and better balanced than a
fixed layout on long-tail batches."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.batch_assign import AssignError, Pool, WorkCost, assign, padded_length, piece_work, PAD_CHUNKS
from planner.batch_layout import static_work

COST = WorkCost(linear=1e-6, attention=1e-10, exchange=2e-7, latency=1e-5)


def _check(lengths, pool: Pool, cost: WorkCost) -> None:
    a = assign(lengths, pool, cost)
    assert [p.piece for p in a.placements] == list(range(len(lengths)))
    held = [0] * pool.workers
    work = [0.0] * pool.workers
    sizes = pool.group_sizes()
    for p in a.placements:
        assert p.length == lengths[p.piece] and p.size in sizes
        assert 0 <= p.first and p.first + p.size <= pool.workers
        assert p.first in pool.windows(p.size)
        assert p.padded == padded_length(p.length, p.size) and p.padded % (PAD_CHUNKS * p.size if p.size > 1 else 1) == 0
        assert p.padded - p.length < max(PAD_CHUNKS * p.size, 1)
        for w in p.workers:  # every token of the piece on exactly the group's workers, evenly
            held[w] += p.padded // p.size
            work[w] += piece_work(p.length, p.size, cost)
    assert tuple(held) == a.tokens and max(held) <= pool.capacity
    assert np.allclose(work, a.work)
    assert a.step >= a.ideal * (1 - 1e-9)
    # every worker runs its groups in one global order: no two members disagree
    for w in range(pool.workers):
        order = [p.piece for p in a.on_worker(w) if p.size > 1]
        assert order == [i for i in a.group_order if w in a.placements[i].workers]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 4000), min_size=1, max_size=80), workers=st.integers(1, 12),
       aligned=st.booleans(), ulysses=st.booleans(), data=st.data())
def test_every_token_placed_once_within_memory(lengths, workers, aligned, ulysses, data):
    max_group = data.draw(st.integers(1, workers))
    per = -(-sum(lengths) // workers)
    capacity = data.draw(st.integers(max(per, -(-max(lengths) // max_group) + PAD_CHUNKS), 2 * per + 4000))
    cost = WorkCost(linear=1e-6, attention=data.draw(st.sampled_from([0.0, 1e-10, 1e-8])),
                    exchange=2e-7, alltoall=1e-7, latency=1e-5, method="ulysses" if ulysses else "ring")
    pool = Pool(workers, max_group, capacity, aligned=aligned)
    try:
        _check(lengths, pool, cost)
    except AssignError as e:  # only when the batch truly leaves no room (aligned windows, padding)
        assert "room" in str(e) or "needs more" in str(e)


def test_deterministic_and_fast_for_1024_documents():
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.maximum(rng.lognormal(np.log(1024), 1.5, 1024).astype(int), 32), 131072).tolist()
    pool = Pool(64, 64, 2 * sum(lengths) // 64)
    first = assign(lengths, pool, COST)
    assert assign(list(lengths), pool, COST) == first  # same inputs, same assignment
    times = []  # CPU time of this process: the planner's own work, whatever else shares the machine's cores
    for _ in range(7):
        t = time.process_time()
        assign(lengths, pool, COST)
        times.append(time.process_time() - t)
    assert sorted(times)[3] < 0.010, f"median {sorted(times)[3] * 1e3:.1f} ms per batch of 1,024 documents"


def test_long_document_split_short_ones_whole():
    lengths = [8192] + [64] * 128
    a = assign(lengths, Pool(4, 4, 4608), COST)
    assert a.placements[0].size >= 2  # 8192 tokens cannot fit one worker of 4608
    assert all(p.size == 1 for p in a.placements[1:])
    assert a.spread() < 1.05


def test_non_power_of_two_groups_when_allowed():
    lengths = [3000] + [100] * 3
    cost = WorkCost(linear=1e-6, attention=0.0)
    a = assign(lengths, Pool(3, 3, 1100), cost)
    assert a.placements[0].size == 3 and a.placements[0].padded == 3000
    assert sorted(p.first for p in a.placements[1:]) == [0, 1, 2] and a.tokens == (1100, 1100, 1100)
    with pytest.raises(AssignError, match="needs more than 3 workers"):
        assign(lengths, Pool(3, 3, 1100, sizes=(1, 2)), cost)


def test_refuses_what_cannot_fit():
    with pytest.raises(AssignError, match="raise the CP budget"):
        assign([10_000], Pool(4, 2, 4096), COST)
    with pytest.raises(AssignError, match="room"):
        assign([100] * 10, Pool(2, 2, 300), COST)
    with pytest.raises(AssignError, match="max_group"):
        Pool(2, 4, 100)


def test_static_work_counts_every_pair():
    # one document filling the row: zigzag gives every cp rank the same pairs
    cost = WorkCost(linear=0.0, attention=1.0)
    w = static_work([64], 64, 1, 4, cost)
    assert np.allclose(w, w[0]) and np.isclose(sum(w), 2 * 64 * 65 / 2)
    # short documents: the same total, no ring exchange hidden (visiting pairs 0)
    lens = [8] * 8 + [16] * 4
    w = static_work(lens, 64, 2, 2, cost)
    assert np.isclose(sum(w), sum(2 * n * (n + 1) / 2 for n in lens))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=60), dp=st.sampled_from([1, 2, 4]),
       cp=st.sampled_from([1, 2, 4]), mbs=st.sampled_from([1, 2]), ulysses=st.booleans())
def test_fixed_layouts_priced_at_the_busiest_rank(lengths, dp, cp, mbs, ulysses):
    """The cost model's attention share of a fixed layout (cost_models.documents.busiest_share) is
    the mean share times the busiest rank's attention over the mean rank's, micro-batch by
    micro-batch: the same per-rank pairs static_work prices a batch with (one rule,
    planner.batch_layout.row_rank_pairs); one rank pays the mean exactly."""
    from cost_models.documents import busiest_share, pack_mix

    row = 64
    mix = pack_mix(lengths * (row * 8 // sum(lengths) + 1), row)  # at least 8 rows
    if mix.rows < dp * mbs:
        return
    u = cp if ulysses else 1
    att = WorkCost(linear=0.0, attention=1.0, method="ulysses" if ulysses else "ring")
    ends = np.cumsum(mix.pieces)
    k = dp * mbs
    busiest = mean = 0.0
    for g in range(mix.rows // k):  # each micro-batch: dp ranks, mbs rows each
        sel = (ends > g * k * row) & (ends <= (g + 1) * k * row)
        w = static_work(np.asarray(mix.pieces)[sel], row, dp, cp, att)
        busiest, mean = busiest + max(w), mean + sum(w) / len(w)
    got = busiest_share(mix, dp, cp, u, mbs)
    assert got >= mix.attention_share * (1 - 1e-12)
    assert np.isclose(got, mix.attention_share * busiest / mean, rtol=1e-9)
    if dp * cp == 1:
        assert got == mix.attention_share


def test_per_batch_beats_static_on_long_tail():
    rng = np.random.default_rng(1)
    wins = 0
    for _ in range(20):
        lens, total = [], 0
        while total < 16 * 4096:
            n = int(min(max(rng.lognormal(np.log(256), 1.5), 16), 16384))
            n = min(n, 16 * 4096 - total)
            lens.append(n)
            total += n
        best_static = min(max(static_work(lens, 4096 * cp, 16 // cp, cp, COST)) for cp in (4, 8, 16))
        per_batch = assign(lens, Pool(16, 16, 2 * 4096), COST).step
        wins += per_batch < best_static
    assert wins >= 18


def test_pricing_rates_from_the_cost_model():
    from cost_models.batch_pricing import Layout, capacity_tokens, compare, work_cost
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig

    graph = load_graph("llama3-8b", batch=1, seq_len=16384)
    cluster = parse_cluster("dgx-h100:1")
    cfg = ParallelConfig(dp=1, cp=8, zero="fsdp", recompute="full")
    cost = work_cost(graph, cluster, cfg)
    assert cost.linear > 0 and cost.attention > 0 and cost.exchange > 0 and cost.method == "ring"
    # a 16K document's attention is a real share of its work on an H100 (flash: about a third to a half)
    share = cost.attention * 16384 ** 2 / (cost.linear * 16384 + cost.attention * 16384 ** 2)
    assert 0.15 < share < 0.7
    assert work_cost(graph, cluster, ParallelConfig(dp=1, cp=8, ulysses=8, zero="fsdp")).method == "ulysses"
    assert capacity_tokens(2048, 10e9, 50e9, 80e9) == 2048 * 3 and capacity_tokens(2048, 10e9, 75e9, 80e9) == 2048
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(10):
        lens, total = [], 0
        while total < 8 * 4096:
            n = min(int(max(rng.lognormal(np.log(512), 2.0), 32)), 16384, 8 * 4096 - total)
            while n:  # cut at the 16K rows' ends
                take = min(n, 16384 - total % 16384)
                lens.append(take)
                total, n = total + take, n - take
        batches.append(lens)
    c = compare(batches, Pool(8, 8, 8192), cost, [Layout(2, 4, 16384), Layout(1, 8, 16384)], fixed_s=0.01)
    assert c.best_static in ("dp2 cp4", "dp1 cp8") and c.speedup > 1.0 and c.ideal_gap >= 1.0
    assert len(c.spread_before) == len(c.spread_after) == 10


def _documents_plan(fix: str, per_batch: bool = True):
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    rng = np.random.default_rng(0)
    lengths = [int(min(max(x, 32), 16384)) for x in rng.lognormal(np.log(1024), 1.5, 400)]
    graph = load_graph("llama-1b", batch=1, seq_len=16384)
    return plan_model(graph, parse_cluster("dgx-h100:1"), 8, spec="llama-1b", cluster_spec="dgx-h100:1",
                      fix=fix, seq_lens=lengths, per_batch=per_batch)[0]


def test_plan_records_per_batch_and_the_program_runs_it():
    from codegen.emit import emit
    from codegen.runtime.batch_parallel import per_batch_of
    from planner.describe import describe
    from planner.plan import PlanError

    plan = _documents_plan("dp=8,pp=1,tp=1,cp=1,mbs=1,recompute=none")
    rec = plan.batch["per_batch"]
    assert rec["workers"] == 8 and rec["batches"] >= 1 and rec["spread_after"] < rec["spread_before"]
    # priced directly: the busiest worker's mean seconds plus the step's shared work, whatever the layout
    assert rec["expected_step_s"] == pytest.approx(rec["per_batch_s"], rel=1e-3) and rec["expected_step_s"] > rec["fixed_s"]
    assert rec["ratio"] == pytest.approx(rec["expected_step_s"] / plan.estimate["step_s"], rel=1e-3)
    assert rec["chosen"] and rec["ratio"] <= 0.98 and "per-batch assignment" in rec["why"]
    text = emit(plan)
    assert "PER_BATCH = per_batch_of({" in text and "per-batch assignment" in describe(plan).attention
    from planner.report.data import per_batch_text
    line = per_batch_text(plan)
    assert line.startswith("chosen: ") and f"{rec['spread_before']:.2f}x the mean work" in line
    pb = per_batch_of(rec)
    assert pb.pool.workers == 8 and pb.cost.attention == rec["cost"]["attention"]
    plan.batch["per_batch"]["cost"]["method"] = "os.system('id')"
    with pytest.raises(PlanError, match="method"):
        emit(plan)
    # a layout the runtime cannot run per batch: recorded, not chosen, and why
    plan = _documents_plan("dp=8,pp=1,tp=1,cp=1,mbs=1,recompute=full")
    assert not plan.batch["per_batch"]["chosen"] and "recompute" in plan.batch["per_batch"]["why"]


def test_per_batch_needs_documents():
    from planner.errors import AutoparError
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    with pytest.raises(AutoparError, match="--seq-lens"):
        plan_model(load_graph("llama-tiny", batch=1, seq_len=256), parse_cluster("dgx-h100:1"), 8, spec="llama-tiny",
                   cluster_spec="dgx-h100:1", fix="pp=1,tp=1", per_batch=True)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), workers=st.integers(1, 4), data=st.data())
def test_worker_rows_hold_every_token_once(lengths, workers, data):
    """The runtime's rows (codegen/runtime/batch_parallel.py): every real token of the batch on
    exactly the workers of its group, each once per group rank, with its piece's positions."""
    import torch
    from codegen.runtime.batch_parallel import PAD_ID, pieces, row_spans, worker_row
    from codegen.runtime.documents import IGNORE_INDEX

    seq = 16
    total = -(-sum(lengths) // seq) * seq
    lengths = lengths + ([total - sum(lengths)] if total > sum(lengths) else [])
    rows = total // seq
    cu = torch.cumsum(torch.tensor([0] + lengths), 0)
    starts = pieces(cu, rows, seq)
    ends = torch.cat([starts[1:], torch.tensor([total])])
    assert int(starts[0]) == 0 and bool((starts[1:] > starts[:-1]).all())
    assert all(int(s) // seq == (int(e) - 1) // seq for s, e in zip(starts, ends))  # no piece crosses a row end
    ids = torch.arange(1, total + 1)  # token t has id t + 1 (0 is the pad)
    a = assign((ends - starts).tolist(), Pool(workers, workers, 2 * total), COST)
    seen = torch.zeros(total, dtype=torch.long)
    windows = [(f, g) for g in range(2, workers + 1) for f in range(workers - g + 1)]
    pad_to = max(a.tokens) + data.draw(st.integers(0, 5)) if data.draw(st.booleans()) else None  # a pipeline's rows
    for w in range(workers):
        r = worker_row(a, w, starts, ids, ids.clone(), windows, pad_to)
        assert pad_to is None or r.ids.shape[1] == pad_to
        spans = row_spans(r.codes[0], len(windows))  # the layout codes: whole pieces, shares in order, padding
        assert sum(sp.length for sp in spans) == r.ids.shape[1]
        assert [windows[sp.window] for sp in spans if sp.window is not None] == [(p.first, p.size) for p in r.shares]
        whole = [p for p in a.on_worker(w) if p.size == 1]
        assert [sp.length for sp in spans if sp.window is None and not sp.pad] == [p.length for p in whole]
        pads = [sp for sp in spans if sp.pad]
        assert len(pads) == (pad_to is not None and pad_to > a.tokens[w]) and (not pads or pads[0] is spans[-1])
        real = r.ids[0] != PAD_ID
        assert bool((r.targets[0][~real] == IGNORE_INDEX).all())
        seen.index_add_(0, r.ids[0][real] - 1, torch.ones(int(real.sum()), dtype=torch.long))
        tok = r.ids[0][real] - 1  # positions: the token's offset in its piece
        piece_start = starts[torch.searchsorted(starts, tok, right=True) - 1]
        assert torch.equal(r.positions[0][real], tok - piece_start)
    assert torch.equal(seen, torch.ones(total, dtype=torch.long))  # a group's tokens are split, not copied


def test_per_batch_problem_names_what_the_runtime_cannot_run():
    from planner.batch_assign import per_batch_problem
    from planner.plan import ParallelConfig

    pool = Pool(4, 4, 4096)
    ok = ParallelConfig(dp=2, cp=2, mbs=2)
    assert per_batch_problem(ok, 4, pool, "ring") is None
    assert "mbs = global batch / dp" in per_batch_problem(ParallelConfig(dp=2, cp=2, mbs=1), 4, pool, "ring")
    assert per_batch_problem(ParallelConfig(dp=2, pp=2, mbs=1), 4, Pool(2, 2, 99), "ring") is None  # 2 micro-batches
    assert per_batch_problem(ParallelConfig(dp=2, pp=2, mbs=1, schedule="gpipe"), 4, Pool(2, 2, 99), "ring") is None
    assert "gpipe or 1f1b" in per_batch_problem(ParallelConfig(dp=2, pp=2, mbs=1, schedule="zb-h1"), 4,
                                                Pool(2, 2, 99), "ring")
    assert "gpipe or 1f1b" in per_batch_problem(ParallelConfig(dp=1, pp=2, vpp=2, mbs=1, schedule="interleaved-1f1b"),
                                                4, Pool(1, 1, 99), "ring")
    assert "tensor parallelism" in per_batch_problem(ParallelConfig(dp=2, tp=2, mbs=2), 4, Pool(2, 2, 99), "ring")
    assert "recompute" in per_batch_problem(ParallelConfig(dp=2, cp=2, mbs=2, recompute="full"), 4, pool, "ring")
    assert "dp x cp = 4" in per_batch_problem(ok, 4, Pool(2, 2, 99), "ring")
    assert "do not divide" in per_batch_problem(ok, 4, Pool(4, 4, 99, sizes=(1, 4)), "ulysses", heads=4, kv_heads=2)
    assert per_batch_problem(ok, 4, Pool(4, 4, 99, sizes=(1, 2)), "ulysses", heads=4, kv_heads=2) is None


def test_pipeline_rows_are_padded_and_the_padding_priced():
    """Under a pipeline every worker's row is padded to the pool's capacity: the pads cost linear
    work (``padded_work``), a step is the pipeline's over its micro-batches, and a longer row
    costs more on the same batches (``compare``)."""
    from cost_models.batch_pricing import Layout, compare
    from planner.batch_assign import microbatch_ranges, padded_work, row_tokens
    from planner.batch_layout import pipeline_step

    lens = [64, 3, 5, 8, 12, 4, 4, 28, 7, 9, 16, 10, 6, 16, 40, 24]  # 256 tokens: 4 rows of 64
    assert [len(r) for r in microbatch_ranges(lens, 2)] == [8, 8]  # 128 tokens each, cut at a row end
    assert [sum(lens[r.start:r.stop]) for r in microbatch_ranges(lens, 4)] == [64] * 4
    assert pipeline_step([1.0, 1.0, 1.0], 2) == 4.0 and pipeline_step([1.0, 3.0], 4) == 13.0
    pool = Pool(2, 2, 80)
    a = assign(lens[:8], pool, COST)
    assert row_tokens(pool, 1) is None and row_tokens(pool, 2) == 80
    assert padded_work(a, pool, COST, 1) == a.work
    assert padded_work(a, pool, COST, 2) == pytest.approx([w + COST.linear * (80 - n) for w, n in zip(a.work, a.tokens)])
    steps = [compare([lens], Pool(2, 2, cap), COST, [Layout(2, 1, 64)], pp=2, microbatches=2).per_batch[0]
             for cap in (72, 96, 160)]
    assert steps[0] < steps[1] < steps[2]  # padding costs time
    flat = compare([lens], Pool(2, 2, 96), COST, [Layout(2, 1, 64)], pp=1, microbatches=2)
    assert flat.per_batch[0] < steps[1]  # without a pipeline nothing is padded (and nothing fills or drains)


def test_plan_prices_per_batch_under_a_pipeline():
    """pp2 x dp4 with 1f1b: not refused; the padded row is weighed above the mean tokens per
    worker and below what memory allows; other pipeline schedules are refused in one line."""
    plan = _documents_plan("dp=4,pp=2,tp=1,cp=1,mbs=1,recompute=none,schedule=1f1b")
    rec = plan.batch["per_batch"]
    assert "per-batch assignment" in rec["why"] and rec["microbatches"] == 2, rec["why"]
    assert 16384 < rec["capacity"] <= min(rec["memory_capacity"], 2 * 16384)
    assert rec["expected_step_s"] > rec["ideal_s"] >= rec["fixed_s"]
    from planner.report.data import per_batch_text
    assert f"padded to {rec['capacity']:,} tokens" in per_batch_text(plan)
    plan = _documents_plan("dp=4,pp=2,tp=1,cp=1,mbs=1,recompute=none,schedule=zb-h1")
    assert not plan.batch["per_batch"]["chosen"] and "gpipe or 1f1b" in plan.batch["per_batch"]["why"]
