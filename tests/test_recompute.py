"""Activation recomputation per block (codegen/runtime/recompute.py) and its price
(cost_models/op_recompute.py): what each policy re-runs in backward, counted in matmuls,
and the per-op policy's kept bytes and recomputed share against hand counts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from codegen.runtime.torch_compat import observe_ops

from codegen.runtime.recompute import checkpoint_block
from cost_models.memory import layer_activation
from cost_models.compute import op_recompute_share
from cost_models.op_recompute import op_saved_bytes
from planner.frontend.load import graph_of_config
from planner.plan import ParallelConfig, ModelFacts
from planner.recompute_rules import recompute_problem
from model_cases import fitting_problems
from planner.zoo import preset


class Block(nn.Module):
    """Seven matmuls (q, k, v, o, gate, up, down) around SDPA: a Llama block without norms."""

    def __init__(self, h: int = 16, f: int = 24) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, 2, h // 2).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(a)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class CountMatmuls:
    """The matmuls run under :meth:`watching`."""

    def __init__(self) -> None:
        self.n = 0

    def watching(self):
        return observe_ops(self.seen)

    def seen(self, func, args, kwargs, out) -> None:
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.n += 1


def _backward_matmuls(policy: str) -> tuple[int, torch.Tensor]:
    torch.manual_seed(0)
    blk = Block()
    if policy != "none":
        checkpoint_block(blk, per_op=policy == "selective-op")
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = blk(x).square().sum()
    c = CountMatmuls()
    with c.watching():
        y.backward()
    return c.n, x.grad


def test_each_policy_recomputes_what_it_says():
    n_none, g_none = _backward_matmuls("none")
    n_full, g_full = _backward_matmuls("full")
    n_op, g_op = _backward_matmuls("selective-op")
    # the forward again, up to the last tensor backward needs: 6 matmuls (torch's non-reentrant
    # checkpoint stops before down, whose output no backward reads)
    assert n_full == n_none + 6
    assert n_op == n_none + 3               # k, o and up (the 2nd, 4th, 6th); q, v, gate, down kept
    torch.testing.assert_close(g_full, g_none, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_op, g_none, rtol=0, atol=1e-6)


def test_per_op_checkpointed_block_runs_forwards_in_flight():
    """Two micro-batches' forwards before either backward (a pipeline schedule's order): each
    forward keeps its own outputs and its own matmul count."""
    torch.manual_seed(0)
    ref, blk = Block(), Block()
    blk.load_state_dict(ref.state_dict())
    checkpoint_block(blk, per_op=True)
    xs = [torch.randn(2, 8, 16) for _ in range(2)]
    outs = [blk(x).square().sum() for x in xs]
    for o in reversed(outs):
        o.backward()
    for x in xs:
        ref(x).square().sum().backward()
    for (n, p), q in zip(blk.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_op_saved_bytes_match_a_hand_count():
    g = graph_of_config(preset("llama-tiny"))   # batch 1, seq 32, fp32; hidden 64, heads 4 x 16, kv 2
    blk = g.layer("layers.1")
    kept = op_saved_bytes(blk, g)
    tokens, e = 32, 4
    # kept linears: q (64), v (32), gate (176) column; down (64) row; plus attention out + fp32 LSE
    assert kept.tp_part == tokens * (64 + 32 + 176) * e + tokens * 4 * (16 * e + 4)
    assert kept.rest == blk.input_bytes + tokens * 64 * e
    cfg = ParallelConfig(dtype="fp32", mbs=1)
    acts = {p: layer_activation(blk, g, cfg, p) for p in ("none", "selective-op", "full")}
    assert acts["full"] < acts["selective-op"] < acts["none"]
    # the embedding is not checkpointed: it keeps what it keeps without recompute
    emb = g.layers[0]
    assert layer_activation(emb, g, cfg, "selective-op") == layer_activation(emb, g, cfg, "none")


def test_op_recompute_share_is_the_unkept_forward():
    g = graph_of_config(preset("llama-tiny"))
    blk = g.layer("layers.1")
    share = op_recompute_share(blk, g)
    tokens = 32
    lin = {l.name.split(".")[-1]: 2.0 * tokens * l.in_features * l.out_features for l in blk.linears}
    core = 4.0 * 4 * 32 * 32 * 16 / 2
    kept = lin["q_proj"] + lin["v_proj"] + lin["gate_proj"] + lin["down_proj"] + core
    assert share == pytest.approx(1 - kept / blk.fwd_flops)
    assert 0.2 < share < 0.6
    assert op_recompute_share(g.layers[0], g) == 0.0


def test_per_op_recompute_is_refused_under_a_split_backward():
    assert recompute_problem("selective-op", "1f1b", 2) is None
    assert recompute_problem("selective-op", "zb-h1", 1) is None   # no pipeline: no split backward
    why = recompute_problem("selective-op", "zb-h1", 2)
    assert why and "split backward" in why and "use recompute=full" in why
    cfg = ParallelConfig(pp=2, schedule="zb-h1", recompute="selective-op")
    assert any("split backward" in p for p in fitting_problems(cfg, ModelFacts(units=8, seq_len=32)))
