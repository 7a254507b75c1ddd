"""Mixture-of-experts decoder (Mixtral / DeepSeek-V3 shape): a Llama decoder whose MLPs,
after ``dense_layers`` dense ones, are routed experts.

``MoEFeedForward`` (the ``mlp`` of an MoE block), for tokens x [T, hidden]:

1. **Router**: scores = ``score_func(router(x))`` over ``experts`` (softmax, Mixtral; or
   sigmoid, DeepSeek-V3). Each token picks its ``top_k`` experts by ``scores + expert_bias``
   (the bias only steers the choice: auxiliary-loss-free load balancing, DeepSeek-V3 §2.1.2);
   its weights are the chosen scores, renormalised to sum 1 for sigmoid scores.
2. **Dispatch**: the (token, choice) pairs are sorted by expert, so each expert's rows are
   contiguous; ``counts`` [experts] says how many each got.
3. **Experts** (``routed``, a :class:`RoutedExperts`): SwiGLU per expert on its rows, with the
   stacked weights ``w_gate``, ``w_up`` [experts, hidden, expert_ffn] and ``w_down``
   [experts, expert_ffn, hidden] (:func:`grouped_swiglu`).
4. **Combine**: each row times its weight, summed back onto its token; plus the
   ``shared_experts`` (one SwiGLU of ``shared_experts * expert_ffn``) every token passes.

``routed.dispatcher`` (None: all experts local) is where expert parallelism plugs in, per
instance: it takes the routed module, the sorted rows and the rows per expert, and returns
the expert outputs in the same order (``codegen/runtime/expert_parallel.py``). The experts
are a submodule of their own so that data parallelism can shard them over a group of
their own. ``load`` accumulates the tokens per expert of the micro-batches differentiated since
the last :meth:`take_load` (counted when the layer's output gradient arrives, so a forward
that is never differentiated - a pipeline's shape probe, a recomputation - does not count); the runtime sums it over the data-parallel ranks before each optimizer
step and calls :meth:`update_bias` (``codegen/runtime/experts.py``).

Capture (planner/frontend/trace.py) runs the model on fake tensors, where data-dependent row
counts do not exist: ``static_shapes = True`` on an instance makes it assume the balanced
load (every expert ``T * top_k / experts`` rows, rounded up), which gives the expected
FLOPs and activation bytes of the routed experts; nothing else changes.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from codegen.runtime.layers import SelfAttention, grouped_swiglu, run_routed
from planner.zoo.config import ModelConfig
from planner.zoo.gpt import LMHead, ZooModel
from planner.zoo.llama import SwiGLU, TokenEmbedding

BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed gamma


class RoutedExperts(nn.Module):
    """The stacked routed experts; ``forward(rows, split)``: SwiGLU of expert e on its
    ``split[e]`` contiguous rows, locally or through ``dispatcher`` (expert parallelism).

    The routed-experts protocol the runtime and the capture use (a transformers model's
    experts get the same from ``codegen/runtime/adapters/hf_experts.py``): ``expert_weights``
    (the stacks, experts on dim 0), ``run_local(rows, split, weights)``, ``dispatcher``,
    ``moe_shape()`` -> (experts, expert FFN width)."""

    expert_weights = ("w_gate", "w_up", "w_down")

    def __init__(self, hidden: int, expert_ffn: int, experts: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, expert_ffn))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, expert_ffn))
        self.w_down = nn.Parameter(torch.empty(experts, expert_ffn, hidden))
        self.dispatcher: Optional[Callable] = None

    def run_local(self, rows: torch.Tensor, split: list[int], weights: list[torch.Tensor]) -> torch.Tensor:
        return grouped_swiglu(rows, split, *weights)

    def moe_shape(self) -> tuple[int, int]:
        return int(self.w_gate.shape[0]), int(self.w_gate.shape[2])

    def forward(self, rows: torch.Tensor, split: list[int]) -> torch.Tensor:
        if self.dispatcher is not None:
            return self.dispatcher(self, rows, split)
        return self.run_local(rows, split, [self.w_gate, self.w_up, self.w_down])


class MoEFeedForward(nn.Module):
    """Routed experts plus optional shared experts (module docstring)."""

    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int, shared_experts: int,
                 score_func: str):
        super().__init__()
        self.experts, self.top_k, self.shared_experts, self.score_func = experts, top_k, shared_experts, score_func
        self.router = nn.Linear(hidden, experts, bias=False)
        self.routed = RoutedExperts(hidden, expert_ffn, experts)
        self.shared = SwiGLU(hidden, shared_experts * expert_ffn) if shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(experts), persistent=True)
        self.load: Optional[torch.Tensor] = None  # tokens per expert since take_load() (not a buffer)
        self.static_shapes = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert ids [T, top_k]) of tokens x [T, hidden]."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        ids = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        w = scores.gather(-1, ids)
        if self.score_func == "sigmoid":
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        y, counts = run_routed(x, ids, weights, self.experts, self.routed, static=self.static_shapes)
        if self.shared is not None:
            y = y + self.shared(x)
        if y.requires_grad:  # counted when its gradient arrives: forwards never differentiated
            y.register_hook(lambda grad, c=counts: self._add_load(c))  # (shape probes) do not count
        return y.reshape(shape)

    @torch.no_grad()
    def _add_load(self, counts: torch.Tensor) -> None:
        self.load = counts.float() if self.load is None else self.load + counts.float()

    def take_load(self) -> torch.Tensor:
        """Tokens each expert got since the last call ([experts], float), and reset."""
        load = self.load if self.load is not None else torch.zeros_like(self.expert_bias)
        self.load = None
        return load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float = BIAS_RATE) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): raise the bias of the experts that
        got fewer than the mean of ``load`` (tokens per expert over the whole batch), lower it for
        those that got more, by ``rate``."""
        if load.sum() > 0:
            self.expert_bias += rate * torch.sign(load.mean() - load)


class MoEBlock(nn.Module):
    """A Llama block whose ``mlp`` is a :class:`MoEFeedForward` (or a dense SwiGLU for the
    first ``dense_layers`` blocks)."""

    def __init__(self, cfg: ModelConfig, dense: bool):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.kv_heads, bias=False, causal=True,
                                  rope_theta=float(cfg.rope_theta))
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.ffn_hidden) if dense else MoEFeedForward(
            cfg.hidden, cfg.expert_ffn_hidden, cfg.experts, cfg.top_k, cfg.shared_experts, cfg.router)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class MoE(ZooModel):
    """MoE decoder: ``embed``, ``layers`` (MoEBlock), ``norm``, ``head``.
    ``forward(input_ids, labels=None, positions=None)`` as Llama's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = TokenEmbedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(MoEBlock(cfg, dense=i < cfg.dense_layers) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = LMHead(cfg.hidden, cfg.vocab)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, S, vocab], or the mean loss if ``labels`` [B, S] is given."""
        return self.run_decoder(self.embed(input_ids, positions), labels, positions)

    def init_weights(self, seed: Optional[int] = None) -> None:
        """As the other zoo models (the expert stacks N(0, 0.02)), the balancing bias zeroed."""
        super().init_weights(seed)
        for m in self.moe_layers():
            if not m.expert_bias.is_meta:
                m.expert_bias.zero_()
            m.load = None

    def moe_layers(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

