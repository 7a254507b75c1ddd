"""Test-only data hooks for tests/test_export.py (``--data tests.export_data:hf_batches``).

Random token rows (ids below 128, the smallest vocabulary the tests train), seeded by the
step, so the test can rebuild the batch of any step: ``hf_batches`` gives ``labels`` =
``input_ids`` (a transformers model shifts them), ``zoo_batches`` the next tokens.
"""
import torch

VOCAB = 128


def _rows(step: int, global_batch: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + step)
    return torch.randint(0, VOCAB, (global_batch, seq_len + 1), generator=g)


def hf_batches(step: int, global_batch: int, seq_len: int) -> dict:
    ids = _rows(step, global_batch, seq_len)[:, :-1].contiguous()
    return {"input_ids": ids, "labels": ids.clone()}


def zoo_batches(step: int, global_batch: int, seq_len: int) -> dict:
    ids = _rows(step, global_batch, seq_len)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
