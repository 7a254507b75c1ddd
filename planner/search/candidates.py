"""The search's candidates: every configuration of the device count the runtime can run,
enumerated degree by degree, each level pruned by the feasibility predicate's own part
(``planner/feasibility.py``) before anything is priced.

Levels, outer to inner, and the part each calls (its one-line reason is what the search
records as rejected):

- degrees ``world = dp x pp x cp x tp``, for each process count ``rank_counts`` allows (the
  device count; on a local CPU cluster its divisors too, fewer ranks with more threads each:
  ``layout_threads``) (:func:`degree_tuples`): ``tp_problem`` (node size,
  heads, kv heads, hidden), ``cp_problem`` (the sequence's zigzag chunks), ``pp_problem``
  (stage groups), ``replicas_problem`` (dp dividing the global batch);
- micro-batch sizes (:func:`micro_batch_sizes`): divisors of each replica's sequences, and
  ``fill_problem`` (at least one micro-batch per pipeline stage);
- expert-parallel degrees (:func:`ep_degrees`): ``ep_problem``;
- Ulysses degrees (:func:`ulysses_degrees`): ``cp_problem`` with the degree;
- variants (:func:`variants`): ``schedule_problem`` and ``pp_problem`` with vpp (via
  :func:`schedule_choices`), ``zero_problem``, ``recompute_problem``, ``sp_problem``,
  ``ep_problem`` with the variant's sequence parallel.

So every configuration enumerated has ``feasibility.problems(...) == []``, and every one it
leaves out has a problem - except the search's deliberate space choices, which are not
feasibility (tests/test_feasibility.py holds the search to exactly this):

- micro-batch sizes up to ``max_mbs`` (8 unless pinned), and without a pipeline the whole
  replica batch in one micro-batch;
- DP sharding without ``zero2`` (``ZEROS``), and only ``ddp`` without data parallelism
  (dp x cp = 1: the modes differ only in what they shard over dp);
- interleaving with v in {2, 4} (or the pinned range), never with v = 1 (it is 1F1B); with
  pp = 1 the schedule is ``1f1b`` (none runs);
- expert-parallel degrees among the common divisors of the experts and dp x cp x tp;
- the attention kernel ``default_attention``, the loss and dtype of the request;
- one Ulysses degree per degree tuple (the fastest, picked by the search by pricing);
- ``DOMINATED`` variants, skipped only when the search prices (``dominated=False``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from planner.feasibility import (Batch, ClusterShape, cp_problem, modes_problem, default_attention, documents_problem, ep_problem,
                                 fill_problem, layout_threads, length_problem, loss_problem, model_problem,
                                 pp_problem, rank_counts,
                                 recompute_attention_problem, replicas_problem, schedule_problem, sp_problem,
                                 tp_problem, zero_problem)
from planner.graph import ModelGraph
from planner.low_comm import low_comm_problem
from planner.plan import SCHEDULES, ModelFacts, ParallelConfig
from planner.recompute_rules import recompute_policies
from planner.schedule_ir import seq_chunks_batch_problem, seq_chunks_problem
from planner.sharding import ZERO
from planner.search.pins import Pins

# The DP sharding modes the search tries: planner.sharding.ZERO without zero2 (with pp > 1 it holds
# and moves what fsdp does; with pp = 1 it only trades fsdp's per-layer gathers for every layer
# held gathered), to keep the space small; ``--fix zero=zero2`` prices it.
ZEROS = tuple(z for z in ZERO if z != "zero2")

# Variants the cost model never prefers, with the one that dominates them (no slower, no
# more memory), so the search skips them and counts them as pruned:
DOMINATED = {
    "gpipe": "1f1b: the same step time with min(pp, m) instead of m micro-batches in flight",
    "sp=off": "sp=on: the same TP traffic (reduce-scatter + all-gather = all-reduce) and sequence-sharded norms",
}
DOMINATED_REASON = ("dominated (" + ", ".join(f"{k} by {v.split(':')[0]}" for k, v in DOMINATED.items())
                    + ": no faster, more memory)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Rejections:
    """Why configurations were left out: reason -> count, up to three examples each, and which
    reasons are the request's own options (compile, float8, the dtype: what the user may drop)."""

    def __init__(self) -> None:
        self.examples: dict[str, list[str]] = {}
        self.counts: dict[str, int] = {}
        self.requested: set[str] = set()

    def add(self, reason: str, example: str | Callable[[], str], n: int = 1, requested: bool = False) -> None:
        """Count ``n`` configurations under ``reason`` (``requested``: the request's options ruled
        them out); ``example`` (or what calling it gives: a label made only while the reason has
        fewer than three) among its examples."""
        self.counts[reason] = self.counts.get(reason, 0) + n
        if requested:
            self.requested.add(reason)
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 3:
            ex.append(example if isinstance(example, str) else example())


