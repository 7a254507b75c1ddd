"""Worker for tests/test_outer_loop.py: low-communication DP on 4 gloo ranks = 2 groups ("regions")
of 2 ranks. Inside a group the ranks all-reduce gradients every step (plain DP); across groups
only codegen.runtime.outer_loop.OuterLoop exchanges pseudo-gradients, every H steps, between
the ranks at the same place in each group. One launch runs every case of ``CASES``.

    torchrun --nproc-per-node 4 tests/outer_worker.py OUT.json
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from codegen.runtime.outer_loop import OuterConfig, OuterLoop

GROUP, STEPS, SHARD = 2, 12, 8
CASES = {"H4-bf16": OuterConfig(every=4, dtype="bf16"), "H4-int8-F2": OuterConfig(every=4, dtype="int8", fragments=2),
         "H3-fp32": OuterConfig(every=3, dtype="fp32")}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def shard(step: int, group: int, member: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows rank ``member`` of ``group`` trains on at ``step`` (groups see different data)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * group + member)
    x = torch.randn(SHARD, 16, generator=g)
    return x, torch.sin(x[:, :4] * (1 + group))


def inner_opt(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def run(cfg: OuterConfig, inner: dist.ProcessGroup, outer: dist.ProcessGroup) -> dict:
    rank = dist.get_rank()
    group, member = divmod(rank, GROUP)
    m = model()
    opt = inner_opt(m)
    loop = OuterLoop(list(m.parameters()), outer, cfg)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = shard(step, group, member)
        opt.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        for p in m.parameters():
            dist.all_reduce(p.grad, group=inner)
            p.grad /= GROUP
        opt.step()
        loop.after_step(step)
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=inner)
        losses.append(mean.item() / GROUP)
    params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return {"losses": losses, "bytes_sent": loop.bytes_sent, "exchanges": loop.exchanges,
            "numel": params.numel(), "params": params.tolist(),
            "spread": max((t - gathered[0]).abs().max().item() for t in gathered)}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inners = [dist.new_group(list(range(g * GROUP, (g + 1) * GROUP))) for g in range(world // GROUP)]
    outers = [dist.new_group(list(range(i, world, GROUP))) for i in range(GROUP)]
    inner, outer = inners[rank // GROUP], outers[rank % GROUP]
    results = {}
    for name, cfg in CASES.items():
        r = run(cfg, inner, outer)
        results[name] = {"rank0": r, "group1": None}
        # each group's loss curve (rank 0 and rank 2 hold them)
        curve = torch.tensor(r["losses"])
        curves = [torch.empty_like(curve) for _ in range(world)]
        dist.all_gather(curves, curve)
        results[name]["group_losses"] = [curves[g * GROUP].tolist() for g in range(world // GROUP)]
    if rank == 0:
        import json
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
