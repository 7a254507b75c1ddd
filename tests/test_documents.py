"""Plans for a document-length distribution (``autopar plan --seq-lens``): reading the lengths,
the packing statistics against hand counts, the cost model with packed documents (equal to
today's for documents that fill the row, cheaper attention and exposed ring transfers for
short ones), the planner choosing a smaller context-parallel degree for a long tail of short
documents, and the plan / report / CLI carrying it."""
from __future__ import annotations

import dataclasses
import functools
import json
import random

import pytest

from cost_models import documents as docs
from cost_models.cluster import parse_cluster
from cost_models.compute import layer_time
from cost_models.layer_work import attention_share, model_flops_per_seq
from cost_models.layer_costs import LayerCosts
from planner.errors import AutoparError
from planner.graph import ModelGraph
from planner.plan import ParallelConfig, Plan
from planner.search.seq_lens import as_histogram, default_budget, read_seq_lens, with_documents


# ---------------------------------------------------------------- reading the lengths

@pytest.mark.parametrize("name,text,hist", [
    ("list.txt", "# lengths\n3\n\n5\n3\n", {3: 2, 5: 1}),
    ("list.json", "[3, 5, 3]", {3: 2, 5: 1}),
    ("hist.json", '{"3": 2, "5": 1, "9": 0}', {3: 2, 5: 1}),
    ("hist.csv", "length,count\n3,2\n5,1\n", {3: 2, 5: 1}),
    ("hist.tsv", "3\t2\n5\t1\n", {3: 2, 5: 1}),
])
def test_reads_lists_and_histograms(tmp_path, name, text, hist):
    p = tmp_path / name
    p.write_text(text)
    assert read_seq_lens(str(p)) == hist


@pytest.mark.parametrize("text,says", [
    ("3\n12.5\n", "line 2: length '12.5' is not a positive integer"),
    ("3\n-4\n", "line 2: length '-4'"),
    ("0\n", "line 1: length '0'"),
    ("3\n5,2\n", "line 2: '5,2' mixes lengths and length,count lines"),
    ("3,1,4\n", "has 3 fields"),
    ("8,x\n", "count 'x' is not a non-negative integer"),
    ('{"8": -1}', "count of length 8 -1"),
    ('{"eight": 1}', "length 'eight'"),
    ("[3, true]", "entry 1 True"),
    ('{"8": [1]}', "count of length 8 [1]"),
    ("[3, 5", "not valid JSON"),
    ("", "no document lengths in it"),
    ("# nothing\n\n", "no document lengths in it"),
])
def test_bad_input_is_one_line_naming_the_problem_and_the_fix(tmp_path, text, says):
    p = tmp_path / "lens.txt"
    p.write_text(text)
    with pytest.raises(AutoparError) as e:
        read_seq_lens(str(p))
    msg = str(e.value)
    assert says in msg and "\n" not in msg and str(p) in msg
    assert "write" in msg or "use one of" in msg  # the fix


def test_missing_file_and_the_api_forms(tmp_path):
    with pytest.raises(AutoparError, match="no such file"):
        read_seq_lens(str(tmp_path / "nope.txt"))
    (tmp_path / "lens.json").write_text('"3"')
    with pytest.raises(AutoparError, match="JSON str is not a list of lengths"):
        read_seq_lens(str(tmp_path / "lens.json"))
    assert as_histogram([4, 4, 8]) == ({4: 2, 8: 1}, "seq_lens")
    assert as_histogram({"4": 2, 8: 1})[0] == {4: 2, 8: 1}
    with pytest.raises(AutoparError, match="not a path, a list"):
        as_histogram(3)


def test_default_budget_is_the_longest_rounded_up_to_128():
    assert default_budget({1000: 3, 20: 1}) == 1024
    assert default_budget({128: 1}) == 128 and default_budget({129: 1}) == 256


# ---------------------------------------------------------------- packing statistics

