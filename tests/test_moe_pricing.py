"""Mixtures of experts priced by mechanism: the EP all-to-all over the links the group crosses
and hidden under the engine's 1F1B overlap, grouped-GEMM efficiency by rows per expert, a
published layout that fits, and MLA (DeepSeek-V3) captured with its latent projections."""
import dataclasses
import os

import pytest

from cost_models import gpu_kernels as gk
from cost_models.cluster import load_preset
from cost_models.engines import ENGINES, Engine, exposed_s
from cost_models.experts import alltoall_bytes, expert_comm, remote_nodes
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
    cl, cfg = h100(4), ParallelConfig(dp=32, ep=32, mbs=4)
    plain = over = moe_layer(moe32)
    ov = {"engine": Engine("o", ep_overlap=True)}
    base = expert_comm(plain, moe32, cl, cfg, window_s=1.0)  # no overlap: the window does not matter
    total = base.fwd + base.bwd
    assert total > 0
    assert expert_comm(plain, moe32, cl, cfg, window_s=0.0).fwd == base.fwd
    hidden = expert_comm(over, moe32, cl, cfg, window_s=10 * total, **ov)
    assert hidden.fwd + hidden.bwd == 0.0
    exposed = expert_comm(over, moe32, cl, cfg, window_s=0.0, **ov)
    assert exposed.fwd + exposed.bwd == pytest.approx(total)
    part = expert_comm(over, moe32, cl, cfg, window_s=total / 4, **ov)
    assert part.fwd + part.bwd == pytest.approx(0.75 * total)


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
