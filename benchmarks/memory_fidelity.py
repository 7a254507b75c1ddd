"""Memory-model fidelity: predicted per-rank peak memory vs the live-tensor peak of a real step.

For each layout, one torchrun launch (gloo, CPU) builds the model with the runtime
(``codegen.runtime.train.parallelize``, AdamW), runs one training step, then measures
the SECOND step (optimizer states exist) with :class:`LiveTensorTracker`: every storage
alive at the start of the step (found by a ``gc`` scan) plus every storage an operator
creates during it, counted once each, freed when the storage dies (weakref) or is
resized (FSDP2 frees its all-gather buffers with ``storage.resize_(0)``). The peak of
that sum is compared with ``estimate(...).memory[pp rank].tensors``, predicted with the
same global batch, micro-batch size and partition the run uses.

At the peak the live bytes are split into weights / grads / optimizer states (storages
that are parameters, gradients and optimizer state at the end of the step) and ``other``
(activations, FSDP all-gather buffers, collective buffers, temporaries), with the ops
that created the largest ``other`` storages, and the phase (fwd/bwd or optimizer).

    python -m benchmarks.memory_fidelity [--model gpt-small] [--seq-len 128] [--global-batch 8]
        [--nproc 4] [--layouts dp4-ddp,dp4-fsdp,...] [--out benchmarks/results/memory_fidelity.json]

The worker half (``--worker OUT``) is what torchrun runs; tests/test_memory_fidelity.py
reuses both halves at a smaller size.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from collections import defaultdict
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results import write_json  # noqa: E402

MiB = 2**20
TOLERANCE = 0.15

# name -> (config string, model variant suffix). "untied": the preset with an untied
# output projection (the runtime refuses tied embeddings across pipeline stages).
LAYOUTS: dict[int, list[tuple[str, str, str]]] = {
    4: [
        ("dp4-ddp", "dp=4,zero=ddp,dtype=fp32", ""),
        ("dp4-fsdp", "dp=4,zero=fsdp,dtype=fp32", ""),
        ("dp2-tp2-sp", "dp=2,tp=2,sp=on,dtype=fp32", ""),
        ("pp2-dp2-1f1b", "pp=2,dp=2,schedule=1f1b,dtype=fp32", "untied"),
        ("pp2-dp2-fsdp", "pp=2,dp=2,schedule=1f1b,zero=fsdp,dtype=fp32", "untied"),
        ("dp4-recompute-full", "dp=4,recompute=full,dtype=fp32", ""),
        # bf16 mixed precision (codegen/runtime/precision.py): fp32 masters, bf16 compute copies
        ("dp4-ddp-bf16", "dp=4,zero=ddp,dtype=bf16", ""),
        ("dp4-fsdp-bf16", "dp=4,zero=fsdp,dtype=bf16", ""),
        ("dp2-tp2-sp-bf16", "dp=2,tp=2,sp=on,dtype=bf16", ""),
        ("pp2-dp2-fsdp-bf16", "pp=2,dp=2,schedule=1f1b,zero=fsdp,dtype=bf16", "untied"),
        ("pp4-1f1b-bf16", "pp=4,schedule=1f1b,dtype=bf16", "untied"),
    ],
    2: [
        ("dp2-ddp", "dp=2,zero=ddp,dtype=fp32", ""),
        ("dp2-fsdp", "dp=2,zero=fsdp,dtype=fp32", ""),
        ("pp2-1f1b", "pp=2,schedule=1f1b,dtype=fp32", "untied"),
    ],
}


# ----------------------------------------------------------------------------- model + graph
def model_config(model: str, variant: str):
    from planner import zoo
    cfg = zoo.preset(model)
    if variant == "untied":
        cfg = cfg.replace(tie_embeddings=False)
    return cfg


def graph_for(model: str, variant: str, seq_len: int):
    """The ModelGraph the planner would capture (``planner.frontend.load.load_graph``'s preset path),
    for the preset or its untied variant, at batch 1."""
    import torch
    from planner import zoo
    from planner.frontend.trace import capture
    from planner.frontend.load import load_graph
    if not variant:
        return load_graph(model, batch=1, seq_len=seq_len)
    cfg = model_config(model, variant)
    with torch.device("meta"):
        m = zoo.build_model(cfg, device="meta")
    ex = zoo.example_batch(cfg, 1, seq_len, device="meta")
    config = {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, bool))}
    return capture(m, ex, name=f"{cfg.name}-{variant}", config=config, hidden=cfg.hidden, vocab=cfg.vocab)


def partition_for(graph, pc):
    from planner.plan import Partition
    return Partition.even(len(graph.layers), pc.pp * pc.vpp, pc.recompute)


def predict(graph, pc, global_batch: int) -> tuple[list[dict], int]:
    """Per pp rank StageMemory dicts (bytes) and the number of micro-batches."""
    from cost_models.cluster import parse_cluster
    from cost_models.estimate import estimate
    est = estimate(graph, parse_cluster(f"local-cpu:{pc.world}"), pc, partition_for(graph, pc), global_batch)
    return [dict(m.to_dict(), tensors=m.tensors) for m in est.memory], est.microbatches


# ----------------------------------------------------------------------------- tracker
def _storages_of(t) -> list:
    """Untyped storages behind tensor ``t`` (inner tensors of wrapper subclasses such as DTensor)."""
    import torch
    from codegen.runtime.torch_compat import is_traceable_wrapper_subclass
    if not isinstance(t, torch.Tensor):
        return []
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        out = []
        for a in attrs:
            out += _storages_of(getattr(t, a))
        return out
    if t.device.type == "meta":
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


class LiveBytes:
    """Live bytes of tensor storages: each storage counted once, from creation (an op output)
    or the start (``add_existing``) until it dies or is resized; tracks the peak. The
    bookkeeping of :class:`LiveTensorTracker`."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[Any, int, str]] = {}   # id(storage) -> (weakref, nbytes, label)
        self.total = 0
        self.peak = 0
        self.peak_snapshot: list[tuple[Any, int, str]] = []
        self.peak_phase = ""
        self.phase = "fwd/bwd"

    def _dead(self, key: int):
        def cb(_ref):
            ent = self.live.pop(key, None)
            if ent is not None:
                self.total -= ent[1]
        return cb

    def track(self, st, label: str) -> None:
        key = id(st)
        if key in self.live:
            return
        nb = int(st.nbytes())
        self.live[key] = (weakref.ref(st, self._dead(key)), nb, label)
        self.total += nb
        self._bump()

    def resized(self, st, label: str) -> None:
        ent = self.live.get(id(st))
        if ent is None:
            self.track(st, label)
            return
        nb = int(st.nbytes())
        self.total += nb - ent[1]
        self.live[id(st)] = (ent[0], nb, ent[2])
        self._bump()

    def _bump(self) -> None:
        if self.total > self.peak:
            self.peak = self.total
            self.peak_phase = self.phase
            self.peak_snapshot = list(self.live.values())

    def add_existing(self) -> None:
        """Count every tensor storage alive now (Python-visible tensors, via gc)."""
        import warnings

        import torch

        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for obj in objs:
            try:
                for st in _storages_of(obj):
                    self.track(st, "existing")
            except Exception:  # noqa: BLE001 - exotic objects: skip
                continue
        self.peak = self.total
        self.peak_snapshot = list(self.live.values())
        self.peak_phase = "start"


class LiveTensorTracker(LiveBytes):
    """:class:`LiveBytes` of a step run under :meth:`watching`: every op output's storages are
    tracked, and every ``UntypedStorage.resize_`` (FSDP frees and regrows its unsharded parameters)."""

    def watching(self):
        from codegen.runtime.torch_compat import observe_ops

        return observe_ops(self.seen, resized=lambda st: self.resized(st, "resize_"))

    def seen(self, func, args, kwargs, out) -> None:
        from codegen.runtime.torch_compat import tree_flatten

        label = str(func.overloadpacket.__name__)
        for t in tree_flatten(out)[0]:
            for st in _storages_of(t):
                self.track(st, label)


def classify_peak(tracker, pm) -> dict[str, Any]:
    """Split the peak's live bytes into weights / grads / optimizer / other, by what the
    storages are at the end of the step (parameters, their gradients, optimizer state)."""
    import torch
    kinds: dict[int, str] = {}
    for _, p in pm.named_parameters():
        for st in _storages_of(p):
            kinds.setdefault(id(st), "weights")
        if p.grad is not None:
            for st in _storages_of(p.grad):
                kinds.setdefault(id(st), "grads")
    for opt in pm.optimizer.optimizers:
        inner = getattr(opt, "inner", opt)
        if inner is None:
            continue
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    for st in _storages_of(v):
                        kinds.setdefault(id(st), "optimizer")
    cats = defaultdict(float)
    other_by_op = defaultdict(float)
    for ref, nb, label in tracker.peak_snapshot:
        st = ref()
        kind = kinds.get(id(st)) if st is not None else None
        if kind is None:
            kind = "other"
            other_by_op[label] += nb
        cats[kind] += nb
    top = sorted(other_by_op.items(), key=lambda kv: -kv[1])[:6]
    return {"by_category": dict(cats), "other_top_ops": top}


# ----------------------------------------------------------------------------- worker
def _batch(vocab: int, gb: int, seq: int, step: int):
    import torch
    g = torch.Generator().manual_seed(100 + step)
    return {"input_ids": torch.randint(0, vocab, (gb, seq), generator=g),
            "labels": torch.randint(0, vocab, (gb, seq), generator=g)}


def run_layout(model: str, variant: str, cfg_str: str, seq: int, gb: int, graphs: dict) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from codegen.runtime.train import parallelize
    from planner import zoo
    from planner.plan import ParallelConfig
    from planner.frontend.tp_layout import tp_layout

    pc = ParallelConfig.parse(cfg_str).validate()
    key = (model, variant)
    if key not in graphs:
        graphs[key] = graph_for(model, variant, seq)
    graph = graphs[key]
    part = partition_for(graph, pc)
    names = [l.name for l in graph.layers]
    stages = [names[a:b] for a, b in part.bounds]
    mcfg = model_config(model, variant)
    m = zoo.build_model(mcfg, device="meta")
    pm = parallelize(m, pc, stages, part.recompute, tp_layout(graph), gb, seq, "cpu",
                     optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1), seed=1234)
    t0 = time.perf_counter()
    loss1 = pm.step(_batch(mcfg.vocab, gb, seq, 0))
    t1 = time.perf_counter()
    dist.barrier()
    gc.collect()
    tracker = LiveTensorTracker()
    opts = pm.optimizer.optimizers  # torch's step hooks mark the optimizer phase: the first's pre, the last's post
    hooks = [opts[0].register_step_pre_hook(lambda *_: setattr(tracker, "phase", "optimizer")),
             opts[-1].register_step_post_hook(lambda *_: setattr(tracker, "phase", "after"))]
    batch = _batch(mcfg.vocab, gb, seq, 1)
    tracker.add_existing()
    start = tracker.total
    t2 = time.perf_counter()
    with tracker.watching():
        loss2 = pm.step(batch)
    t3 = time.perf_counter()
    for h in hooks:
        h.remove()
    info = classify_peak(tracker, pm)
    pp_rank = pm.mesh["pp"].get_local_rank()  # before close() destroys the mesh's groups
    pm.close()
    res = {"rank": dist.get_rank(), "pp_rank": pp_rank, "peak": tracker.peak,
           "start": start, "peak_phase": tracker.peak_phase, "losses": [loss1, loss2],
           "step1_s": t1 - t0, "step2_s": t3 - t2, **info}
    pm = m = tracker = None  # free them before the next layout (the closures above hold names, not values)
    gc.collect()
    return res


