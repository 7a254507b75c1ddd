"""A transformers model's routed experts, run by autopar.

transformers dispatches the forward of every experts class decorated with
``use_experts_implementation`` (Mixtral, Qwen-MoE, DeepSeek, ...) through its
``ExpertsInterface`` by the name in ``config._experts_implementation``. :func:`install`
registers one more name, ``autopar_<tag>`` of the build (no existing entry changes; the
build's close removes it), sets it on the
model's own config and gives each experts instance the routed-experts protocol the
runtime and the capture use (the zoo's ``RoutedExperts`` has the same):

- ``expert_weights``: the stacked parameters (experts on dim 0) expert parallelism splits;
- ``run_local(rows, split, weights)``: each expert on its contiguous rows, with the given
  (local) stacks: a split / unbind loop, as the zoo's ``grouped_swiglu`` (the weights'
  layout, gating and biases from the decorator's own flags: ``is_transposed``,
  ``has_gate``, ``has_bias``);
- ``dispatcher``: None, or expert parallelism's token exchange
  (``codegen/runtime/expert_parallel.py``);
- ``static_shapes``: False; the capture sets it on its fake copy, where rows per expert
  cannot depend on the routing, which then assumes the balanced load;
- ``moe_shape()``: (experts, expert FFN width).

The experts forward itself (:func:`autopar_experts_forward`) routes as the zoo's layer does
(``codegen.runtime.layers.run_routed``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from codegen.runtime.layers import run_routed

EXPERTS_NAME = "autopar"  # + _<tag> of the build


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts instances of ``model`` that transformers' ``use_experts_implementation``
    decorated (it leaves these flags on each instance)."""
    return [m for m in model.modules()
            if all(hasattr(m, a) for a in ("is_transposed", "is_concatenated", "has_gate", "has_bias", "num_experts"))]


def unsupported(m: nn.Module) -> Optional[str]:
    """Why autopar cannot run experts instance ``m`` (None if it can)."""
    if not m.is_concatenated:
        return "interleaved gate/up expert weights"
    if getattr(m, "has_post_expert_norm", False):
        return "a norm after each expert"
    return None


def _weight_names(m: nn.Module) -> tuple[str, ...]:
    up = "gate_up_proj" if m.has_gate else "up_proj"
    names = (up, "down_proj")
    return names + tuple(n + "_bias" for n in names) if m.has_bias else names


def _linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    y = x @ w if transposed else F.linear(x, w)
    return y + b if b is not None else y


def run_local(m: nn.Module, rows: torch.Tensor, split: list[int], weights: list[torch.Tensor]) -> torch.Tensor:
    """Expert e of the stacks ``weights`` (``expert_weights`` order) on its ``split[e]`` rows."""
    up, down = weights[0], weights[1]
    up_b, down_b = (weights[2], weights[3]) if m.has_bias else (None, None)
    n = up.shape[0]
    biases = (up_b.unbind(0), down_b.unbind(0)) if m.has_bias else ([None] * n, [None] * n)
    outs = []
    for x, w1, w2, b1, b2 in zip(rows.split(split), up.unbind(0), down.unbind(0), *biases):
        h = _linear(x, w1, b1, m.is_transposed)
        h = m._apply_gate(h) if m.has_gate else m.act_fn(h)
        outs.append(_linear(h, w2, b2, m.is_transposed))
    return torch.cat(outs)


def moe_shape(m: nn.Module) -> tuple[int, int]:
    """(experts, expert FFN width) from the down projection's stack."""
    d = m.down_proj
    return int(d.shape[0]), int(d.shape[1] if m.is_transposed else d.shape[2])


def autopar_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature: tokens [T, hidden], their experts and weights
    [T, k]; routed as the zoo's layer routes (``codegen.runtime.layers.run_routed``)."""
    def run(rows: torch.Tensor, split: list[int]) -> torch.Tensor:
        if self.dispatcher is not None:
            return self.dispatcher(self, rows, split)
        return self.run_local(rows, split, [getattr(self, n) for n in self.expert_weights])

    y, _ = run_routed(hidden_states, top_k_index, top_k_weights, self.num_experts, run, static=self.static_shapes)
    return y


def install(model: nn.Module, config, installs) -> None:
    """Register :func:`autopar_experts_forward` as ``autopar_<tag>`` (``installs``: this build's
    record, which removes it at close), select it on ``config`` (the model's own copy: the
    caller gives every module of this model that copy) and give each experts instance the
    routed-experts protocol (module docstring; the build's close removes it). Idempotent."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = f"{EXPERTS_NAME}_{installs.tag}"
    if name not in ALL_EXPERTS_FUNCTIONS:
        installs.register(ALL_EXPERTS_FUNCTIONS, name, autopar_experts_forward)
    config._experts_implementation = name
    for m in experts_modules(model):
        if getattr(m, "expert_weights", None) is not None:
            continue
        m.expert_weights = _weight_names(m)
        m.run_local = functools.partial(run_local, m)
        m.moe_shape = functools.partial(moe_shape, m)
        m.dispatcher = None
        m.static_shapes = False
