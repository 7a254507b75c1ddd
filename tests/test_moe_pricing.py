"""Mixtures of experts priced by mechanism: the EP all-to-all over the links the group crosses
and hidden under the engine's 1F1B overlap, grouped-GEMM efficiency by rows per expert, a
published layout that fits, and MLA (DeepSeek-V3) captured with its latent projections."""
import dataclasses
import os

import pytest

from cost_models import gpu_kernels as gk
from cost_models.cluster import load_preset
from cost_models.engines import ENGINES, Engine, exposed_s, paired_exposed_s
from cost_models.experts import (ComputeChunks, alltoall_bytes, expert_comm, overlap_inflight, remote_nodes,
                                 unpaired_ep_s, unpaired_passes)
from cost_models.moe_layer import grouped_gemm_seconds
from planner.frontend.load import graph_of_config, load_graph
from planner.graph import MoEDims
from planner.plan import ParallelConfig
from planner.zoo import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def moe32():
    """A small MoE model with 32 experts (EP up to 32), captured once."""
    cfg = ModelConfig(name="moe32", arch="moe", layers=2, hidden=256, ffn_hidden=512, heads=4, kv_heads=2,
                      vocab=512, seq_len=256, experts=32, top_k=4, expert_ffn_hidden=128)
    return graph_of_config(cfg)


def h100(nodes: int):
    c = load_preset("dgx-h100")
    c.nodes = nodes
    return c


def moe_layer(g):
    return next(l for l in g.layers if l.moe is not None)


def test_exposed_comm_hidden_exposed_partly():
    assert exposed_s(2.0, 5.0) == 0.0          # fully hidden: adds nothing
    assert exposed_s(2.0, 0.0) == 2.0          # no compute beside it: all of it
    assert exposed_s(2.0, 0.5) == pytest.approx(1.5)  # partly hidden: the rest


def test_ep_overlap_switch_hides_all_to_all(moe32):
    """Unsplit compute (a profiled layer): all the layer's all-to-alls beside all of its compute."""
    cl, cfg = h100(4), ParallelConfig(dp=32, ep=32, mbs=4)
    plain = over = moe_layer(moe32)
    ov = {"engine": Engine("o", ep_overlap=True)}
    base = expert_comm(plain, moe32, cl, cfg, window=ComputeChunks(1.0, 0.0))  # no overlap: the window does not matter
    total = base.fwd + base.bwd
    assert total > 0
    assert expert_comm(plain, moe32, cl, cfg).fwd == base.fwd
    hidden = expert_comm(over, moe32, cl, cfg, window=ComputeChunks(10 * total, 0.0), **ov)
    assert hidden.fwd + hidden.bwd == 0.0
    exposed = expert_comm(over, moe32, cl, cfg, window=ComputeChunks(0.0, 0.0), **ov)
    assert exposed.fwd + exposed.bwd == pytest.approx(total)
    part = expert_comm(over, moe32, cl, cfg, window=ComputeChunks(total / 8, total / 8), **ov)
    assert part.fwd + part.bwd == pytest.approx(0.75 * total)


def test_ep_overlap_pairs_each_all_to_all_with_one_chunk(moe32):
    """Split compute: each all-to-all hides only behind its partner chunk of the other pass, so a
    window large in total but all in the experts leaves the chunks paired with attention exposed."""
    cl, cfg = h100(4), ParallelConfig(dp=32, ep=32, mbs=4)
    layer, ov = moe_layer(moe32), {"engine": Engine("o", ep_overlap=True)}
    base = expert_comm(layer, moe32, cl, cfg)
    one = base.bwd / 2  # the backward's two all-to-alls; the forward adds the counts and the host sync
    big = 100 * (base.fwd + base.bwd)
    even = expert_comm(layer, moe32, cl, cfg, window=ComputeChunks(2 * big, 2 * big, big, big), **ov)
    assert even.fwd + even.bwd == 0.0
    lopsided = expert_comm(layer, moe32, cl, cfg, window=ComputeChunks(big, big, big, big), **ov)
    assert lopsided.fwd + lopsided.bwd == pytest.approx(2 * one)  # combine beside the empty attention chunks
    # the dispatcher's SMs: a hidden all-to-all still takes their share of the compute beside it
    sms = Engine("s", ep_overlap=True, ep_comm_sms=33)
    slowed = expert_comm(layer, moe32, cl, cfg, window=ComputeChunks(2 * big, 2 * big, big, big), engine=sms)
    assert slowed.fwd + slowed.bwd == pytest.approx(33 / 132 * (base.fwd + base.bwd))


