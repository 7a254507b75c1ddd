"""Distributed worker for tests/test_batch_parallel.py: per-batch assignment against the fixed layout.

``python -m torch.distributed.run --nproc-per-node 4 tests/batch_worker.py OUT.json`` trains
gpt-tiny and llama-tiny for 3 SGD steps (fp32) on packed batches of one long document (a whole
row of 32 tokens) and many short ones (``DOC_LENGTHS``), first on the fixed layout (dp4, DDP),
then with per-batch assignment (codegen/runtime/batch_parallel.py) over the dp x cp pool, for
ring groups of the sizes the rule picks, ring groups of 3 (non-power-of-two) and of 4, and
Ulysses groups; and under a pipeline, pp2 x (dp x cp = 2) with ring groups (1f1b) and Ulysses
groups (gpipe), two micro-batches, every worker's row padded to ``CAPACITY`` tokens, against the
fixed pp2 x dp2 layout. Rank 0 writes per case the losses, the first step's gradient and loss errors
against its fixed layout, the first step's group placements and tokens held per micro-batch
and worker, and the padded row length (None without a pipeline). Then the multimodal cases of
tests/mm_worker.py (variable images per sample, dp4 and dp2) in the same launch.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from codegen.runtime.batch_parallel import PerBatch  # noqa: E402
from codegen.runtime.mesh import init_distributed  # noqa: E402
from codegen.runtime.train import parallelize  # noqa: E402
from planner.batch_assign import Pool, WorkCost  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402

from dist_worker import LR, NORM, STEPS, compare  # noqa: E402
from mm_worker import run_cases  # noqa: E402
from model_cases import GB, SEED, SEQ, case, planner_view, stages_for  # noqa: E402
from worker_io import failure, finish, report  # noqa: E402

# row 0 is one document; the others pack short ones, one running from row 2 into row 3
DOC_LENGTHS = [32, 3, 1, 5, 2, 7, 6, 4, 4, 2, 6, 9, 3, 1, 5, 8, 2, 4, 6, 3, 5, 2, 4, 1, 3]
assert sum(DOC_LENGTHS) == GB * SEQ
CAPACITY = 40  # tokens per worker: the 32-token document fits no worker whole next to its share
COST = dict(linear=1.0, attention=0.05, exchange=0.1, latency=0.5)
SCHEDULE = {"ring": "1f1b", "ulysses": "gpipe"}  # per-batch assignment's pipelines, one case each
FIXED = {"dp4": dict(dp=4, mbs=1, zero="ddp"),  # the fixed layouts the cases are compared with
         "pp2-dp2": dict(pp=2, dp=2, mbs=1, zero="ddp", schedule="1f1b")}
CASES = {  # name -> (model, pp, dp, cp, method, group sizes, fixed layout); pipelines: 1f1b (ring), gpipe (Ulysses)
    "ring": ("llama-tiny", 1, 2, 2, "ring", None, "dp4"),
    "ring-g3": ("llama-tiny", 1, 2, 2, "ring", (1, 3), "dp4"),
    "ring-cp4-g4": ("gpt-tiny", 1, 1, 4, "ring", (1, 4), "dp4"),
    "ulysses-g2": ("llama-tiny", 1, 2, 2, "ulysses", (1, 2), "dp4"),
    "ulysses-g4": ("gpt-tiny", 1, 2, 2, "ulysses", (1, 4), "dp4"),
    # pp2 x (dp x cp = 2): two micro-batches of 2 rows, each worker's row padded to CAPACITY
    "pp2-cp2-ring": ("llama-tiny", 2, 1, 2, "ring", None, "pp2-dp2"),
    "pp2-dp2-ulysses": ("gpt-tiny", 2, 2, 1, "ulysses", None, "pp2-dp2"),
}


def packed(c, n: int) -> list[dict]:
    cu = torch.cumsum(torch.tensor([0] + DOC_LENGTHS), 0)
    return [dict(b, cu_seqlens=cu) for b in c.batches(n)]


def train(model: str, cfg_kw: dict, data: list[dict], per_batch=None) -> tuple[list[float], dict, tuple]:
    c = case(model)
    pc = ParallelConfig(dtype="fp32", **cfg_kw).validate()
    _, layout, facts = planner_view(model)
    pm = parallelize(c.build(c.parallel_device), pc, stages_for(model, pc.pp), ["none"] * pc.pp, layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED, facts=facts,
                     per_batch=per_batch)
    losses, grads, sizes, held = [], None, [], []
    for s, b in enumerate(data):
        losses.append(pm.step(b))
        if s == 0:
            grads = pm.gradients_for_check()
            grads[NORM] = torch.tensor(pm.clip_grad_norm_(None), dtype=torch.float64)
            if pm.batch_planner is not None:
                sizes = [[p.length, p.size, p.first] for a in pm.batch_planner.assignments for p in a.placements
                         if p.size > 1]
                held = [list(a.tokens) for a in pm.batch_planner.assignments]  # per micro-batch, per worker
    pm.close()
    return losses, grads, (sizes, held, pm.batch_planner.row if pm.batch_planner else None)


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    torch.manual_seed(0)
    results: dict = {}
    fixed: dict = {}
    for name, (model, pp, dp, cp, method, sizes, ref) in CASES.items():
        try:
            data = packed(case(model), STEPS)
            if (model, ref) not in fixed:
                fixed[model, ref] = train(model, FIXED[ref], data)
            ref_losses, ref_grads, _ = fixed[model, ref]
            pool = Pool(dp * cp, dp * cp, CAPACITY, sizes=sizes)
            pb = PerBatch(pool, WorkCost(method=method, **COST))
            mbs = GB // dp if pp == 1 else GB // (2 * dp)  # under the pipeline: 2 micro-batches
            kw = dict(pp=pp, dp=dp, cp=cp, mbs=mbs, zero="ddp") | (dict(schedule=SCHEDULE[method]) if pp > 1 else {})
            losses, grads, (groups, held, row) = train(model, kw, data, pb)
            results[name] = {"losses": losses, "ref_losses": ref_losses, "groups": groups, "held": held, "row": row,
                             **compare(grads, ref_grads, losses, ref_losses)}
        except Exception as exc:
            results[name] = failure(exc)
        report(name, results[name])
    results.update(run_cases())  # multimodal batches (tests/mm_worker.py), in the same launch
    finish(results, out)


if __name__ == "__main__":
    main()