def test_concatenate_and_split_by_hand():
    assert docs.pack([3, 5, 8], 8) == [3, 5, 8]
    assert docs.pack([3, 8, 5], 8) == [3, 5, 3, 5]  # the 8 crosses the row end: two documents
    assert docs.pack([3, 8, 5, 2], 8) == [3, 5, 3, 5]  # the last partial row is dropped
    with pytest.raises(ValueError, match="fewer than one row"):
        docs.pack([3, 2], 8)
    m = docs.pack_mix([3, 5, 8], 8)  # rows [3, 5] and [8]
    assert m.rows == 2 and m.attention_share == (9 + 25 + 64) / (2 * 64)
    assert m.mean_tokens == (9 + 25 + 64) / 16
    assert (m.documents, m.tokens, m.median, m.p90, m.longest, m.cut) == (3, 16, 5, 8, 8, 0)


def test_long_documents_are_cut_into_budget_pieces():
    m = docs.pack_mix([20, 4], 8)  # 20 -> 8, 8, 4; rows [8] [8] [4, 4]
    assert m.pieces == (8, 8, 4, 4) and m.cut == 1 and m.longest == 20
    assert m.attention_share == (64 + 64 + 16 + 16) / (3 * 64)


def test_documents_filling_the_row_save_nothing_and_a_shuffled_histogram_is_deterministic():
    full = docs.document_mix({64: 5}, 64)
    assert full.attention_share == 1.0 and full.mean_tokens == 64.0
    halves = docs.document_mix({32: 6}, 64)  # any order: rows of two 32-token documents
    assert halves.attention_share == 0.5 and halves.rows == 3
    mixed = {3: 40, 17: 9, 100: 2}
    assert docs.document_mix(mixed, 64) == docs.document_mix(mixed, 64)


def test_visiting_share_by_hand():
    # S = 8, cp = 2: zigzag chunks of 2 tokens, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    m = docs.pack_mix([3, 5], 8)
    # document [0, 3): tokens 0, 1 on rank 0, token 2 on rank 1 -> 2 of its 6 causal pairs visit;
    # document [3, 8): tokens 3, 4, 5 on rank 1, tokens 6, 7 on rank 0 -> 15 - (6 + 3) = 6 visit
    assert docs.visiting_pairs(m, 2) == (8, 21)
    assert docs.visiting_share(m, 2) == 8 / 21
    # documents of one chunk that never cross a chunk boundary: no visiting work at all
    assert docs.visiting_share(docs.pack_mix([2] * 8, 8), 2) == 0.0
    # S = 16, cp = 4 as Ulysses 2 x ring 2: chunks of 2 tokens; ring rank 0 holds the chunks of cp
    # ranks 0 and 1 (chunks 0, 1, 6, 7: tokens 0-3 and 12-15), ring rank 1 tokens 4-11
    m = docs.pack_mix([6, 10], 16)
    # [0, 6): 4 tokens on ring rank 0, 2 on 1 -> 21 - (10 + 3) = 8; [6, 16): 6 on 1, 4 on 0 -> 55 - (21 + 10) = 24
    assert docs.visiting_pairs(m, 4, 2) == (8 + 24, 21 + 55)


def test_visiting_share_of_rows_of_one_document_is_the_no_document_value():
    for s, cp, u in ((64, 2, 1), (64, 4, 1), (64, 8, 2), (128, 8, 1), (128, 4, 4)):
        m = docs.pack_mix([s] * 3, s)
        assert docs.visiting_share(m, cp, u) == docs.full_row_share(s, cp, u)
        assert docs.ring_hiding(m, cp, u) == 1.0
    assert docs.full_row_share(8, 2) == 16 / 36  # 36 causal pairs, 2 x 10 on the ranks' own tokens
    assert docs.visiting_share(docs.pack_mix([16], 16), 4, 4) == 0.0  # pure Ulysses: no ring


def _brute_visits(pieces: list[int], s: int, cp: int, u: int) -> int:
    c = s // (2 * cp)

    def ring(pos: int) -> int:
        k = (pos % s) // c
        return (k if k < cp else 2 * cp - 1 - k) // u

    out, start = 0, 0
    for n in pieces:
        out += sum(ring(q) != ring(k) for q in range(start, start + n) for k in range(start, q + 1))
        start += n
    return out


