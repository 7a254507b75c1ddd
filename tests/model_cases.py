"""The models the runtime parity tests train, each through its own adapter.

- ``gpt-tiny``, ``llama-tiny``: the zoo (built on meta, materialised by the runtime);
  ``gpt-tiny-tied``: gpt-tiny with its head tied to the token embedding;
- ``hf-llama``: a transformers ``LlamaForCausalLM`` (grouped-query attention, RoPE, untied);
- ``hf-gpt2``: a transformers ``GPT2LMHeadModel`` (tied embedding, learned positions,
  ``Conv1D`` linears with a packed q/k/v projection);
- ``hf-mixtral``: a transformers ``MixtralForCausalLM`` (8 experts, top-2; its reference runs
  the library's own experts loop, the parallel run autopar's through ``ExpertsInterface``);
- ``user-lm``: ``tests/user_models.UserLM``, a plain module in another style whose loss is
  computed outside the model.

A case builds the model for a parallel run (meta where the adapter can materialise it,
else the same seeded weights on every rank), runs the single-process reference (the
unmodified model, its own loss, SGD), and gives the planner's view of it: the TP layout
and facts of ``planner.frontend.load.graph_of`` and an even stage split over the stage groups.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SEED = 1234
GB, SEQ, VOCAB = 4, 32, 128


def hf_config(kind: str):
    from transformers import GPT2Config, LlamaConfig, MixtralConfig
    if kind == "hf-mixtral":  # 8 experts, top-2, through transformers' ExpertsInterface
        return MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=8, num_experts_per_tok=2,
                             max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "hf-llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                           tie_word_embeddings=False)
    return GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=64, tie_word_embeddings=True,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def build_hf(kind: str, device: str) -> nn.Module:
    """A transformers model on ``meta``, or on ``device`` with the adapter's seeded init (the
    numbers a meta-built model's stages get)."""
    from transformers import AutoModelForCausalLM

    from codegen.runtime.adapters import adapter_for
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(kind))
    if device != "meta":
        ad = adapter_for(model)
        ad.materialize(ad.units, torch.device(device), SEED)
        ad.close()  # the reference runs the library's own attention and experts loop
    return model


def build_user(device: str) -> nn.Module:
    from user_models import UserLM
    torch.manual_seed(SEED)
    return UserLM(vocab=VOCAB).to(device)


@dataclass
class Case:
    name: str
    kind: str                                   # zoo | hf | module
    build: Callable[[str], nn.Module]           # device -> model ("meta": the runtime materialises it)
    parallel_device: str                        # what the parallel run builds on
    vocab: int

    def batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        out = []
        for s in range(n):
            g = torch.Generator().manual_seed(100 + s)
            ids = torch.randint(0, self.vocab, (GB, SEQ), generator=g)
            labels = ids if self.kind == "hf" else torch.randint(0, self.vocab, (GB, SEQ), generator=g)
            out.append({"input_ids": ids, "labels": labels})
        return out

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The unmodified model's own training loss."""
        if self.kind == "zoo":
            return model(batch["input_ids"], labels=batch["labels"])
        if self.kind == "hf":
            return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        from user_models import user_loss
        return user_loss(model(batch["input_ids"]), batch["labels"])

    def reference(self, data: list[dict], lr: float) -> tuple[list[float], dict]:
        from codegen.runtime.experts import balance_experts, moe_layers

        model = self.build("cpu")
        moe = moe_layers([model])  # MoE: the balancing bias moves after each step, as the runtime's
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses, grads = [], None
        for s, b in enumerate(data):
            opt.zero_grad()
            loss = self.loss(model, b)
            loss.backward()
            if s == 0:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            balance_experts(moe, first_step=s == 0)
            losses.append(loss.item())
        return losses, grads


def zoo_config(name: str):
    """The zoo config of case ``name``: a preset, ``gpt-tiny-tied`` (gpt-tiny whose head
    shares the token embedding's weight) or ``gpt-tiny-h8`` (gpt-tiny with 8 heads)."""
    from planner import zoo
    if name == "moe-tiny-skewed":
        return zoo.preset("moe-tiny")
    if name == "gpt-tiny-tied":
        return zoo.preset("gpt-tiny").replace(name=name, tie_embeddings=True)
    if name == "gpt-tiny-h8":
        return zoo.preset("gpt-tiny").replace(name=name, heads=8, kv_heads=8)
    return zoo.preset(name)


