"""A vision + language model: ViT patch encoder -> projector -> Llama decoder.

Structure (top-level children, in execution order, each a pipeline "layer unit"):
``vision`` (VisionEncoder: ``patch_embed``, ``blocks``, ``norm``) -> ``projector``
(``fc1``, GELU, ``fc2``) -> ``embed`` -> ``layers`` -> ``norm`` -> ``head`` (the Llama
parts). The vision blocks are narrower than the decoder's and run on fewer tokens, so
layers are deliberately unequal in cost.

Shapes: ``pixel_values`` [B, channels, image_size, image_size] (values in any range;
no normalisation is applied), ``input_ids`` [B, S_text]. The decoder sequence is the
``num_patches`` image tokens followed by the text: ``S = num_patches + S_text``;
logits are [B, S, vocab]. Image positions never contribute to the loss.

Variable images per sample (``image_counts`` [B], int, each >= 0): ``pixel_values`` is then
[N, channels, image_size, image_size] with ``N = sum(image_counts)``, the images of sample 0
first, then sample 1's, and so on. Sample ``b``'s decoder sequence is its ``image_counts[b]``
images' ``num_patches`` tokens each, in order, followed by its ``S_text`` text tokens; the
sequences are right-padded (zero embeddings, targets ignored: causal attention never lets a
real token see them) to the longest, ``max(image_counts) * num_patches + S_text``, so logits
are [B, that, vocab]; positions restart at 0 in every sample. ``labels`` are then [B, S_text]
(text only). The runtime's multimodal batches (codegen/runtime/multimodal.py) use this format.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from planner.errors import AutoparError
from planner.zoo.config import ModelConfig
from planner.zoo.gpt import IGNORE_INDEX, GPTBlock
from planner.zoo.llama import LlamaDecoder
from codegen.runtime.layers import patchify


class PatchEmbedding(nn.Module):
    """``proj`` = Linear over flattened patches, plus learned position embedding ``pos``."""

    def __init__(self, patch_dim: int, hidden: int, num_patches: int):
        super().__init__()
        self.proj = nn.Linear(patch_dim, hidden)
        self.pos = nn.Embedding(num_patches, hidden)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches) + self.pos.weight


class VisionBlock(GPTBlock):
    """ViT block: pre-LayerNorm, NON-causal multi-head attention, GELU MLP, biases on."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.vision_hidden, cfg.vision_heads, cfg.vision_heads, cfg.vision_ffn_hidden,
                         cfg.norm_eps, causal=False)


class VisionEncoder(nn.Module):
    """pixels [B, C, H, W] -> image features [B, num_patches, vision_hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.image_size = cfg.image_size
        self.channels = cfg.channels
        self.patch_embed = PatchEmbedding(cfg.patch_dim, cfg.vision_hidden, cfg.num_patches)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_layers))
        self.norm = nn.LayerNorm(cfg.vision_hidden, eps=cfg.norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        want = (self.channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise AutoparError(f"pixel_values has shape {tuple(pixel_values.shape)}, expected [B, {want[0]}, "
                               f"{want[1]}, {want[2]}]; resize images to the config's image_size")
        x = self.patch_embed(patchify(pixel_values, self.patch_size))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Projector(nn.Module):
    """Two-layer MLP vision_hidden -> hidden -> hidden with GELU, biases on."""

    def __init__(self, vision_hidden: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(vision_hidden, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MLLM(LlamaDecoder):
    """Vision encoder + projector + Llama decoder.

    ``forward(input_ids [B, S_text], pixel_values [B, C, H, W], labels=None, positions=None,
    image_counts=None)``. ``labels``: [B, S_text] (padded on the left with -100 for the image
    tokens) or [B, num_patches + S_text] (used as given). ``positions``: [S] or [B, S] over the
    whole sequence (default ``arange(S)``). ``image_counts``: variable images per sample
    (module docstring; ``pixel_values`` [N, C, H, W], ``labels`` [B, S_text]).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.vision = VisionEncoder(cfg)
        self.projector = Projector(cfg.vision_hidden, cfg.hidden)
        self._add_decoder(cfg)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None,
                image_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, num_patches + S_text, vocab], or the mean loss over text labels."""
        if image_counts is not None:
            x, labels = self.variable_images(input_ids, pixel_values, image_counts, labels)
            return self.run_decoder(x, labels, positions)
        image = self.projector(self.vision(pixel_values))
        text = self.embed(input_ids, positions)
        x = torch.cat((image.to(text.dtype), text), dim=1)
        if labels is not None:
            n_img, n_txt = image.shape[1], input_ids.shape[1]
            if labels.shape[-1] == n_txt:
                pad = labels.new_full((*labels.shape[:-1], n_img), IGNORE_INDEX)
                labels = torch.cat((pad, labels), dim=-1)
            elif labels.shape[-1] != n_img + n_txt:
                raise AutoparError(f"labels have length {labels.shape[-1]}, expected {n_txt} (text) or "
                                   f"{n_img + n_txt} (image + text); pass labels aligned with input_ids")
        return self.run_decoder(x, labels, positions)

    def variable_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_counts: torch.Tensor,
                        labels: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The decoder input [B, S, hidden] and targets [B, S] (or None) of a batch with
        ``image_counts`` images per sample (module docstring: each sample's image tokens, then its
        text, right-padded to the longest)."""
        counts = [int(c) for c in image_counts.reshape(-1).tolist()]
        b, s_text = input_ids.shape
        if len(counts) != b or min(counts, default=0) < 0 or sum(counts) != pixel_values.shape[0]:
            raise AutoparError(f"image_counts {counts} for {b} samples and {pixel_values.shape[0]} images: give one "
                               "count >= 0 per sample, summing to the images in pixel_values")
        if labels is not None and labels.shape != input_ids.shape:
            raise AutoparError(f"labels have shape {tuple(labels.shape)}, expected {tuple(input_ids.shape)}: with "
                               "image_counts, labels are the text's targets")
        text = self.embed(input_ids)
        p = self.config.num_patches
        feats = (self.projector(self.vision(pixel_values)).to(text.dtype) if sum(counts)
                 else text.new_zeros((0, p, text.shape[-1])))
        longest = max(counts) * p + s_text
        starts = [sum(counts[:i]) for i in range(b)]
        rows, targets = [], []
        for i, (k, n) in enumerate(zip(starts, counts)):
            pad = longest - n * p - s_text
            rows.append(torch.cat((feats[k:k + n].reshape(n * p, text.shape[-1]), text[i], text.new_zeros((pad, text.shape[-1])))))
            if labels is not None:
                targets.append(torch.cat((labels.new_full((n * p,), IGNORE_INDEX), labels[i],
                                          labels.new_full((pad,), IGNORE_INDEX))))
        return torch.stack(rows), (torch.stack(targets) if labels is not None else None)
