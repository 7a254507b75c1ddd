"""The zoo mixture of experts (planner/zoo/moe.py): routing and experts against a per-token
reference, gradients of experts without tokens, the balancing bias, capture's FLOPs and the
planner on MoE presets (under TP only with sequence parallel)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from planner import zoo
from planner.errors import AutoparError
from planner.zoo.moe import MoEFeedForward


def _layer(score_func="softmax", shared=1, seed=0) -> MoEFeedForward:
    torch.manual_seed(seed)
    m = MoEFeedForward(hidden=16, expert_ffn=8, experts=8, top_k=2, shared_experts=shared, score_func=score_func)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def _reference(m: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: its top-k experts by score + bias, weighted by the (renormalised) score."""
    out = []
    for t in x:
        s = m.router(t).softmax(-1) if m.score_func == "softmax" else m.router(t).sigmoid()
        ids = torch.topk(s + m.expert_bias, m.top_k).indices
        w = s[ids] / (s[ids].sum() if m.score_func == "sigmoid" else 1.0)
        y = sum(w[j] * (F.silu(t @ m.routed.w_gate[e]) * (t @ m.routed.w_up[e])) @ m.routed.w_down[e] for j, e in enumerate(ids))
        out.append(y + (m.shared(t) if m.shared is not None else 0.0))
    return torch.stack(out)


@pytest.mark.parametrize("score_func,shared", [("softmax", 1), ("sigmoid", 0)])
def test_layer_matches_per_token_reference(score_func, shared):
    m = _layer(score_func, shared)
    m.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    x = torch.randn(2, 12, 16)
    got = m(x)
    want = _reference(m, x.reshape(-1, 16)).reshape(2, 12, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_get_zero_gradients():
    m = _layer(shared=0)
    m.expert_bias.copy_(torch.tensor([10.0, 10.0, 0, 0, 0, 0, 0, 0]))  # every token picks experts 0 and 1
    m(torch.randn(3, 5, 16)).sum().backward()
    g = m.routed.w_gate.grad
    assert g is not None and g[:2].abs().sum() > 0
    assert torch.count_nonzero(g[2:]) == 0 and torch.count_nonzero(m.routed.w_down.grad[2:]) == 0


def test_load_is_counted_once_per_differentiated_forward():
    m = _layer()
    x = torch.randn(4, 16)
    with torch.no_grad():
        m(x)  # never differentiated (a shape probe): not counted
    assert m.take_load().sum() == 0
    m(x).sum().backward()
    assert m.take_load().sum() == 4 * 2  # tokens x top_k
    assert m.take_load().sum() == 0      # taking resets


def test_bias_update_moves_load_toward_balance():
    m = _layer(shared=0, seed=3)
    with torch.no_grad():
        m.router.weight[0] += 1.0  # expert 0 scores high for most tokens
    x = torch.randn(256, 16)

    def spread() -> float:
        m(x).sum().backward()
        load = m.take_load()
        return float(load.max() - load.min())

    before = spread()
    for _ in range(100):
        m(x).sum().backward()
        m.update_bias(m.take_load(), rate=0.01)
    after = spread()
    assert after < 0.5 * before, (before, after)
    assert m.expert_bias[0] < 0  # the overloaded expert was pushed down


def test_capture_counts_the_routed_flops_of_the_balanced_load():
    """moe-tiny at 32 tokens: each MoE block's MLP = router 2*T*H*E + routed experts
    3 GEMMs * 2*(T*k)*H*F + the shared expert 3 * 2*T*H*F (T*k = 64 rows, 8 per expert)."""
    from planner.frontend.load import load_graph

    cfg = zoo.preset("moe-tiny")
    g = load_graph("moe-tiny", batch=1, seq_len=32)
    T, H, E, k, F_ = 32, cfg.hidden, cfg.experts, cfg.top_k, cfg.expert_ffn_hidden
    want = 2 * T * H * E + 3 * 2 * T * k * H * F_ + 3 * 2 * T * H * F_ * cfg.shared_experts
    moe_blocks = [l for l in g.layers if l.name.startswith("layers.") and l.name != "layers.0"]
    assert len(moe_blocks) == cfg.layers - cfg.dense_layers
    for layer in moe_blocks:
        mlp = next(o for o in layer.ops if o.name == "mlp")
        assert mlp.fwd_flops == want
    assert sum(l.params for l in g.layers) == cfg.num_params()


def test_presets_match_published_sizes_and_validate():
    assert zoo.preset("mixtral-8x7b").num_params() == pytest.approx(46.7e9, rel=0.005)
    assert zoo.preset("mixtral-8x22b").num_params() == pytest.approx(140.6e9, rel=0.005)
    with pytest.raises(AutoparError, match="top_k 9 exceeds experts 8"):
        zoo.preset("moe-tiny").replace(top_k=9)
    with pytest.raises(AutoparError, match="router 'relu'"):
        zoo.preset("moe-tiny").replace(router="relu")


def test_moe_under_tp_needs_sequence_parallel():
    """Mixtral 8x7B on 16 H100s: the MoE layers run on each tp rank's sequence shard, so a layout
    with tp > 1 needs sequence parallel; evaluating tp=2 without it says why, with it runs."""
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config, plan_model

    g = load_graph("mixtral-8x7b", batch=1, seq_len=4096)
    c = parse_cluster("dgx-h100:2")
    plan, _ = plan_model(g, c, 64, spec="mixtral-8x7b", cluster_spec="dgx-h100:2")
    layouts = [plan.config] + [ParallelConfig.parse(a["config"]) for a in plan.alternatives]
    assert any(x.tp > 1 for x in layouts) and all(x.sp for x in layouts if x.tp > 1)
    _, problems = evaluate_config(g, c, ParallelConfig.parse("dp=2,pp=4,tp=2,zero=fsdp"), 64)
    assert any("routed experts" in p and "use sp=on" in p for p in problems), problems
    _, problems = evaluate_config(g, c, ParallelConfig.parse("dp=2,pp=4,tp=2,sp=on,ep=4,zero=fsdp"), 64)
    assert problems == []
