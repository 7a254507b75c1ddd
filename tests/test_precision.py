"""Mixed precision as planned (codegen/runtime/precision.py, ``planner.precision.mixed_precision``).

Slow part: one torchrun launch per world size (2, 4) runs ``tests/precision_worker.py``: every
layout family (DDP, ZeRO-1/2, FSDP, TP + SP, PP 1F1B and interleaved, ring and Ulysses CP, EP,
and their 2-D mixes) under ``dtype=bf16`` against one process in bf16 mixed precision written
independently in the worker (fp32 masters, a bf16-parameter copy runs the model's own forward
and loss, fp32 gradients step the masters), 3 SGD steps:

- every layout computes with bf16 parameters only (no module saw an fp32 weight), steps fp32
  parameters with fp32 gradients; the fp32 control layouts compute in fp32 and match the fp32
  reference to 1e-5;
- losses within ``LOSS_TOL`` of the bf16 reference: bf16 rounds each product to 8 bits of
  mantissa (relative 2^-9 = 0.002) and the layouts sum in other orders, which moves the mean
  token loss by ~3e-5 here; gradients within ``GRAD_TOL`` (measured: 5e-3 to 1.8e-2; the
  reference's whole-batch gradient is itself rounded to bf16, the runtime accumulates
  micro-batches in fp32). Routed experts under EP x CP get ``ROUTED_TOL``: a router near a tie
  may send a token to another expert when the hidden state rounds differently (measured 0.15);
- each rank's parameter, gradient and AdamW-state bytes after a step equal the memory model's
  (``cost_models.memory.stage_memory``) within ``STATE_TOL``, in bf16 and fp32.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from cost_models.model_states import per_param_bytes
from planner.feasibility import modes_problem
from planner.plan import ParallelConfig
from planner.sharding import dp_wrapper, reshard_after_forward, uses_ddp_reducer
from planner.precision import mixed_precision

from launches import run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "precision_worker.py")
LOSS_TOL, GRAD_TOL, NORM_TOL, ROUTED_TOL, FP32_TOL, STATE_TOL = 1e-3, 5e-2, 5e-3, 0.3, 1e-5, 0.10

sys.path.insert(0, os.path.join(ROOT, "tests"))
import precision_worker as PW  # noqa: E402


# ---------------------------------------------------------------- rules (fast)

def test_mixed_precision_rule_and_policy():
    from codegen.runtime.precision import mp_policy

    assert mixed_precision("bf16") and not mixed_precision("fp32")
    p = mp_policy("bf16")
    assert p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32
    assert mp_policy("fp32").param_dtype is None and mp_policy("fp32").reduce_dtype is None
    # DDP's reducer casts nothing: mixed precision always runs FSDP2's replicate; one rank is wrapped too
    assert uses_ddp_reducer("ddp", 1, 1, "fp32") and not uses_ddp_reducer("ddp", 1, 1, "bf16")
    assert dp_wrapper("ddp", 1, 1, 1, "fp32") == "none" and dp_wrapper("ddp", 1, 1, 2, "fp32") == "ddp-reducer"
    assert dp_wrapper("ddp", 1, 1, 2, "bf16") == "replicate" and dp_wrapper("zero2", 2, 1, 2, "bf16") == "fully_shard"
    # one mixed-precision rank: fully_shard casts each unit and frees it after the forward (not under a pipeline)
    assert dp_wrapper("ddp", 1, 1, 1, "bf16") == "fully_shard" and reshard_after_forward("ddp", 1, 1)
    assert not reshard_after_forward("ddp", 2, 1) and not reshard_after_forward("zero2", 1, 4)
    assert modes_problem("fp16") and "bf16" in modes_problem("fp16") and modes_problem("bf16") is None


@pytest.mark.parametrize("zero", ["ddp", "zero1", "zero2", "fsdp"])
def test_model_states_are_fp32_masters_with_a_bf16_compute_copy(zero):
    """16 bytes per parameter at rest in both dtypes; the compute copy is 2 bytes in bf16."""
    for pp in (1, 2):
        bf, fp = (per_param_bytes(ParallelConfig(dp=4, pp=pp, zero=zero, dtype=d)) for d in ("bf16", "fp32"))
        for k in ("weights", "grads", "optimizer"):
            assert bf[k] == fp[k], (zero, k)
        assert bf["weights_full"] == 2 and fp["weights_full"] == 4
        assert bf["buffers"] < fp["buffers"] or bf["buffers"] == fp["buffers"] == 0
    # one rank: nothing held beyond fp32 in full precision; the per-unit casts are transient (pp=1), but a
    # pipeline keeps its stage's compute copy from the first forward to the last backward
    assert per_param_bytes(ParallelConfig(dp=1, zero=zero, dtype="bf16"))["buffers"] == 0
    assert per_param_bytes(ParallelConfig(dp=1, pp=2, zero=zero, dtype="bf16"))["buffers"] == 2
    assert per_param_bytes(ParallelConfig(dp=1, pp=2, zero=zero, dtype="fp32"))["buffers"] == 0


# ---------------------------------------------------------------- the runs (slow)

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    import json

    d = tmp_path_factory.mktemp("precision")
    res = {}
    for world in PW.LAYOUTS:
        out = d / f"w{world}.json"

        def cmd(world=world, out=out) -> list[str]:
            from planner.entry.launch import torchrun_cmd
            return torchrun_cmd(world, [WORKER, str(out)])
        proc = run_launch(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), timeout=900)
        assert proc.returncode == 0 and out.exists(), (proc.stdout[-3000:], proc.stderr[-5000:])
        res.update(json.loads(out.read_text()))
    return res


CASES = [f"{m}/{name}/{dtype}" for w in PW.LAYOUTS for m in PW.MODELS[w] for name, _, _ in PW.layouts_of(w, m)
         for dtype in (("bf16", "fp32") if name in PW.FP32_CONTROL else ("bf16",))]


@pytest.mark.slow
@pytest.mark.parametrize("key", CASES)
def test_layout_trains_in_the_planned_precision(runs, key):
    r = runs[key]
    assert "error" not in r and "refused" not in r, r
    assert not r["missing"], r["missing"]
    assert r["stepped"] == ["float32"] and r["grad_dtypes"] == ["float32"], (r["stepped"], r["grad_dtypes"])
    if key.endswith("/fp32"):
        assert r["compute"] == ["float32"], r["compute"]
        assert r["loss_rel_err"] < FP32_TOL and r["grad_rel_err"] < FP32_TOL, r
        return
    assert r["compute"] == ["bfloat16"], f"modules computed in fp32 under a bf16 plan: {r['fp32_modules']}"
    assert r["loss_rel_err"] < LOSS_TOL, (r["losses"], r["ref_losses"])
    assert r["norm_rel_err"] < NORM_TOL, r["norm_rel_err"]
    routed = ".routed." in r["worst"] and "ep" in key and "cp" in key
    assert r["grad_rel_err"] < (ROUTED_TOL if routed else GRAD_TOL), (r["worst"], r["grad_rel_err"])


STATES = [f"states/llama-tiny/{name}/{dtype}" for w in PW.LAYOUTS for name, _, _ in PW.LAYOUTS[w]
          if name in PW.STATE_LAYOUTS for dtype in ("bf16", "fp32")]


@pytest.mark.slow
@pytest.mark.parametrize("key", STATES)
def test_model_state_bytes_match_the_memory_model(runs, key):
    r = runs[key]
    assert "error" not in r, r
    for k, m in r["measured"].items():
        assert abs(m / r["predicted"][k] - 1) <= STATE_TOL, (k, m, r["predicted"][k])


@pytest.mark.parametrize("cluster, config, dtype", [("local-cpu:2", "dp=2", "fp32"), ("local-cpu:2", "dp=2,dtype=bf16", "bf16"),
                                                    ("dgx-h100", "dp=8", "bf16")])
def test_evaluate_prices_the_dtype_a_plan_for_the_cluster_trains_in(cluster, config, dtype, capsys):
    """``autopar evaluate`` without ``dtype=`` prices the dtype the search would plan there
    (``precision.default_dtype``: fp32 on CPU ranks), not ParallelConfig's bf16; a given one stays."""
    import json

    from planner.entry.cli import main

    assert main(["evaluate", "--model", "gpt-tiny", "--cluster", cluster, "--global-batch", "8",
                 "--config", config, "--json"]) == 0
    assert f"dtype={dtype}," in json.loads(capsys.readouterr().out)["config"]
