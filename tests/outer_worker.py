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
    params = torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # (rank 0's)
    gathered = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    return {"losses": losses, "bytes_sent": loop.bytes_sent, "exchanges": loop.exchanges,
            "numel": params.numel(), "params": params.tolist(),
            "spread": max((t - gathered[0]).abs().max().item() for t in gathered)}


PLAN_STEPS = 4
PLAN_CASES = {"sync-dp4": "", "low-2x1-fp32-plain": "2x1:fp32:1:0", "low-2x2-bf16": "2x2:bf16"}
# synchronous DP across 2 "regions" (dp_spans=2: hierarchical) and its flat twin, per DP sharding
HIER_CASES = {"hier-ddp": ("ddp", 2), "hier-fsdp": ("fsdp", 2), "flat-fsdp": ("fsdp", 1)}
CLIP = {"ddp": None, "fsdp": 0.5}  # fsdp: the gradient norm over the 2-d mesh's shards clips every step


def hier_of(pm) -> str:
    """How the build reduces gradients across the ranks: ``hsdp`` (fully_shard over a 2-D mesh),
    ``hook`` (DDP's reducer with a communication hook), ``flat`` otherwise."""
    from torch.distributed.tensor import DTensor

    p = next(p for _, p in pm.named_parameters())
    if isinstance(p, DTensor):
        return "hsdp" if p.device_mesh.ndim == 2 else "flat"
    from codegen.runtime.torch_compat import replicate_comm_hooked

    return "hook" if replicate_comm_hooked(pm.stage_modules[0]) else "flat"


def plan_run(low_comm: str, zero: str = "ddp", dp_spans: int = 1) -> dict:
    """The zoo's tiny llama on dp=4 through ``parallelize`` (the emitted program's runtime) with
    ``ParallelConfig.low_comm`` (``zero``, and DP across ``dp_spans`` cluster groups): per-step
    global losses, the spread of the parameters over the ranks after each step (0 when the
    groups agree), the whole parameters after the last step, and how gradients were reduced."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from model_cases import GB, SEED, SEQ, case, planner_view, stages_for  # noqa: E402
    from codegen.runtime.torch_compat import local_tensor
    from codegen.runtime.train import parallelize
    from planner.plan import ParallelConfig

    c = case("llama-tiny")
    pc = ParallelConfig(dp=4, dtype="fp32", zero=zero, low_comm=low_comm).validate()
    _, layout, facts = planner_view("llama-tiny")
    pm = parallelize(c.build(c.parallel_device), pc, stages_for("llama-tiny", 1), ["none"], layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.5), seed=SEED, facts=facts,
                     dp_spans=dp_spans)
    losses, spread = [], []
    for s in range(PLAN_STEPS):
        g = torch.Generator().manual_seed(100 + s)
        batch = {"input_ids": torch.randint(0, 128, (GB, SEQ), generator=g),
                 "labels": torch.randint(0, 128, (GB, SEQ), generator=g)}
        losses.append(pm.step(batch, max_norm=CLIP[zero]))
        flat = torch.cat([local_tensor(p).detach().reshape(-1) for _, p in pm.named_parameters()])
        if zero == "fsdp":  # sharded: the whole parameters, the same on every rank
            flat = torch.cat([p.full_tensor().detach().reshape(-1) for _, p in pm.named_parameters()])
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        spread.append(max((t - every[0]).abs().max().item() for t in every))
    sent = pm.outer.bytes_sent if pm.outer is not None else 0
    how = hier_of(pm)
    first = next(p for _, p in pm.named_parameters())
    mesh = list(first.device_mesh.shape) if hasattr(first, "device_mesh") else []
    local = sum(local_tensor(p).numel() for _, p in pm.named_parameters())
    pm.close()
    return {"losses": losses, "spread": spread, "bytes_sent": sent, "params": flat.tolist(), "how": how,
            "mesh": mesh, "local_share": local / flat.numel()}


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
    for name, low in PLAN_CASES.items():
        results[name] = plan_run(low)
    for name, (zero, spans) in HIER_CASES.items():
        results[name] = plan_run("", zero, spans)
    if rank == 0:
        import json
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
