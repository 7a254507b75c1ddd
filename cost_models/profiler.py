"""Profiler: measure the real cluster and write a ProfileDB (JSON).

Run by ``autopar profile --cluster local-cpu:4 --model gpt-small -o profile.json``, which
launches this module under torchrun (``python -m cost_models.profiler ...`` on every
rank). The same code runs with gloo on CPUs and nccl on GPUs. It measures:

(a) **Layers**: every distinct layer class of the model (one representative of each
    signature), forward and backward, at the shapes candidate plans run: micro-batch
    sizes ``--batches``, and each TP shard size (column-parallel linears keep
    out/tp outputs, row-parallel ones in/tp inputs - exactly the local work of a TP
    rank, without its collectives, which the communication model adds) and each CP
    size (the rank's S/cp tokens; the ring's attention over the other ranks' keys
    is scaled in as cp x the local attention core). All ranks measure at once, so
    the figures include the contention of ranks sharing a machine, as in training.
(b) **Collectives**: all-reduce, all-gather, reduce-scatter, all-to-all for each
    group size the mesh can have, with all groups of that size running at once
    (as all tp groups, or all dp groups, do in training), over message sizes.
(c) **p2p**: send/recv between rank pairs, all pairs at once.

Times are medians of ``--repeats`` runs after a warm-up. Only rank 0 writes the
file (atomically).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24)


def _log(msg: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[profile] {msg}", flush=True)


def _timeit(fn: Callable[[], Any], repeats: int, sync: Callable[[], None], budget_s: float = 2.0) -> float:
    """Median seconds of ``fn`` over up to ``repeats`` timed runs after one warm-up, stopping
    early once ``budget_s`` is spent (at least 3 runs when they are that cheap)."""
    fn()
    sync()
    ts: list[float] = []
    spent = 0.0
    while len(ts) < repeats and (spent < budget_s or len(ts) < min(3, repeats)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
        spent += ts[-1]
    return statistics.median(ts)


def _coll_repeats(nbytes: int, repeats: int) -> int:
    """Small messages are cheap and noisy on an oversubscribed CPU: time many more of them."""
    return max(repeats, 25) if nbytes <= (1 << 20) else repeats


def _all_gather(out, inp, group):
    import torch.distributed as dist

    # torch >= 2.13 renamed all_gather_into_tensor; older releases (the GPU box has 2.11) lack the new name
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp, group=group)


def _reduce_scatter(out, inp, group):
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, inp, group=group)


def _groups(world: int, n: int) -> list[list[int]]:
    """Contiguous groups of n ranks (the inner-most mesh placement)."""
    return [list(range(i, i + n)) for i in range(0, world, n)]


def measure_collectives(db, world: int, rank: int, sizes, repeats: int, device) -> None:
    import torch
    import torch.distributed as dist

    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    for n in [d for d in range(2, world + 1) if world % d == 0]:
        groups = _groups(world, n)
        pgs = [dist.new_group(g) for g in groups]
        mine = pgs[rank // n]
        for kind in KINDS:
            for nbytes in sizes:
                elems = max(n, nbytes // 4 // n * n)
                x = torch.ones(elems, device=device)
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(x, group=mine)
                elif kind == "all_gather":
                    inp = torch.ones(elems // n, device=device)
                    fn = lambda: _all_gather(x, inp, group=mine)
                elif kind == "reduce_scatter":
                    out = torch.empty(elems // n, device=device)
                    fn = lambda: _reduce_scatter(out, x, group=mine)
                else:
                    out = torch.empty_like(x)
                    fn = lambda: dist.all_to_all_single(out, x, group=mine)
                dist.barrier()
                t = _timeit(fn, _coll_repeats(nbytes, repeats), sync, budget_s=1e9)
                tt = torch.tensor([t], dtype=torch.float64)
                dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                db.add_collective(kind, n, "intra" if _same_node(groups[0]) else "inter", elems * 4, tt.item())
        _log(f"collectives over groups of {n}: done")
    # p2p: pairs (0,1), (2,3), ... exchange at once; one-way time = ping-pong / 2
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), device=device)
        peer = rank ^ 1
        if peer >= world:
            continue

        def pingpong():
            if rank % 2 == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
        dist.barrier()
        t = _timeit(pingpong, _coll_repeats(nbytes, repeats), sync, budget_s=1e9) / 2
        tt = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        db.add_collective("send_recv", 2, "intra" if _same_node([0, 1]) else "inter", x.numel() * 4, tt.item())
    _log("p2p: done")


def _same_node(group: list[int]) -> bool:
    per = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return len({r // per for r in group}) == 1


def _shard_linears(unit, roles: dict[str, str], tp: int):
    """A copy of ``unit`` whose column/row-parallel linears have a TP rank's local shape."""
    import torch.nn as nn

    u = copy.deepcopy(unit)
    for name, role in roles.items():
        if role not in ("column", "row"):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = u.get_submodule(parent_name) if parent_name else u
        lin = getattr(parent, leaf)
        if not isinstance(lin, nn.Linear):
            continue
        fin, fout = lin.in_features, lin.out_features
        if role == "column":
            fout //= tp
        else:
            fin //= tp
        new = nn.Linear(fin, fout, bias=lin.bias is not None, device=lin.weight.device, dtype=lin.weight.dtype)
        setattr(parent, leaf, new)
    return u


