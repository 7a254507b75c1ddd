"""The emitted programs' synthetic data: deterministic per step, and learnable."""
from __future__ import annotations

import math

import torch

from codegen.runtime.data import FOLLOW_P, entropy_floor, successor_table, synthetic
from planner import zoo


def test_batches_depend_only_on_seed_and_step() -> None:
    a, b = synthetic(256, 4, 32, seed=1), synthetic(256, 4, 32, seed=1)
    assert torch.equal(a(3)["input_ids"], b(3)["input_ids"])
    assert not torch.equal(a(3)["input_ids"], a(4)["input_ids"])
    x = a(0)
    assert torch.equal(x["labels"][:, :-1], x["input_ids"][:, 1:])  # next-token targets
    hf = synthetic(256, 4, 32, seed=1, model_shifts_labels=True)(3)
    assert torch.equal(hf["labels"], hf["input_ids"])  # a transformers model shifts them itself


def test_tokens_follow_the_successor_table() -> None:
    ids = synthetic(512, 64, 128, seed=0)(0)["input_ids"]
    succ = successor_table(512, seed=0)
    hit = (succ[ids[:, :-1]] == ids[:, 1:]).float().mean().item()
    expected = FOLLOW_P + (1 - FOLLOW_P) / 512
    assert abs(hit - expected) < 0.01, hit
    assert 0 < entropy_floor(512) < 0.5 * math.log(512)


def test_a_small_model_learns_it_within_a_few_steps() -> None:
    cfg = zoo.PRESETS["gpt-tiny"]
    model = zoo.build_model(cfg, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = synthetic(cfg.vocab, 8, 32, seed=0)
    losses = []
    for step in range(25):
        b = data(step)
        loss = model(b["input_ids"], labels=b["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > math.log(cfg.vocab) - 0.3  # starts near uniform guessing
    assert losses[-1] < losses[0] - 1.0, losses  # uniform random tokens could not fall below ln(vocab)
