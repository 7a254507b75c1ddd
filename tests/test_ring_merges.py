"""A CPU ring's own work outside the fallback's calls (cost_models/ring_merges.py): the merges and
calls it prices are the ones the runtime's ring makes, nothing at cp 1, nothing on GPUs."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import cost_models.ring_merges as rm
from cost_models.documents import pack_mix
from cost_models.fallback_attention import rank_elements, row_doc_starts
from cost_models.ring_merges import (
    PLAIN_RING_ELEMENTS,
    PLAIN_ROW_ELEMENTS,
    plain_ring_elements,
    ring_steps,
)

OWN = ("MERGE_ROW_ELEMENTS", "CALL_ROW_ELEMENTS", "RING_CALL_ELEMENTS")


def _traced(seq: int, cp: int, ulysses: int, doc_start=None, flash: bool = True) -> np.ndarray:
    """Per ring rank, the forward's (log-sum-exp merges, query rows merged, flash calls, calls x
    query rows held) of a real run of the runtime's ring (``RingCompute``, on CPU the fallback),
    rows counted at all heads (a rank at ``1 / u`` of them: ``u`` x fewer) and per batch row
    summed; ``flash=False``: the plain path (``merge_partials``, no calls)."""
    import torch

    import codegen.runtime.context_parallel as cpm
    from codegen.kernels import attention
    from codegen.runtime.documents import Documents

    count = np.zeros(4)
    merge = (attention.__file__, "attn_merge") if flash else (cpm.__file__, "merge_partials")

    def trace(frame, event, arg):
        code = frame.f_code
        if event != "return":
            return
        if (code.co_filename, code.co_name) == merge:
            lse = arg[1]                                   # [B, H / u, positions]
            count[:2] += (1, lse.shape[0] * lse.shape[2] * lse.shape[1] / 4)
        elif (code.co_filename, code.co_name) == (attention.__file__, "flash_attention"):
            count[2:] += (1, rows * seq / cp)              # the rank's whole q: rows x S / cp at all heads

    docs = None
    if doc_start is not None:
        docs = Documents()
        docs.set(torch.as_tensor(doc_start, dtype=torch.int64))
    rows = 1 if doc_start is None else len(doc_start)
    out = []
    for rank in range(cp // ulysses):
        q, k, v = (torch.randn(rows, 4 // ulysses, seq * ulysses // cp, 64) for _ in range(3))
        sys.setprofile(trace)
        try:
            cpm.RingCompute(cp // ulysses, rank, flash=flash, ulysses=ulysses, documents=docs)(q, k, v, causal=True)
        finally:
            sys.setprofile(None)
        out.append(count.copy())
        count[:] = 0
    return np.array(out)


def _modelled(monkeypatch, mix, cp: int, ulysses: int, mbs: int) -> np.ndarray:
    """Per ring rank, the model's (query rows merged, calls x rows held, calls) at all heads: its
    own work with one constant at 1 at a time, less none (the estimate's own path)."""
    for name in OWN:
        monkeypatch.setattr(rm, name, 0.0)
    base = rank_elements(mix, 1, cp, ulysses, mbs)[0][0]
    got = []
    for name in OWN:
        monkeypatch.setattr(rm, name, 1.0)
        got.append(rank_elements(mix, 1, cp, ulysses, mbs)[0][0] - base)
        monkeypatch.setattr(rm, name, 0.0)
    return np.stack(got, axis=1)[::ulysses]          # one per ring rank (its Ulysses ranks alike)


MIXES = {"one document": [1024], "documents": [1024, 1024, 200, 500, 324] + [64] * 16, "short": [64] * 16}


@pytest.mark.parametrize("cp,ulysses", [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("docs", list(MIXES))
def test_own_work_is_the_runtimes_merges_and_calls(monkeypatch, cp, ulysses, docs):
    # the merges (query rows), calls and calls x rows the model prices per ring rank are the ones
    # the runtime's ring makes, counted: one row of one document, 4 rows of mixed documents, one
    # row of 64-token documents (no query sees another rank's block: only the own step computed)
    monkeypatch.delenv("AUTOPAR_KERNEL_IMPL", raising=False)  # "auto": the fallback on CPU
    seq = 1024
    mix = pack_mix(MIXES[docs], seq)
    got = _traced(seq, cp, ulysses, row_doc_starts(mix))
    want = _modelled(monkeypatch, mix, cp, ulysses, mix.rows)
    assert got[:, [1, 3, 2]] == pytest.approx(want)   # rows merged, calls x rows held, calls
    merges = ring_steps(seq, cp, ulysses)[..., rm.MERGES]
    if docs == "short":      # visiting steps all skipped: the own block's merges and calls only
        assert got[:, 0].tolist() == merges[:, 0].tolist() and (want[:, 2] < ring_steps(seq, cp, ulysses)[
            ..., rm.CALLS].sum(axis=1)).all()
    else:
        assert got[:, 0].tolist() == merges.sum(axis=1).tolist()


def test_nothing_at_cp_1(monkeypatch):
    assert not ring_steps(2048, 1).any()
    mix = pack_mix([2048, 300, 1748], 2048)
    before = rank_elements(mix, 2, 1)
    for name in OWN:
        monkeypatch.setattr(rm, name, 1e9)
    after = rank_elements(mix, 2, 1)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert rank_elements(mix, 1, 2)[0].min() > 1e9  # and priced at cp 2


def test_gpu_pricing_is_unchanged(monkeypatch):
    # on a GPU cluster the fused kernels carry their own merge: neither the estimate of a ring
    # nor the per-batch rates see these constants
    from cost_models.batch_pricing import work_cost
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config

    graph = load_graph("llama-1b", batch=1, seq_len=16384)
    gpu = parse_cluster("dgx-h100:1")
    cfg = ParallelConfig(dp=2, cp=4, zero="fsdp", recompute="full")
    est, cost = evaluate_config(graph, gpu, cfg, 8)[0].step_s, work_cost(graph, gpu, cfg)
    assert cost.merge == cost.ring == 0.0
    for name in OWN + ("PLAIN_ROW_ELEMENTS", "PLAIN_RING_ELEMENTS"):
        monkeypatch.setattr(rm, name, 1e9)
    assert evaluate_config(graph, gpu, cfg, 8)[0].step_s == est and work_cost(graph, gpu, cfg) == cost


def test_plain_ring_is_the_per_batch_groups_merges(monkeypatch):
    # the per-batch runtime's groups (RingAttention without flash): one merge of the worker's
    # queries per visiting step, priced per worker as (g - 1) merge x share + ring on a CPU
    from dataclasses import replace

    from cost_models.batch_pricing import fallback_element_s, work_cost
    from cost_models.cluster import parse_cluster
    from planner.batch_assign import WorkCost, piece_work
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig

    monkeypatch.delenv("AUTOPAR_KERNEL_IMPL", raising=False)
    for g in (2, 4):
        got = _traced(512, g, 1, flash=False)
        assert got[:, :2].tolist() == [[g - 1, (g - 1) * 512 / g]] * g
    assert plain_ring_elements(1) == (0.0, 0.0)
    graph = load_graph("llama-mini", batch=1, seq_len=2048)
    cpu = parse_cluster("local-cpu:4")
    cost = work_cost(graph, cpu, ParallelConfig(dp=2, cp=2, mbs=2, dtype="fp32"))
    element = fallback_element_s(graph, cpu, ParallelConfig(dp=4, mbs=1, dtype="fp32"))
    assert element > 0
    assert cost.merge == pytest.approx(PLAIN_ROW_ELEMENTS * element) and cost.ring == pytest.approx(
        PLAIN_RING_ELEMENTS * element)
    bare = replace(cost, merge=0.0, ring=0.0)
    for g, n in ((2, 1000), (4, 1000)):  # padded to 1,000 and 1,008: shares of 500 and 252
        share = -(-n // (2 * g)) * 2
        added = piece_work(n, g, cost) - piece_work(n, g, bare)
        assert added == pytest.approx((g - 1) * cost.merge * share + cost.ring)
    assert piece_work(1000, 1, cost) == piece_work(1000, 1, bare)
    uly = WorkCost(linear=1e-6, attention=1e-10, alltoall=1e-7, method="ulysses", merge=1.0, ring=1.0)
    assert piece_work(1000, 2, uly) == piece_work(1000, 2, replace(uly, merge=0.0, ring=0.0))  # no ring merges


def test_the_program_runs_the_priced_rates():
    # the plan's record, its program literal and the runtime's PerBatch carry merge and ring
    # (older records without them: 0)
    from codegen.runtime.batch_parallel import per_batch_of

    rec = {"chosen": True, "workers": 4, "max_group": 4, "capacity": 8192, "cost": {
        "linear": 1e-4, "attention": 1e-8, "exchange": 1e-6, "alltoall": 0.0, "latency": 1e-3, "method": "ring"}}
    assert per_batch_of(rec).cost.merge == 0.0
    rec["cost"].update(merge=2e-6, ring=3e-3)
    pb = per_batch_of(rec)
    assert (pb.cost.merge, pb.cost.ring) == (2e-6, 3e-3)
