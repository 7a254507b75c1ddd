"""The emitted programs' synthetic data: deterministic per step, and learnable."""
from __future__ import annotations

import math

import torch

from codegen.runtime.data import FOLLOW_P, entropy_floor, packed_documents, successor_table, synthetic
from codegen.runtime.documents import doc_starts
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


def test_packed_documents_fill_rows_with_whole_chains() -> None:
    """Rows of exactly seq_len tokens; cu_seqlens ends at every row's end; within a document the
    labels are its next tokens and each document starts its own chain."""
    lengths = [3, 5, 8]
    data = packed_documents(64, 3, 16, lengths, seed=1)
    b = data(0)
    assert b["input_ids"].shape == b["labels"].shape == (3, 16)
    cu = b["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 48 and all(r * 16 in cu for r in range(4))
    assert all(0 < n <= 8 for n in (b - a for a, b in zip(cu, cu[1:])))
    ids, labels = b["input_ids"].flatten(), b["labels"].flatten()
    starts = set(cu)
    inner = [i for i in range(47) if i + 1 not in starts]   # positions whose next token is in their document
    assert torch.equal(labels[inner], ids[[i + 1 for i in inner]])
    ds = doc_starts(b["cu_seqlens"], 3, 16)
    assert ds.max() < 16 and torch.equal(data(0)["input_ids"], b["input_ids"])
    assert not torch.equal(data(1)["input_ids"], b["input_ids"])