def facts_of(graph: ModelGraph) -> ModelFacts:
    """What the feasibility predicate (``planner.feasibility.problems``) needs of ``graph``."""
    attn = [l.attention for l in graph.layers if l.attention]
    return ModelFacts(heads=tuple(sorted({a.heads for a in attn})), kv_heads=tuple(sorted({a.kv_heads for a in attn})),
                      hidden=graph.hidden, units=len(graph.stage_groups()), seq_len=graph.seq_len,
                      limits=dict(graph.limits), experts=max((l.moe.experts for l in graph.layers if l.moe), default=0),
                      max_seq_len=graph.max_seq_len)


def batch_of(graph: ModelGraph, global_batch: int) -> Batch:
    """The batch the feasibility predicate checks for ``graph``: ``global_batch`` sequences of
    its ``seq_len``, packed documents where it has them."""
    return Batch(global_batch, graph.seq_len, documents=graph.documents is not None)


def request_problem(facts: ModelFacts, batch: Batch, loss: str) -> str | None:
    """What refuses every layout of a request, so the search stops before enumerating: the
    model runs nowhere (``model_problem``), the requested loss kernel (``loss_problem``),
    packed documents on this model (``documents_problem``), a sequence longer than its
    learned positions (``length_problem``)."""
    return (model_problem(facts) or length_problem(batch.seq_len, facts) or loss_problem(loss, facts)
            or (documents_problem(facts.limits) if batch.documents else None))


def fp8_problem(fp8: str, cluster) -> str | None:
    """Why a request for float8 linears cannot run on ``cluster`` (one line), or None: the
    device must have float8 tensor cores (a ``fp8`` peak in ``[device.peak_tflops]``, as the
    H100 / H200 presets give; A100s and CPUs have none)."""
    if fp8 == "none" or (cluster.backend == "nccl" and "fp8" in cluster.device.peak_tflops):
        return None
    return (f"--fp8 {fp8}: {cluster.device.name} has no float8 tensor cores (H100 / H200 class devices have); "
            "plan without --fp8")


def fp8_caveat(fp8: str, compile: bool) -> str | None:
    """One line for a float8 request without compiled blocks, which runs but slowly: torchao casts
    each linear's operands in separate eager kernels (its docs ask for torch.compile). On one H200,
    llama-1b's step took 1.397 s in float8 eager against 0.379 s in bf16 and 0.452 s in float8
    compiled (benchmarks/measured/gpu_check_h200_2026-12-04b.json); the time model does not price
    that overhead, so such a plan is predicted far too fast."""
    if fp8 == "none" or compile:
        return None
    return (f"--fp8 {fp8} without --compile: torchao's eager casts ran llama-1b 3.7x slower than bf16 on an "
            "H200 (1.397 vs 0.379 s per step), which the prediction does not include; add --compile")


def compile_problem(compile: bool, cluster) -> str | None:
    """Why regional ``torch.compile`` cannot run on ``cluster`` (one line), or None: on CPUs
    inductor generates C++ and needs a compiler on this machine (``CXX``, c++, g++ or clang++)."""
    import os
    import shutil

    if not compile or cluster.backend != "gloo":
        return None
    if any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        return None
    return "--compile on CPU: torch.compile's inductor needs a C++ compiler (install g++); plan without --compile"


def degree_tuples(facts: ModelFacts, cluster: ClusterShape, batch: Batch, rej: Rejections,
                  pins: Pins | None = None) -> Iterator[tuple[int, int, int, int]]:
    """(dp, pp, cp, tp) multiplying to one of the cluster's process counts (``rank_counts``,
    largest first) that the ``pins`` admit and that the predicate's per-degree parts accept;
    the others are recorded in ``rej`` (those the pins leave out are not)."""
    pins = pins or Pins()
    for world in (w for w in rank_counts(cluster) if pins.allows("world", w)):
        yield from _degree_tuples(world, facts, cluster, batch, rej, pins)