def test_overlap_keeps_what_a_pass_without_partner_pays(moe32):
    """``alone`` is the layer's all-to-alls unhidden whatever the window: with the overlap off it
    equals fwd + bwd; with it on and everything hidden, the same total."""
    cl, cfg = h100(4), ParallelConfig(dp=32, ep=32, mbs=4)
    layer = moe_layer(moe32)
    base = expert_comm(layer, moe32, cl, cfg)
    assert base.alone == pytest.approx(base.fwd + base.bwd) and base.alone > 0
    hidden = expert_comm(layer, moe32, cl, cfg, window=ComputeChunks(1e3, 1e3), engine=Engine("o", ep_overlap=True))
    assert hidden.fwd + hidden.bwd == 0.0 and hidden.alone == pytest.approx(base.alone)


def test_unpaired_passes_follow_megatrons_warmup_plus_the_overlaps_extra_microbatch():
    # interleaved: 2 (pp - rank - 1) + (vpp - 1) pp, + 1 for the overlap (get_pp_rank_microbatches)
    assert unpaired_passes(8, 4, 128, 0) == 14 + 24 + 1
    assert unpaired_passes(8, 4, 128, 7) == 0 + 24 + 1
    assert unpaired_passes(4, 1, 16, 0) == 3 + 1 and unpaired_passes(4, 1, 16, 3) == 1  # 1F1B: pp - rank - 1
    assert unpaired_passes(1, 1, 8, 0) == 1  # no pipeline: the first forward (and the last backward) alone
    assert unpaired_passes(8, 4, 2, 0) == 8  # never more than the rank's m x vpp chunk passes


def test_unpaired_all_to_alls_add_on_the_rank_with_most_of_them():
    """Rank 0 (39 unpaired passes at pp 8, vpp 4, m 128) with 1 s of hidden all-to-all per chunk
    pass: 39 s; stages without the overlap's hiding (0 s each) add nothing."""
    on_rank = [[r, r + 8, r + 16, r + 24] for r in range(8)]
    assert unpaired_ep_s(8, 4, 128, [1.0] * 32, on_rank) == pytest.approx(39.0)
    assert unpaired_ep_s(8, 4, 128, [0.0] * 32, on_rank) == 0.0
    # the average chunk of a rank: rank 7's chunks carry 4 s each, rank 0's 1 s: 25 x 4 > 39 x 1
    lop = [4.0 if r % 8 == 7 else 1.0 for r in range(32)]
    assert unpaired_ep_s(8, 4, 128, lop, on_rank) == pytest.approx(100.0)


def test_unpaired_passes_add_to_the_overlapped_step_once_per_step(moe32):
    """Under the 1F1B overlap ``ep_comm`` is m x (what each micro-batch leaves exposed) + the
    unpaired passes' all-to-alls, which do not grow with m: doubling m leaves
    2 ep(m) - ep(2m) = that extra, which is rank 0's pp warm-up + 1 passes times its stage's
    hidden all-to-alls. Without the overlap nothing is added."""
    from cost_models.estimate import estimate
    from cost_models.layer_costs import LayerCosts
    from planner.search.stage_split import even_split

    cl, ov = h100(4), Engine("o", ep_overlap=True)
    cfg = ParallelConfig(dp=8, pp=2, ep=8, mbs=1, schedule="1f1b", zero="zero1")
    part = even_split(moe32, cfg.pp)
    ep = {gb: estimate(moe32, cl, cfg, part, gb, engine=ov).breakdown["ep_comm"] for gb in (64, 128)}
    costs = LayerCosts(moe32, cl, cfg, None, engine=ov)
    hidden = [sum(costs.get(moe32.layers[i]).ep_unpaired for i in range(lo, hi)) for lo, hi in part.bounds]
    extra = max(unpaired_passes(2, 1, 8, r) * hidden[r] for r in range(2))
    assert extra > 0
    assert 2 * ep[64] - ep[128] == pytest.approx(extra, rel=1e-6)
    plain = {gb: estimate(moe32, cl, cfg, part, gb).breakdown["ep_comm"] for gb in (64, 128)}
    assert 2 * plain[64] - plain[128] == pytest.approx(0.0, abs=1e-12)


