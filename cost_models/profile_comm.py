"""The profiler's collectives and p2p (``cost_models.profiler``, items (b) and (c)), into a ProfileDB.

For each group size the mesh can have, all groups of that size at once (as all tp groups, or all
dp groups, do in training), every kind of :data:`KINDS` over the message sizes; then send/recv
between rank pairs, all pairs at once. Timing: batches of back-to-back calls of about 20 ms
(``profile_timing.timeit_rounds``), every (kind, size) of a group size one batch per round, in
``repeats`` interleaved rounds (sizes whose buffers exceed :data:`INTERLEAVE_BYTES` together in
sets of their own: :func:`size_sets`), the median per call, the slowest rank's. Interleaved, a
slow spell of the machine lands on one round of every message, not on the consecutive sizes
timed while it lasted. On the 2-core VM (2026-12-07), two ranks timing each (kind, size) in a
block of 3 batches read a 1 KiB all-gather at 0.15-0.67 ms and a 16 MiB reduce-scatter at
20.0-22.4 ms over four profiles (68.7 ms in one of four more with 9 batches each, 75.0 ms in an
``autopar profile`` run of the same hour); in interleaved rounds, 0.36-0.84 ms and 20.0-24.4 ms.

A larger message never costs less than a smaller one of the same kind (more bytes to move and
reduce, the same calls): each kind's medians are made non-decreasing in size
(:func:`non_decreasing`, the least-squares fit under that order), so one slow small message does
not price every size between it and the next measured one above the larger messages.
"""
from __future__ import annotations

import os

from cost_models.profile_timing import agree_min, slowest_rank, timeit_rounds

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# Buffers held per message byte while a set of sizes is timed: the kinds' inputs and outputs (the
# all-to-all's two, the all-reduce's one, the gather's and reduce-scatter's whole and shard).
BUFFERS_PER_BYTE = 6
INTERLEAVE_BYTES = 1 << 30  # per rank, the most the messages of one set of interleaved rounds hold


def non_decreasing(ys: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``ys`` (pool adjacent violators): each run of
    values that falls is replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(c)]


def groups_of(world: int, n: int) -> list[list[int]]:
    """Contiguous groups of n ranks (the inner-most mesh placement)."""
    return [list(range(i, i + n)) for i in range(0, world, n)]


def same_node(group: list[int]) -> bool:
    per = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return len({r // per for r in group}) == 1


def _call(kind: str, nbytes: int, n: int, group, device):
    """(one ``kind`` call over ``group`` of about ``nbytes`` per rank, the bytes it moves)."""
    import torch
    import torch.distributed as dist

    from codegen.runtime.torch_compat import all_gather_into, reduce_scatter_into

    elems = max(n, nbytes // 4 // n * n)
    x = torch.ones(elems, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x, group=group)), elems * 4
    if kind == "all_gather":
        inp = torch.ones(elems // n, device=device)
        return (lambda: all_gather_into(x, inp, group=group)), elems * 4
    if kind == "reduce_scatter":
        out = torch.empty(elems // n, device=device)
        return (lambda: reduce_scatter_into(out, x, group=group)), elems * 4
    out = torch.empty_like(x)
    return (lambda: dist.all_to_all_single(out, x, group=group)), elems * 4


def _sync(device):
    import torch

    return (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)


def size_sets(sizes, budget: int = INTERLEAVE_BYTES) -> list[list[int]]:
    """``sizes`` in ascending runs whose buffers (:data:`BUFFERS_PER_BYTE` x the message over the
    kinds) fit ``budget`` bytes together, timed as one set of interleaved rounds; a size over it
    alone (a GPU profile's GiB messages are not all held at once)."""
    sets: list[list[int]] = []
    held = 0
    for size in sorted(sizes):
        need = BUFFERS_PER_BYTE * size
        if not sets or held + need > budget:
            sets.append([])
            held = 0
        sets[-1].append(size)
        held += need
    return sets


def measure_collectives(db, world: int, rank: int, sizes, repeats: int, device, log=print) -> None:
    """Every kind over every group size and message size (module docstring) into ``db``."""
    import torch.distributed as dist

    for n in [d for d in range(2, world + 1) if world % d == 0]:
        groups = groups_of(world, n)
        mine = [dist.new_group(g) for g in groups][rank // n]
        got: dict[str, list[tuple[int, float]]] = {kind: [] for kind in KINDS}
        for part in size_sets(sizes):
            calls = [(kind, *_call(kind, s, n, mine, device)) for kind in KINDS for s in part]
            dist.barrier()
            times = slowest_rank(timeit_rounds([fn for _, fn, _ in calls], repeats, _sync(device), agree=agree_min,
                                               lockstep=dist.barrier))
            for (kind, _, nb), t in zip(calls, times):
                got[kind].append((nb, t))
            del calls
        link = "intra" if same_node(groups[0]) else "inter"
        for kind, pts in got.items():
            for (nb, _), t in zip(pts, non_decreasing([t for _, t in pts])):
                db.add_collective(kind, n, link, nb, t)
        log(f"collectives over groups of {n}: done")
    if world > 1:
        measure_p2p(db, world, rank, sizes, repeats, device)
    log("p2p: done")


def measure_p2p(db, world: int, rank: int, sizes, repeats: int, device) -> None:
    """Pairs (0,1), (2,3), ... exchange at once; one-way time = ping-pong / 2. With an odd world
    the last rank has no partner: it times nothing but joins every barrier and reduction."""
    import torch
    import torch.distributed as dist

    peer = rank ^ 1

    def pingpong(x):
        def run() -> None:
            if peer >= world:
                return
            if rank % 2 == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
        return run

    bufs = [torch.ones(max(1, nbytes // 4), device=device) for nbytes in sorted(sizes)]
    dist.barrier()
    times = slowest_rank(timeit_rounds([pingpong(x) for x in bufs], repeats, _sync(device), agree=agree_min,
                                       lockstep=dist.barrier))
    link = "intra" if same_node([0, 1]) else "inter"
    for x, t in zip(bufs, non_decreasing([t / 2 for t in times])):
        db.add_collective("send_recv", 2, link, x.numel() * 4, t)
