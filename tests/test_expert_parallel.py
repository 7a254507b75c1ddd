"""Expert parallelism priced and planned: the all-to-all bytes and grouped-GEMM FLOPs of one
MoE layer against hand counts, the feasibility rule, the token permutation of the
runtime's dispatcher, the skewed parity case's routing, and the search choosing ``ep``
(within a node on a fast network, not at all on a slow one) with the report saying why;
also FSDP's units of a very large block (experts stacks and linears gathered one at a
time). The runtime's EP parity is in tests/test_runtime_parity.py."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from codegen.runtime.expert_parallel import by_expert
from cost_models import comm as comm_mod
from cost_models.cluster import load_preset
from cost_models.layer_work import expert_gemms
from cost_models.experts import alltoall_bytes, ep_mesh, expert_comm
from cost_models.moe_layer import expert_rows
from cost_models.memory import layer_params_local, stage_memory
from cost_models.model_states import per_param_bytes
from planner.frontend.load import graph_of_config
from planner.plan import ModelFacts, ParallelConfig
from planner.feasibility import expert_groups
from model_cases import fitting_problems
from planner.zoo import ModelConfig

# a fine-grained MoE (DeepSeek-like routing: 128 experts, top-8, sigmoid), small enough to plan fast
FINE = ModelConfig(name="moe-fine", arch="moe", layers=6, hidden=2048, ffn_hidden=5632, heads=16, kv_heads=4,
                   vocab=32000, seq_len=2048, max_seq_len=2048, experts=128, top_k=8, expert_ffn_hidden=768,
                   shared_experts=1, dense_layers=1, router="sigmoid")


@functools.cache
def _fine():
    return graph_of_config(FINE)


def _moe_layer(g):
    return next(l for l in g.layers if l.moe is not None)


def test_alltoall_bytes_and_time_match_hand_counts():
    g = _fine()
    layer = _moe_layer(g)
    cfg = ParallelConfig(dp=16, ep=8, mbs=2, zero="fsdp", dtype="bf16")
    # tokens x top_k x hidden x bytes: 2 x 2048 tokens, 8 choices, 2048 wide, bf16
    assert alltoall_bytes(layer.moe, g, cfg) == 2 * 2048 * 8 * 2048 * 2
    skewed = dataclasses.replace(layer.moe, imbalance=1.5)
    assert alltoall_bytes(skewed, g, cfg) == pytest.approx(1.5 * 2 * 2048 * 8 * 2048 * 2)
    cl = load_preset("dgx-h100")
    cl.nodes = 2
    one = comm_mod.collective_time("all_to_all", alltoall_bytes(layer.moe, g, cfg), cl, ep_mesh(cfg), "cp").seconds
    # inside one node (ep 8 consecutive ranks): (n-1)/n x B / (bw x NCCL bus efficiency) + (n-1) alpha
    bw = cl.intra.bandwidth_gbs * 1e9 * comm_mod.NCCL_BUS_EFF["intra"]
    assert one == pytest.approx(7 / 8 * alltoall_bytes(layer.moe, g, cfg) / bw + 7 * cl.intra.latency_us * 1e-6, rel=1e-6)
    ex = expert_comm(layer, g, cl, cfg)
    assert ex.bwd == pytest.approx(2 * one)             # dispatch and combine, reversed
    assert ex.fwd > ex.bwd                              # + the count exchange and the host sync
    assert expert_comm(layer, g, cl, cfg.replace(ep=1)).fwd == 0.0


def test_dispatch_after_the_count_exchange_pays_no_shared_core_wait():
    """On 4 ranks sharing 2 cores every collective after compute pays the scheduler wait
    (``shared_cores.sync_wait_s``); the dispatch, right after the count exchange, does not
    (benchmarks/collective_in_step.py): the forward is two row all-to-alls and the counts less one wait."""
    from cost_models.cluster import parse_cluster
    from cost_models.shared_cores import sync_wait_s
    g = graph_of_config(ModelConfig(name="moe-cpu", arch="moe", layers=2, hidden=64, ffn_hidden=128, heads=4, kv_heads=2,
                                    vocab=256, seq_len=32, experts=4, top_k=2, expert_ffn_hidden=64),
                        batch=1, seq_len=32)
    layer = _moe_layer(g)
    cl = dataclasses.replace(parse_cluster("local-cpu:4"), cores_per_node=2)
    cfg = ParallelConfig(dp=4, ep=4, mbs=2, zero="fsdp")
    wait = sync_wait_s(2, 4)
    assert wait > 0
    b = alltoall_bytes(layer.moe, g, cfg)
    rows = comm_mod.collective_time("all_to_all", b, cl, ep_mesh(cfg), "cp").seconds
    chained = comm_mod.collective_time("all_to_all", b, cl, ep_mesh(cfg), "cp", chained=True).seconds
    assert chained == pytest.approx(rows - wait)
    counts = comm_mod.collective_time("all_to_all", layer.moe.experts * 8, cl, ep_mesh(cfg), "cp").seconds
    ex = expert_comm(layer, g, cl, cfg)
    assert ex.fwd == pytest.approx(2 * rows + counts - wait)
    assert ex.bwd == pytest.approx(2 * rows)            # the backward's all-to-alls each follow compute


def test_grouped_gemm_flops_match_hand_counts():
    g = _fine()
    m = _moe_layer(g).moe
    tokens = 2 * 2048
    for ep in (1, 4, 16):
        rows = expert_rows(m, tokens, ep)
        assert rows == tokens * 8 * ep / 128
        local = m.experts // ep
        flops = local * sum(2 * a * b * c for a, b, c in expert_gemms(m, tokens, g.hidden, ep))
        # every rank multiplies its share of the routed rows: tokens x top_k x 3 GEMMs of hidden x ffn
        assert flops == pytest.approx(tokens * 8 * 3 * 2 * 2048 * 768)
    assert expert_rows(dataclasses.replace(m, imbalance=1.25), tokens, 4) == pytest.approx(1.25 * tokens * 8 * 4 / 128)
    assert expert_rows(dataclasses.replace(m, imbalance=1.25), tokens, 1) == tokens * 8 / 128  # no EP: no skew


def test_expert_memory_is_split_by_ep_and_sharded_over_the_rest():
    g = _fine()
    moe = [i for i, l in enumerate(g.layers) if l.moe is not None]
    fsdp = ParallelConfig(dp=16, zero="fsdp", mbs=1)
    with_ep = fsdp.replace(ep=8)
    m1, m8 = stage_memory(g, moe, fsdp, 1), stage_memory(g, moe, with_ep, 1)
    # at rest FSDP holds 1/16 of every expert either way (1/8 of them over a group of 2) ...
    assert m8.weights == pytest.approx(m1.weights, rel=1e-6)
    # ... but gathers only this rank's experts: the unsharded-layer buffers shrink
    assert m8.buffers < m1.buffers / 4
    assert per_param_bytes(with_ep, experts=True)["weights"] == 4.0 / 2   # fp32 masters over dp / ep = 2 ranks


def test_ep_under_tp_routes_the_sequence_shard_and_sums_the_whole_moe_parameters():
    """dp4 x tp2 (SP) with ep8: each rank routes its sequence shard (half the tokens) to an EP
    group of all 8 ranks; the experts' data-parallel group is dp x tp / ep = 1 rank; the router
    and the shared expert are held whole by both tp ranks and summed over tp once per step."""
    from cost_models.memory import layer_token_local
    g = _fine()
    layer = _moe_layer(g)
    cfg = ParallelConfig(dp=4, tp=2, sp=True, ep=8, mbs=2, zero="fsdp", dtype="bf16")
    assert alltoall_bytes(layer.moe, g, cfg) == 2 * 2048 / 2 * 8 * 2048 * 2
    assert ep_mesh(cfg) == comm_mod.Mesh(pp=1, dp=1, cp=8, tp=1)
    assert ep_mesh(cfg.replace(ep=1)) == comm_mod.Mesh(pp=1, dp=4, cp=1, tp=2)
    assert per_param_bytes(cfg.replace(dp=8), experts=True)["weights"] == 4.0 / 2  # fp32 masters over 8 x 2 / 8 ranks
    whole = 2048 * 128 + 3 * 2048 * 768  # router + one shared SwiGLU expert
    assert layer_token_local(layer, cfg, g.hidden) == whole
    assert layer_token_local(layer, cfg.replace(ep=1), g.hidden) == whole + layer.moe.expert_params(g.hidden)
    assert layer_token_local(layer, cfg.replace(tp=1, sp=False), g.hidden) == 0
    # TP splits the attention, not the MoE layer: only the experts are divided (by ep)
    attn = next(o.params for o in layer.ops if o.kind == "attention")
    assert layer_params_local(layer, 2, ep=8, hidden=g.hidden) == pytest.approx(
        layer.params - attn / 2 - layer.moe.expert_params(g.hidden) * 7 / 8)


def test_imbalance_adds_the_busiest_ranks_routed_activations():
    from cost_models.memory import layer_activation
    g = _fine()
    layer = _moe_layer(g)
    cfg = ParallelConfig(dp=16, ep=8, zero="fsdp", mbs=1, dtype="bf16")
    even = layer_activation(layer, g, cfg, "none")
    hot = dataclasses.replace(g, layers=[dataclasses.replace(l, moe=dataclasses.replace(l.moe, imbalance=1.5))
                                         if l.moe else l for l in g.layers])  # every MoE layer skewed
    skewed = _moe_layer(hot)
    moe_layers = sum(l.moe is not None for l in g.layers)
    # one layer per rank (pp = the MoE layers): 0.5 x 2048 tokens x top-8 rows x (hidden 2048 + 4 x 768) x bf16
    full = 0.5 * 2048 * 8 * (2048 + 4 * 768) * 2
    assert layer_activation(skewed, hot, cfg.replace(pp=moe_layers), "none") - even == pytest.approx(full)
    # all of them on one rank: the busiest rank's excess averages over its layers' routers
    assert moe_layers > 1
    assert layer_activation(skewed, hot, cfg, "none") - even == pytest.approx(full / moe_layers ** 0.5)
    no_ep = cfg.replace(ep=1)
    assert layer_activation(skewed, hot, no_ep, "none") == layer_activation(layer, g, no_ep, "none")


def test_feasibility_rule_for_ep():
    f = ModelFacts(units=8, seq_len=64, experts=8)
    ok = ParallelConfig(dp=4, ep=4, zero="fsdp")
    assert fitting_problems(ok, f) == []
    assert any("does not divide the 8 experts" in p for p in fitting_problems(ok.replace(dp=12, ep=12), f))
    assert any("does not divide dp x cp x tp = 4" in p for p in fitting_problems(ParallelConfig(dp=4, ep=8, zero="fsdp"), f))
    assert any("use zero=fsdp" in p for p in fitting_problems(ok.replace(zero="ddp"), f))
    assert any("no routed experts" in p for p in fitting_problems(ok, ModelFacts(units=8, seq_len=64)))
    assert expert_groups(2, 2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # under TP (with sequence parallel) the tp ranks route tokens of their own: EP may span them
    tp_ok = ParallelConfig(dp=2, tp=2, sp=True, ep=4, zero="fsdp")
    assert fitting_problems(tp_ok, f) == []
    assert any("use sp=on" in p for p in fitting_problems(tp_ok.replace(sp=False), f))
    assert any("use sp=on" in p for p in fitting_problems(tp_ok.replace(sp=False, ep=1), f))
    # no data parallelism and no rank sharing its experts: nothing for FSDP to do
    assert fitting_problems(ParallelConfig(tp=2, sp=True, ep=2), f) == []
    assert any("use zero=fsdp" in p for p in fitting_problems(ParallelConfig(tp=4, sp=True, ep=2), f))
    assert expert_groups(1, 1, 2, tp=4) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_groups(2, 1, 4, tp=2) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert ParallelConfig.parse("dp=4,ep=2,zero=fsdp").ep == 2
    assert "ep2" in ParallelConfig(dp=4, ep=2, zero="fsdp").label()


def test_dispatch_permutation_groups_rows_by_local_expert():
    got = torch.tensor([[2, 0, 1], [1, 3, 0], [0, 0, 2]])  # [source rank, local expert] row counts
    order = by_expert(got)
    # source blocks: s0 = rows 0-2 (e0 e0 e2), s1 = rows 3-6 (e0 e1 e1 e1), s2 = rows 7-8 (e2 e2)
    assert order.tolist() == [0, 1, 3, 4, 5, 6, 2, 7, 8]
    assert by_expert(torch.zeros(2, 2, dtype=torch.long)).numel() == 0


def test_skewed_parity_case_leaves_experts_empty_and_loads_uneven():
    import sys, os
    sys.path.insert(0, os.path.dirname(__file__))
    from model_cases import case
    c = case("moe-tiny-skewed")
    model = c.build("cpu")
    b = c.batches(1)[0]
    c.loss(model, b).backward()
    for m in model.moe_layers():
        load = m.take_load()
        assert load[6] == 0 and load[7] == 0
        assert load[:6].min() < load[:6].max()


def _plan_on(inter_gbs: float, global_batch: int = 64):
    from planner.search.pins import Pins
    from planner.search.space import search
    cl = load_preset("dgx-h100")
    cl.nodes = 4
    cl.inter = dataclasses.replace(cl.inter, bandwidth_gbs=inter_gbs)
    return search(_fine(), cl, global_batch, pins=Pins.parse("pp=1,tp=1,cp=1")), cl


def _why_not_ep(r, cl) -> dict:
    from planner.search.planning import build_plan
    from planner.report.data import why_not_degrees
    plan = build_plan(_fine(), cl, r.best, spec="moe-fine", cluster_spec="dgx-h100:4",
                      alternatives=r.alternatives, rejected=r.rejected, counts=r.rejected_counts)
    return {w["degree"]: w for w in why_not_degrees(plan) if w["degree"].startswith("ep=")}


def test_fast_network_picks_expert_parallelism_and_prices_crossing_nodes():
    """On a fast inter-node network expert parallelism wins, and an ep group crossing nodes pays
    more all-to-all time than one inside a node. (Whether ep 8 or ep 16 wins there is a near tie:
    ep 16 halves each rank's experts and their data-parallel traffic, 0.0873 s against 0.0874 s.)"""
    r, cl = _plan_on(400.0)
    assert r.best.config.ep > 1  # ep consecutive ranks of dp x cp x tp
    kept = [r.best, *r.alternatives]
    inside = [a for a in kept if 1 < a.config.ep <= cl.devices_per_node]
    wider = [a for a in kept if a.config.ep > cl.devices_per_node]
    assert inside and wider
    assert min(a.breakdown["ep_comm"] for a in wider) > max(a.breakdown["ep_comm"] for a in inside)
    rows = _why_not_ep(r, cl)
    assert rows["ep=1"]["reasons"] or rows["ep=1"]["alternative"]  # ep=1 lost, and the report says how


def test_slow_network_keeps_experts_within_a_node_and_the_report_says_why():
    """At 1 GB/s between nodes and 256 sequences a step, splitting the experts across nodes
    (EP16) sends every token over the slow links: the plan keeps them within a node (where EP
    still saves FSDP's gathers and fp32 reduce-scatters of the experts over the nodes), and
    the report says what EP16 would cost. (At 64 sequences EP16 wins even at 1 GB/s: the
    tokens' traffic grows with the batch, the parameters' does not.)"""
    r, cl = _plan_on(1.0, 256)
    assert r.best.config.ep <= cl.devices_per_node
    rows = _why_not_ep(r, cl)
    wide = rows["ep=16"]  # priced and kept (its why-not names the all-to-all), or pruned by its time floor
    why = wide["alternative"]["why_not"] if wide["alternative"] else "; ".join(wide["reasons"])
    assert "ep comm" in why or "time floor above the best step time" in why, wide


def test_a_very_large_block_is_sharded_module_by_module(monkeypatch):
    """A 530B-class dense block (5B parameters) is gathered one module at a time under FSDP, so
    its transient buffers are the largest linear's, not the block's; a small block stays one unit."""
    import planner.sharding as plan_mod
    from cost_models.memory import fsdp_units
    from planner.sharding import FSDP_UNIT_PARAMS
    big = ModelConfig(name="gpt-530b-block", arch="gpt", layers=2, hidden=20480, ffn_hidden=81920, heads=128,
                      kv_heads=128, vocab=51200, seq_len=256, max_seq_len=256)
    g = graph_of_config(big)
    blk = next(l for l in g.layers if l.kind == "transformer_block")
    cfg = ParallelConfig(dp=8, zero="fsdp", mbs=1)
    units = fsdp_units(blk, cfg, g.hidden)
    assert blk.params > FSDP_UNIT_PARAMS and len(units) == 7      # q, k, v, o, fc1, fc2 and the rest (norms, biases)
    assert max(units) == 20480 * 81920 and sum(units) == pytest.approx(blk.params)
    i = g.layers.index(blk)
    per_module = stage_memory(g, [i], cfg, 1)
    monkeypatch.setattr(plan_mod, "FSDP_UNIT_PARAMS", 10**12)         # as if the block were one unit
    whole = stage_memory(g, [i], cfg, 1)
    # two gathered units with their bf16 gradients (2 + 2 bytes each): block -> largest linear
    assert whole.buffers - per_module.buffers == pytest.approx(2 * (blk.params - max(units)) * 4, rel=1e-6)
    moe = _moe_layer(_fine())                                        # 0.6B parameters: one unit
    assert fsdp_units(moe, cfg, 2048) == [pytest.approx(layer_params_local(moe, 1, 1, 1, 2048))]


def test_runtime_picks_the_modules_it_shards_alone(monkeypatch):
    """The runtime's choice of per-module units follows the same rule (threshold lowered for a tiny block)."""
    import planner.sharding as plan_mod
    from codegen.runtime.data_parallel import module_units
    from planner.zoo import build_model, preset
    block = build_model(preset("llama-tiny"), device="cpu", seed=0).layers[0]
    assert module_units(block) == []
    monkeypatch.setattr(plan_mod, "FSDP_UNIT_PARAMS", 1000)
    names = {n for n, m in block.named_modules() if m in module_units(block)}
    assert {"attn.q_proj", "mlp.gate_proj", "mlp.down_proj"} <= names
    assert not any("norm" in n for n in names)                       # under 1% of the block: stays in its unit