def test_visiting_pairs_match_a_brute_force_count():
    rng = random.Random(3)
    for _ in range(25):
        s = rng.choice((16, 32, 48))
        m = docs.pack_mix([rng.randint(1, 70) for _ in range(rng.randint(4, 20))] + [s], s)
        for cp, u in ((2, 1), (4, 1), (4, 2), (8, 2), (8, 1)):
            if s % (2 * cp) == 0:
                assert docs.visiting_pairs(m, cp, u)[0] == _brute_visits(list(m.pieces), s, cp, u)


def test_a_large_histogram_is_sampled_quickly():
    import time

    t0 = time.perf_counter()
    m = docs.document_mix({2048: 10**7, 100_000: 10}, 131072)
    assert m.sampled and m.rows == docs.max_rows(131072) and m.documents == 10**7 + 10
    assert docs.visiting_share(m, 8) < docs.full_row_share(131072, 8)
    assert time.perf_counter() - t0 < 5.0


def test_the_graph_keeps_the_mix_through_json():
    g = _graph(8, 8192)
    gd = with_documents(g, {1024: 30, 8192: 2})
    assert g.documents is None and gd.documents.seq_len == 8192
    back = ModelGraph.from_dict(json.loads(json.dumps(gd.to_dict())))
    assert back.documents == gd.documents
    assert gd.fingerprint() == g.fingerprint()  # a planning input: `autopar run` recaptures without it
    with pytest.raises(AutoparError, match="fewer than one row"):
        with_documents(g, {100: 3})


# ---------------------------------------------------------------- the cost model

@functools.cache
def _graph(kv_heads: int, seq: int, layers: int = 2) -> ModelGraph:
    """A small Llama-shaped model (32 heads of 128, ``kv_heads`` kv heads) at ``seq`` tokens."""
    from planner.frontend.load import graph_of_config
    from planner.zoo import ModelConfig

    return graph_of_config(ModelConfig(name="doc-llama", arch="llama", layers=layers, hidden=4096, ffn_hidden=11008,
                                       heads=32, kv_heads=kv_heads, vocab=32000, seq_len=seq, max_seq_len=seq))


CONFIGS = ["dp=8,zero=fsdp", "dp=2,cp=4,zero=fsdp", "dp=1,cp=8,zero=fsdp,recompute=selective",
           "dp=2,cp=4,ulysses=2,zero=fsdp", "cp=2,tp=4,sp=on,recompute=selective-op"]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_documents_filling_the_row_price_exactly_as_without(cfg):
    from planner.search.planning import evaluate_config

    g = _graph(8, 32768)
    gd = with_documents(g, {32768: 4})
    assert gd.documents.attention_share == 1.0
    cl = parse_cluster("dgx-h100")
    a, _ = evaluate_config(g, cl, ParallelConfig.parse(cfg), 8, even_split=True)
    b, _ = evaluate_config(gd, cl, ParallelConfig.parse(cfg), 8, even_split=True)
    assert (a.step_s, a.mfu, a.breakdown) == (b.step_s, b.mfu, b.breakdown)
    assert [m.total for m in a.memory] == [m.total for m in b.memory]


