"""``autopar export``: a sharded checkpoint of a trained parallel run, gathered in one process
into the model's own format, reproduces the trained model.

Reference: the run's own log. The program checkpoints at step 2 and then logs step 3's loss,
computed by the parallel model with exactly the step-2 weights on the batch of step index 2;
the exported model, loaded the way a user loads it (transformers' ``from_pretrained``, or the
zoo model's ``load_state_dict``), must give that loss within fp32 tolerance, and its logits
must equal those of the same model loaded through torch's own DCP reader
(``dcp_to_torch_save``, independent of ``codegen.runtime.checkpoint.read_model_state``).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from launches import run_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY = 3, 2
TOL = 2e-4  # fp32: the tied head's copy drifts from the embedding's by ~2e-5 in 3 steps (pp = 2)


def _train(tmp_path, spec: str, cluster: str, fix: str, batch: int, seq: int, hook: str) -> str:
    """Plan ``spec`` with ``fix`` pinned, run it STEPS steps (checkpoint every EVERY) with
    ``tests.export_data:<hook>``; returns the run directory."""
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    plan, _ = plan_model(load_graph(spec, seq_len=seq), parse_cluster(cluster), batch, spec=spec,
                         cluster_spec=cluster, fix=fix)
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = run_launch([sys.executable, "-m", "planner.entry.cli", "run", plan_path, "--steps", str(STEPS), "--dir",
                    str(run), "--ckpt-every", str(EVERY), "--data", f"tests.export_data:{hook}"], env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(run)


def _logged_loss(run: str, step: int) -> float:
    recs = [json.loads(l) for l in open(os.path.join(run, "train_log.jsonl"))]
    return next(r["loss"] for r in recs if r["step"] == step)


def _export(run: str, out: str, *extra: str) -> None:
    from planner.entry.cli import main

    step = os.path.join(run, "checkpoints", f"step-{EVERY}")
    assert main(["export", step, "-o", out, *extra]) == 0


def _dcp_model_state(step_dir: str, tmp: str) -> dict:
    """The checkpoint's model entries through torch's own offline converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(tmp, "flat.pt")
    dcp_to_torch_save(step_dir, path)
    return torch.load(path, weights_only=True)["train"]["model"]


@pytest.mark.slow
def test_export_of_a_pp2_tp2_transformers_run_reproduces_it(tmp_path):
    """A tied llama (transformers) trained under pp=2 x tp=2: each stage saved its own units,
    TP-sharded DTensors, the tied embedding and head on two ranks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.export_data import VOCAB, hf_batches

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, use_cache=False)
    cfg.save_pretrained(tmp_path / "tied")
    run = _train(tmp_path, f"hf:{tmp_path / 'tied'}", "local-cpu:4", "pp=2,tp=2", 4, 16, "hf_batches")
    out = str(tmp_path / "out")
    _export(run, out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    batch = hf_batches(EVERY, 4, 16)
    with torch.no_grad():
        loss = model(**batch).loss.item()
        logits = model(batch["input_ids"]).logits
    assert abs(loss - _logged_loss(run, EVERY + 1)) < TOL, (loss, _logged_loss(run, EVERY + 1))

    ref = AutoModelForCausalLM.from_config(cfg).eval()
    state = _dcp_model_state(os.path.join(run, "checkpoints", f"step-{EVERY}"), str(tmp_path))
    ref.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(ref(batch["input_ids"]).logits, logits, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_export_of_an_fsdp_zoo_run_reproduces_it(tmp_path):
    """llama-tiny (a zoo model) trained with dp=2 and FSDP: model.safetensors by the model's own fqns."""
    from safetensors.torch import load_file

    from planner import zoo
    from tests.export_data import zoo_batches

    run = _train(tmp_path, "llama-tiny", "local-cpu:2", "dp=2,zero=fsdp", 4, 16, "zoo_batches")
    out = str(tmp_path / "out")
    _export(run, out)
    assert json.load(open(os.path.join(out, "autopar.json")))["model"] == "llama-tiny"
    model = zoo.load_model_spec("llama-tiny").build().eval()
    model.load_state_dict(load_file(os.path.join(out, "model.safetensors")), strict=True)
    batch = zoo_batches(EVERY, 4, 16)
    with torch.no_grad():
        loss = model(batch["input_ids"], batch["labels"]).item()
        logits = model(batch["input_ids"])
    assert abs(loss - _logged_loss(run, EVERY + 1)) < 1e-5, (loss, _logged_loss(run, EVERY + 1))
    ref = zoo.load_model_spec("llama-tiny").build().eval()
    ref.load_state_dict(_dcp_model_state(os.path.join(run, "checkpoints", f"step-{EVERY}"), str(tmp_path)))
    with torch.no_grad():
        torch.testing.assert_close(ref(batch["input_ids"]), logits, rtol=0, atol=0)


def _one_process_checkpoint(path, spec: str) -> dict:
    """A step directory as the runtime lays it out ({ROOT: {"model": ...}} and autopar.json),
    written by DCP in this one process; returns the saved state."""
    import torch.distributed.checkpoint as dcp

    from codegen.runtime import checkpoint
    from planner import zoo

    state = zoo.load_model_spec(spec).build().state_dict()
    dcp.save({checkpoint.ROOT: {"model": state, "step": 2}}, checkpoint_id=str(path), no_dist=True)
    (path / checkpoint.ABOUT).write_text(json.dumps({"model": spec}))
    (path.parent / checkpoint.LATEST).write_text(path.name + "\n")
    return state


def test_export_refuses_in_one_line(tmp_path, capsys):
    from planner.entry.cli import main

    saved = _one_process_checkpoint(tmp_path / "ck" / "step-2", "gpt-tiny")
    (tmp_path / "ck" / "step-4").mkdir()                              # cut off mid-write: no .metadata
    (tmp_path / "empty").mkdir()
    cases = [([str(tmp_path / "none")], "no such checkpoint folder"),
             ([str(tmp_path / "empty")], "holds no complete checkpoint"),
             ([str(tmp_path / "ck" / "step-4")], "is an incomplete checkpoint"),
             ([str(tmp_path / "ck"), "--model", "llama-tiny"], "is for model 'llama-tiny' but checkpoint"),
             ([str(tmp_path / "ck"), "--model", "llama-tiny", "--plan", "p.json"], "not both")]
    for args, why in cases:
        assert main(["export", *args, "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    (tmp_path / "ck" / "step-2" / "autopar.json").unlink()           # an older checkpoint: it does not say
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "out")]) == 2
    assert "--plan PLAN.json or --model SPEC" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "out"), "--model", "llama-tiny"]) == 2
    assert "does not hold model 'llama-tiny'" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "out"), "--model", "gpt-tiny",
                 "--format", "pt"]) == 0                              # the newest complete step: step-2
    back = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert back.keys() == saved.keys() and all(torch.equal(back[k], saved[k]) for k in saved)
    assert main(["export", str(tmp_path / "ck"), "-o", str(tmp_path / "out"), "--model", "gpt-tiny"]) == 2
    assert "not an empty folder" in capsys.readouterr().err
