"""The CPU runtime's own per-call work, measured on a cluster's ranks (cost_models/cpu_runtime.py lists
the keys; ``cost_models.profiler`` and the first-run calibration's ``planner.entry.timed_runs`` call
:func:`measure_runtime`): the data-parallel wrappers per unit, the EP dispatch per MoE layer and
DTensor's dispatch per TP-sharded linear and sequence-parallel norm, into ``ProfileDB.runtime``; and
what an FSDP2 unit costs by its size (:func:`measure_fsdp_units`, the profile's ``FSDP_UNIT`` samples).

FSDP2 on gloo costs more than its collectives as the profiler times them back to back on buffers
it keeps: each call gathers into fresh buffers and copies out of them (and into them for the
reduce-scatter), and blocks of 64 MiB or more come from fresh pages every time
(``codegen.runtime.cpu_env.MALLOC_ENV``). Measured 2026-12-07 on the 2-core VM, 2 ranks, one
``nn.Linear`` unit of n MiB fp32 under the runtime's allocator settings, its forward and backward
with gradient sync over the unwrapped one: 1 / 4 / 16 / 28 / 64 / 147 MiB 8.3 / 12.6 / 49.9 / 112 /
329 / 915 ms, against two all-gathers and a reduce-scatter of the unit timed as the profiler times
them, plus the wrapper's fixed work: 8.6 / 13.2 / 45.5 / 77 / 204 / 512 ms. gpt-small's units
(28 MiB blocks, a 154 MB root holding the embedding) fall where the two part ways."""
from __future__ import annotations

from cost_models.profile_timing import agree_min, slowest_rank, timeit_paired


def _log(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[profile] {msg}", flush=True)


RUNTIME_UNITS = 8  # the wrapper measurement's stack of units (two 64 x 64 linears on [4, 16, 64] each)


def _unit_stack():
    import torch.nn as nn

    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(RUNTIME_UNITS)])


# rounds the paired figures below are timed in, whatever the profile's --repeats (unless a round takes
# so long that ``profile_timing``'s budget cuts them, to 3 at the least): the EP dispatch on
# 2 ranks of the 2-core VM read 0.06-4.1 ms in five profiles of 3 rounds, 2.2-3.2 ms in five of 9
# (its parts timed separately: 1.4-4.7 and 3.3-5.3 ms), 2026-12-07
RUNTIME_ROUNDS = 9


def _paired_extra(pairs, repeats: int) -> list[float]:
    """Per ``(base, more)`` pair, what ``more`` takes beyond ``base`` on this rank (median of paired
    rounds, ``profile_timing.timeit_paired``), every rank timing alike."""
    import torch.distributed as dist

    return [extra for _, extra in timeit_paired(pairs, max(repeats, RUNTIME_ROUNDS), lambda: None,
                                                 budget_s=4.0, agree=agree_min, lockstep=dist.barrier)]