def test_overlap_holds_one_more_microbatch_in_flight(moe32):
    """The overlap's extra warm-up micro-batch: one more (chunk, micro-batch) pair on every rank,
    capped at all of them; nothing without the overlap or without EP; and the estimate's memory
    rises by it while the layout without the overlap keeps its own."""
    from cost_models.estimate import estimate
    from planner.search.stage_split import even_split

    ov = Engine("o", ep_overlap=True)
    cfg = ParallelConfig(dp=8, pp=2, ep=8, mbs=1, schedule="1f1b", zero="zero1")
    assert overlap_inflight([2, 1], cfg, ov, m=8) == [3, 2]
    assert overlap_inflight([2, 2], cfg, ov, m=2) == [2, 2]
    assert overlap_inflight([2, 1], cfg, Engine("p"), m=8) == [2, 1]
    assert overlap_inflight([2, 1], dataclasses.replace(cfg, ep=1), ov, m=8) == [2, 1]
    part = even_split(moe32, cfg.pp)
    plain, over = (estimate(moe32, h100(4), cfg, part, 64, engine=e) for e in (Engine("p"), ov))
    assert all(o.total > p.total for o, p in zip(over.memory, plain.memory))


def test_paired_exposed_sm_share():
    assert paired_exposed_s([(2.0, 5.0)]) == 0.0
    assert paired_exposed_s([(2.0, 5.0)], 0.25) == pytest.approx(0.5)   # hidden, but the SMs it holds
    assert paired_exposed_s([(2.0, 1.0)], 0.25) == pytest.approx(1.0)   # comm outlasts the slowed compute
    assert paired_exposed_s([(2.0, 1.0), (1.0, 0.0)]) == pytest.approx(2.0)


def test_ep_inside_node_cheaper_per_byte_than_across(moe32):
    layer = moe_layer(moe32)
    ep8, ep32 = ParallelConfig(dp=8, ep=8, mbs=4), ParallelConfig(dp=32, ep=32, mbs=4)
    b8, b32 = alltoall_bytes(layer.moe, moe32, ep8), alltoall_bytes(layer.moe, moe32, ep32)
    t8 = expert_comm(layer, moe32, h100(1), ep8)
    t32 = expert_comm(layer, moe32, h100(4), ep32)
    assert t8.fwd / b8 < t32.fwd / b32
    # DeepEP-style node deduplication sends each token over the network once per remote node
    dedup = expert_comm(layer, moe32, h100(4), ep32, engine=ENGINES["megatron-moe-deepep"])
    assert dedup.fwd < t32.fwd


def test_remote_nodes_counts_distinct_nodes():
    m = MoEDims(experts=128, top_k=8, expert_ffn=1536, shared_experts=0, part="mlp")
    assert remote_nodes(m, 8, 8) == 0.0                        # one node: nothing leaves it
    one = dataclasses.replace(m, top_k=1)
    assert remote_nodes(one, 32, 8) == pytest.approx(3 / 4)    # one copy: remote with prob (nodes-1)/nodes
    assert 2.0 < remote_nodes(m, 32, 8) < 3.0                  # 8 copies over 4 nodes: fewer than 8 x 3/4


