"""The plan's kernels in the runtime (codegen/runtime/kernels.py) and in the planner.

Runtime: ``tests/kernel_worker.py`` trains gpt-tiny and llama-tiny for 3 SGD steps (fp32,
global batch 4, seq 32) with ``loss="fused"`` + ``attention="flash"`` and with the eager
kernels, for pp=1 in one process and TP2+SP (vocabulary-parallel fused loss), PP2 1F1B
(fused loss on the last stage), CP2 zigzag (ring attention on the flash path) and CP2
Ulysses (all-to-all around a ring of one, on the flash path) in one
2-process launch (both launches run concurrently). Losses and first-step gradients must
equal the single-process model (SDPA + logits cross-entropy) and the eager runtime within
1e-5 relative, and the kernel paths must actually have run.

Planner: for a 128k-vocabulary model, the fused loss (no [tokens x vocab] logits) changes
the chosen configuration.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "kernel_worker.py")
TOL = 1e-5
LAYOUTS = {1: ["pp1"], 2: ["tp2-sp", "pp2-1f1b", "cp2-zigzag", "cp2-ulysses"]}
MODELS = ("llama-tiny", "gpt-tiny")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("kernels")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")  # tests/launches.py
    env.pop("TRITON_INTERPRET", None)
    env["AUTOPAR_KERNEL_IMPL"] = "torch"  # the torch fallbacks on every call (auto: SDPA for local attention)
    one = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    cmds = {1: ([sys.executable, WORKER, str(d / "w1.json")], one),
            2: ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                 f"--master-port={_free_port()}", WORKER, str(d / "w2.json")], env)}
    procs = {w: subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w, (c, e) in cmds.items()}
    res = {}
    for w, p in procs.items():
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        path = d / f"w{w}.json"
        if p.returncode != 0 or not path.exists():
            raise AssertionError(f"kernel worker world={w} failed (rc={p.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
        res.update(json.loads(path.read_text()))
    return res


CASES = [f"{m}/{name}" for m in MODELS for names in LAYOUTS.values() for name in names]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_reference_and_eager_runtime(runs, case: str) -> None:
    k, e, ve = runs[f"{case}/kernels"], runs[f"{case}/eager"], runs[f"{case}/vs-eager"]
    for r in (k, e):
        assert "error" not in r, r.get("error")
        assert not r["missing"], r["missing"]
        assert r["loss_rel_err"] < TOL, (r["losses"], r["ref_losses"])
        assert r["grad_rel_err"] < TOL, (r["worst"], r["grad_rel_err"])
    assert ve["loss_rel_err"] < TOL and ve["grad_rel_err"] < TOL, ve
    # the kernel paths ran (counted over all ranks), the eager runtime used neither
    assert k["calls"]["linear_loss"] >= 12 and k["calls"]["flash_attention"] > 0, k["calls"]
    assert e["calls"] == {"linear_loss": 0, "flash_attention": 0}, e["calls"]
    expected_impl = {"cp2-zigzag": "RingAttention", "cp2-ulysses": "UlyssesAttention"}.get(case.split("/")[1],
                                                                                         "FlashAttention")
    assert k["attention_impl"] == expected_impl


# --------------------------------------------------------------------------- planner

PLANNER_CASE = dict(model="llama-1b", cluster="dgx-a100-80g", global_batch=64, seq_len=40960, fix="cp=1")


@pytest.fixture(scope="module")
def planner_case():
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    c = PLANNER_CASE
    return load_graph(c["model"], batch=1, seq_len=c["seq_len"]), parse_cluster(c["cluster"])


def test_fused_loss_changes_the_plan_for_a_128k_vocabulary(planner_case) -> None:
    """llama-1b (vocab 128256, tied) at 40k tokens per sequence on 8 A100-80G, cp fixed to 1:
    with eager logits (40960 x 128256 per micro-batch) plain dp8 does not fit, so the planner
    pays for tp2+sp; with the fused loss dp8 fits (selective recompute pinned), at about the same
    step time: the kernel's logit recompute and its slower forward (measured on an H200,
    ``gpu_layer.FUSED_LOSS_FWD_SLOWDOWN``) cost about what dropping TP's collectives saves."""
    from planner.search.planning import plan_model
    g, cl = planner_case
    c = PLANNER_CASE
    best = {}
    for loss in ("eager", "fused"):
        # selective recompute pinned: offloading the blocks' activations would make room for the
        # eager logits as well, and the fused loss would change nothing
        _, res = plan_model(g, cl, c["global_batch"], spec=c["model"], cluster_spec=c["cluster"], loss=loss,
                            fix=c["fix"] + ",recompute=selective")
        best[loss] = res.best
        assert res.best.config.loss == loss and res.best.fits
    e, f = best["eager"].config, best["fused"].config
    assert (e.dp, e.tp, e.sp) == (4, 2, True), e.label()
    assert (f.dp, f.tp) == (8, 1), f.label()
    assert best["fused"].step_s == pytest.approx(best["eager"].step_s, rel=0.03)


def test_fused_loss_lowers_head_stage_activations_and_makes_dp8_fit(planner_case) -> None:
    from planner.plan import ParallelConfig
    from planner.search.planning import evaluate_config
    g, cl = planner_case
    est = {}
    for loss in ("eager", "fused"):
        cfg = ParallelConfig(dp=8, zero="fsdp", mbs=1, dtype="bf16", loss=loss)
        est[loss], problems = evaluate_config(g, cl, cfg, PLANNER_CASE["global_batch"])
        assert not problems, problems
    e, f = est["eager"].memory[-1], est["fused"].memory[-1]
    assert f.activations < e.activations
    # the saving is at least one bf16 copy of the logits of a micro-batch: 40960 x 128256 x 2 bytes
    assert e.activations - f.activations >= 40960 * 128256 * 2 * 0.99
    assert not est["eager"].fits and est["fused"].fits


def test_local_flash_attention_on_cpu_is_torch_sdpa_unless_the_fallback_is_forced(monkeypatch):
    """Without Triton, a local call (no documents, no ring) runs torch's fused SDPA kernel; with
    ``AUTOPAR_KERNEL_IMPL=torch`` the plain-torch fallback; both agree, GQA and gradients included."""
    import torch

    from codegen.runtime import kernels as kern

    calls = []
    real = kern.flash_attention
    monkeypatch.setattr(kern, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    q = torch.randn(2, 4, 48, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 48, 16, requires_grad=True) for _ in range(2))
    outs, grads = [], []
    for forced in (None, "torch"):
        if forced:
            monkeypatch.setenv("AUTOPAR_KERNEL_IMPL", forced)
        else:
            monkeypatch.delenv("AUTOPAR_KERNEL_IMPL", raising=False)
        out = kern.FlashAttention()(q, k, v, causal=True)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    assert len(calls) == 1  # only the forced run went through the fallback kernel
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(*grads))
