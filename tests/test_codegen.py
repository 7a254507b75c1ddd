"""Codegen: the emitted program, autopar run/demo end to end, and auto_parallelize."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cost_models.cluster import parse_cluster
from codegen.emit import emit
from planner.frontend import load_graph
from planner.planning import plan_model

HERE = os.path.dirname(os.path.abspath(__file__))


def _plan(model="llama-tiny", cluster="local-cpu:2", gb=4):
    g = load_graph(model, batch=1)
    p, _ = plan_model(g, parse_cluster(cluster), gb, spec=model, cluster_spec=cluster)
    return p


def test_emitted_program_is_readable_python():
    plan = _plan()
    text = emit(plan)
    compile(text, "train.py", "exec")
    assert len(text.splitlines()) <= 200
    assert repr(plan.config.to_str()) in text and "parallelize(" in text and "checkpoint.load_latest" in text


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_auto_parallelize(nproc, tmp_path):
    out, ck = tmp_path / "out.json", tmp_path / "ckpt"
    if nproc == 1:
        cmd = [sys.executable, os.path.join(HERE, "api_worker.py"), str(out), str(ck)]
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    else:
        from planner.launch import torchrun_cmd

        cmd = torchrun_cmd(2, [os.path.join(HERE, "api_worker.py"), str(out), str(ck)])
        env = dict(os.environ)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["losses"][1] < d["losses"][0]
    assert d["again"] == d["after"]  # load() restored the step-2 state exactly


@pytest.mark.slow
def test_emitted_pipeline_with_tied_embeddings_runs(tmp_path):
    """A model built on meta whose head shares the embedding: the first stage materialises the
    embedding (and re-ties the head to it), the last one only the head. Every rank must still
    agree on the tied pairs (they create a process group together): this hung before."""
    import signal

    from planner.plan import ParallelConfig
    from planner.planning import build_plan, evaluate_config

    spec = tmp_path / "tied.toml"
    spec.write_text('name = "gpt-tied"\narch = "gpt"\nlayers = 2\nhidden = 32\nffn_hidden = 64\nheads = 2\n'
                    'kv_heads = 2\nvocab = 64\nseq_len = 16\ntie_embeddings = true\n')
    g, c = load_graph(str(spec), batch=1), parse_cluster("local-cpu:2")
    e, problems = evaluate_config(g, c, ParallelConfig.parse("pp=2,schedule=1f1b,mbs=1,dtype=fp32"), 4,
                                  even_split=True)
    assert not problems
    plan_path = tmp_path / "plan.json"
    build_plan(g, c, e, spec=str(spec), cluster_spec="local-cpu:2").save(str(plan_path))
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", "run", str(plan_path), "--steps", "2", "--dir",
                          str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the pipelined run of a tied model hung")
    assert p.returncode == 0, out[-2000:]
    recs = [json.loads(l) for l in open(tmp_path / "run" / "train_log.jsonl")]
    assert [r["step"] for r in recs] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
