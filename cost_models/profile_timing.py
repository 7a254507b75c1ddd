"""The profiler's timing helpers (cost_models/profiler.py, cost_models/profile_runtime.py):
batched timing of a call on every rank alike and the ranks' agreed counts (the all-gather /
reduce-scatter under their torch-version names: ``codegen.runtime.torch_compat``)."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence


def timeit(fn: Callable[[], Any], repeats: int, sync: Callable[[], None], budget_s: float = 2.0,
           target_s: float = 0.02, agree: Callable[[int], int] | None = None,
           lockstep: Callable[[], None] | None = None) -> float:
    """Seconds per call of ``fn``: the median over ``n`` timed batches of ``k`` back-to-back
    calls, divided by ``k``.

    One warm-up call, then one timed call ``t``; ``k = ceil(target_s / t)`` (1 when a call
    takes longer than ``target_s``; at most 1000) and ``n = repeats``, cut to what fits in
    ``budget_s`` (at least 3 when ``repeats`` allows). ``agree`` maps this rank's k and n
    to ones every rank uses (collectives must be issued the same number of times
    everywhere); ``lockstep`` (a barrier) runs before every batch, so ranks sharing cores
    time their batches while the others compute too, as in training.
    """
    first = _probe(fn, sync)
    k = _calls_per_batch(first, target_s)
    n = _batches(repeats, budget_s, k * first)
    if agree is not None:
        k, n = agree(k), agree(n)
    return statistics.median(_batch_s(fn, k, sync, lockstep) for _ in range(n))


def timeit_paired(pairs: Sequence[tuple[Callable[[], Any], Callable[[], Any]]], repeats: int,
                  sync: Callable[[], None], budget_s: float = 2.0, target_s: float = 0.02,
                  agree: Callable[[int], int] | None = None,
                  lockstep: Callable[[], None] | None = None) -> list[tuple[float, float]]:
    """Per ``(base, more)`` pair, seconds per call of ``base`` and what ``more`` (a call doing
    ``base``'s work and more: a forward and backward against a forward) takes beyond it: the
    median over ``n`` rounds of ``base``'s batch, and the median over the rounds of the two
    batches' difference (per call). Within a round ``more``'s batch follows ``base``'s, so a
    slow spell of the machine lands on both sides of one round's difference, which the median
    then drops (two separate medians, :func:`timeit` each, would subtract one spell from
    another); and the pairs' rounds are interleaved, round ``i`` timing each pair in turn, so a
    spell lands on one round of every pair, not on all rounds of the pair timed while it lasted.

    ``k`` per function as :func:`timeit` chooses it; ``n`` = ``repeats`` cut to ``budget_s`` per
    pair (at least 3 when ``repeats`` allows); ``agree`` maps every ``k`` and ``n`` to ones all
    ranks use, and ``lockstep`` runs before every batch, as there."""
    firsts = [(_probe(b, sync), _probe(m, sync)) for b, m in pairs]
    ks = [(_calls_per_batch(fb, target_s), _calls_per_batch(fm, target_s)) for fb, fm in firsts]
    round_s = sum(kb * fb + km * fm for (kb, km), (fb, fm) in zip(ks, firsts))
    n = _batches(repeats, budget_s * len(pairs), round_s)
    if agree is not None:
        ks, n = [(agree(kb), agree(km)) for kb, km in ks], agree(n)
    rounds: list[list[tuple[float, float]]] = [[] for _ in pairs]
    for _ in range(n):
        for got, (b, m), (kb, km) in zip(rounds, pairs, ks):
            got.append((_batch_s(b, kb, sync, lockstep), _batch_s(m, km, sync, lockstep)))
    return [(statistics.median(a for a, _ in got), statistics.median(max(b - a, 0.0) for a, b in got))
            for got in rounds]


def timeit_rounds(fns: Sequence[Callable[[], Any]], repeats: int, sync: Callable[[], None],
                  target_s: float = 0.02, agree: Callable[[int], int] | None = None,
                  lockstep: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call of each of ``fns``: ``repeats`` rounds, round ``i`` timing one batch of
    each function in turn, and per function the median of its rounds. A slow spell of the machine
    (seconds long on a shared VM) then lands on one round of every function, not on all rounds of
    the ones timed while it lasted. ``k`` per function, ``agree`` and ``lockstep`` as :func:`timeit`."""
    ks = [_calls_per_batch(_probe(fn, sync), target_s) for fn in fns]
    n = max(1, repeats)
    if agree is not None:
        ks, n = [agree(k) for k in ks], agree(n)
    rounds: list[list[float]] = [[] for _ in fns]
    for _ in range(n):
        for got, fn, k in zip(rounds, fns, ks):
            got.append(_batch_s(fn, k, sync, lockstep))
    return [statistics.median(got) for got in rounds]


def _probe(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds of one call of ``fn`` after a warm-up call."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return max(time.perf_counter() - t0, 1e-9)


def _calls_per_batch(first_s: float, target_s: float) -> int:
    """Back-to-back calls in a batch of about ``target_s`` (1 for slower calls; at most 1000)."""
    return min(1000, max(1, math.ceil(target_s / first_s)))


def _batches(repeats: int, budget_s: float, batch_s: float) -> int:
    """``repeats`` batches (or rounds) of ``batch_s``, cut to ``budget_s``, at least 3 when ``repeats`` allows."""
    fits = math.ceil(budget_s / batch_s) if math.isfinite(budget_s) else repeats
    return max(min(3, repeats), min(repeats, fits))


def _batch_s(fn: Callable[[], Any], k: int, sync: Callable[[], None], lockstep: Callable[[], None] | None) -> float:
    """Seconds per call of one batch of ``k`` back-to-back calls, started in ``lockstep``."""
    if lockstep is not None:
        lockstep()
    sync()
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    sync()
    return (time.perf_counter() - t0) / k


def reduce_device() -> str:
    """Where a small tensor must live for a collective on the default group (nccl: the GPU)."""
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def slowest_rank(times: Sequence[float]) -> list[float]:
    """Each figure's slowest rank (a MAX all-reduce over the default group)."""
    import torch
    import torch.distributed as dist

    tt = torch.tensor(list(times), dtype=torch.float64, device=reduce_device())
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    return tt.tolist()


def agree_min(k: int) -> int:
    """The smallest ``k`` over all ranks (every rank times the same number of calls; the
    smallest keeps a rank whose calls are slow, or a rank with nothing to time, from
    stretching everyone's batches)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([k], dtype=torch.int64, device=reduce_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
