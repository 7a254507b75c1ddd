"""One rank of the two-"region" rig (benchmarks/wan_rig.py): 4 gloo ranks, ranks 0-1 in one network
namespace, 2-3 in the other, the veth between them rate-limited. Modes (``MODE`` argument):

- ``pp``: a 2-stage pipeline across the cut (stage 0 on ranks 0-1, stage 1 on 2-3; dp = 2 inside
  each namespace), ``M`` micro-batches one after another: each sends its activation across and
  gets its gradient back;
- ``sync``: synchronous DP over all 4 ranks as autopar's runtime runs it across cluster groups
  (codegen/runtime/data_parallel.py ``apply_dp``: DDP's reducer over a 2-D mesh with the
  hierarchical hook: each bucket reduce-scattered inside a namespace, its half all-reduced
  across the cut, gathered back);
- ``flat``: plain DP over all 4 ranks, one flat all-reduce per parameter across the cut (the
  runtime's way before it ran DP hierarchically);
- ``lowH``: low-communication DP (codegen/runtime/outer_loop.py): DP inside each namespace,
  pseudo-gradients in bf16 across every H steps.

Prints one JSON line on rank 0: per-step seconds (median after warm-up), losses, parameters.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from codegen.runtime.outer_loop import OuterConfig, OuterLoop

WIDTH, DEPTH, ROWS, M, WARMUP = 512, 4, 256, 4, 2


def steps_of(mode: str) -> int:
    """Warm-up plus a whole number of outer periods (low-communication DP: 2 exchanges measured)."""
    return WARMUP + (2 * int(mode[3:]) if mode.startswith("low") else 10)


def mlp(depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(ROWS, WIDTH, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def allreduce_grads(model: nn.Module, group, n: int) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= n


def hierarchical(model: nn.Module) -> nn.Module:
    """``model`` wrapped for DP over the 4 ranks as the runtime wraps a stage whose dp group
    spans the 2 namespaces (``recipe.apply_dp`` with the plan's ``dp_spans=2``)."""
    from codegen.runtime import data_parallel as dpar
    from codegen.runtime.mesh import hybrid_dp_mesh
    from planner.plan import ParallelConfig
    from planner.sharding import dp_replicas, dp_wrapper

    cfg = ParallelConfig(dp=4, zero="ddp", dtype="fp32")
    wrapper = dp_wrapper(cfg.zero, cfg.pp, cfg.tp, cfg.dp, cfg.dtype)
    model.units = []  # a stage module without repeated blocks
    dpar.apply_dp([model], hybrid_dp_mesh(cfg, dp_replicas(wrapper, cfg.dp, 2)), wrapper, [])
    return model


def run_dp(outer_every: int, groups, steps: int, runtime: bool = False) -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    model = hierarchical(mlp(DEPTH)) if runtime else mlp(DEPTH)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inner, outer = groups
    loop = OuterLoop(list(model.parameters()), outer, OuterConfig(every=outer_every, dtype="bf16")) \
        if outer_every else None
    times, losses = [], []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = data(step, rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not runtime:  # the runtime's reducer has averaged them during backward
            allreduce_grads(model, inner if loop else None, 2 if loop else 4)
        opt.step()
        if loop:
            loop.after_step(step)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return times, losses


def run_pp(groups, steps: int) -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    stage, peer = (0, rank + 2) if rank < 2 else (1, rank - 2)
    model = mlp(DEPTH // 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    inner, _ = groups
    times, losses = [], []
    mb = ROWS // M
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        x, y = data(step, rank % 2)
        opt.zero_grad()
        total = 0.0
        for k in range(M):
            rows = slice(k * mb, (k + 1) * mb)
            if stage == 0:
                out = model(x[rows])
                dist.send(out.detach().contiguous(), peer)
                grad = torch.empty_like(out)
                dist.recv(grad, peer)
                out.backward(grad)
            else:
                inp = torch.empty(mb, WIDTH)
                dist.recv(inp, peer)
                inp.requires_grad_(True)
                loss = nn.functional.mse_loss(model(inp), y[rows]) / M
                loss.backward()
                dist.send(inp.grad.contiguous(), peer)
                total += loss.item()
        allreduce_grads(model, inner, 2)
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        mean = torch.tensor(total)
        dist.all_reduce(mean)  # the last stage's two dp ranks hold the loss
        losses.append(mean.item() / 2)
    return times, losses


def main() -> None:
    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inners = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    outers = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (inners[rank // 2], outers[rank % 2])
    if mode == "pp":
        times, losses = run_pp(groups, steps_of(mode))
    else:
        times, losses = run_dp(int(mode[3:]) if mode.startswith("low") else 0, groups, steps_of(mode),
                               runtime=mode == "sync")
    if rank == 0:
        steady = times[WARMUP:]
        print("RESULT " + json.dumps({"mode": mode, "step_s": statistics.median(steady), "mean_s": statistics.mean(steady),
                                      "times": times, "losses": losses}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