def test_grouped_gemm_efficiency_rises_with_rows_per_expert():
    gpu = gk.GpuSpec(peak=989e12, bw=3.35e12, sms=132)
    co = gk.GpuCoefficients()
    effs = []
    for rows in (32, 128, 512, 2048, 8192):
        t = grouped_gemm_seconds(16, rows, 1536, 4096, 2, gpu, co)
        effs.append(2 * 16 * rows * 1536 * 4096 / (t * gpu.peak))
    assert effs == sorted(effs) and effs[0] < 0.5 * effs[-1]
    # one kernel over the experts fills the SMs that sixteen separate small GEMMs leave idle
    assert grouped_gemm_seconds(16, 512, 1536, 4096, 2, gpu, co) < 16 * gk.gemm_seconds(512, 1536, 4096, 2, gpu, co)


def test_published_mixtral_layout_fits_and_prices_close():
    from benchmarks import published_moe as pm

    run = next(r for r in pm.load_runs() if "mixtral" in r["id"])
    assert pm.moe_config(run).recompute == "none"
    r = pm.price(run)
    assert r["fits"], r["memory_gib"]
    assert abs(r["error"]) < 0.15


@pytest.mark.slow  # captures the 671B model on fake tensors: about 11 s
def test_deepseek_v3_mla_capture_has_latent_projections():
    g = load_graph("hf:" + os.path.join(ROOT, "planner", "zoo", "hf", "deepseek-v3.json"), seq_len=512)
    assert g.hidden == 7168
    block = next(l for l in g.layers if l.moe is not None)
    shapes = {lin.name: (lin.in_features, lin.out_features) for lin in block.linears}
    assert shapes["self_attn.q_a_proj"] == (7168, 1536)
    assert shapes["self_attn.kv_a_proj_with_mqa"] == (7168, 512 + 64)
    assert shapes["self_attn.kv_b_proj"] == (512, 128 * (128 + 128))
    assert block.attention is not None and block.attention.head_dim == 192 and block.attention.kv_heads == 128
    assert (block.moe.experts, block.moe.top_k, block.moe.shared_experts) == (256, 8, 1)
    assert sum(l.moe is not None for l in g.layers) == 61 - 3


def test_deepseek_v3_tiny_capture_is_deterministic():
    spec = "hf:" + os.path.join(HERE, "hf_configs", "deepseek_v3-tiny.json")
    prints = {load_graph(spec, seq_len=32).fingerprint() for _ in range(3)}
    assert len(prints) == 1


def test_fused_elementwise_lowers_saved_bytes_and_memory_time_only_where_the_engine_has_it():
    """Fused norms / RoPE / SwiGLU (cost_models/fused_elementwise.py) keep and move less than the
    capture's eager fp32 ops; autopar's runtime (eager) prices the block exactly as captured, and
    Megatron's norm recompute drops the norms' outputs on top."""
    from cost_models.gpu_layer import gpu_layer_time
    from cost_models.memory import layer_activation

    g = graph_of_config(ModelConfig(name="l", arch="llama", layers=2, hidden=1024, ffn_hidden=2816, heads=8,
                                    kv_heads=2, vocab=1024, seq_len=1024))
    block = next(l for l in g.layers if l.kind == "transformer_block")
    cfg = ParallelConfig(tp=2, sp=True, dtype="bf16")
    eager = ENGINES["autopar"]
    fused = dataclasses.replace(eager, name="fused", fused_elementwise=True)
    norm_rc = dataclasses.replace(fused, recompute_modules=("layernorm",))
    tp_part, rest = block.act_bytes_tp, block.act_bytes - block.act_bytes_tp
    assert layer_activation(block, g, cfg, "none", eager) == pytest.approx((tp_part / 2 + rest / 2) / 2)  # bf16 of fp32
    assert layer_activation(block, g, cfg, "none", fused) < 0.8 * layer_activation(block, g, cfg, "none", eager)
    assert layer_activation(block, g, cfg, "selective", norm_rc) < layer_activation(block, g, cfg, "selective", fused)
    assert layer_activation(block, g, cfg, "none", norm_rc) == layer_activation(block, g, cfg, "none", fused)
    h100 = load_preset("dgx-h100")
    t_eager, t_fused = gpu_layer_time(block, g, h100, cfg, engine=eager), gpu_layer_time(block, g, h100, cfg, engine=fused)
    assert t_fused.fwd_s < t_eager.fwd_s and t_fused.bwd_s < t_eager.bwd_s
    assert gpu_layer_time(block, g, h100, cfg, engine=dataclasses.replace(eager, name="x")) == t_eager


