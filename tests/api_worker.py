"""Worker for tests/test_codegen.py: auto_parallelize under torchrun (or one plain process);
rank 0 writes the plan label, the losses and a save/load round trip as JSON."""
import json
import os
import sys

import torch
import torch.distributed as dist

import planner
from planner import zoo

cfg = zoo.preset("gpt-tiny")
model = zoo.build_model(cfg, device="cpu", seed=0)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, cfg.vocab, (4, 33), generator=g)
batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
world = int(os.environ.get("WORLD_SIZE", "1"))
par = planner.auto_parallelize(model, batch, cluster=f"local-cpu:{world}", spec="gpt-tiny",
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
losses = [par.step(batch) for _ in range(2)]
par.save(sys.argv[2])
after = par.step(batch)
assert par.load(sys.argv[2]) == 2
again = par.step(batch)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"label": par.plan.config.label(), "losses": losses, "after": after, "again": again,
                   "cluster_fp": par.plan.cluster["fingerprint"], "cores": sorted(os.sched_getaffinity(0))}, f)
par.close()  # the build's groups and the default group auto_parallelize created; the script ends normally
