"""The emitted program runs multimodal per-batch assignment when the plan chooses it.

One 2-rank gloo launch (module fixture): mllm-tiny planned on local-cpu:2 pinned to dp2 with
0 to 6 images per sample, the program emitted and trained for ``STEPS`` steps (AdamW, warmup
and cosine learning rate, global-norm clipping, a checkpoint). Its logged losses and gradient
norms must equal those of one process training the same model on the same whole batches
(fp32), and its logged per-rank work must show assignment evened out what the fixed split
would have given the ranks.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from launches import run_launch  # noqa: E402

IMAGES = {0: 0.4, 1: 0.3, 2: 0.1, 6: 0.2}
STEPS, SEED, CLIP = 3, 0, 1.0
PINNED = "dp=2,pp=1,tp=1,cp=1,zero=ddp"


def _plan(fix: str = PINNED):
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    graph = load_graph("mllm-tiny", batch=1)
    return plan_model(graph, parse_cluster("local-cpu:2"), 8, spec="mllm-tiny", cluster_spec="local-cpu:2",
                      fix=fix, images=IMAGES)[0]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(plan, program text, the run's log records, its checkpoint folder)."""
    from codegen.emit import emit
    from planner.entry.launch import torchrun_cmd

    tmp = tmp_path_factory.mktemp("mm_program")
    plan = _plan()
    text = emit(plan)
    prog, log, ck = tmp / "train_mm.py", tmp / "log.jsonl", tmp / "ck"
    prog.write_text(text)
    args = [str(prog), "--steps", str(STEPS), "--metrics", str(log), "--ckpt-dir", str(ck),
            "--ckpt-every", str(STEPS), "--seed", str(SEED), "--clip", str(CLIP)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    r = run_launch(lambda: torchrun_cmd(2, args), env=env, timeout=300, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:]
    return plan, text, [json.loads(line) for line in log.read_text().splitlines()], ck


def reference(plan) -> list[tuple[float, float]]:
    """(loss, gradient norm before clipping) per step of one process on the whole batches."""
    from codegen.runtime.adapters import adapter_for
    from codegen.runtime.data import synthetic
    from codegen.runtime.optim import adamw, warmup_cosine
    from planner import zoo

    spec = zoo.load_model_spec("mllm-tiny")
    model = spec.build("meta")
    units = [u for s in plan.stages for u in s["layers"]]
    adapter_for(model, order=units, seq_len=plan.batch["seq_len"]).materialize(units, torch.device("cpu"), SEED)
    data = synthetic(spec.cfg.vocab, 8, plan.batch["seq_len"], SEED, mllm=spec.cfg, images=IMAGES)
    opt = adamw(list(model.parameters()), lr=3e-4, betas=(0.9, 0.999), weight_decay=0.1)
    out = []
    for step in range(STEPS):
        b = data(step)
        opt.zero_grad()
        loss = model(b["input_ids"], b["pixel_values"], labels=b["labels"], image_counts=b["image_counts"])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for g in opt.param_groups:
            g["lr"] = warmup_cosine(step, STEPS, 3e-4, 3e-5, 2)
        opt.step()
        out.append((float(loss.detach()), float(norm)))
    return out


@pytest.mark.slow
def test_plan_chooses_assignment_and_the_program_runs_it(launched) -> None:
    from planner.report.data import multimodal_text

    plan, text, records, _ = launched
    rec = plan.batch["multimodal"]
    assert plan.config.dp == 2 and rec["chosen"] and "the program assigns" in rec["why"]
    assert multimodal_text(rec).startswith("chosen: ")
    assert "MULTIMODAL = multimodal_of({" in text
    assert f"PREDICTED = {{'step_s': {rec['assigned_s']!r}," in text  # the assigned step, printed beside the run's
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_program_losses_equal_one_process(launched) -> None:
    plan, _, records, ck = launched
    ref = reference(plan)
    for r, (loss, norm) in zip(records, ref):
        assert r["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-4, abs=1e-6)
    assert len({r["batch"] for r in records}) == STEPS  # a new batch every step
    assert any(ck.iterdir())  # the checkpoint of the last step


@pytest.mark.slow
def test_logged_work_shows_assignment_evened_the_ranks(launched) -> None:
    _, _, records, _ = launched
    work = [r["dp_work"] for r in records]
    assert all(len(w["fixed"]) == 2 and len(w["assigned"]) == 2 for w in work)
    assert all(max(w["assigned"]) <= max(w["fixed"]) + 1e-12 for w in work)
    assert all(sum(w["assigned"]) == pytest.approx(sum(w["fixed"])) for w in work)
    assert any(max(w["assigned"]) < max(w["fixed"]) * 0.99 for w in work)  # some batch was rebalanced


def test_layouts_that_cannot_assign_are_refused_in_one_line() -> None:
    from codegen.emit import emit
    from codegen.runtime.multimodal import multimodal_of
    from planner.batch_multimodal import layout_problem
    from planner.plan import ParallelConfig, PlanError

    assert layout_problem(ParallelConfig(dp=4, dtype="fp32")) is None
    for cfg in (ParallelConfig(dp=2, tp=2, dtype="fp32"), ParallelConfig(dp=2, pp=2, dtype="fp32"),
                ParallelConfig(dp=2, zero="fsdp", dtype="fp32"), ParallelConfig(dp=2, dtype="bf16")):
        why = layout_problem(cfg)
        assert why and "\n" not in why and "--fix" in why
    plan = _plan("dp=1,pp=2,tp=1,cp=1")
    assert not plan.batch["multimodal"]["chosen"] and "data-parallel layouts only" in plan.batch["multimodal"]["why"]
    plan.batch["multimodal"].update(chosen=True, capacity=10, cost={"linear": 1.0, "attention": 0.0})
    with pytest.raises(PlanError, match="data-parallel layouts only"):
        emit(plan)  # before any process starts
    plan = _plan()
    plan.batch["multimodal"]["cost"]["method"] = "os.system('id')"
    with pytest.raises(PlanError, match="batch.multimodal"):
        emit(plan)
    plan.batch["multimodal"]["cost"]["method"] = "ring"
    plan.batch["multimodal"]["images"] = {"__import__('os')": 1.0}
    with pytest.raises(PlanError, match="batch.multimodal"):
        emit(plan)
    mm = multimodal_of({"images": {0: 1.0}, "cost": {"linear": 1.0, "attention": 0.0}, "capacity": 10, "patches": 4})
    with pytest.raises(ValueError, match="pp 2"):
        mm.balancer(ParallelConfig(dp=1, pp=2, dtype="fp32"), 0)


def test_synthetic_images_per_sample_are_drawn_from_seed_and_step() -> None:
    from codegen.runtime.data import batch_digest, synthetic
    from codegen.runtime.multimodal import MultimodalBatch
    from planner import zoo

    cfg = zoo.preset("mllm-tiny")
    data = synthetic(cfg.vocab, 16, 32, 3, mllm=cfg, images=IMAGES)
    again = synthetic(cfg.vocab, 16, 32, 3, mllm=cfg, images=IMAGES)
    seen = set()
    for step in range(8):
        b, c = data(step), again(step)
        assert batch_digest(b) == batch_digest(c) and torch.equal(b["pixel_values"], c["pixel_values"])
        mb = MultimodalBatch.of(b)  # the multimodal format, images in sample order
        assert mb.input_ids.shape == (16, 32 - cfg.num_patches)
        seen |= set(b["image_counts"].tolist())
    assert seen <= set(IMAGES) and len(seen) >= 3
    assert batch_digest(data(0)) != batch_digest(data(1))
    with pytest.raises(ValueError, match="image-text model"):
        synthetic(cfg.vocab, 4, 32, 0, images=IMAGES)