def _wrapper_figures(mesh, repeats: int) -> dict[str, float]:
    """Per unit and micro-batch, forward + backward: the data-parallel wrappers' own work
    (cost_models/cpu_runtime.py), each paired with what it adds to: ``replicate`` (gradient sync
    off) over an unwrapped stack; ``fully_shard`` with sync off over the unwrapped stack and the
    units' all-gathers (two each) back to back; sync on over off and the units' reduce-scatters."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from codegen.runtime import torch_compat

    x, n = torch.randn(4, 16, 64), mesh.size()

    def fwd_bwd(wrap=None, grad_sync=True):
        m = _unit_stack()
        if wrap is not None:
            for unit in m:
                wrap(unit)
            wrap(m)
            m.set_requires_gradient_sync(grad_sync)
        return lambda: m(x).sum().backward()

    plain, rep = fwd_bwd(), fwd_bwd(lambda u: torch_compat.replicate()(u, mesh=mesh), grad_sync=False)
    off, on = (fwd_bwd(lambda u: fully_shard(u, mesh=mesh), grad_sync=g) for g in (False, True))
    numel = sum(p.numel() for p in _unit_stack()[0].parameters()) // n * n
    flat, shard = torch.ones(numel), torch.ones(numel // n)

    def gathered() -> None:
        plain()
        for _ in range(2 * RUNTIME_UNITS):
            torch_compat.all_gather_into(flat, shard, None)

    def reduced() -> None:
        off()
        for _ in range(RUNTIME_UNITS):
            torch_compat.reduce_scatter_into(shard, flat, None)

    units = RUNTIME_UNITS + 1  # the stack's root is a unit too (it holds no parameters: no collective)
    extra = _paired_extra([(plain, rep), (gathered, off), (reduced, on)], repeats)
    return dict(zip(("replicate_unit_s", "fsdp_unit_s", "fsdp_reduce_unit_s"), (e / units for e in extra)))


def _ep_figure(world: int, repeats: int) -> float:
    """One MoE layer's TokenDispatch forward + backward over every rank (2 experts per rank, 8 rows of
    64 per expert from each), paired with the local GEMMs followed by its four row all-to-alls and
    one count all-to-all back to back."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from codegen.runtime.expert_parallel import TokenDispatch

    experts = 2 * world
    split, rows, mine = [8] * experts, torch.randn(8 * experts, 64, requires_grad=True), torch.randn(8 * experts, 64)

    class Routed(nn.Module):
        expert_weights = ("w",)

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 64, 64) * 0.1)

        def run_local(self, x, sizes, weights):
            return torch.cat([c @ weights[0][e] for e, c in enumerate(torch.split(x, sizes))])

    routed, disp = Routed(), TokenDispatch(dist.group.WORLD, world, experts)
    out, counts = torch.empty_like(mine), torch.tensor(split)

    def local() -> None:
        routed.run_local(mine.requires_grad_(), [4 * experts] * 2, [routed.w]).sum().backward()
        for _ in range(4):
            dist.all_to_all_single(out, mine.detach())
        dist.all_to_all_single(torch.empty_like(counts), counts)

    return _paired_extra([(local, lambda: disp(routed, rows, split).sum().backward())], repeats)[0]


DTENSOR_PAIRS = 16  # the DTensor measurement's column + row linear pairs (64 features, 16 tokens)
DTENSOR_NORMS = 16  # and its sequence-parallel norms (64 features, [2, 16, 64] shards)


