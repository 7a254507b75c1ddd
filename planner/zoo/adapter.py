"""The runtime adapter of autopar's own reference models (GPT, Llama, the MLLM, the MoE): every
zoo model returns one from ``autopar_adapter()``, the hook by which a model brings its own adapter
(``codegen.runtime.adapters.adapter_for``).

Units: ``embed``, ``layers.<i>``, ``norm``, ``head`` (the MLLM adds ``vision.patch_embed``,
``vision.blocks.<i>``, ``vision.norm`` and ``projector`` in front). A stage runs its units
in order; what flows between stages:

- first stage inputs: ``(input_ids,)``, or ``(input_ids, pixel_values)`` for the MLLM;
- between stages: ``(x,)`` hidden states, or ``(x, input_ids)`` while the MLLM's text
  embedding has not run yet (the image path runs first);
- the last stage, given ``labels``, returns the summed token cross-entropy (fused
  linear + cross-entropy from the head's input, or of the head's logits).

Attention: each :class:`codegen.runtime.layers.SelfAttention` of a block gets the runtime's
implementation as its ``attn_impl``. Initialisation of a meta-built model is per
parameter, seeded by name (``ZooModel.init_weights``), so a stage's units get the same
numbers as the whole model's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from codegen.runtime.adapters.base import IGNORE_INDEX, AttentionImpl, ModelAdapter, StageModule, Unit, attach
from codegen.runtime import kernels as kern
from codegen.runtime.layers import SelfAttention, patchify


def _zoo_units(model: nn.Module) -> list[Unit]:
    units: list[Unit] = []
    if hasattr(model, "vision"):
        units.append(Unit("vision.patch_embed", "before"))
        units += [Unit(f"vision.blocks.{i}", "block") for i in range(len(model.vision.blocks))]
        units += [Unit("vision.norm", "before"), Unit("projector", "before")]
    units.append(Unit("embed", "before"))
    units += [Unit(f"layers.{i}", "block") for i in range(len(model.layers))]
    units += [Unit("norm", "after"), Unit("head", "head")]
    return units


class ZooAdapter(ModelAdapter):
    kind = "zoo"

    def __init__(self, model: nn.Module):
        super().__init__(model, _zoo_units(model))
        self.is_mllm = hasattr(model, "vision")

    def limits(self) -> dict[str, str]:
        if self.is_mllm:
            return {"cp": "image tokens are not sequence-sharded (vision layers)",
                    "sp": "the vision encoder is not sequence-sharded"}
        return {}

    def build_stage(self, units: Sequence[str], recompute: str) -> StageModule:
        return ZooStage(self, units, recompute)

    def attention_modules(self, block: nn.Module) -> list[nn.Module]:
        return [m for m in block.modules() if isinstance(m, SelfAttention)]

    def set_attention(self, block: nn.Module, impl: AttentionImpl) -> None:
        for m in self.attention_modules(block):
            m.attn_impl = impl

    def inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.is_mllm:
            return batch["input_ids"], batch["pixel_values"]
        return (batch["input_ids"],)

    def targets(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        if self.is_mllm and labels.shape[-1] == batch["input_ids"].shape[-1]:
            n_img = self.model.config.num_patches
            labels = torch.cat((labels.new_full((labels.shape[0], n_img), IGNORE_INDEX), labels), dim=1)
        return labels

    def materialize(self, units: Sequence[str], device: torch.device, seed: Optional[int]) -> None:
        if not any(p.is_meta for p in self.model.parameters()):
            return
        for fqn in units:
            self.model.get_submodule(fqn).to_empty(device=device)
        self.model.init_weights(seed)  # per-parameter seeded; meta (other stages') parameters are skipped


class ZooStage(StageModule):
    """A run of a zoo model's units under their own fqns (see the module docstring)."""

    def __init__(self, adapter: ZooAdapter, units: Sequence[str], recompute: str):
        super().__init__(units, adapter.units, recompute)
        model = adapter.model
        self.is_mllm = adapter.is_mllm
        self.patch_size = model.vision.patch_size if self.is_mllm else None
        self.vocab = model.embed.tok.num_embeddings
        all_units = adapter.units
        first, last = all_units.index(self.units[0]), all_units.index(self.units[-1])
        embed_at = all_units.index("embed")
        self.needs_ids_in = self.is_mllm and first <= embed_at and not self.is_first
        self.carries_ids_out = self.is_mllm and last < embed_at
        for fqn in self.units:
            attach(self, fqn, model.get_submodule(fqn))

    def _inputs(self, args):
        if self.is_first:
            return None, args[0], (args[1] if self.is_mllm else None)
        if self.needs_ids_in:
            x, input_ids = args
            # torch's stage metadata inference runs forward on uninitialised tensors; keep its
            # garbage ids in range (a no-op on real token ids).
            return x, input_ids.clamp(0, self.vocab - 1), None
        return args[0], None, None

    def forward(self, *args: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, doc_start: Optional[torch.Tensor] = None):
        x, input_ids, pixel_values = self._inputs(args)
        pos = self.take_step(positions, doc_start)
        for fqn in self.units:
            mod = self.get_submodule(fqn)
            if fqn == "vision.patch_embed":
                x = mod(patchify(pixel_values, self.patch_size))
            elif fqn == "embed":
                text = mod(input_ids, pos)
                x = text if x is None else torch.cat((x.to(text.dtype), text), dim=1)
            elif fqn.startswith("layers."):
                x = mod(x, pos)
            elif fqn == "head" and labels is not None:
                if self.loss_kernel == "fused":
                    return kern.linear_loss(mod.proj.weight, x, labels, sp=self.sp)
                return kern.logits_loss(mod(x), labels)
            else:  # vision.blocks.<i>, vision.norm, projector, norm, head (logits)
                x = mod(x)
        if self.carries_ids_out:
            return x, input_ids
        return x
