"""Transformers causal-LM families beyond Llama and GPT-2, planned and run (tests/hf_configs).

Planning (unit): every family captures through its adapter and ``autopar plan`` finds a
runnable configuration for local-cpu:4; what the runtime cannot run for it is refused
with the reason the README lists.

Running (slow, one 4-process launch, ``tests/family_worker.py``): each family trains 3
SGD steps under pp=2 x tp=2 (sequence parallel, flash attention and the fused loss where
allowed; pp=2 x dp=2 where tensor parallelism is refused) with the planner's stage split,
and its losses and first-step gradients match the unmodified model in one process.
"""
from __future__ import annotations

import json
import os
import socket
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import family_worker as FW  # noqa: E402
from launches import run_launch  # noqa: E402

TOL = 1e-5
# family -> {feature: a word of the reason it is refused}; features not listed must be allowed
REFUSED = {
    "qwen2": {"cp": "sliding-window", "flash_attention": "sliding-window", "sp": "masks"},
    "phi": {"fused_loss": "bias"},
    "gpt_neox": {},
    "gemma2": {"cp": "sliding-window", "flash_attention": "sliding-window", "sp": "masks",
               "fused_loss": "post-processes"},
    "cohere": {"fused_loss": "post-processes"},
    "stablelm": {},
    "opt": {"sp": "nothing gathers the sequence shard", "fused_loss": "post-processes"},
    "phi3": {"tp": "colwise_gather_output"},
    "olmo2": {"tp": "colwise_gather_output"},
    "deepseek_v3": {"tp": "moe_tp_experts"},  # its shared experts are a module, not a count
    # their own attention (outside AttentionInterface): TP, CP, flash, selective recompute refused
    "falcon": {"attention": "AttentionInterface"},
    "bloom": {"attention": "AttentionInterface"},
}


@pytest.mark.parametrize("family", FW.FAMILIES)
def test_family_plans_within_its_limits(family):
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.feasibility import Batch, Nodes, problems
    from planner.search.candidates import batch_of, facts_of
    from planner.search.planning import plan_model

    g = load_graph(FW.spec(family), batch=1, seq_len=32)
    facts = facts_of(g)
    assert g.adapter == "hf"
    assert set(facts.limits) == set(REFUSED[family]), facts.limits
    for feature, word in REFUSED[family].items():
        assert word in facts.limits[feature], (feature, facts.limits[feature])
    cluster = parse_cluster("local-cpu:4")
    plan, res = plan_model(g, cluster, 8, spec=FW.spec(family), cluster_spec="local-cpu:4")
    assert problems(plan.config, plan.facts, Batch.of_plan(plan.batch), Nodes.of_plan(plan.cluster, 4)) == []
    for alt in res.alternatives:
        assert problems(alt.config, facts, batch_of(g, 8), cluster) == []
    if "attention" in facts.limits:  # it runs its own attention: data and pipeline parallelism only
        for c in [plan.config] + [a.config for a in res.alternatives]:
            assert c.tp == c.cp == 1 and c.attention == "eager" and c.recompute != "selective", c.label()
        assert all(s["recompute"] != "selective" for s in plan.stages)


def test_learned_positions_bound_the_sequence():
    """OPT learns 64 positions (a table of 66 rows: OPT's offset of 2): a plan for 128 tokens is
    refused at plan time in one line (it crashed every rank with ``IndexError: index out of range
    in self``), the plan's facts carry the bound to the runtime's check; a RoPE model has none."""
    from cost_models.cluster import parse_cluster
    from planner.errors import AutoparError
    from planner.feasibility import Batch, Nodes, problems
    from planner.frontend.load import load_graph
    from planner.plan import ModelFacts, ParallelConfig
    from planner.search.candidates import facts_of
    from planner.search.planning import plan_model

    g = load_graph(FW.spec("opt"), batch=1, seq_len=128)
    facts = facts_of(g)
    assert facts.max_seq_len == 64 and ModelFacts.from_dict(facts.to_dict()) == facts
    with pytest.raises(AutoparError) as e:
        plan_model(g, parse_cluster("local-cpu:2"), 4, spec=FW.spec("opt"), cluster_spec="local-cpu:2")
    assert "seq_len 128 exceeds the 64 positions" in str(e.value) and "\n" not in str(e.value)
    assert problems(ParallelConfig(dp=2), facts, Batch(4, 128), Nodes("box", 1, 2)) == [
        str(e.value).split(": ", 1)[1]]
    assert problems(ParallelConfig(dp=2), facts, Batch(4, 64), Nodes("box", 1, 2)) == []
    assert facts_of(load_graph(FW.spec("qwen2"), batch=1, seq_len=128)).max_seq_len == 0  # RoPE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("families") / "families.json"
    def cmd() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={_free_port()}",
                os.path.join(ROOT, "tests", "family_worker.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = run_launch(cmd, env=env, timeout=900)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"family worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("family", FW.FAMILIES)
def test_family_trains_like_one_process(runs, family):
    r = runs[family]
    assert "error" not in r, r.get("error")
    assert not r["missing"], r["missing"]
    assert r["loss_rel_err"] < TOL, (r["losses"], r["ref_losses"])
    assert r["grad_rel_err"] < TOL, (r["worst"], r["grad_rel_err"])
    tp_refused = "tp" in REFUSED[family] or "attention" in REFUSED[family]  # its own attention: no TP
    assert ("tp2" in r["config"]) != tp_refused and "pp2" in r["config"], r["config"]
