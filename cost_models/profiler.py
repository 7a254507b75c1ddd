"""Profiler: measure the real cluster and write a ProfileDB (JSON).

Run by ``autopar profile --cluster local-cpu:4 --model gpt-small -o profile.json``, which
launches this module under torchrun (``python -m cost_models.profiler ...`` on every
rank). The same code runs with gloo on CPUs and nccl on GPUs. It measures:

(a) **Layers**: every distinct layer class of the model (one representative of each
    signature), forward and backward, at the shapes candidate plans run: micro-batch
    sizes ``--batches``, each TP shard size and each CP size, with a TP rank's local
    shapes exactly as the runtime shards them (column-parallel linears keep out/tp
    outputs, row-parallel ones in/tp inputs, the vocabulary-parallel head and token
    embedding vocab/tp rows, the head's loss over the local logits through torch's
    ``loss_parallel`` as the runtime's runs: :func:`shard_unit`) and, under CP, the rank's
    S/cp tokens through the runtime's own ring attention computation
    (``codegen.runtime.context_parallel.RingCompute``: every ring step's block attention
    and merge, without the p2p). Collectives inside a layer (TP all-reduces, the ring's
    exchange) are not in these times: the communication model adds them. All ranks
    measure at once, so the figures include the contention of ranks sharing a machine,
    as in training. Besides, at batch 1 without TP and CP, one sequence chunk of each
    searched count (``cost_models.seq_chunks.chunk_lengths``). Layers run in the compute
    dtype of the plans the profile will price (``--dtype``, by default the cluster's:
    bf16 on GPUs, fp32 on CPUs), as the runtime's compute copies of the parameters do.
(b) **Collectives**: all-reduce, all-gather, reduce-scatter, all-to-all for each
    group size the mesh can have, with all groups of that size running at once
    (as all tp groups, or all dp groups, do in training), over message sizes, in interleaved
    rounds, non-decreasing in size (``cost_models.profile_comm``).
(c) **p2p**: send/recv between rank pairs, all pairs at once (the same way).
(d) **The CPU runtime's own work** (gloo only, ``cost_models.profile_runtime.measure_runtime``;
    cost_models/cpu_runtime.py): data-parallel wrappers per unit, EP dispatch per MoE layer and
    (even worlds: tp groups of 2) DTensor dispatch per TP-sharded module, into
    ``ProfileDB.runtime``; and one FSDP2 unit's whole traffic by its size
    (``profile_runtime.measure_fsdp_units``, called from there).

Timing (``cost_models.profile_timing``): after a warm-up call, ``--repeats`` batches of k back-to-back
calls, k chosen so a batch lasts about 20 ms (1 for anything slower), and the median
batch time / k. Batching amortises timer and scheduler jitter, which dominates
sub-millisecond operations when ranks share cores. A layer's forward and its forward +
backward alternate in rounds, and its backward is the median of the rounds' differences, so a
slow spell of the machine lands on both sides of one round; the rounds of every layer shape of a
CP degree are interleaved (``profile_timing.timeit_paired``: round i times each shape in
turn), so a slow spell lands on one round of every shape, not on all rounds of the one timed then. All ranks use one agreed k and
batch count, layers start every batch together (a barrier), and the slowest rank's
time is reported. Only rank 0 writes the file (atomically).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, NamedTuple

from cost_models.profile_comm import measure_collectives
from cost_models.profile_runtime import measure_runtime
from cost_models.profile_timing import agree_min, timeit_paired
from planner.precision import DTYPES, default_dtype

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24)
DEFAULT_REPEATS = 3
# rounds the split backward is timed in, whatever the profile's --repeats: its figure is a
# difference of two timings, so one slow round must be a minority for the median to drop it. Two
# CI runs read +1407% and +872% for gpt-tiny profiled with --repeats 2 (elsewhere +52-106%): with 2
# rounds the median is the mean, and a spell of a few tens of ms on one round's split batches
# (gpt-tiny's block: 2.1 ms, 0.6 ms of it the split's extra) gives that; the likely cause, not reproduced.
SPLIT_ROUNDS = 5


def _log(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[profile] {msg}", flush=True)


def _vocab_shard_embedding(emb, tp: int):
    """A TP rank's vocabulary-parallel token embedding (rank 0's rows): the runtime's own local
    lookup (``codegen.runtime.tensor_parallel.vocab_shard_lookup``), ids outside its rows looked up
    as row 0 and zeroed."""
    import torch
    import torch.nn as nn

    from codegen.runtime.tensor_parallel import vocab_shard_lookup, vocab_shard_rows

    class VocabShardEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.start, self.rows = vocab_shard_rows(emb.num_embeddings, tp, 0)
            self.weight = nn.Parameter(emb.weight.detach()[:self.rows].clone())

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return vocab_shard_lookup(ids, self.weight, self.start)

    return VocabShardEmbedding()


def shard_unit(unit, layer, tp: int, loss_mesh=None):
    """A copy of ``unit`` (the module of graph ``layer``) with a TP rank's local shapes.

    Column-parallel linears keep out/tp outputs, row-parallel ones in/tp inputs, the
    vocabulary-parallel head out = vocab/tp, and a token embedding of the vocabulary
    vocab/tp rows (see ``codegen/runtime/tensor_parallel.py``). Returns ``unit`` itself
    when ``tp == 1``. Parameters are fresh: the copy never shares (or unties) the model's.

    ``loss_mesh`` (a one-rank mesh, :func:`one_rank_mesh`): the head's local linear takes the
    runtime's own ``vocab_head`` style on it, so its logits are a ``Shard(-1)`` DTensor and
    the head's own loss (called under ``loss_context`` by :func:`layer_calls`) runs as the
    runtime runs it: torch's ``loss_parallel``, an unfused log-softmax over the rank's vocabulary shard, not
    the fused kernel a plain local loss takes (the loss alone on 512 tokens x 25,128 columns, fp32, one
    thread, 2 ranks at once on an idle 2-core VM: 208-211 ms forward + backward against 86-88 ms fused;
    gpt-small's whole head at tp2, batch 4: 372-406 ms against 363-388 ms, 2026-12-05). Its two
    all-reduces of a few bytes per token run on the one-rank group (nearly free); the head's
    DTensor dispatch is then in the profile as well as in ``dtensor_dispatch_s`` (its
    ``dtensor_module_s`` a micro-batch, about 1 ms on CPUs, counted twice).
    """
    import torch.nn as nn

    if tp == 1:
        return unit
    u = copy.deepcopy(unit)
    for lin in layer.linears:
        if lin.role not in ("column", "row", "vocab"):
            continue
        parent_name, _, leaf = lin.name.rpartition(".")
        parent = u.get_submodule(parent_name) if parent_name else u
        old = getattr(parent, leaf)
        if not isinstance(old, nn.Linear):
            continue
        fin, fout = old.in_features, old.out_features
        if lin.role == "row":
            fin //= tp
        else:
            fout //= tp
        new = nn.Linear(fin, fout, bias=old.bias is not None, device=old.weight.device, dtype=old.weight.dtype)
        setattr(parent, leaf, _as_vocab_head(new, loss_mesh) if lin.role == "vocab" and loss_mesh is not None else new)
    vocab_ops = {op.name for op in layer.ops if op.kind == "embedding" and op.tp_style == "vocab"}
    for name in vocab_ops:
        parent_name, _, leaf = name.rpartition(".")
        parent = u.get_submodule(parent_name) if parent_name else u
        old = getattr(parent, leaf)
        if isinstance(old, nn.Embedding):
            setattr(parent, leaf, _vocab_shard_embedding(old, tp))
    return u


def _as_vocab_head(linear, mesh):
    """``linear`` under the runtime's ``vocab_head`` style on ``mesh`` (its logits a ``Shard(-1)`` DTensor)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from codegen.runtime.tp_styles import style_for, style_source

    return parallelize_module(linear, mesh, style_for(style_source("vocab_head", sp=False)))


def one_rank_mesh(device):
    """A DeviceMesh of this rank alone, for :func:`shard_unit`'s head; every rank of the
    process group calls it (the one-rank groups are made collectively)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group, _ = dist.new_subgroups(group_size=1)
    return DeviceMesh.from_group(group, torch.device(device).type)


def local_labels(args: tuple, kwargs: dict, layer, tp: int) -> tuple[tuple, dict]:
    """Under a vocabulary-parallel head, the loss sees vocab/tp logit columns: map label
    ids into that range (ignored labels stay ignored) so the local loss is well-defined."""
    import torch

    if tp == 1 or not any(l.role == "vocab" for l in layer.linears) or not layer.vocab:
        return args, kwargs
    local = layer.vocab // tp

    def fix(x):
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() > 0:
            return torch.where(x >= 0, x % local, x)
        return x

    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}


def measure_layers(db, spec: str, seq_len: int, batches, tps, cps, repeats: int, device) -> None:
    """Time forward and backward of each distinct layer of ``spec`` (its representative) per
    micro-batch size, TP degree and CP degree, as the runtime shards it, in ``db.dtype`` (the
    runtime's compute copies of the parameters, and so its activations); into ``db``."""
    import torch
    import torch.distributed as dist

    from codegen.runtime.context_parallel import RingCompute
    from codegen.runtime.layers import sdpa_attention
    from planner import zoo

    graph, cfg, model, reps, sync = _profiled_model(db, spec, seq_len, device)
    loss_mesh = one_rank_mesh(device) if max(tps) > 1 else None  # the head's loss as the runtime runs it
    for cp in cps:
        # this rank plays cp rank (rank % cp): the zigzag layout gives every cp rank equal work
        ring = RingCompute(cp, dist.get_rank() % cp, fallback=sdpa_attention) if cp > 1 else None
        shapes, pairs, units = [], [], {}
        for b in batches:
            inputs = _layer_inputs(model, reps.values(), zoo.example_batch(cfg, b, seq_len // cp, device=device))
            for tp in tps:
                for sig, layer in reps.items():
                    if tp > 1 and layer.attention is not None and layer.attention.kv_heads % tp:
                        continue
                    if (sig, tp) not in units:
                        units[sig, tp] = _unit_with(model, layer, tp, ring, loss_mesh)
                    shapes.append((sig, b, tp))
                    pairs.append(layer_calls(units[sig, tp], layer, inputs[layer.name], tp))
        dist.barrier()
        times = timeit_paired(pairs, repeats, sync, budget_s=4.0, agree=agree_min, lockstep=dist.barrier)
        tt = torch.tensor(times, dtype=torch.float64, device=device).reshape(-1, 2)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)  # the slowest rank's
        for (sig, b, tp), (tf, tb) in zip(shapes, tt.tolist()):
            db.add_layer(sig, b, seq_len, tp, cp, tf, tb)
        _log(f"layers: {len(shapes)} shapes measured (cp={cp}, batches {list(batches)}, tp {list(tps)})")


class _Profiled(NamedTuple):
    """A zoo model as the profiler times it: its graph, config, the model in ``db.dtype`` on the
    device, one representative layer per signature, and the device's synchronisation."""
    graph: Any
    cfg: Any
    model: Any
    reps: dict
    sync: Callable[[], None]


def _profiled_model(db, spec: str, seq_len: int, device) -> _Profiled:
    """``spec`` built for timing (:class:`_Profiled`); refuses a model that is not a zoo spec."""
    import torch

    from codegen.runtime.precision import compute_dtype
    from planner import zoo
    from planner.frontend.load import load_graph

    graph = load_graph(spec, batch=1, seq_len=seq_len)
    ms = zoo.load_model_spec(spec)
    if ms.cfg is None:
        raise SystemExit("error: the profiler measures zoo models (presets or TOML specs); "
                         "profile a preset of the same shape")
    model = zoo.build_model(ms.cfg, device=device, seed=0).to(compute_dtype(db.dtype))
    reps = {layer.signature: layer for layer in graph.layers if layer.repeat_of is None}
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    return _Profiled(graph, ms.cfg, model, reps, sync)


def measure_split(db, spec: str, seq_len: int, repeats: int, device) -> None:
    """What a backward split as torch's schedule runtime splits it (input gradients, then weight
    gradients: ``torch_compat.split_backward``) costs beyond one whole backward, as a share of the
    backward: over ``spec``'s layers with inputs that take gradients, at one sequence, tp 1, each
    weighted by how often it repeats, the extra seconds over the whole backward's, timed in the
    same rounds (the forward + whole backward call's time times the backward's share of the
    layer in ``db``); the ranks' median, into ``db.runtime["split_backward_frac"]``
    (cost_models/cpu_runtime.py); 0 when no layer has such inputs. At least ``SPLIT_ROUNDS`` rounds
    (``repeats`` where more). The ranks' median, not the slowest rank's
    as the layer times take: a noisy difference's maximum over ranks ran high (llama-fid on
    local-cpu:4, three profiles: 8.4%, 17.8%, 20.4%, the split schedules then priced up to 11%
    over their measured steps; the median rank's, one profile: 11.5%; one process: 4-16%)."""
    import torch
    import torch.distributed as dist

    from planner import zoo

    graph, cfg, model, reps, sync = _profiled_model(db, spec, seq_len, device)
    inputs = _layer_inputs(model, reps.values(), zoo.example_batch(cfg, 1, seq_len, device=device))
    count = Counter(layer.signature for layer in graph.layers)
    pairs, counts, bwd_share = [], [], []
    for sig, layer in reps.items():
        a, k = inputs[layer.name]
        if not any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in a):
            continue  # (the first stage's inputs: torch's runtime runs its backward whole, in its W)
        pairs.append(_split_calls(_unit_with(model, layer, 1, None), a, k))
        counts.append(count[sig])
        f, b = db.layer_time(sig, 1, seq_len, 1, 1)
        bwd_share.append(b / max(f + b, 1e-12))
    rounds = max(repeats, SPLIT_ROUNDS)
    times = timeit_paired(pairs, rounds, sync, budget_s=4.0, agree=agree_min, lockstep=dist.barrier) if pairs else []
    # the whole backward as timed in the same rounds as the split: the forward + backward call's
    # time, times the backward's share of the layer in the profile
    whole = [s * base for s, (base, _) in zip(bwd_share, times)]
    over = sum(c * x for c, (_, x) in zip(counts, times)) / max(sum(c * b for c, b in zip(counts, whole)), 1e-12)
    got = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(got, torch.tensor([over], dtype=torch.float64, device=device))
    db.runtime = dict(db.runtime, split_backward_frac=max(0.0, statistics.median(float(t.item()) for t in got)))
    _log(f"split backward: +{db.runtime['split_backward_frac'] * 100:.1f}% of a whole backward ({len(pairs)} layers)")


def _split_calls(unit, a: tuple, k: dict) -> tuple:
    """(forward + whole backward, forward + split backward) calls of ``unit`` on ``(a, k)``."""
    import torch

    from codegen.runtime import torch_compat

    def run(split: bool) -> None:
        aa = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in a]
        out = unit(*aa, **k)
        out = out if isinstance(out, torch.Tensor) else out[0]
        grad = None if out.dim() == 0 else torch.ones_like(out)
        if split:
            torch_compat.split_backward(out, grad, [x for x in aa if isinstance(x, torch.Tensor)],
                                        list(unit.parameters()))
        else:
            out.backward(grad)

    return (lambda: run(False)), (lambda: run(True))


def _layer_inputs(model, layers, batch: dict) -> dict[str, tuple]:
    """Each layer's (args, kwargs) in one forward of ``model`` on ``batch``."""
    import torch

    inputs: dict[str, tuple] = {}
    hooks = [model.get_submodule(layer.name).register_forward_pre_hook(
        lambda m, a, k, name=layer.name: inputs.setdefault(name, (a, k)), with_kwargs=True) for layer in layers]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    return inputs


def _unit_with(model, layer, tp: int, ring, loss_mesh=None):
    """``layer``'s module as a tp rank holds it (:func:`shard_unit`), its attention running
    ``ring``'s compute (or SDPA when None)."""
    from codegen.runtime.layers import SelfAttention

    unit = shard_unit(model.get_submodule(layer.name), layer, tp, loss_mesh)
    for m in unit.modules():
        if isinstance(m, SelfAttention):
            m.attn_impl = ring
    return unit


def layer_calls(unit, layer, inputs: tuple, tp: int) -> tuple:
    """(forward, forward + backward) calls of ``unit`` on ``inputs`` (their labels made local
    to the tp rank's vocabulary shard), under the runtime's ``loss_context(tp)`` (the head's
    loss: :func:`shard_unit`): the pair :func:`profile_timing.timeit_paired` times."""
    import torch

    from codegen.runtime.tensor_parallel import loss_context

    a, k = local_labels(*inputs, layer, tp)

    def fwd():
        with torch.no_grad(), loss_context(tp):
            unit(*a, **k)

    def fwd_bwd():
        aa = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in a]
        with loss_context(tp):
            out = unit(*aa, **k)
            out = out if isinstance(out, torch.Tensor) else out[0]
            (out.float().sum() if out.dim() else out).backward()

    return fwd, fwd_bwd