def _zoo(name: str) -> Case:
    from planner import zoo
    cfg = zoo_config(name)
    return Case(name, "zoo", lambda dev: zoo.build_model(cfg, device=dev, seed=SEED), "meta", cfg.vocab)


def _moe_skewed() -> Case:
    """moe-tiny whose balancing bias starts skewed: experts 6 and 7 never get a token, 0 and 1
    get more than the others (uneven all-to-all splits, experts with empty rows). Built on the
    CPU with its weights (a meta build's initialisation would zero the bias)."""
    from planner import zoo
    cfg = zoo.preset("moe-tiny")

    def build(dev: str) -> nn.Module:
        model = zoo.build_model(cfg, device="cpu", seed=SEED)
        for m in model.moe_layers():
            m.expert_bias.copy_(torch.tensor([0.02, 0.01, 0.0, 0.0, 0.0, 0.0, -10.0, -10.0]))
        return model.to(dev)
    return Case("moe-tiny-skewed", "zoo", build, "cpu", cfg.vocab)


CASES = {
    "moe-tiny-skewed": _moe_skewed,
    "gpt-tiny": lambda: _zoo("gpt-tiny"),
    "llama-tiny": lambda: _zoo("llama-tiny"),
    "hf-llama": lambda: Case("hf-llama", "hf", functools.partial(build_hf, "hf-llama"), "meta", VOCAB),
    "hf-gpt2": lambda: Case("hf-gpt2", "hf", functools.partial(build_hf, "hf-gpt2"), "meta", VOCAB),
    "hf-mixtral": lambda: Case("hf-mixtral", "hf", functools.partial(build_hf, "hf-mixtral"), "meta", VOCAB),
    "user-lm": lambda: Case("user-lm", "module", build_user, "cpu", VOCAB),
}


def case(name: str) -> Case:
    """The case ``name``; any other zoo preset is a zoo case."""
    return CASES[name]() if name in CASES else _zoo(name)


def refusals(cfg, facts, documents: bool = False) -> list[str]:
    """What the runtime refuses of ``cfg`` for a case: ``planner.feasibility.problems`` on the
    cases' batch (``GB`` rows of ``SEQ`` tokens, packed documents with ``documents``) and one
    node of ``cfg``'s world."""
    from planner.feasibility import Batch, Nodes, problems

    return problems(cfg, facts, Batch(GB, SEQ, documents=documents), Nodes("local", 1, cfg.world))


def fitting_problems(cfg, facts) -> list[str]:
    """``planner.feasibility.problems`` of ``cfg`` on a batch and a cluster that fit its
    degrees (one micro-batch per pipeline stage and replica, one node): the model's rules."""
    from planner.feasibility import Batch, Nodes, problems

    return problems(cfg, facts, Batch(cfg.dp * cfg.mbs * cfg.pp, facts.seq_len), Nodes("local", 1, cfg.world))


@functools.cache
def planner_view(name: str):
    """(graph, TP layout, facts) the planner derives for case ``name`` (frontend.graph_of)."""
    from planner.frontend.load import example_for_module, graph_of
    from planner.search.candidates import facts_of
    from planner.frontend.tp_layout import tp_layout

    c = case(name)
    model = c.build("meta") if c.parallel_device == "meta" else c.build("cpu")
    if c.kind == "zoo":
        from planner import zoo
        cfg = zoo_config(name)
        ex = zoo.example_batch(cfg, 1, SEQ, device="meta")
        g = graph_of(model, ex, name=name, seq_len=SEQ, hidden=cfg.hidden, vocab=cfg.vocab)
    elif c.kind == "hf":
        g = graph_of(model, example_for_module(model, 1, SEQ), name=name, seq_len=SEQ)
    else:
        g = graph_of(model, (torch.zeros(1, SEQ, dtype=torch.long),), name=name, seq_len=SEQ,
                     loss_fn=lambda out: out.float().sum())
    return g, tp_layout(g), facts_of(g)


def stages_for(name: str, n: int) -> list[list[str]]:
    """``n`` virtual stages of case ``name``: the planner's even split over its stage groups."""
    from planner.search.stage_split import even_split
    g, _, _ = planner_view(name)
    part = even_split(g, n)
    names = [l.name for l in g.layers]
    return [names[a:b] for a, b in part.bounds]