def worker(out: str, model: str, seq: int, gb: int, only: Optional[list[str]]) -> None:
    import torch
    import torch.distributed as dist
    from codegen.runtime.mesh import exit_process, init_distributed, teardown

    torch.set_num_threads(1)
    init_distributed()
    world = dist.get_world_size()
    graphs: dict = {}
    results: dict[str, Any] = {}
    for name, cfg_str, variant in LAYOUTS[world]:
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            r = run_layout(model, variant, cfg_str, seq, gb, graphs)
        except Exception as exc:  # noqa: BLE001 - report and keep going
            import traceback
            traceback.print_exc()
            r = {"rank": dist.get_rank(), "error": f"{type(exc).__name__}: {exc}"}
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, r)
        results[name] = {"config": cfg_str, "variant": variant, "ranks": per_rank,
                         "seconds": time.perf_counter() - t0}
        if dist.get_rank() == 0:
            peaks = " ".join(f"{x.get('peak', 0) / MiB:.0f}" for x in per_rank)
            print(f"[worker] {name}: {time.perf_counter() - t0:.1f}s, peaks MiB {peaks}", flush=True)
            with open(out, "w") as fh:  # after every layout: a later crash keeps what was measured
                json.dump(results, fh)
    teardown()
    exit_process(0)  # the gloo exit abort (codegen/runtime/mesh.py)


