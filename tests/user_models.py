"""Models written the way users write them, for the adapter tests (not autopar's conventions).

``UserLM`` is GPT-style in another style than the zoo: token embedding ``transformer.wte``,
blocks ``transformer.h[i]`` (an attention module with separate q/k/v projections whose
view reads the head count from ``self.n_head``, rotary positions from an optional
``positions`` argument, ``F.scaled_dot_product_attention`` with grouped-query heads; an
``nn.Sequential`` MLP), a final ``transformer.ln_f`` and an ``lm_head`` returning LOGITS: the
loss is computed outside the model (:func:`user_loss`). ``build()`` is a ``package.module:function`` model
spec (``tests.user_models:build``).

``RootPositionsLM`` adds learned positions at the root of its forward (between the units),
so running its units one after another does not compute its forward: the adapter must
refuse it and ask for an explicit spec.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    half = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos.to(x.dtype) + half * sin.to(x.dtype)


class Attention(nn.Module):
    """Separate q/k/v projections; heads from ``self.n_head`` (not the tensor's size)."""

    def __init__(self, d: int, n_head: int, n_kv_head: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, d // n_head
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.v = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_head, self.hd).transpose(1, 2)
        k = self.k(x).view(b, s, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, self.n_kv_head, self.hd).transpose(1, 2)
        q, k = _rope(q, positions), _rope(k, positions)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.proj(a.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, n_head, n_kv_head)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        x = x + self.attn(self.ln_1(x), positions)
        return x + self.mlp(self.ln_2(x))


class UserLM(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, n_layer: int = 4, n_head: int = 4, n_kv_head: int = 2):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.h = nn.ModuleList(Block(d, n_head, n_kv_head) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, positions)
        return self.lm_head(self.transformer.ln_f(x))


def user_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The user's training loss: mean token cross-entropy, labels aligned with positions."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def build() -> nn.Module:
    torch.manual_seed(0)
    return UserLM()


class RootPositionsLM(UserLM):
    """Learned positions added at the root of the forward, between the units."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.wpe = nn.Parameter(torch.zeros(64, self.lm_head.in_features))

    def forward(self, idx: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.transformer.h:
            x = block(x, positions)
        return self.lm_head(self.transformer.ln_f(x))


def fixed_tokens(step: int, global_batch: int, seq_len: int) -> dict:
    """``--data`` hook: the same batch every step (labels = input_ids), so the loss must fall."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (global_batch, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids}


class NanoBlock(nn.Module):
    """nanoGPT's block: one fused q/k/v ``c_attn`` Linear split in three, ``c_proj`` out."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT-style: learned token and position embeddings ``wte`` / ``wpe`` summed at the root
    of the forward, blocks in a ModuleList, ``forward(input_ids) -> logits``, the head tied to
    ``wte`` when ``tied``."""

    def __init__(self, vocab: int = 128, d: int = 64, n_layer: int = 2, n_head: int = 4, block_size: int = 64,
                 tied: bool = False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList(NanoBlock(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        for m in self.modules():  # nanoGPT's init: N(0, 0.02) weights (a tied head then starts near uniform)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT(tied=True)


class TokenMix(nn.Module):
    """A second table looked up with the token ids (not the running hidden state)."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.table = nn.Embedding(vocab, d)

    def forward(self, ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.table(ids)


class TwoStreamLM(UserLM):
    """Adds a second embedding of the token ids at the root (``x = wte(ids) + mix(ids)``); ``mix``
    takes positions, so its units run as a chain, which feeds ``mix`` the hidden state: no
    chain computes this forward (an explicit spec is needed)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.mix = TokenMix(self.lm_head.out_features, self.lm_head.in_features)

    def forward(self, idx: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.mix(idx)
        for block in self.transformer.h:
            x = block(x, positions)
        return self.lm_head(self.transformer.ln_f(x))


def build_two_stream() -> nn.Module:
    torch.manual_seed(0)
    return TwoStreamLM()