@pytest.mark.slow  # captures Qwen3-235B at 4K and its four long-context lengths, Mixtral 8x22B: about 40 s
@pytest.mark.parametrize("key", ["mixtral", "tp2pp32ep8vpp3", "tp2pp8ep32vpp4", "tp4pp8ep8vpp4"])
def test_published_moe_runs_fit_as_they_ran_and_price_within_15_percent(key, qwen3_graph, routing):
    """Each run at its layout, routed as it ran (benchmarks/published_moe.py: forced balance, or
    dropless at the imbalance the source's own forced / dropless pairs give), within 15% of its
    published step; it fits in 80 GB as it ran, balanced and routed (split as its config split it:
    Qwen3's embedding and loss count as layers, ``Engine.split_ends``)."""
    from benchmarks import published_moe as pm

    run = next(r for r in pm.load_runs() if r["id"].endswith(key) or key in r["id"] and "overlap" not in r["id"])
    graph = None if key == "mixtral" else qwen3_graph
    assert pm.price(run, graph)["fits"]  # they ran in 80 GB
    r = pm.price(run, graph, pm.run_imbalance(run, routing))
    if key == "tp4pp8ep8vpp4" and abs(r["error"]) >= 0.15:  # not one of issue 26's three: a known gap
        pytest.xfail(f"Qwen3 TP4 PP8 EP8 predicted {r['error']:+.0%} too fast (README, published MoE runs)")
    assert abs(r["error"]) < 0.15, r["error"]
    assert r["fits"], f"{key} judged not to fit at imbalance {r['imbalance']:.2f} ({r['memory_gib']:.1f} GiB)"


@pytest.fixture(scope="module")
def qwen3_graph():
    """Qwen3-235B-A22B captured once on fake tensors from its transformers config (about 4 s)."""
    from benchmarks import published_moe as pm

    return pm.moe_graph(next(r for r in pm.load_runs() if "qwen3" in r["id"]))


@pytest.fixture(scope="module")
def routing(qwen3_graph):
    """Each model's dropless imbalance from the source's forced-balance / dropless pairs."""
    from benchmarks import published_moe as pm

    pairs, runs = pm.load_routing_pairs(), pm.load_runs()
    first = {r["model_name"]: r for r in reversed(runs)}
    return {m: pm.routing_imbalance(first[m], pairs[m], qwen3_graph if "Qwen3" in m else None) for m in pairs}


@pytest.mark.slow
def test_one_imbalance_explains_each_models_forced_and_dropless_pairs(routing, qwen3_graph):
    """Qwen3's four long-context pairs (dropless 1.245x to 1.090x slower, 16K to 128K tokens) each
    solve to an imbalance within 15% of the others: the gap shrinks with length as the model says
    it should (attention's share grows). The solved imbalance reprices its own pair at the
    published ratio; forced-balance runs are priced balanced."""
    from benchmarks import published_moe as pm

    q = routing["Qwen3-235B-A22B"]
    assert len(q.per_pair) == 4 and max(q.per_pair) / min(q.per_pair) < 1.15, q.per_pair
    assert 1.0 < routing["Mixtral 8x22B"].value < q.value
    run = next(r for r in pm.load_runs() if "qwen3" in r["id"])
    pair = pm.load_routing_pairs()["Qwen3-235B-A22B"][0]
    r = pm.pair_run(run, pair)
    g = pm.moe_graph(r)
    ratio = pm.price(r, g, q.per_pair[0])["step_s"] / pm.price(r, g)["step_s"]
    assert ratio == pytest.approx(pair["forced_tflops"] / pair["dropless_tflops"], rel=2e-3)
    assert all(pm.run_imbalance(x, routing) == 1.0 for x in pm.load_runs() if x["moe_routing"] == "forced-balance")


