"""GPT (GPT-3 / Megatron shape) and the pieces the other zoo models share.

Structure (top-level children, in execution order, each a pipeline "layer unit"):
``embed`` (GPTEmbedding: ``tok``, ``pos``) -> ``layers`` (ModuleList of GPTBlock) ->
``norm`` (LayerNorm) -> ``head`` (LMHead). Shapes: ``input_ids`` [B, S] token ids,
hidden states [B, S, hidden], logits [B, S, vocab]; the loss is a mean over
non-ignored tokens (nats).
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from codegen.runtime.layers import SelfAttention
from planner.zoo.config import ModelConfig

IGNORE_INDEX = -100
INIT_STD = 0.02
# Output projections of residual branches get std / sqrt(2 * depth) (GPT-2 scheme).
_OUT_PROJ = ("o_proj", "fc2", "down_proj")


class LMHead(nn.Module):
    """``proj`` = Linear(hidden, vocab, bias=False); logits, or mean cross-entropy given labels.

    ``labels`` [B, S] are the targets for each position as given (no shifting);
    ``-100`` is ignored. The loss is computed in float32.
    """

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.proj(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


class GPTEmbedding(nn.Module):
    """Token embedding ``tok`` plus learned position embedding ``pos``.

    ``positions``: [S] or [B, S] indices into ``pos`` (default ``arange(S)``; global
    indices under context parallelism). Must be < max_seq_len.
    """

    def __init__(self, vocab: int, hidden: int, max_seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq_len, hidden)

    def forward(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        return self.tok(input_ids) + self.pos(positions)


class GPTMLP(nn.Module):
    """``fc1`` (hidden -> ffn) -> GELU (tanh approximation) -> ``fc2`` (ffn -> hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)); x + mlp(ln2(x)). Biases on.

    ``causal=False`` gives the ViT block used by the MLLM vision encoder.
    ``positions`` is accepted for a uniform block signature and unused.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, eps: float,
                 causal: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = SelfAttention(hidden, heads, kv_heads, bias=True, causal=causal)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = GPTMLP(hidden, ffn_hidden)

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), positions)
        return x + self.mlp(self.ln2(x))


def init_weights_(model: nn.Module, cfg: ModelConfig, seed: Optional[int] = None,
                  aliases: Optional[dict[str, str]] = None) -> None:
    """Deterministically (re)initialise every parameter of ``model`` in place.

    Linear/Embedding weights ~ N(0, 0.02); output projections of residual branches
    (``o_proj``, ``fc2``, ``down_proj`` inside ``layers`` / ``vision.blocks``) ~
    N(0, 0.02 / sqrt(2 * depth)); biases 0; norm weights 1. Each parameter draws from
    its own generator seeded by ``(seed, parameter name)``, so a value does not depend
    on which other parameters exist (a pipeline stage holding a subset of the layers
    gets the same numbers as the full model on the same device type). ``seed=None``
    draws a seed from torch's global RNG. Meta parameters are skipped. Zoo models have
    no buffers (RoPE tables are computed in forward). ``aliases`` maps a parameter name to
    the name whose numbers it gets (a tied head held alone by the last pipeline stage).
    """
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    seen: set[int] = set()
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) in seen or p.is_meta:
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{pname}" if mod_name else pname
                full = (aliases or {}).get(full, full)
                if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                    p.fill_(1.0 if pname == "weight" else 0.0)
                    continue
                if pname == "bias":
                    p.zero_()
                    continue
                std = INIT_STD
                leaf = mod_name.rsplit(".", 1)[-1]
                if leaf in _OUT_PROJ:
                    if mod_name.startswith("layers."):
                        std /= math.sqrt(2 * cfg.layers)
                    elif mod_name.startswith("vision.blocks."):
                        std /= math.sqrt(2 * cfg.vision_layers)
                gen = torch.Generator(device=p.device)
                gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(full.encode())) % (2 ** 63))
                p.normal_(0.0, std, generator=gen)


class ZooModel(nn.Module):
    """Shared behaviour: ``config``, weight tying and ``init_weights``."""

    config: ModelConfig

    def tie_weights(self) -> None:
        """Share ``head.proj.weight`` with ``embed.tok.weight`` when the config ties them.

        ``Module.to_empty`` unties shared parameters; ``init_weights`` calls this first. A
        pipeline stage that materialised the head but not the embedding keeps its own copy
        (the runtime sums the two copies' gradients across the first and last stage).
        """
        if self.config.tie_embeddings and not (self.embed.tok.weight.is_meta and not self.head.proj.weight.is_meta):
            self.head.proj.weight = self.embed.tok.weight

    def init_weights(self, seed: Optional[int] = None) -> None:
        """Re-tie embeddings and deterministically initialise all parameters (see ``init_weights_``);
        an untied copy of a tied head gets the embedding's numbers."""
        self.tie_weights()
        aliases = {"head.proj.weight": "embed.tok.weight"} if self.config.tie_embeddings else None
        init_weights_(self, self.config, seed, aliases)

    def autopar_adapter(self):
        """The runtime adapter of this model (``codegen.runtime.adapters.adapter_for`` asks it)."""
        from planner.zoo.adapter import ZooAdapter

        return ZooAdapter(self)

    def run_decoder(self, x: torch.Tensor, labels: Optional[torch.Tensor],
                    positions: Optional[torch.Tensor]) -> torch.Tensor:
        """``layers`` in order, then ``norm`` and ``head``."""
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(self.norm(x), labels)


class GPT(ZooModel):
    """GPT-3/Megatron-shaped decoder. ``forward(input_ids, labels=None, positions=None)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = GPTEmbedding(cfg.vocab, cfg.hidden, cfg.max_seq_len)
        self.layers = nn.ModuleList(
            GPTBlock(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.norm_eps) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = LMHead(cfg.hidden, cfg.vocab)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, S, vocab], or the mean loss if ``labels`` [B, S] is given."""
        return self.run_decoder(self.embed(input_ids, positions), labels, positions)
