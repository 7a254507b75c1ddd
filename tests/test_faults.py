"""Fault tolerance: a killed process is relaunched, resumes from the newest complete
checkpoint, and ends exactly where an uninterrupted run ends (bitwise on CPU), with every
step logged once; a checkpoint cut off mid-write is never taken as the newest."""
from __future__ import annotations

import json
import os

import pytest
import torch

from codegen.runtime import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- no processes

def _complete(d):
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, ".metadata"), "w").close()


def test_partial_checkpoint_is_never_latest(tmp_path):
    ck = str(tmp_path)
    assert checkpoint.latest_path(ck) is None
    _complete(tmp_path / "step-2")
    _complete(tmp_path / "step-4")
    (tmp_path / "step-6").mkdir()                       # cut off mid-write: shards, no .metadata
    (tmp_path / "step-6" / "__0_0.distcp").write_bytes(b"\0" * 16)
    assert checkpoint.latest_path(ck) == str(tmp_path / "step-4")
    (tmp_path / "latest").write_text("step-6\n")        # even if the marker names it
    assert checkpoint.latest_path(ck) == str(tmp_path / "step-4")
    (tmp_path / "latest").write_text("step-2\n")        # the marker wins when complete
    assert checkpoint.latest_path(ck) == str(tmp_path / "step-2")
    (tmp_path / "latest").write_text("")                # an empty marker (crash while writing)
    assert checkpoint.latest_path(ck) == str(tmp_path / "step-4")
    assert checkpoint.latest_path(str(tmp_path / "nothing")) is None   # no checkpoint folder at all


def test_trim_log_drops_steps_after_the_checkpoint(tmp_path):
    log = tmp_path / "log.jsonl"
    checkpoint.trim_log(str(log), 2)                    # no log yet: nothing to do
    assert not log.exists()
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    checkpoint.trim_log(str(log), 2)
    assert [json.loads(l)["step"] for l in log.read_text().splitlines()] == [1, 2]
    checkpoint.trim_log(str(log), 0)                    # a fresh start keeps nothing
    assert log.read_text() == ""


# ---------------------------------------------------------------- killed and relaunched

STEPS, EVERY, KILL_AT = 6, 2, 3   # rank 1 dies asking for step index 3 (steps 1-3 logged, checkpoint at 2)


def _tensors(step_dir: str, tmp: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tmp, "flat.pt")
    dcp_to_torch_save(step_dir, out)
    sd = torch.load(out, weights_only=True)
    flat = {}

    def walk(prefix, x):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = x

    walk("", sd)
    return flat


@pytest.mark.slow
def test_killed_rank_is_relaunched_and_resumes_bitwise(tmp_path, monkeypatch, capfd):
    from cost_models.cluster import parse_cluster
    from planner.entry.launch import run_plan
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    plan, _ = plan_model(load_graph("llama-tiny", seq_len=32), parse_cluster("local-cpu:2"), 4, spec="llama-tiny",
                         cluster_spec="local-cpu:2", fix="world=2")  # two ranks: one of them is killed
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("AUTOPAR_TEST_MODEL", "llama-tiny")
    extra = ["--data", "tests.fault_worker:data"]

    monkeypatch.delenv("AUTOPAR_TEST_KILL_AT", raising=False)
    rc, log_a = run_plan(plan_path, steps=STEPS, run_dir=str(tmp_path / "clean"), ckpt_every=EVERY, extra=extra)
    assert rc == 0

    monkeypatch.setenv("AUTOPAR_TEST_KILL_AT", str(KILL_AT))
    capfd.readouterr()
    rc, log_b = run_plan(plan_path, steps=STEPS, run_dir=str(tmp_path / "fault"), ckpt_every=EVERY,
                         max_restarts=1, extra=extra)
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    assert "relaunching (attempt 2 of 2)" in err                      # it did die and was relaunched
    printed = [int(l.split()[1]) for l in out.splitlines() if l.startswith("step ")]
    assert printed == [1, 2, 3, 3, 4, 5, 6]     # step 3 ran (and was logged) before the kill, then again

    a = [json.loads(l) for l in open(log_a)]
    b = [json.loads(l) for l in open(log_b)]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))  # none lost or repeated
    assert [r["loss"] for r in a] == [r["loss"] for r in b]                               # bitwise equal losses
    ta = _tensors(str(tmp_path / "clean" / "checkpoints" / f"step-{STEPS}"), str(tmp_path / "clean"))
    tb = _tensors(str(tmp_path / "fault" / "checkpoints" / f"step-{STEPS}"), str(tmp_path / "fault"))
    assert ta.keys() == tb.keys() and any(k.startswith("train.model.") for k in ta)
    for k in ta:
        if isinstance(ta[k], torch.Tensor):
            assert torch.equal(ta[k], tb[k]), k
        else:
            assert ta[k] == tb[k], k