def test_experts_data_parallel_calls_are_one_per_routed_layer():
    """FSDP shards each routed-experts module as one unit over the experts' data-parallel group
    (codegen/runtime/data_parallel.py shard_experts): the expert traffic is priced as that many calls
    per micro-batch (two gathers and a reduce-scatter each), not one per layer of the stage.
    A profile where every 2-rank gather / reduce-scatter costs 1 s and nothing else costs anything
    counts the calls: 4 layers, 1 of them dense -> 3 routed units -> 9 s."""
    from cost_models.cluster import parse_cluster
    from cost_models.estimate import estimate
    from cost_models.profile_db import ProfileDB
    from planner.search.stage_split import even_split

    cfg = ModelConfig(name="moe-calls", arch="moe", layers=4, hidden=64, ffn_hidden=128, heads=4, kv_heads=2,
                      vocab=256, seq_len=32, experts=4, top_k=2, expert_ffn_hidden=32, dense_layers=1)
    g = graph_of_config(cfg)
    cluster = dataclasses.replace(parse_cluster("local-cpu:4"), cores_per_node=4)  # no shared-core waits
    db = ProfileDB(cluster_fingerprint=cluster.fingerprint(), backend="gloo", world=4)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for n in (2, 4):
            for nbytes in (1, 2**30):
                db.add_collective(kind, n, "intra", nbytes, 1.0 if (n == 2 and kind != "all_to_all") else 0.0)
    pc = ParallelConfig(dp=4, ep=2, mbs=1, zero="fsdp")
    e = estimate(g, cluster, pc, even_split(g, 1), 4, profile=db)
    assert e.breakdown["dp_comm"] == pytest.approx(9.0, abs=0.5)


def test_selective_recompute_reruns_what_the_engine_names(moe32):
    """``selective`` re-runs the attention core on autopar's runtime and on Megatron-Core by
    default; with ``--recompute-modules`` only what they name: nothing priced for the norms and
    the experts' activation, the MoE layer's forward (routed GEMMs, dispatcher, all-to-alls) for
    ``moe``, which then keeps only its input."""
    from cost_models.layer_costs import LayerCosts, recompute_seconds
    from cost_models.memory import layer_activation

    cl, cfg = h100(4), ParallelConfig(dp=4, ep=4, mbs=4, zero="fsdp", recompute="selective", dtype="bf16")
    layer, mega = moe_layer(moe32), ENGINES["megatron-moe"]

    def cost(mods):
        return LayerCosts(moe32, cl, cfg, None, engine=dataclasses.replace(mega, recompute_modules=mods)).get(layer)

    default, acts, whole, both = cost(()), cost(("layernorm", "moe_act")), cost(("moe",)), cost(("core_attn", "moe"))
    assert default.sel_rc == default.core > 0
    assert LayerCosts(moe32, cl, cfg, None).get(layer).sel_rc == LayerCosts(moe32, cl, cfg, None).get(layer).core
    assert acts.sel_rc == 0.0
    comm = expert_comm(layer, moe32, cl, cfg, engine=mega)
    assert whole.sel_rc > comm.alone_fwd > 0  # the forward all-to-alls and the layer's MoE compute
    assert both.sel_rc == pytest.approx(whole.sel_rc + whole.core)
    assert recompute_seconds(whole, "selective") == whole.sel_rc and recompute_seconds(whole, "none") == 0.0

    def kept(mods):
        return layer_activation(layer, moe32, cfg, "selective", dataclasses.replace(mega, recompute_modules=mods))
    assert kept(("moe",)) < kept(("moe_act",)) < kept(())
    with pytest.raises(ValueError, match="recompute_modules"):
        Engine("x", recompute_modules=("mlp",))