def test_cpu_attention_through_the_torch_fallback_is_priced_slower():
    """On a CPU, masked documents and CP's blocks (ring or Ulysses) run the flash kernels' plain-torch
    fallback, fused SDPA the rest: documents filling the row (the same FLOPs) cost more than none
    without CP, the same under it (both blocks); an eager kernel, SDPA handed the documents' mask,
    computes the whole square: its attention core twice the causal call's."""
    from cost_models.compute import CPU_TORCH_ATTENTION_SLOWDOWN

    g = _graph(8, 1024)
    gd = with_documents(g, {1024: 4})
    cpu = parse_cluster("local-cpu:2")
    block = next(l for l in g.layers if l.attention is not None)
    plain, masked = (layer_time(block, x, cpu, ParallelConfig(dp=2, dtype="fp32")) for x in (g, gd))
    assert CPU_TORCH_ATTENTION_SLOWDOWN > 1 and masked.fwd_s > plain.fwd_s and masked.bwd_s > plain.bwd_s
    eager = ParallelConfig(dp=2, dtype="fp32", attention="eager")
    assert layer_time(block, gd, cpu, eager).fwd_s > layer_time(block, g, cpu, eager).fwd_s
    # Ulysses runs the fallback too (codegen.runtime.context_parallel.RingCompute: its group's zigzag
    # chunks attended in position order, one key run): the same core FLOPs per rank as the ring's,
    # but none of the ring's extra calls (its late chunk's queries reach both key runs) or merges
    ring, uly = ParallelConfig(cp=2, dtype="fp32"), ParallelConfig(cp=2, ulysses=2, dtype="fp32")
    assert layer_time(block, g, cpu, uly).fwd_s < layer_time(block, g, cpu, ring).fwd_s
    # a non-causal core (a vision encoder's) under CP: RingCompute hands it to the local kernel, fused SDPA
    from dataclasses import replace

    enc = replace(block, attention=replace(block.attention, causal=False))
    flash = ParallelConfig(cp=2, dtype="fp32")
    assert layer_time(enc, g, cpu, flash) == layer_time(enc, g, cpu, flash.replace(attention="eager"))  # no slowdown


def test_documents_filling_the_row_price_exactly_as_without_on_cpus_and_profiles():
    from cost_models.profile_db import ProfileDB

    g = _graph(8, 1024)
    gd = with_documents(g, {1024: 4})
    cpu = parse_cluster("local-cpu:2")
    cfg = ParallelConfig(dp=1, cp=2, dtype="fp32", recompute="selective-op")
    block = next(l for l in g.layers if l.attention is not None)
    assert layer_time(block, g, cpu, cfg) == layer_time(block, gd, cpu, cfg)
    db = ProfileDB(cpu.fingerprint(), "gloo", 2)
    db.add_layer(block.signature, 1, 1024, 1, 2, 0.5, 1.0)
    assert layer_time(block, g, cpu, cfg, db) == layer_time(block, gd, cpu, cfg, db)
    assert model_flops_per_seq(g) == model_flops_per_seq(gd) == g.flops_per_seq()


def _short(seq: int) -> dict[int, int]:
    """Documents of 1-2K tokens, far shorter than the rows."""
    return {1024 + 64 * i: 10 for i in range(16)}


def test_short_documents_cut_the_attention_time_flops_and_mfu_figures():
    g = _graph(8, 32768)
    gd = with_documents(g, _short(32768))
    share = gd.documents.attention_share
    assert 0.0 < share < 0.06
    block = next(l for l in g.layers if l.attention is not None)
    assert attention_share(block, gd) == share and attention_share(block, g) == 1.0
    for cl, cfg in ((parse_cluster("dgx-h100"), ParallelConfig(dp=8)),
                    (parse_cluster("local-cpu:2"), ParallelConfig(dp=1, dtype="fp32"))):
        full, packed = layer_time(block, g, cl, cfg), layer_time(block, gd, cl, cfg)
        assert packed.fwd_s < full.fwd_s and packed.bwd_s < full.bwd_s
        eager = cfg.replace(attention="eager")  # SDPA given the mask computes every score of the square
        causal, square = layer_time(block, g, cl, eager), layer_time(block, gd, cl, eager)
        assert square.fwd_s > causal.fwd_s and square.bwd_s > causal.bwd_s
    from cost_models.layer_work import attn_core_flops

    saved = sum(3 * attn_core_flops(l, g.batch) * (1 - share) for l in g.layers if l.attention is not None)
    assert model_flops_per_seq(gd) == pytest.approx(g.flops_per_seq() - saved / g.batch)
    # the profiled layer is scaled by the model's ratio of the two layer times
    from cost_models.profile_db import ProfileDB

    cpu = parse_cluster("local-cpu:2")
    cfg = ParallelConfig(dp=1, dtype="fp32")
    db = ProfileDB(cpu.fingerprint(), "gloo", 2)
    db.add_layer(block.signature, 1, 32768, 1, 1, 2.0, 4.0)
    ratio = layer_time(block, gd, cpu, cfg).fwd_s / layer_time(block, g, cpu, cfg).fwd_s
    assert layer_time(block, gd, cpu, cfg, db).fwd_s == pytest.approx(2.0 * ratio)


