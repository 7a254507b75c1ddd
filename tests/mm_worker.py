"""Multimodal per-batch assignment against one process (gloo, fp32): the cases
tests/batch_worker.py runs in its launch (:func:`run_cases`), or alone::

    python -m torch.distributed.run --nproc-per-node 4 tests/mm_worker.py OUT.json

mllm-tiny trains ``STEPS`` SGD steps on batches of 8 samples with 0 to 6 images each (the
images bunched in the first samples: a fixed split gives one rank most of the vision work),
each sample's text ``TEXT`` tokens (some targets -100), through
codegen/runtime/multimodal.py: dp4 with the per-batch planner's assignment and with the fixed
split, and dp2 with assignment on two groups of two ranks (ranks 0-1 and 2-3, each its own
data-parallel group). Reference: the single-process model on the whole batch (padded, mean
token loss). Per case: the losses, the first step's gradient / norm / loss errors, each rank's
samples in the first step and the first batch's per-rank work before and after assignment.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from codegen.runtime.multimodal import MultimodalBatch, SampleBalancer, train_step  # noqa: E402
from planner import zoo  # noqa: E402
from planner.batch_assign import WorkCost  # noqa: E402

from dist_worker import LR, NORM, STEPS, compare  # noqa: E402
from model_cases import SEED  # noqa: E402
from worker_io import failure, finish, report  # noqa: E402

SAMPLES, TEXT = 8, 12
COUNTS = [[6, 3, 0, 1, 0, 0, 1, 0], [5, 4, 2, 0, 0, 1, 0, 0], [0, 6, 2, 2, 0, 0, 0, 1]]  # per step
COST = WorkCost(linear=1.0, attention=0.01, vision=30.0)
CAPACITY = 10_000
CASES = {"mm-dp4-assigned": (4, True), "mm-dp4-fixed": (4, False), "mm-dp2-assigned": (2, True)}


def mm_batch(step: int, cfg) -> dict:
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    counts = torch.tensor(COUNTS[step % len(COUNTS)])
    ids = torch.randint(0, cfg.vocab, (SAMPLES, TEXT + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[step % SAMPLES, -3:] = -100  # a few ignored targets
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels,
            "pixel_values": torch.randn(int(counts.sum()), cfg.channels, cfg.image_size, cfg.image_size, generator=g),
            "image_counts": counts}


def grads_of(model) -> dict:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    out[NORM] = torch.sqrt(sum(g.double().pow(2).sum() for g in out.values()))
    return out


def reference(cfg, batches) -> tuple[list[float], dict]:
    model = zoo.build_model(cfg, device="cpu", seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for s, b in enumerate(batches):
        opt.zero_grad()
        loss = model(b["input_ids"], b["pixel_values"], labels=b["labels"], image_counts=b["image_counts"])
        loss.backward()
        losses.append(float(loss))
        if s == 0:
            grads = grads_of(model)
        opt.step()
    return losses, grads


def train(cfg, batches, dp: int, assigned: bool) -> dict:
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(i, i + dp))) for i in range(0, dist.get_world_size(), dp)]
    group = groups[rank // dp]
    model = zoo.build_model(cfg, device="cpu", seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    bal = SampleBalancer(dp, rank % dp, COST, CAPACITY, cfg.num_patches, assign=assigned)
    losses, grads, mine, balance = [], {}, [], None
    for s, b in enumerate(batches):
        opt.zero_grad()
        losses.append(train_step(model, b, bal, group))
        if s == 0:
            grads = grads_of(model)
            mine = bal.samples(MultimodalBatch.of(b))
            balance = {"fixed": list(bal.last.fixed), "assigned": list(bal.last.assigned), "ideal": bal.last.ideal}
        opt.step()
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"losses": losses, "grads": grads, "samples": every, "balance": balance}


def run_cases() -> dict:
    """Every case (collective: all ranks call it); rank 0's results."""
    cfg = zoo.preset("mllm-tiny")
    batches = [mm_batch(s, cfg) for s in range(STEPS)]
    ref_losses, ref_grads = reference(cfg, batches)
    out: dict = {}
    for name, (dp, assigned) in CASES.items():
        try:
            r = train(cfg, batches, dp, assigned)
            out[name] = {"losses": r["losses"], "ref_losses": ref_losses, "samples": r["samples"],
                         "balance": r["balance"], **compare(r["grads"], ref_grads, r["losses"], ref_losses)}
        except Exception as exc:
            out[name] = failure(exc)
        report(name, out[name])
    return out


def main() -> None:
    from codegen.runtime.mesh import init_distributed
    init_distributed()
    finish(run_cases(), sys.argv[1])


if __name__ == "__main__":
    main()
