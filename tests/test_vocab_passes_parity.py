"""Vocabulary passes through the runtime against one process (gloo, fp32).

One torchrun launch per world size (2 and 4 processes) runs ``vocab_worker.vocab_group``: gpt-tiny,
llama-tiny and transformers' Llama with the head split by vocabulary into one pipeline stage per pp
rank (planner/vocab_passes.py; codegen/runtime/vocab_passes.py), pp2 and pp4 and dp2 x pp2, under
interleaved 1F1B and a schedule generated for the passes; 3 SGD steps. First-step gradients (the
head's rows gathered from the pp ranks), their global norm and the 3 losses must match within 1e-5
relative, and each pp rank must hold its rows of the head and no more.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vocab_worker as V  # noqa: E402
from test_runtime_parity import assert_parity, launch  # noqa: E402

pytestmark = pytest.mark.slow
CASES = [(world, m, f"{lay}-{s}") for world in V.LAYOUTS for m in V.MODELS for lay, _ in V.LAYOUTS[world]
         for s in ("interleaved", "generated")]
VOCAB = {"gpt-tiny": 256, "llama-tiny": 256, "hf-llama": 128}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("vocab")
    return {world: launch(world, "vocab", str(d / f"w{world}.json")) for world in V.LAYOUTS}


@pytest.mark.parametrize("world, model, layout", CASES, ids=[f"w{w}/{m}/{lay}" for w, m, lay in CASES])
def test_vocabulary_passes_match_one_process(runs, world: int, model: str, layout: str) -> None:
    r = runs[world][f"{model}/{layout}"]
    assert_parity(r)
    pp = dict(V.LAYOUTS[world])[layout.rsplit("-", 1)[0]]["pp"]
    assert all(rows == [[VOCAB[model] // pp, 64]] for rows in r["rows"]), r["rows"]


def test_a_checkpoint_resumes_the_passes_exactly(runs) -> None:
    """Saved after 2 steps (DCP: each pp rank its rows of the head, zero1's optimizer state) and
    resumed in a fresh build: the last 2 losses are the uninterrupted run's."""
    r = runs[2]["ckpt"]
    assert "error" not in r, r.get("error")
    assert r["resumed_from"] == 2
    assert r["resumed"] == pytest.approx(r["uninterrupted"][2:], rel=1e-6)


def test_emitted_program_with_vocabulary_passes_matches_one_process(tmp_path):
    """The emitted program of a plan with vocabulary passes (llama-tiny, pp2, interleaved order;
    2 processes), with its default optimizer, schedule and clipping: the single-process losses and
    gradient norms step by step (a pass computing over the whole vocabulary, the head not split,
    would add log 2 to the loss)."""
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.entry.launch import run_plan
    from planner.schedule_ir import builtin
    from planner.search.planning import build_plan, evaluate_config
    from test_codegen import assert_matches_one_process

    g, c = load_graph("llama-tiny", batch=1, seq_len=32), parse_cluster("local-cpu:2")
    cfg = ParallelConfig.parse("pp=2,mbs=1,dtype=fp32,schedule=custom,vpp=2,vocab_passes=on")
    sched = builtin("interleaved-1f1b", 2, 4, 2)
    e, problems = evaluate_config(g, c, cfg, 4, even_split=True, schedule=sched)
    assert not problems, problems
    plan = build_plan(g, c, e, spec="llama-tiny", cluster_spec="local-cpu:2", schedule=sched)
    assert [s["layers"] for s in plan.stages][2:] == [["head[vocab 0/2]"], ["head[vocab 1/2]"]]
    path = str(tmp_path / "plan.json")
    plan.save(path)
    rc, log = run_plan(path, steps=3, run_dir=str(tmp_path / "run"), timeout_s=240)
    assert rc == 0
    assert_matches_one_process(log, "llama-tiny", 3, world=2)