def test_short_documents_expose_the_rings_transfers():
    g = _graph(8, 32768)
    gd = with_documents(g, _short(32768))
    cl = parse_cluster("dgx-h100")
    cfg = ParallelConfig(dp=1, cp=8, mbs=1)
    block = next(l for l in g.layers if l.attention is not None)
    whole, packed = LayerCosts(g, cl, cfg, None).get(block), LayerCosts(gd, cl, cfg, None).get(block)
    assert whole.cp == 0.0  # one 32K document per row: the block attention hides every ring step
    assert packed.cp > 0.0 and packed.core < whole.core
    # the transfers hide only behind the visiting blocks' share of the (smaller) attention work
    hide = docs.ring_hiding(gd.documents, 8)
    assert hide == pytest.approx(docs.visiting_share(gd.documents, 8) / docs.full_row_share(32768, 8)) and hide < 0.5
    from cost_models.context_parallel import cp_comm

    a = block.attention
    assert packed.cp == cp_comm(a, cfg, cl, packed.core, hide=hide).exposed > cp_comm(a, cfg, cl, packed.core).exposed


# ---------------------------------------------------------------- the planner

def _long_tail(budget: int, n: int = 20000, seed: int = 0) -> dict[int, int]:
    """95% of documents 1-4K tokens, 4.9% 4-8K, 0.1% (20 of 20000) from 8K up to the budget."""
    rng = random.Random(seed)
    hist: dict[int, int] = {}
    for _ in range(n):
        u = rng.random()
        length = (rng.randint(1024, 4096) if u < 0.95 else rng.randint(4096, 8192) if u < 0.999
                  else rng.randint(8192, budget))
        hist[length] = hist.get(length, 0) + 1
    return hist


@functools.cache
def _llama8b_plans():
    """Llama 3 8B at a 128K-token budget on two DGX H100 (16 GPUs), global batch 16, trained with
    FSDP and ring attention (``tp=1,ulysses=1`` pinned): planned as one 128K document per row, and
    for the long tail of short documents of :func:`_long_tail`."""
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    g = load_graph("llama3-8b", seq_len=131072)
    cl = parse_cluster("dgx-h100:2")
    out = {}
    for name, seq_lens in (("one", None), ("docs", _long_tail(131072))):
        out[name] = plan_model(g, cl, 16, spec="llama3-8b", cluster_spec="dgx-h100:2", fix="tp=1,ulysses=1",
                               seq_lens=seq_lens)
    return g, cl, out