# ----------------------------------------------------------------------------- launcher
def launch(nproc: int, model: str, seq: int, gb: int, layouts: Optional[list[str]], out: str,
           timeout: Optional[float] = None) -> dict:
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), "--worker", out, "--model", model,
           "--seq-len", str(seq), "--global-batch", str(gb)]
    if not os.path.exists(cmd[0]):
        cmd = [sys.executable, "-m", "torch.distributed.run"] + cmd[1:]
    if layouts:
        cmd += ["--layouts", ",".join(layouts)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # MALLOC_MMAP_THRESHOLD_: large tensors are mmapped and returned to the OS when freed, so
    # the ranks' resident memory stays near their live tensors (4 x gpt-small on a 24 GiB box).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, timeout=timeout, cwd=root)
    if proc.returncode and not os.path.exists(out):
        raise RuntimeError(f"torchrun failed (rc {proc.returncode}) before any layout finished")
    with open(out) as fh:
        return json.load(fh)


def compare(measured: dict, model: str, seq: int, gb: int) -> list[dict]:
    """One row per (layout, rank): prediction for the rank's pp stage vs the measured peak."""
    from planner.plan import ParallelConfig
    rows, graphs = [], {}
    for name, lay in measured.items():
        pc = ParallelConfig.parse(lay["config"]).validate()
        key = lay["variant"]
        if key not in graphs:
            graphs[key] = graph_for(model, key, seq)
        preds, m = predict(graphs[key], pc, gb)
        for r in lay["ranks"]:
            if "error" in r:
                rows.append({"layout": name, "rank": r["rank"], "error": r["error"]})
                continue
            # mesh order [pp, dp, cp, tp]: pp index = rank // (dp * cp * tp)
            pp_idx = r["rank"] // (pc.dp * pc.cp * pc.tp)
            assert pp_idx == r["pp_rank"], (pp_idx, r["pp_rank"])
            p = preds[pp_idx]
            err = (p["tensors"] - r["peak"]) / r["peak"]
            rows.append({"layout": name, "config": lay["config"], "rank": r["rank"], "pp_rank": pp_idx,
                         "microbatches": m, "predicted": p, "measured_peak": r["peak"],
                         "measured_start": r["start"], "measured_at_peak": r["by_category"],
                         "other_top_ops": r["other_top_ops"], "peak_phase": r["peak_phase"],
                         "err": err, "within_tolerance": abs(err) <= TOLERANCE, "step2_s": r["step2_s"]})
    return rows


def print_table(rows: list[dict]) -> None:
    hdr = (f"{'layout':<20}{'rk':>3}{'pp':>3}  {'pred MiB: W':>11}{'G':>7}{'Opt':>7}{'Act':>7}{'Buf':>7}{'Tot':>8}"
           f"  {'meas MiB: W':>11}{'G':>7}{'Opt':>7}{'Other':>7}{'Peak':>8}{'phase':>10}{'err':>8}")
    print(hdr)
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:<20}{r['rank']:>3}  ERROR {r['error']}")
            continue
        p, c = r["predicted"], r["measured_at_peak"]
        f = lambda v: v / MiB  # noqa: E731
        print(f"{r['layout']:<20}{r['rank']:>3}{r['pp_rank']:>3}  {f(p['weights']):>11.1f}{f(p['grads']):>7.1f}"
              f"{f(p['optimizer']):>7.1f}{f(p['activations']):>7.1f}{f(p['buffers']):>7.1f}{f(p['tensors']):>8.1f}"
              f"  {f(c.get('weights', 0)):>11.1f}{f(c.get('grads', 0)):>7.1f}{f(c.get('optimizer', 0)):>7.1f}"
              f"{f(c.get('other', 0)):>7.1f}{f(r['measured_peak']):>8.1f}{r['peak_phase']:>10}"
              f"{r['err'] * 100:>7.1f}%")


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--layouts", default="", help="comma-separated subset of the layout names")
    ap.add_argument("--out", default="benchmarks/results/memory_fidelity.json")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    only = [s for s in args.layouts.split(",") if s] or None
    if args.worker:
        worker(args.worker, args.model, args.seq_len, args.global_batch, only)
        return
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-memfid-") as tmp:
        measured = launch(args.nproc, args.model, args.seq_len, args.global_batch, only, os.path.join(tmp, "m.json"))
    run_s = time.perf_counter() - t0
    rows = compare(measured, args.model, args.seq_len, args.global_batch)
    print(f"\nmodel {args.model}, seq {args.seq_len}, global batch {args.global_batch}, local-cpu:{args.nproc}, "
          f"fp32 AdamW; peak of step 2 (live tensors); err = (predicted - measured) / measured\n")
    print_table(rows)
    ok = [r for r in rows if "error" not in r]
    n_ok = sum(r["within_tolerance"] for r in ok)
    print(f"\n{n_ok}/{len(rows)} rank rows within {TOLERANCE:.0%}; torchrun run {run_s:.1f}s")
    for r in ok:
        if not r["within_tolerance"]:
            ops = ", ".join(f"{k} {v / MiB:.1f}" for k, v in r["other_top_ops"])
            print(f"  {r['layout']} rank {r['rank']}: 'other' at peak by creating op (MiB): {ops}")
    write_json(args.out, {"args": vars(args), "run_seconds": run_s, "tolerance": TOLERANCE, "rows": rows,
                          "layouts": {k: {kk: vv for kk, vv in v.items() if kk != "ranks"}
                                      for k, v in measured.items()}})


if __name__ == "__main__":
    main()