def _degree_tuples(world: int, facts: ModelFacts, cluster: ClusterShape, batch: Batch, rej: Rejections,
                   pins: Pins) -> Iterator[tuple[int, int, int, int]]:
    for tp in divisors(world):
        if not pins.allows("tp", tp) or (tp == 1 and not pins.allows("sp", False)):
            continue
        if why := tp_problem(tp, facts, cluster):
            rej.add(why, f"tp={tp}")
            continue
        for cp in divisors(world // tp):
            if not pins.allows("cp", cp):
                continue
            if why := cp_problem(cp, facts, batch):
                rej.add(why, f"cp={cp}")
                continue
            for pp in divisors(world // (tp * cp)):
                if not pins.allows("pp", pp):
                    continue
                if why := pp_problem(pp, facts):
                    rej.add(why, f"pp={pp}")
                    continue
                dp = world // (tp * cp * pp)
                if not pins.allows("dp", dp):
                    continue
                if why := replicas_problem(batch.global_batch, dp):
                    rej.add(why, f"dp={dp} pp={pp} cp={cp} tp={tp}")
                    continue
                yield dp, pp, cp, tp


def micro_batch_sizes(dp: int, pp: int, cp: int, tp: int, batch: Batch, max_mbs: float, rej: Rejections,
                      pins: Pins) -> list[tuple[int, int]]:
    """(micro-batch size, micro-batches per step) of one degree tuple: the divisors of each
    replica's sequences up to ``max_mbs`` that the pins admit and that give every pipeline
    stage a micro-batch (``fill_problem``); the others are recorded."""
    label = f"dp={dp} pp={pp} cp={cp} tp={tp}"
    per_replica = batch.global_batch // dp
    sizes = [d for d in divisors(per_replica) if (d <= max_mbs or (d == per_replica and pp == 1))
             and pins.allows("mbs", d)]  # beyond the cap: the whole replica batch at once (what one process runs)
    if not sizes:
        rej.add(f"no micro-batch size {pins.describe('mbs')} divides the {per_replica} sequences per replica", label)
    out = []
    for mbs in sizes:
        if why := fill_problem(pp, per_replica // mbs):
            rej.add(why, f"{label} mbs={mbs}")
            continue
        out.append((mbs, per_replica // mbs))
    return out


def ep_degrees(facts: ModelFacts, batch: Batch, dp: int, cp: int, tp: int, rej: Rejections,
               pins: Pins) -> list[int]:
    """The expert-parallel degrees to try with ``dp`` x ``cp`` x ``tp`` (1 for a model without
    routed experts): every ``ep`` dividing both the experts and dp x cp x tp that the pins
    admit; 1 stays a candidate, because expert parallelism can lose. Degrees the runtime
    cannot run (with tp > 1: without sequence parallel, every degree) are recorded."""
    if not facts.experts:
        return [1]
    out = []
    sp = tp > 1 and sp_problem(tp, cp, facts, batch) is None
    for ep in divisors(math.gcd(facts.experts, dp * cp * tp)):
        if not pins.allows("ep", ep):
            continue
        if why := ep_problem(ep, dp, cp, facts, tp, sp):
            rej.add(why, f"ep={ep}")
            continue
        out.append(ep)
    return out


def ulysses_degrees(facts: ModelFacts, batch: Batch, cp: int, tp: int, rej: Rejections, pins: Pins) -> list[int]:
    """The Ulysses degrees to try with ``cp`` x ``tp`` (``ParallelConfig.cp_method``): 1 (ring
    attention), cp (Ulysses) and the divisors between (the 2-D hybrid) that the pins admit
    and that split every attention's heads and kv heads per tp rank; the others are recorded.
    Without cp, 1."""
    if cp == 1:
        return [1]
    out = []
    for u in divisors(cp):
        if not pins.allows("ulysses", u):
            continue
        if why := cp_problem(cp, facts, batch, u, tp):
            rej.add(why, f"cp={cp} ulysses={u} tp={tp}")
            continue
        out.append(u)
    return out


def degrees_label(dp: int, pp: int, cp: int, tp: int, mbs: int, ep: int = 1, moe: bool = False,
                  ulysses: int = 1) -> str:
    """A degree tuple as the search's rejections and the report name it (``ep`` for a MoE model,
    ``ulysses`` above 1)."""
    ep_s, uly = (f" ep={ep}" if moe else ""), (f" ulysses={ulysses}" if ulysses > 1 else "")
    return f"dp={dp} pp={pp} cp={cp}{uly} tp={tp}{ep_s} mbs={mbs}"


@dataclass(frozen=True)
class Point:
    """One degree tuple of the search with its micro-batching and expert-parallel degree, and
    the Ulysses degrees it may take (the search prices them and keeps the fastest)."""
    dp: int
    pp: int
    cp: int
    tp: int
    mbs: int
    m: int                          # micro-batches per optimizer step per replica
    ep: int
    ulysses: tuple[int, ...]
    threads: int = 0                # ParallelConfig.threads (feasibility.layout_threads)


def points(facts: ModelFacts, cluster: ClusterShape, batch: Batch, rej: Rejections, pins: Pins,
           max_mbs: float) -> Iterator[Point]:
    """Every (dp, pp, cp, tp, mbs, ep) the predicate's per-degree parts accept, with its Ulysses
    degrees. A refused Ulysses degree is recorded once per (cp, tp, ep, mbs): the key the
    search prices the Ulysses degrees under."""
    seen: dict[tuple[int, int, int, int], tuple[int, ...]] = {}
    for dp, pp, cp, tp in degree_tuples(facts, cluster, batch, rej, pins):
        for mbs, m in micro_batch_sizes(dp, pp, cp, tp, batch, max_mbs, rej, pins):
            for ep in ep_degrees(facts, batch, dp, cp, tp, rej, pins):
                key = (cp, tp, ep, mbs)
                if key not in seen:
                    seen[key] = tuple(ulysses_degrees(facts, batch, cp, tp, rej, pins))
                if seen[key]:
                    yield Point(dp, pp, cp, tp, mbs, m, ep, seen[key], layout_threads(cluster, dp * pp * cp * tp))


def schedule_choices(pp: int, m: int, facts: ModelFacts, pins: Pins) -> list[tuple[str, int]]:
    """(schedule, vpp) to try for ``pp`` stages and ``m`` micro-batches: every schedule the
    runtime can run (``schedule_problem``), interleaved with v in {2, 4} (or the pinned vpp
    values) where the stage groups allow (``pp_problem``); a pinned schedule or vpp applies
    only when pp > 1."""
    if pp == 1:
        return [("1f1b", 1)]
    vs: Sequence[int] = (2, 4)
    if "vpp" in pins.lo or "vpp" in pins.hi:  # a pinned range, up to one stage group per virtual stage
        vs = range(max(2, pins.lo.get("vpp", 2)), pins.hi.get("vpp", facts.units // pp) + 1)
    out = [(s, 1) for s in SCHEDULES if s != "interleaved-1f1b"] + [("interleaved-1f1b", v) for v in vs]
    return [(s, v) for s, v in out if schedule_problem(s, pp, v, m) is None and pp_problem(pp, facts, v) is None
            and pins.allows("schedule", s) and pins.allows("vpp", v)]


def variants(p: Point, ulysses: int, facts: ModelFacts, batch: Batch, dtype: str, loss: str,
             dominated: bool = True, pins: Pins | None = None, fp8: str = "none",
             compile: bool = False, low_comm: str = "", offload: bool = True,
             seq_chunks: Sequence[int] = (1,)) -> Iterator[ParallelConfig]:
    """The variants of one degree tuple with Ulysses degree ``ulysses`` that the ``pins``
    admit: schedule and vpp, DP sharding, recompute, sequence parallel - each where the
    runtime can run it. With ``dominated=False`` the variants the cost model proves no better
    are left out (see ``DOMINATED``) unless the pins leave out what dominates them. The
    attention kernel is flash unless the model cannot use it. ``low_comm`` (``autopar plan
    --low-comm``, planner/low_comm.py): each variant also with low-communication DP across
    groups of replicas, where the degrees allow it. ``offload=False`` leaves ``recompute=offload``
    out unless the pins name the policy: the search's choice where offloading frees no device
    memory (``cost_models.offload.offload_saves``: there it is dominated by ``none``). ``seq_chunks``:
    the chunk counts > 1 tried beside each variant where they can run (planner/schedule_ir.py)."""
    for choice in variant_choices(p, facts, batch, dtype, dominated, pins, fp8, compile, low_comm, offload, seq_chunks):
        yield variant_config(p, ulysses, choice, facts, dtype, loss, fp8, compile)


def variant_config(p: Point, ulysses: int, choice: tuple[str, int, str, str, bool, int, str], facts: ModelFacts,
                   dtype: str, loss: str, fp8: str = "none", compile: bool = False,
                   attention: str | None = None) -> ParallelConfig:
    """The configuration of one of :func:`variant_choices`' choices (what :func:`variants` yields);
    ``attention`` None: ``default_attention`` (the search's own: planner/search/kernel_choice.py)."""
    sched, v, zero, rc, sp, k, low = choice
    return ParallelConfig(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp, ep=p.ep, ulysses=ulysses, mbs=p.mbs, schedule=sched,
                          vpp=v, zero=zero, recompute=rc, sp=sp, dtype=dtype, loss=loss,
                          attention=attention or default_attention(facts.limits), threads=p.threads, fp8=fp8, compile=compile,
                          low_comm=low, seq_chunks=k)


def variant_count(p: Point, facts: ModelFacts, batch: Batch, dtype: str, dominated: bool = True,
                  pins: Pins | None = None, fp8: str = "none", compile: bool = False, low_comm: str = "",
                  offload: bool = True, seq_chunks: Sequence[int] = (1,)) -> int:
    """How many :func:`variants` the same arguments give, without building them (the search counts
    every tuple's variants; a configuration object costs microseconds, a choice tuple far less)."""
    return sum(1 for _ in variant_choices(p, facts, batch, dtype, dominated, pins, fp8, compile, low_comm, offload,
                                          seq_chunks))


def variant_choices(p: Point, facts: ModelFacts, batch: Batch, dtype: str, dominated: bool = True,
                    pins: Pins | None = None, fp8: str = "none", compile: bool = False, low_comm: str = "",
                    offload: bool = True, seq_chunks: Sequence[int] = (1,)
                    ) -> Iterator[tuple[str, int, str, str, bool, int, str]]:
    """:func:`variants`' choices in its order, as (schedule, vpp, zero, recompute, sp, seq_chunks,
    low_comm): the one enumeration both it and :func:`variant_count` read."""
    pins = pins or Pins()
    dp, pp, cp, tp, ep = p.dp, p.pp, p.cp, p.tp, p.ep
    if modes_problem(dtype, fp8, compile, tp, cp):
        return
    sp_ok = sp_problem(tp, cp, facts, batch) is None
    zeros = ("ddp",) if dp * cp == 1 else tuple(z for z in (ZERO if "zero" in pins.choice else ZEROS)
                                                 if pins.allows("zero", z))
    sps = [(s, sp_ok and not s and pins.allows("sp", True)) for s in ((False, True) if sp_ok else (False,))
           if pins.allows("sp", s)]  # (sp, dominated by sp=on)
    low = bool(low_comm) and low_comm_problem(low_comm, dp, ep) is None
    for sched, v in schedule_choices(pp, p.m, facts, pins):
        dom_sched = sched == "gpipe" and pins.allows("schedule", "1f1b")
        ks = [k for k in seq_chunks if k > 1 and pins.allows("seq_chunks", k)
              and not seq_chunks_problem(k, sched, pp, v, cp)]
        policies = [r for r in recompute_policies(sched, pp) if pins.allows("recompute", r)
                    and not recompute_attention_problem(r, facts.limits)
                    and (offload or r != "offload" or "recompute" in pins.choice)]
        chunked = {rc: [k for k in ks if not seq_chunks_batch_problem(k, batch.seq_len, batch.documents, facts.limits,
                                                                      rc)] for rc in policies}
        for zero in zeros:
            if zero_problem(zero, tp, dp * cp, facts, ep):
                continue
            for rc in policies:
                for sp, dom_sp in sps:
                    if ep_problem(ep, dp, cp, facts, tp, sp):  # a MoE model under TP needs SP
                        continue
                    if not dominated and (dom_sched or dom_sp):
                        continue
                    yield sched, v, zero, rc, sp, 1, ""
                    for k in chunked[rc]:
                        yield sched, v, zero, rc, sp, k, ""
                    if low:
                        yield sched, v, zero, rc, sp, 1, low_comm


def configurations(facts: ModelFacts, cluster: ClusterShape, batch: Batch, *, dtype: str, loss: str,
                   max_mbs: float = 8, pins: Pins | None = None, fp8: str = "none",
                   compile: bool = False) -> Iterator[ParallelConfig]:
    """Every configuration the search enumerates, before any pricing: each point's variants
    under each of its Ulysses degrees (dominated ones included); none where
    :func:`request_problem` refuses the request."""
    pins = pins or Pins()
    if request_problem(facts, batch, loss):
        return
    for p in points(facts, cluster, batch, Rejections(), pins, max_mbs):
        for u in p.ulysses:
            yield from variants(p, u, facts, batch, dtype, loss, pins=pins, fp8=fp8, compile=compile)