def test_a_long_tail_of_short_documents_prices_the_busiest_rank():
    """One 128K document per row: attention is most of the step and each of a cp=8 ring's 16K-key
    blocks is long enough to hide its K/V transfer, so cp=8 (the ring on one node's NVLink) wins,
    or since activation offload, cp=4 with the activations on the host.
    Short documents leave about 4% of the attention work on average, and under a third of what is
    left on the ring's visiting blocks, so the cp=8 ring's transfers are no longer hidden. But the
    rows differ: the rare long document lands on some rank's row, and every micro-batch waits for
    that rank (``busiest_share``). On 8 dp ranks of cp=2 the busiest rank does over 4x the mean
    attention, on 2 of cp=8 about 2x: the wider ring spreads the long document and stays ahead,
    exposed transfers and all (priced at the mean row, cp=2 with full recompute won)."""
    from cost_models.documents import busiest_share

    g, cl, plans = _llama8b_plans()
    one, _ = plans["one"]
    packed, res = plans["docs"]
    # one document per row: a wide ring, or cp=4 with its activations offloaded to the host
    assert (one.config.cp, one.config.recompute) in ((8, "selective-op"), (4, "offload")) and packed.config.cp == 8
    d = packed.batch["documents"]
    assert d["attention_share"] < 0.06 and d["budget"] == 131072 and d["documents"] == 20000
    assert d["ring_visiting"]["cp=8"]["share"] < 0.5 * d["ring_visiting"]["cp=8"]["one_document"]
    gd = with_documents(g, _long_tail(131072))
    mix = gd.documents
    spread = [busiest_share(mix, 16 // cp, cp) / mix.attention_share for cp in (1, 2, 4, 8, 16)]
    assert spread == sorted(spread, reverse=True) and spread[1] > 4 and spread[3] < 2.5
    assert busiest_share(mix, 1, 1, mbs=4) == mix.attention_share  # one rank: the mean exactly
    from planner.search.planning import evaluate_config

    narrow, problems = evaluate_config(gd, cl, dataclasses.replace(one.config, dp=8, cp=2, recompute="full"), 16)
    assert not problems and narrow.step_s > res.best.step_s
    assert res.best.breakdown["cp_comm"] > 0 and one.estimate["breakdown"]["cp_comm"] == 0  # exposed with documents
    assert res.best.tokens_per_s > 2 * one.estimate["tokens_per_s"]


def test_the_report_explains_the_documents_and_a_rejected_cp():
    from planner.report.data import build_report, summary_rows, why_not_degrees

    _, _, plans = _llama8b_plans()
    packed, _ = plans["docs"]
    plan = Plan.from_dict(json.loads(packed.to_json()))  # what the plan file holds
    rows = {key: text for key, _, text, _ in summary_rows(build_report(plan, layers=False))}
    assert "20,000 documents" in rows["documents"] and "131,072 tokens (the budget" in rows["documents"]
    assert "causal attention work" in rows["documents"]
    d = plan.batch["documents"]
    ratio = d["busiest_share"] / d["attention_share"]  # cp=8: about 1.6-2.3x the mean rank's attention
    assert 1.3 < ratio < 3 and f"busiest rank does {ratio:.2f}x" in rows["documents"]
    why = {w["degree"]: w for w in why_not_degrees(plan)}
    assert "visiting blocks" in why["cp=4"]["documents"] and "exposed" in why["cp=4"]["documents"]
    from planner.report.render import render_html

    assert "K/V transfers are exposed: the attention over short documents is too small" in render_html(
        build_report(plan, layers=False))
    assert "documents" not in plans["one"][0].batch


# ---------------------------------------------------------------- CLI and API

def test_cli_plans_and_reports_a_document_distribution(tmp_path):
    from planner.entry.cli import main

    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(40 + (i * 37) % 160) for i in range(300)) + "\n1000\n")
    out, md = tmp_path / "plan.json", tmp_path / "r.md"
    assert main(["plan", "--model", "llama-tiny", "--cluster", "dgx-h100", "--global-batch", "8",
                 "--seq-lens", str(lens), "-o", str(out)]) == 0
    plan = Plan.load(str(out))
    assert plan.batch["seq_len"] == 1024 and plan.batch["documents"]["budget"] == 1024
    assert plan.batch["documents"]["documents"] == 301 and plan.batch["documents"]["source"] == "lens.txt"
    assert main(["report", str(out), "--md", str(md)]) == 0
    assert "documents (--seq-lens)" in md.read_text()
    assert main(["evaluate", "--model", "llama-tiny", "--cluster", "dgx-h100", "--global-batch", "8",
                 "--seq-lens", str(lens), "--seq-len", "512", "--config", "dp=8", "--json"]) == 0