def _dtensor_figures(world: int, repeats: int) -> dict[str, float]:
    """Per TP-sharded module and micro-batch, forward + backward, on tp groups of 2 (every group at
    once), what DTensor adds (cost_models/dtensor_dispatch.py), in one set of paired rounds
    (:func:`_paired_extra`):

    - ``dtensor_module_s``, per linear: beyond the arithmetic and its all-reduces timed back to back
      (its dispatch, and its blocking all-reduces' extra between compute). A stack of
      ``DTENSOR_PAIRS`` column + row linear pairs under torch's ``ColwiseParallel`` /
      ``RowwiseParallel`` against the same pairs as plain local shards followed by the pairs'
      all-reduces (the forward's row output, the backward's column input gradient) back to back
      (timed in separate batches, the all-reduces' and the stacks' slow spells did not cancel:
      0.7-1.7 ms per module in five tries against 0.9-1.3 ms paired, 2 ranks on the 2-core VM,
      2026-12-07);
    - ``dtensor_norm_s``, per sequence-parallel norm: ``DTENSOR_NORMS`` RMSNorms under
      ``SequenceParallel``, each handed the local shard and its output taken back to local (as a
      block's residual stream reaches them), against the same norms plain on the shard."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    group, width, modules = mesh.get_group(), 64, 2 * DTENSOR_PAIRS
    # the input needs its gradient, as a block's does in training: every column linear all-reduces one
    x, reduced = torch.randn(16, width, requires_grad=True), torch.randn(16, width)
    shard = torch.randn(2, 16, width, requires_grad=True)

    def stack(split: int) -> nn.Sequential:
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width // split), nn.Linear(width // split, width))
                               for _ in range(DTENSOR_PAIRS)])

    local, sharded = stack(2), stack(1)
    for pair in sharded:
        parallelize_module(pair, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    plain_norms = [nn.RMSNorm(width) for _ in range(DTENSOR_NORMS)]
    sp_norms = [parallelize_module(nn.RMSNorm(width), mesh, SequenceParallel()) for _ in range(DTENSOR_NORMS)]

    def run_local() -> None:
        local(x).sum().backward()
        for _ in range(modules):
            dist.all_reduce(reduced, group=group)

    def norms(stack_, sp: bool):
        def run() -> None:
            y = shard
            for norm in stack_:
                y = norm(y).to_local() if sp else norm(y)
            y.sum().backward()
        return run

    linear, norm = _paired_extra([(run_local, lambda: sharded(x).sum().backward()),
                                  (norms(plain_norms, False), norms(sp_norms, True))], repeats)
    return {"dtensor_module_s": linear / modules, "dtensor_norm_s": norm / DTENSOR_NORMS}


# always timed too: where FSDP2's cost has parted from its collectives' (module docstring)
FSDP_UNIT_LARGEST = 64 << 20


def measure_fsdp_units(db, world: int, sizes, repeats: int) -> None:
    """Per group size (every group of it at once, as the dp groups run) and unit size (bytes of
    fp32 parameters: those of ``sizes`` of 64 KiB and more, and :data:`FSDP_UNIT_LARGEST`, above
    which the price extrapolates linearly): one FSDP2 unit (a square ``nn.Linear`` under an
    unwrapped root, so that it reshards after the forward as the runtime's block units do) against
    the same module unwrapped, forward and backward on 8 tokens with gradient sync, the median
    difference of interleaved rounds (``profile_timing.timeit_paired``), the slowest rank's, into
    ``db`` as ``FSDP_UNIT`` samples. Nothing where no size reaches 64 KiB (a profile of the
    collectives' latency only, as the fidelity benchmark takes for its later models)."""
    sizes = sorted(s for s in sizes if s >= 1 << 16)
    if not sizes:
        return
    sizes = sorted(set(sizes) | {FSDP_UNIT_LARGEST})
    import math

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cost_models.profile_comm import groups_of, same_node
    from cost_models.profile_db import FSDP_UNIT, collective_key

    for n in [d for d in range(2, world + 1) if world % d == 0]:
        mesh = init_device_mesh("cpu", (world // n, n), mesh_dim_names=("across", "dp"))["dp"]
        pairs, dims = [], [max(8, int(math.sqrt(nb / 4))) for nb in sizes]
        for d in dims:
            x, plain, unit = torch.randn(1, 8, d), nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
            wrapped = nn.Sequential(unit)
            fully_shard(unit, mesh=mesh)
            fully_shard(wrapped, mesh=mesh)
            pairs.append(((lambda m=plain, x=x: m(x).sum().backward()),
                          (lambda m=wrapped, x=x: m(x).sum().backward())))
        extra = slowest_rank(more for _, more in timeit_paired(pairs, repeats, lambda: None, agree=agree_min,
                                                               lockstep=dist.barrier))
        link = "intra" if same_node(groups_of(world, n)[0]) else "inter"
        for d, t in zip(dims, extra):
            db.add_collective(FSDP_UNIT, n, link, d * d * 4, t)
        del pairs
        got = db.collectives[collective_key(FSDP_UNIT, n, link)]
        _log(f"fsdp units over groups of {n}: " + ", ".join(f"{s.nbytes / 2**20:.3g} MiB {s.seconds * 1e3:.3g} ms"
                                                            for s in got))


def measure_runtime(db, world: int, repeats: int, sizes=()) -> None:
    """The CPU runtime's own per-call work (cost_models/cpu_runtime.py) on this cluster's ranks,
    the slowest rank's, into ``db.runtime`` (at least 0), and FSDP2 units of the profile's message
    ``sizes`` (:func:`measure_fsdp_units`); nothing on GPUs or one rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if world < 2 or dist.get_backend() != "gloo":
        return
    figs = _wrapper_figures(init_device_mesh("cpu", (world,)), repeats)
    figs["ep_dispatch_s"] = _ep_figure(world, repeats)
    if world % 2 == 0:
        figs.update(_dtensor_figures(world, repeats))
    db.runtime = {k: max(0.0, v) for k, v in zip(sorted(figs), slowest_rank(figs[k] for k in sorted(figs)))}
    _log("runtime work: " + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in db.runtime.items()))
    measure_fsdp_units(db, world, sizes, repeats)
