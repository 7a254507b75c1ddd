"""Multimodal batches in one process: the MLLM's ``image_counts`` path (planner/zoo/mllm.py) and
the runtime's batch format and sample split (codegen/runtime/multimodal.py). The 4-rank gloo
parity of per-batch assignment is in tests/test_batch_parallel.py (tests/mm_worker.py)."""
from __future__ import annotations

import pytest
import torch

from codegen.runtime.multimodal import MultimodalBatch, SampleBalancer
from planner import zoo
from planner.batch_assign import WorkCost
from planner.errors import AutoparError

CFG = zoo.preset("mllm-tiny")


def batch(counts: list[int], text: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab, (len(counts), text + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone(), "image_counts": torch.tensor(counts),
            "pixel_values": torch.randn(sum(counts), CFG.channels, CFG.image_size, CFG.image_size, generator=g)}


@pytest.fixture(scope="module")
def model():
    return zoo.build_model(CFG, device="cpu", seed=0)


def test_one_image_each_matches_the_one_image_path(model) -> None:
    b = batch([1, 1, 1])
    with torch.no_grad():
        one = model(b["input_ids"], b["pixel_values"], labels=b["labels"])
        var = model(b["input_ids"], b["pixel_values"], labels=b["labels"], image_counts=b["image_counts"])
        logits = model(b["input_ids"], b["pixel_values"], image_counts=b["image_counts"])
    assert torch.allclose(one, var, rtol=1e-6)
    assert logits.shape == (3, CFG.num_patches + 6, CFG.vocab)


def test_padded_batch_equals_its_samples(model) -> None:
    """The batch's mean token loss = the samples' summed token losses over all targets: padding
    changes nothing, whatever the images per sample (0 included)."""
    b = MultimodalBatch.of(batch([3, 0, 1, 0], seed=1))
    b.labels[1, :2] = -100
    with torch.no_grad():
        whole = model(b.input_ids, b.pixel_values, labels=b.labels, image_counts=b.image_counts)
        parts = 0.0
        for i in range(b.samples):
            s = b.sample(i)
            n = int((s["labels"] != -100).sum())
            parts += float(model(s["input_ids"], s["pixel_values"], labels=s["labels"],
                                 image_counts=s["image_counts"])) * n
    assert float(whole) == pytest.approx(parts / b.target_count(), rel=1e-5)
    assert b.sample(2)["pixel_values"].shape[0] == 1 and b.sample(1)["pixel_values"].shape[0] == 0


def test_sample_split_covers_the_batch() -> None:
    b = MultimodalBatch.of(batch([6, 4, 0, 0, 1, 0, 0, 1]))
    cost = WorkCost(linear=1.0, attention=0.01, vision=30.0)
    for assign in (True, False):
        got = [SampleBalancer(4, r, cost, 10_000, CFG.num_patches, assign).samples(b) for r in range(4)]
        assert sorted(i for mine in got for i in mine) == list(range(8))
    fixed = SampleBalancer(4, 0, cost, 10_000, CFG.num_patches, assign=False)
    fixed.samples(b)
    moved = SampleBalancer(4, 0, cost, 10_000, CFG.num_patches)
    moved.samples(b)
    assert max(moved.last.assigned) < max(fixed.last.assigned) == max(fixed.last.fixed)


def test_bad_batches_one_line(model) -> None:
    b = batch([1, 2])
    with pytest.raises(ValueError, match="image_counts sum to 3 but pixel_values holds 2"):
        MultimodalBatch.of(dict(b, pixel_values=b["pixel_values"][:2]))
    with pytest.raises(ValueError, match="needs image_counts"):
        MultimodalBatch.of({k: v for k, v in b.items() if k != "image_counts"})
    with pytest.raises(AutoparError, match="give one count >= 0 per sample"):
        model(b["input_ids"], b["pixel_values"], image_counts=torch.tensor([1, 1]))
    with pytest.raises(AutoparError, match="labels are the text's targets"):
        model(b["input_ids"], b["pixel_values"], labels=b["labels"][:, :3], image_counts=b["image_counts"])
