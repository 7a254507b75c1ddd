"""The profiler: a TP rank's local layer shapes, the ring's compute under CP, batched timing,
core pinning, and one real 2-process profile."""
from __future__ import annotations

import math
import os
import threading
import types

import pytest
import torch

from codegen.runtime import context_parallel as cpar
from cost_models import cpu_runtime, machine, profile_timing, profiler
from cost_models.cluster import parse_cluster
from cost_models.memory import layer_params_local
from cost_models.profile_db import FSDP_UNIT, ProfileDB
from planner import zoo
from planner.frontend.load import load_graph
from launches import run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny"])
def test_shard_unit_holds_a_tp_ranks_parameters_and_runs(spec):
    """Every layer class sharded for tp=2 holds what the memory model says a TP rank holds
    (vocabulary-parallel embedding and head included) and runs forward + backward on the
    inputs the full model gives it (labels mapped into the local vocabulary)."""
    graph = load_graph(spec, batch=1, seq_len=16)
    cfg = zoo.load_model_spec(spec).cfg
    model = zoo.build_model(cfg, device="cpu", seed=0)
    reps = {l.signature: l for l in graph.layers if l.repeat_of is None}
    inputs = {}
    hooks = [model.get_submodule(l.name).register_forward_pre_hook(
        lambda m, a, k, name=l.name: inputs.setdefault(name, (a, k)), with_kwargs=True) for l in reps.values()]
    with torch.no_grad():
        model(**zoo.example_batch(cfg, 2, 16, device="cpu"))
    for h in hooks:
        h.remove()
    vocab_layers = 0
    for layer in reps.values():
        full = model.get_submodule(layer.name)
        unit = profiler.shard_unit(full, layer, 2)
        local = sum(p.numel() for p in unit.parameters())
        assert local == pytest.approx(layer_params_local(layer, 2), rel=0.01), layer.name
        if layer.vocab or any(o.tp_style == "vocab" for o in layer.ops):
            vocab_layers += 1
            assert local < 0.6 * sum(p.numel() for p in full.parameters()), layer.name
        a, k = profiler.local_labels(*inputs[layer.name], layer, 2)
        out = unit(*[x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                     for x in a], **k)
        out = out if isinstance(out, torch.Tensor) else out[0]
        (out.float().sum() if out.dim() else out).backward()
        assert all(p.grad is not None for p in unit.parameters() if p.requires_grad)
    assert vocab_layers == 2  # token embedding and head
    assert profiler.shard_unit(model.embed, graph.layers[0], 1) is model.embed