def test_megatron_split_counts_embedding_and_loss_as_layers(qwen3_graph):
    """``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
    (Engine.split_ends): Qwen3-235B's 94 blocks and its two ends over 96 virtual stages put the
    embedding alone first and the final norm and head together last; over 32, one block fewer
    on the first and last. Without the flags the embedding rides with the first block."""
    from planner.search.stage_split import even_split

    g = qwen3_graph
    kinds = [l.kind for l in g.layers]
    first_block = kinds.index("transformer_block")
    ends = even_split(g, 96, ends_as_layers=True).bounds
    assert ends[0] == (0, first_block) and ends[-1] == (first_block + 94, len(g.layers))
    assert all(b - a == 1 for a, b in ends[1:-1])
    split = even_split(g, 32, ends_as_layers=True)
    blocks = [sum(k == "transformer_block" for k in kinds[a:b]) for a, b in split.bounds]
    assert blocks[0] == blocks[-1] == 2 and set(blocks[1:-1]) == {3}
    assert even_split(g, 96).bounds[0] == (0, first_block + 1)


def test_busiest_ranks_excess_rows_average_over_the_layers_it_holds(moe32):
    """One layer's busiest rank keeps ``imbalance - 1`` more routed rows; over L layers with
    independent routers its excess per layer is ``(imbalance - 1) / sqrt(L)`` (moe_layer.held_imbalance),
    L = the MoE layers one rank holds (the model's over pp)."""
    import math

    from cost_models.memory import held_moe, layer_activation
    from cost_models.moe_layer import held_imbalance

    m = MoEDims(experts=8, top_k=2, expert_ffn=16, shared_experts=0, part="mlp", imbalance=1.6)
    assert held_imbalance(m, 1) == m and held_imbalance(m, 4).imbalance == pytest.approx(1.3)
    assert held_imbalance(dataclasses.replace(m, imbalance=1.0), 9).imbalance == 1.0
    g = moe32
    hot = dataclasses.replace(g, layers=[dataclasses.replace(l, moe=dataclasses.replace(l.moe, imbalance=1.6))
                                         if l.moe else l for l in g.layers])
    layer = moe_layer(hot)
    n = sum(l.moe is not None for l in hot.layers)
    assert n == 2
    one, spread = (ParallelConfig(dp=4, pp=p, ep=4, zero="fsdp") for p in (2, 1))
    assert held_moe(layer, hot, one).imbalance == 1.6
    assert held_moe(layer, hot, spread).imbalance == pytest.approx(1 + 0.6 / math.sqrt(2))
    base = layer_activation(moe_layer(g), g, spread, "none")
    excess = {c.pp: layer_activation(layer, hot, c, "none") - base for c in (one, spread)}
    assert excess[1] == pytest.approx(excess[2] / math.sqrt(2), rel=1e-6) and excess[1] > 0


def test_memory_tables_shared_by_a_search_follow_the_layers_a_rank_holds(moe32):
    """The search shares per-layer memory tables across configurations (LayerCosts.table); under an
    imbalance a MoE layer's kept bytes depend on the MoE layers a rank holds, so pp 2, 8 and 4 priced
    through one cache each get the figures of a fresh table."""
    from cost_models.layer_costs import LayerCosts
    from cost_models.memory import LayerTable

    cfg8 = ModelConfig(name="moe32x8", arch="moe", layers=8, hidden=256, ffn_hidden=512, heads=4, kv_heads=2,
                       vocab=512, seq_len=256, experts=32, top_k=4, expert_ffn_hidden=128)
    g = graph_of_config(cfg8)
    g = dataclasses.replace(g, layers=[dataclasses.replace(l, moe=dataclasses.replace(l.moe, imbalance=1.6))
                                       if l.moe else l for l in g.layers])
    i = g.layers.index(moe_layer(g))
    shared: dict = {}
    got = {}
    for pp in (2, 8, 4):
        cfg = ParallelConfig(dp=8, pp=pp, ep=4, zero="fsdp")
        got[pp] = LayerCosts(g, h100(pp), cfg, None, tables=shared).table(cfg).act["none"][i]
        assert got[pp] == LayerTable(g, cfg).act["none"][i]
    assert got[8] > got[4] > got[2]
