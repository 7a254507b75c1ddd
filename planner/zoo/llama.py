"""Llama (Llama 2/3 shape): RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases.

Structure (top-level children, in execution order, each a pipeline "layer unit"):
``embed`` (TokenEmbedding: ``tok``) -> ``layers`` (ModuleList of LlamaBlock) ->
``norm`` (RMSNorm) -> ``head`` (LMHead). Shapes: ``input_ids`` [B, S], hidden
[B, S, hidden], logits [B, S, vocab]. ``positions`` ([S] or [B, S], default
``arange(S)``) feed RoPE in every attention layer; context parallelism passes the
global positions of its shard.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from codegen.runtime.layers import SelfAttention
from planner.zoo.config import ModelConfig
from planner.zoo.gpt import LMHead, ZooModel


class TokenEmbedding(nn.Module):
    """``tok`` = Embedding(vocab, hidden); ``positions`` accepted for a uniform signature and unused."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.tok(input_ids)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, hidden -> ffn_hidden -> hidden, no biases."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """x + attn(attn_norm(x), positions); x + mlp(mlp_norm(x)). Causal, RoPE with ``rope_theta``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.kv_heads, bias=False, causal=True,
                                  rope_theta=float(cfg.rope_theta))
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class LlamaDecoder(ZooModel):
    """Adds the decoder units ``embed``, ``layers``, ``norm``, ``head`` (in that order) to ``self``."""

    def _add_decoder(self, cfg: ModelConfig) -> None:
        self.embed = TokenEmbedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = LMHead(cfg.hidden, cfg.vocab)
        self.tie_weights()


class Llama(LlamaDecoder):
    """Llama decoder. ``forward(input_ids, labels=None, positions=None)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self._add_decoder(cfg)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, S, vocab], or the mean loss if ``labels`` [B, S] is given."""
        return self.run_decoder(self.embed(input_ids, positions), labels, positions)