def test_head_loss_is_timed_as_the_runtime_computes_it(tmp_path):
    """Under TP the profiled head's logits are a vocabulary-sharded DTensor and its loss runs
    through torch's loss_parallel, as the runtime's does (not the fused local kernel): the same
    loss and gradients as the plain local shard with the same weights."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from codegen.runtime.tensor_parallel import loss_context

    spec = "gpt-tiny"
    graph = load_graph(spec, batch=1, seq_len=16)
    cfg = zoo.load_model_spec(spec).cfg
    model = zoo.build_model(cfg, device="cpu", seed=0)
    head = next(l for l in graph.layers if l.repeat_of is None and any(x.role == "vocab" for x in l.linears))
    got = {}
    hook = model.get_submodule(head.name).register_forward_pre_hook(
        lambda m, a, k: got.setdefault("in", (a, k)), with_kwargs=True)
    with torch.no_grad():
        model(**zoo.example_batch(cfg, 2, 16, device="cpu"))
    hook.remove()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        unit = profiler.shard_unit(model.get_submodule(head.name), head, 2, profiler.one_rank_mesh("cpu"))
        plain = profiler.shard_unit(model.get_submodule(head.name), head, 2)
        with torch.no_grad():
            for p, q in zip(unit.parameters(), plain.parameters()):
                q.copy_(p.to_local() if isinstance(p, DTensor) else p)
        assert any(isinstance(p, DTensor) for p in unit.parameters())  # the head's linear, on the mesh
        logits = []
        vocab = next(m for m in unit.modules() if isinstance(m, torch.nn.Linear))
        hook = vocab.register_forward_hook(lambda m, a, out: logits.append(out))
        _, fwd_bwd = profiler.layer_calls(unit, head, got["in"], 2)
        fwd_bwd()
        hook.remove()
        # the loss saw vocabulary-sharded DTensor logits (what loss_parallel takes), not a local tensor
        assert isinstance(logits[0], DTensor) and logits[0].placements == (Shard(logits[0].dim() - 1),)
        a, k = profiler.local_labels(*got["in"], head, 2)
        want = plain(*a, **k)
        want.backward()
        with torch.no_grad(), loss_context(2):
            loss = unit(*a, **k)
        assert isinstance(loss, DTensor) or loss.dim() == 0
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
        for p, q in zip(unit.parameters(), plain.parameters()):
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, q.grad, rtol=1e-4, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_ring_compute_covers_the_causal_attention_once(monkeypatch):
    """Summed over the cp ranks, RingCompute's block attentions see every causal
    (query, key) pair exactly once, and zigzag gives every rank the same share: the work
    of the runtime's RingAttention, without its exchange."""
    seen = []
    real = cpar.partial_attention

    def counting(q, k, v, *, causal, q_pos=None, kv_pos=None, scale=None, q_doc=None):
        seen.append(int((kv_pos[None, :] <= q_pos[:, None]).sum()))
        return real(q, k, v, causal=causal, q_pos=q_pos, kv_pos=kv_pos, scale=scale, q_doc=q_doc)

    monkeypatch.setattr(cpar, "partial_attention", counting)
    seq, cp = 32, 4
    shares = []
    for r in range(cp):
        seen.clear()
        q = torch.randn(1, 2, seq // cp, 8, requires_grad=True)
        kv = torch.randn(1, 2, seq // cp, 8, requires_grad=True)
        out = cpar.RingCompute(cp, r)(q, kv, kv, causal=True)
        out.sum().backward()
        assert out.shape == q.shape and q.grad is not None
        shares.append(sum(seen))
    assert sum(shares) == seq * (seq + 1) // 2
    assert len(set(shares)) == 1
    with pytest.raises(ValueError, match="outside"):
        cpar.RingCompute(2, 2)


def test_timeit_batches_fast_calls_and_agrees_on_the_batch():
    calls, agreed, steps = [], [], []
    t = profile_timing.timeit(lambda: calls.append(1), repeats=3, sync=lambda: None, target_s=0.005,
                         agree=lambda x: agreed.append(x) or x + 1, lockstep=lambda: steps.append(1))
    k, n = agreed
    assert k > 10 and n == 3                       # a no-op is far below 5 ms: batched; 3 batches asked
    assert len(steps) == n + 1                     # the agreed batch count, each started in lockstep
    assert len(calls) == 2 + (n + 1) * (k + 1)     # warm-up, probe, the agreed batches of the agreed k
    assert 0 < t < 1e-3


def test_timeit_cuts_slow_calls_to_the_budget():
    import time

    calls = []
    profile_timing.timeit(lambda: calls.append(time.sleep(0.01)), repeats=50, sync=lambda: None, budget_s=0.05,
                     target_s=0.001)
    assert 2 + 3 <= len(calls) <= 2 + 6            # k = 1; about 0.05 s / 0.01 s batches, at least 3


def test_pin_cpu_rank_gives_each_rank_its_own_cores(monkeypatch):
    from codegen.runtime.mesh import pin_cpu_rank

    before = os.sched_getaffinity(0)
    cores = sorted(before)
    try:
        monkeypatch.delenv("AUTOPAR_NO_PIN", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(cores)))
        got = []
        for r in range(len(cores)):
            monkeypatch.setenv("LOCAL_RANK", str(r))
            os.sched_setaffinity(0, before)  # each rank is a fresh process with every core allowed
            got.append(pin_cpu_rank())
            assert os.sched_getaffinity(0) == got[-1]
        assert [len(g) for g in got] == [1] * len(cores) and set().union(*got) == before
        monkeypatch.setenv("AUTOPAR_NO_PIN", "1")
        assert pin_cpu_rank() is None
    finally:
        os.sched_setaffinity(0, before)


def test_unpinned_runs_a_pinned_rank_on_the_launchs_cores(monkeypatch):
    """A rank pinned to one core plans and probes on every core its launch (the parent's
    affinity) allowed, then runs on its own core again."""
    from codegen.runtime.mesh import launch_cores, pin_cpu_rank, unpinned

    before = os.sched_getaffinity(0)
    if len(before) < 2 or os.sched_getaffinity(os.getppid()) != before:
        pytest.skip("needs 2 cores and a parent with this process's cores")
    try:
        monkeypatch.delenv("AUTOPAR_NO_PIN", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(before)))
        monkeypatch.setenv("LOCAL_RANK", "1")
        mine = pin_cpu_rank()
        assert len(mine) == 1 and launch_cores() == before
        with unpinned():
            assert os.sched_getaffinity(0) == before
            assert machine.cpu_count() == len(before)  # what Cluster.detect counts
            seen = []
            worker = threading.Thread(target=lambda: (seen.append(os.sched_getaffinity(0)), started.wait(5)))
            started = threading.Event()
            worker.start()  # a thread started inside inherits the wide set...
        assert os.sched_getaffinity(0) == mine and seen == [before]
        assert os.sched_getaffinity(worker.native_id) == mine  # ...and is put back on the way out
        started.set()
        worker.join()
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.slow
def test_profiler_two_processes(tmp_path):
    """One real profile on 2 gloo processes: every layer class at tp 1/2 x cp 1/2 x 2 batch
    sizes, every collective kind at both sizes, positive times; layers timed in bf16 (a GPU
    cluster's plans' dtype) when asked, and the file says so."""
    from planner.entry.launch import torchrun_cmd

    out = tmp_path / "p.json"
    cmd = torchrun_cmd(2, profiler.worker_args("local-cpu:2", "gpt-tiny", str(out), seq_len=32, batches="1,2",
                                               sizes="1024,65536", repeats=2, dtype="bf16"))
    r = run_launch(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    db = ProfileDB.load(out)
    assert db.dtype == "bf16"
    assert db.matches(parse_cluster("local-cpu:2").fingerprint())  # the cluster the job ran on, not a rank's core
    graph = load_graph("gpt-tiny", batch=1, seq_len=32)
    sigs = {l.signature for l in graph.layers}
    assert set(db.layers) == sigs
    for samples in db.layers.values():
        assert {(s.batch, s.tp, s.cp) for s in samples} == {(b, t, c) for b in (1, 2) for t in (1, 2) for c in (1, 2)}
        assert all(s.fwd_s > 0 and s.bwd_s > 0 for s in samples)
    kinds = {k.split("/")[0] for k in db.collectives}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", FSDP_UNIT}
    units = db.collectives.pop(f"{FSDP_UNIT}/2/intra")  # FSDP2 units of the sizes from 64 KiB up, and 64 MiB
    assert [s.nbytes for s in units] == [128 * 128 * 4, 4096 * 4096 * 4] and all(s.seconds > 0 for s in units)
    assert all(len(v) == 2 and all(s.seconds > 0 for s in v) for v in db.collectives.values())
    assert "[profile] wrote" in r.stdout
    # what a split backward costs beyond a whole one (torch's I then W), over the blocks and the head
    assert 0.0 <= db.runtime["split_backward_frac"] < 2.0 and "[profile] split backward: +" in r.stdout
    # the runtime's own work per call, DTensor's dispatch per sharded module among it (1.15 ms by default)
    assert set(db.runtime) == set(cpu_runtime.KEYS) - {"lockstep_wait_frac"}
    assert 1e-4 < db.runtime["dtensor_module_s"] < 2e-2 and "[profile] runtime work: dtensor_module_s" in r.stdout
    assert 2e-5 < db.runtime["dtensor_norm_s"] < 1e-2  # a sequence-parallel norm: 0.40-0.43 ms


def _virtual_calls(monkeypatch, slow: list):
    """``call(ms)``: a function taking ``ms x slow[0]`` milliseconds of a virtual clock, which
    ``profile_timing`` reads instead of the machine's."""
    now = [0.0]
    monkeypatch.setattr(profile_timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def call(ms: float):
        def run() -> None:
            now[0] += ms * slow[0] / 1000
        return run
    return call


def test_timeit_rounds_spreads_a_slow_spell_over_every_message(monkeypatch):
    """Four calls (1 / 2 / 4 / 8 ms) timed in 5 interleaved rounds; a slow spell of 8 batches makes
    rounds 2 and 3 of every call 3x slower. Each keeps 3 quick rounds of 5, so its median is its
    own time; timed one after another (3 batches each), the spell would cover the middle calls."""
    factors = iter([1] * 4 + [3] * 8 + [1] * 8)  # per batch, round-major
    slow = [1]
    call = _virtual_calls(monkeypatch, slow)
    got = profile_timing.timeit_rounds([call(1), call(2), call(4), call(8)], repeats=5, sync=lambda: None,
                                       target_s=0.0005, lockstep=lambda: slow.__setitem__(0, next(factors)))
    assert got == pytest.approx([0.001, 0.002, 0.004, 0.008], rel=1e-9)


def test_fsdp_units_are_timed_from_64_kib_only():
    from cost_models.profile_runtime import measure_fsdp_units

    db = ProfileDB(cluster_fingerprint="x", backend="gloo", world=2)
    measure_fsdp_units(db, 2, [1024, 4096], repeats=3)  # nothing to time: no process group needed
    assert db.collectives == {}


def test_collective_medians_are_made_non_decreasing_in_size():
    from cost_models.profile_comm import non_decreasing

    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing([0.4, 1.1, 0.5, 1.3, 2.0]) == pytest.approx([0.4, 0.8, 0.8, 1.3, 2.0])
    assert non_decreasing([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])


def test_timeit_paired_drops_a_slow_spell_from_the_difference(monkeypatch):
    """A forward (10 ms) and a forward + backward (25 ms) timed in 5 alternating rounds; a slow
    spell makes round 2's batches and round 3's forward 3x slower. The forward is the median
    batch, 10 ms; the backward the median of the rounds' differences, 15 ms. The calls advance a
    virtual clock (a loaded machine's sleeps overshoot: 12.8 ms for 10 in one full-suite run)."""
    factors = iter([1, 1, 3, 3, 3, 1, 1, 1, 1, 1])  # per batch, set by the lockstep before it
    slow = [1]
    call = _virtual_calls(monkeypatch, slow)
    [(tf, tb)] = profile_timing.timeit_paired([(call(10), call(25))], repeats=5, sync=lambda: None, target_s=0.001,
                                              lockstep=lambda: slow.__setitem__(0, next(factors)))
    assert tf == pytest.approx(0.010, rel=1e-9) and tb == pytest.approx(0.015, rel=1e-9)


@pytest.mark.slow
def test_timeit_paired_spreads_a_slow_spell_over_every_shape(monkeypatch):
    """Three layer shapes (forward 10 / 20 / 30 ms, backward twice that) timed in 5 interleaved
    rounds; a slow spell of 12 batches (longer than one shape's 10) makes rounds 2 and 3 of
    every shape 3x slower. Interleaved, each shape keeps 3 quick rounds of 5 and its medians
    are its own times; timed one shape after another, the spell would fall on all the middle
    shape's rounds and price it 3x."""
    batches = 3 * 2 * 5
    factors = iter([1] * 6 + [3] * 12 + [1] * (batches - 18))  # per batch (round-major), set by the lockstep
    slow = [1]
    call = _virtual_calls(monkeypatch, slow)

    pairs = [(call(f), call(3 * f)) for f in (10, 20, 30)]
    got = profile_timing.timeit_paired(pairs, repeats=5, sync=lambda: None, target_s=0.001,
                                            budget_s=math.inf, lockstep=lambda: slow.__setitem__(0, next(factors)))
    for (tf, tb), f in zip(got, (10, 20, 30)):
        assert tf == pytest.approx(f / 1000, rel=1e-9) and tb == pytest.approx(2 * f / 1000, rel=1e-9)
