"""Training data for emitted programs: a deterministic, learnable synthetic batch, or a user hook.

Every rank builds the same global batch for a step (``ParallelModel.step`` takes the
global batch and each rank cuts its dp / cp share), so the data depends only on the
seed and the step: a resumed run sees exactly the batches an uninterrupted one sees.
"""
from __future__ import annotations

import hashlib
import importlib
import math
import re
from typing import Callable, Mapping, Optional

import torch

# ``package.module:function``: the only form a model or data hook may name (nothing else is imported)
FUNC_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")

DataFn = Callable[[int], dict]


FOLLOW_P = 0.9  # chance that the next synthetic token is the current token's fixed successor


def successor_table(vocab: int, seed: int = 0) -> torch.Tensor:
    """The synthetic source's fixed successor of every token (a random permutation of the
    vocabulary, the same for every step and rank of a run)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed * 1_000_003 + 7919))


def entropy_floor(vocab: int) -> float:
    """Per-token entropy of the synthetic source in nats: the lowest mean loss a model can
    reach on it (uniform tokens would give ``ln(vocab)``)."""
    hit = FOLLOW_P + (1 - FOLLOW_P) / vocab
    miss = (1 - FOLLOW_P) / vocab
    return -(hit * math.log(hit) + (vocab - 1) * miss * math.log(miss))


def markov_tokens(succ: torch.Tensor, rows: int, length: int, g: torch.Generator) -> torch.Tensor:
    """``rows x length`` tokens of the first-order Markov source: a uniform first token, then
    each token is ``succ[previous]`` with probability ``FOLLOW_P``, else uniform.

    Vectorised over the sequence (this runs every training step): a token ``d`` positions after
    the last uniform draw ``r`` is ``succ`` applied ``d`` times to that draw, so the loop runs
    over the longest such chain (tens of steps at FOLLOW_P = 0.9), not over the sequence."""
    vocab = succ.numel()
    noise = torch.randint(0, vocab, (rows, length), generator=g)
    follow = torch.rand(rows, length, generator=g) < FOLLOW_P
    follow[:, 0] = False  # the first token is always a uniform draw
    pos = torch.arange(length).expand(rows, length)
    last_draw = torch.where(follow, torch.zeros_like(pos), pos).cummax(dim=1).values
    out = noise.gather(1, last_draw)
    steps = pos - last_draw
    for k in range(1, int(steps.max()) + 1):
        out = torch.where(steps >= k, succ[out], out)
    return out


def synthetic(vocab: int, global_batch: int, seq_len: int, seed: int = 0, *, mllm=None,
              model_shifts_labels: bool = False, images: Optional[Mapping[int, float]] = None) -> DataFn:
    """``step -> batch`` of learnable synthetic text (:func:`markov_tokens`: a model's loss falls
    from ``ln(vocab)`` toward :func:`entropy_floor` as it learns the successor table);
    ``labels`` are the next tokens (``input_ids`` itself when ``model_shifts_labels``: a
    transformers causal LM shifts them), images for the MLLM (``mllm``: its zoo config): one
    per sample, or with ``images`` ({images: weight}, the plan's images per sample) each
    sample's count drawn from those weights and the batch in the multimodal format
    (``image_counts``; codegen/runtime/multimodal.py). Each sample's text is ``seq_len`` less
    one image's tokens either way. Everything is drawn from (seed, step) alone."""
    succ = successor_table(vocab, seed)
    if images is not None and (mllm is None or not images or min(images.values()) < 0
                               or sum(images.values()) <= 0 or min(images) < 0):
        raise ValueError("images per sample need an image-text model and weights >= 0 (some > 0) per count >= 0")
    counts = torch.tensor(sorted(images), dtype=torch.int64) if images else None
    weights = torch.tensor([images[k] for k in sorted(images)], dtype=torch.float64) if images else None

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        text = seq_len - (mllm.num_patches if mllm is not None else 0)
        ids = markov_tokens(succ, global_batch, text + 1, g)
        if model_shifts_labels:
            out = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, :-1].contiguous()}
        else:
            out = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
        n = global_batch
        if counts is not None:  # each sample's image count from the plan's weights
            out["image_counts"] = counts[torch.multinomial(weights, global_batch, replacement=True, generator=g)]
            n = int(out["image_counts"].sum())
        if mllm is not None:
            out["pixel_values"] = torch.randn(n, mllm.channels, mllm.image_size, mllm.image_size, generator=g)
        return out

    return batch


def packed_documents(vocab: int, global_batch: int, seq_len: int, lengths: list[int], seed: int = 0,
                     model_shifts_labels: bool = False) -> DataFn:
    """``step -> batch`` of rows that pack whole documents of the synthetic source (each document
    its own Markov chain from a uniform first token) with their ``cu_seqlens``
    (codegen/runtime/documents.py). Document lengths are drawn from ``lengths`` (tokens,
    uniformly, seeded by the step); a row's last document is cut at the row's end. ``labels``
    are each document's next tokens (``input_ids`` when ``model_shifts_labels``)."""
    succ = successor_table(vocab, seed)

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        ids, labels, docs = [], [], []
        for _ in range(global_batch):
            row, used = [], 0
            while used < seq_len:
                n = min(lengths[int(torch.randint(len(lengths), (1,), generator=g))], seq_len - used)
                row.append(markov_tokens(succ, 1, n + 1, g)[0])
                docs.append(n)
                used += n
            ids.append(torch.cat([d[:-1] for d in row]))
            labels.append(torch.cat([d[1:] for d in row]))
        ids_t = torch.stack(ids)
        cu = torch.cumsum(torch.tensor([0] + docs), 0)
        return {"input_ids": ids_t, "labels": ids_t.clone() if model_shifts_labels else torch.stack(labels),
                "cu_seqlens": cu}

    return batch


def batch_digest(batch: dict) -> str:
    """16 hex digits naming a batch's tokens (``input_ids``, ``labels``, ``cu_seqlens`` and
    ``image_counts``): the program logs it per step, so two runs can be shown to have trained
    on the same data."""
    h = hashlib.blake2b(digest_size=8)
    for key in ("input_ids", "labels", "cu_seqlens", "image_counts"):
        if key in batch:
            h.update(key.encode() + batch[key].to(torch.int64).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def user_hook(spec: str, global_batch: int, seq_len: int) -> DataFn:
    """Import ``package.module:function`` (only when the user names it) and return
    ``step -> function(step, global_batch, seq_len)``."""
    if not FUNC_SPEC.match(spec):
        raise ValueError(f"--data {spec!r} is not package.module:function")
    mod, fn = spec.split(":")
    f = getattr(importlib.import_module(mod), fn)
    return lambda step: f(step, global_batch, seq_len)