def test_cli_refuses_bad_lengths_in_one_line(tmp_path, capsys):
    from planner.entry.cli import main

    bad = tmp_path / "bad.txt"
    bad.write_text("100\nmany\n")
    assert main(["plan", "--model", "llama-tiny", "--cluster", "dgx-h100", "--global-batch", "8",
                 "--seq-lens", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --seq-lens") and "line 2" in err and len(err.splitlines()) == 1


def test_plan_model_takes_seq_lens_and_leaves_the_graph_alone():
    from planner.search.planning import plan_model

    g = _graph(8, 8192)
    plan, res = plan_model(g, parse_cluster("dgx-h100"), 8, spec="doc-llama", cluster_spec="dgx-h100",
                           seq_lens=[512] * 64 + [8192])
    assert g.documents is None and plan.batch["documents"]["documents"] == 65
    base, _ = plan_model(g, parse_cluster("dgx-h100"), 8, spec="doc-llama", cluster_spec="dgx-h100")
    assert res.best.step_s < base.estimate["step_s"]
    assert dataclasses.replace(g, documents=None).fingerprint() == plan.model["fingerprint"]


def test_quantile_lengths_follow_the_source():
    assert docs.quantile_lengths({10: 3, 20: 1}, 4) == (10, 10, 10, 20)
    hist = {n: 1 for n in range(1, 101)}
    q = docs.quantile_lengths(hist, 10)
    assert len(q) == 10 and q[0] == 5 and q[-1] == 95 and list(q) == sorted(q)


def test_models_that_keep_their_own_attention_are_refused_one_line():
    """Documents are masked by autopar's attention: a model whose own attention runs (its
    limits refuse cp), or one with non-causal (vision) attention, cannot plan with them."""
    from planner.feasibility import documents_problem
    from planner.frontend.load import load_graph

    assert documents_problem({}) is None
    assert "as context parallelism does: sliding window" in documents_problem({"cp": "sliding window"})
    assert "text-only causal" in documents_problem({}, causal_only=False)
    g = load_graph("mllm-tiny", batch=1)
    with pytest.raises(AutoparError, match="non-causal attention; plan without --seq-lens") as e:
        with_documents(g, {16: 100})
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.slow
def test_autopar_run_trains_on_the_planned_documents(tmp_path):
    """A plan made with --seq-lens keeps a sample of the lengths; its program's synthetic data
    packs documents of them (with cu_seqlens: the masked path), and `autopar run` trains."""
    import os
    import subprocess
    import sys

    from codegen.emit import emit
    from planner.entry.cli import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lens = tmp_path / "lens.txt"
    lens.write_text("\n".join(str(n) for n in (3, 5, 8, 13, 21)) + "\n")
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--cluster", "local-cpu:2", "--global-batch", "4",
                 "--seq-len", "32", "--seq-lens", str(lens), "--fix", "cp=2", "-o", str(plan)]) == 0
    p = Plan.load(str(plan))
    assert sorted(set(p.batch["documents"]["lengths"])) == [3, 5, 8, 13, 21]
    assert "DOCUMENT_LENGTHS = [" in emit(p) and "packed_documents(VOCAB" in emit(p)
    bad = Plan.from_dict(dict(json.loads(p.to_json()), batch=dict(p.batch, documents={"lengths": ["1; x"]})))
    with pytest.raises(Exception, match="lengths in the plan must be a list of positive integers"):
        emit(bad)
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "planner.entry.cli", "run", str(plan), "--steps", "4", "--dir",
                        str(tmp_path / "run")], cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    recs = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and all(x["loss"] == x["loss"] for x in recs)


def test_full_square_is_sdpa_given_a_document_mask_without_cp():
    """``layer_work.full_square``: the eager kernel (SDPA) handed packed documents' mask, without CP,
    computes every score of the square; with no documents (``is_causal``), the flash kernel or under
    CP (the ring's blocks skip what no query sees) it does not."""
    from cost_models.layer_work import full_square

    g = _graph(8, 1024)
    gd = with_documents(g, {1024: 4})
    block = next(l for l in g.layers if l.attention is not None)
    eager = ParallelConfig(dp=2, attention="eager")
    assert full_square(block, gd, eager)
    assert not full_square(block, g, eager) and not full_square(block, gd, eager.replace(attention="flash"))
    assert not full_square(block, gd, eager.replace(dp=1, cp=2))