def measure_layers(db, spec: str, seq_len: int, batches, tps, cps, repeats: int, device) -> None:
    import torch
    import torch.distributed as dist

    from planner import zoo
    from planner.frontend import load_graph

    graph = load_graph(spec, batch=1, seq_len=seq_len)
    ms = zoo.load_model_spec(spec)
    if ms.cfg is None:
        raise SystemExit("error: the profiler measures zoo models (presets or TOML specs); "
                         "profile a preset of the same shape")
    model = zoo.build_model(ms.cfg, device=device, seed=0)
    reps = {}
    for layer in graph.layers:
        if layer.repeat_of is None:
            reps[layer.signature] = layer
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    total = len(reps) * len(batches) * len(tps) * len(cps)
    done = 0
    for cp in cps:
        for b in batches:
            s = seq_len // cp
            inputs: dict[str, tuple] = {}
            hooks = []
            for layer in reps.values():
                mod = model.get_submodule(layer.name)
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, k, name=layer.name: inputs.setdefault(name, (a, k)), with_kwargs=True))
            with torch.no_grad():
                model(**zoo.example_batch(ms.cfg, b, s, device=device))
            for h in hooks:
                h.remove()
            for tp in tps:
                for sig, layer in reps.items():
                    roles = {l.name: l.role for l in layer.linears}
                    if tp > 1 and layer.attention is not None and layer.attention.kv_heads % tp:
                        done += 1
                        continue
                    unit = model.get_submodule(layer.name)
                    unit = _shard_linears(unit, roles, tp) if tp > 1 else unit
                    a, k = inputs[layer.name]

                    def prep():
                        aa = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                              for x in a]
                        return aa

                    def fwd():
                        with torch.no_grad():
                            unit(*a, **k)

                    def fwd_bwd():
                        out = unit(*prep(), **k)
                        out = out if isinstance(out, torch.Tensor) else out[0]
                        (out.float().sum() if out.dim() else out).backward()

                    dist.barrier()
                    tf = _timeit(fwd, repeats, sync)
                    tfb = _timeit(fwd_bwd, repeats, sync)
                    tb = max(tfb - tf, 0.0)
                    if cp > 1 and layer.attention is not None:
                        # ring attention: this rank's queries meet cp blocks of keys, not one
                        a_ = layer.attention
                        peak_core = 4.0 * b * a_.heads / tp * s * s * a_.head_dim
                        extra = (cp - 1) * 0.5 * peak_core / _gemm_rate(device)
                        tf += extra
                        tb += 2.5 * extra
                    tt = torch.tensor([tf, tb], dtype=torch.float64)
                    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
                    db.add_layer(sig, b, seq_len, tp, cp, tt[0].item(), tt[1].item())
                    done += 1
            _log(f"layers: {done}/{total} shapes measured (cp={cp}, batch={b})")


_RATE: dict[str, float] = {}


def _gemm_rate(device) -> float:
    """Measured matmul FLOP/s of this rank (for scaling the ring's extra attention work)."""
    import torch

    key = str(device)
    if key not in _RATE:
        a = torch.randn(512, 512, device=device)
        t = _timeit(lambda: a @ a, 5, (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None))
        _RATE[key] = 2 * 512**3 / t
    return _RATE[key]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cost_models.profiler")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES))
    ap.add_argument("--skip-layers", action="store_true")
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from cost_models.cluster import parse_cluster
    from cost_models.profile_db import ProfileDB

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    torch.manual_seed(0)
    try:
        cluster = parse_cluster(args.cluster)
        db = ProfileDB(cluster_fingerprint=cluster.fingerprint(), backend=dist.get_backend(), world=world)
        t0 = time.perf_counter()
        measure_collectives(db, world, rank, [int(s) for s in args.sizes.split(",")], args.repeats, device)
        if not args.skip_layers:
            from planner import zoo

            ms = zoo.load_model_spec(args.model)
            seq = args.seq_len or (ms.cfg.seq_len if ms.cfg else 128)
            heads = ms.cfg.kv_heads if ms.cfg else 1
            tps = [t for t in range(1, world + 1) if world % t == 0 and heads % t == 0]
            cps = [c for c in range(1, world + 1) if world % c == 0 and seq % (2 * c) == 0]
            measure_layers(db, args.model, seq, [int(b) for b in args.batches.split(",")], tps, cps,
                           args.repeats, device)
        if rank == 0:
            db.to_json(args.out)
            _log(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
