"""Per-op recompute keeps what the cost model says it keeps: one rule, ``planner.graph.keeps_matmul``.

On three model families (the zoo's Llama, the zoo's MoE, a transformers model from
tests/hf_configs) the runtime's save policy (``codegen.runtime.recompute.OpSavePolicy``) is run on
a real forward of every checkpointed block, deciding op by op as torch's selective checkpointing
asks it; the matmuls it keeps (which Linear ran each, and the output size of those a Linear ran)
must be the ones the cost model keeps on the captured graph (``cost_models.op_recompute``).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from codegen.runtime.recompute import OpSavePolicy
from codegen.runtime.torch_compat import observe_ops
from cost_models.op_recompute import checkpointed, kept_linears, kept_matmuls
from planner.frontend.layer_kinds import is_linear
from planner.frontend.load import graph_of
from planner.zoo import build_model, example_batch, preset

ROOT = os.path.dirname(os.path.abspath(__file__))


class RunPolicy:
    """Asks a fresh ``OpSavePolicy`` about every op of each watched block's forward (as torch's
    selective checkpointing does) and notes each matmul's decision, the Linear that ran it and its
    output size."""

    def __init__(self) -> None:
        self.policy, self.block, self.linear = None, None, ""
        self.seen: dict[str, list[tuple[str, bool, int]]] = {}

    def watching(self):
        return observe_ops(self.op)

    def op(self, func, args, kwargs, out) -> None:
        if self.policy is not None:
            keep = self.policy(None, func, *args, **kwargs) == CheckpointPolicy.MUST_SAVE
            if func in self.policy.matmuls:
                self.seen[self.block].append((self.linear, keep, out.numel()))

    def watch(self, model: torch.nn.Module, names: list[str]) -> list:
        handles = []
        for name in names:
            block = model.get_submodule(name)

            def pre(mod, args, name=name):
                self.policy, self.block = OpSavePolicy(), name
                self.seen[name] = []

            def post(mod, args, out):
                self.policy = None
            handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
            for lname, sub in block.named_modules():
                if is_linear(sub):
                    handles.append(sub.register_forward_pre_hook(lambda m, a, n=lname: setattr(self, "linear", n)))
                    handles.append(sub.register_forward_hook(lambda m, a, o: setattr(self, "linear", "")))
        return handles


def zoo_case(name: str):
    cfg = preset(name)
    model = build_model(cfg, device="cpu", seed=0)
    return model, example_batch(cfg, 2, 16, device="cpu"), cfg


def hf_case(file: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.join(ROOT, "hf_configs", file))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, None


class TwiceAttention(torch.nn.Module):
    """Attention whose query and key come from one Linear run twice: four matmuls for three
    Linears in the block (counting Linears instead of matmuls keeps the wrong ones)."""

    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.a, self.o = torch.nn.Linear(h, h), torch.nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in (self.a(x), self.a(x * 2)))
        v = x.unflatten(-1, (2, -1)).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).flatten(-2))


class TwiceBlock(torch.nn.Module):
    def __init__(self, h: int = 32) -> None:
        super().__init__()
        self.attn, self.mlp = TwiceAttention(h), torch.nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TwiceLM(torch.nn.Module):
    def __init__(self, vocab: int = 64, h: int = 32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(TwiceBlock(h) for _ in range(2))
        self.head = torch.nn.Linear(h, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def user_case(_: str):
    torch.manual_seed(0)
    return TwiceLM(), {"input_ids": torch.randint(0, 64, (2, 16))}, None


CASES = {"zoo": zoo_case, "hf": hf_case, "user": user_case}


@pytest.mark.parametrize("case", ["zoo:llama-tiny", "zoo:moe-tiny", "hf:qwen2-tiny.json", "user:twice"])
def test_runtime_keeps_the_cost_models_matmuls(case):
    kind, name = case.split(":")
    model, ex, cfg = CASES[kind](name)
    meta_ex = {k: (v.to("meta") if torch.is_tensor(v) else v) for k, v in ex.items()}
    g = graph_of(model, meta_ex, name=name, seq_len=16, hidden=cfg.hidden if cfg else None,
                 vocab=cfg.vocab if cfg else None)
    blocks = [l for l in g.layers if checkpointed(l)]
    assert blocks and all(l.matmuls for l in blocks)
    watch = RunPolicy()
    handles = watch.watch(model, [l.name for l in blocks])
    try:
        with torch.no_grad(), watch.watching():
            model(**ex)
    finally:
        for h in handles:
            h.remove()
    for layer in blocks:
        ran = watch.seen[layer.name]
        kept = {id(mm) for mm in kept_matmuls(layer)}
        planned = [(mm.linear, id(mm) in kept, int(mm.out_elems)) for mm in layer.matmuls]
        assert [(lin, keep) for lin, keep, _ in ran] == [(lin, keep) for lin, keep, _ in planned], layer.name
        # a Linear's output has the captured size; routed experts' rows follow the real routing
        assert [n for lin, _, n in ran if lin] == [n for lin, _, n in planned if lin], layer.name
        kept_by_runtime = {lin for lin, keep, _ in ran if keep and lin}
        assert {lin.name for lin in kept_linears(layer)} == kept_by_runtime, layer.name
    if name == "moe-tiny":
        assert any(not lin for l in blocks for lin, _, _ in watch.seen[l.name])  # routed experts' matmuls counted