def _cluster_named(spec: str) -> tuple[str, str]:
    """(fingerprint, backend) of the cluster ``spec`` names, as the job sees it: rank 0 parses it on
    every core of the launch (a rank pinned to its slice would name another machine,
    ``codegen.runtime.mesh.unpinned``) while the others wait, and broadcasts it."""
    import torch.distributed as dist

    from codegen.runtime.mesh import unpinned
    from cost_models.cluster import parse_cluster

    box: list = [None]
    if dist.get_rank() == 0:
        with unpinned():
            cluster = parse_cluster(spec)
        box[0] = (cluster.fingerprint(), cluster.backend)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker_args(cluster: str, model: str, out: str, *, seq_len: int | None = None, batches: str | None = None,
                sizes: str | None = None, repeats: int | None = None, dtype: str | None = None) -> list[str]:
    """The arguments after ``torchrun ...`` that run this profiler on every rank (None: its default)."""
    args = ["-m", "cost_models.profiler", "--cluster", cluster, "--model", model, "-o", out]
    for flag, v in (("--seq-len", seq_len), ("--batches", batches), ("--sizes", sizes), ("--repeats", repeats),
                    ("--dtype", dtype)):
        if v is not None:
            args += [flag, str(v)]
    return args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cost_models.profiler")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES))
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="compute dtype the layers are timed in (default: the cluster's plans' own, "
                         "planner.precision.default_dtype: bf16 on GPUs, fp32 on CPUs)")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from codegen.runtime.mesh import exit_process, init_distributed
    from cost_models.profile_db import ProfileDB
    from cost_models.seq_chunks import chunk_lengths

    # as the training runtime starts: nccl on this rank's GPU, or gloo with the rank pinned to its cores
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    try:
        fingerprint, backend = _cluster_named(args.cluster)
        db = ProfileDB(cluster_fingerprint=fingerprint, backend=dist.get_backend(), world=world,
                       dtype=args.dtype or default_dtype(backend))
        t0 = time.perf_counter()
        sizes = [int(s) for s in args.sizes.split(",")]
        measure_collectives(db, world, rank, sizes, args.repeats, device, log=_log)
        measure_runtime(db, world, args.repeats, sizes)
        if not args.skip_layers:
            from planner import zoo
            from planner.feasibility import sequence_problem

            ms = zoo.load_model_spec(args.model)
            seq = args.seq_len or (ms.cfg.seq_len if ms.cfg else 128)
            heads = ms.cfg.kv_heads if ms.cfg else 1
            tps = [t for t in range(1, world + 1) if world % t == 0 and heads % t == 0]
            cps = [c for c in range(1, world + 1) if world % c == 0 and sequence_problem(seq, c) is None]
            measure_layers(db, args.model, seq, [int(b) for b in args.batches.split(",")], tps, cps,
                           args.repeats, device)
            for c in chunk_lengths(seq):  # one sequence chunk: what each chunk pays (ProfileDB.layer_fixed_share)
                measure_layers(db, args.model, c, [1], [1], [1], args.repeats, device)
            measure_split(db, args.model, seq, args.repeats, device)
        if rank == 0:
            db.to_json(args.out)
            _log(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_process(0)  # the gloo exit abort (codegen/runtime/mesh.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
