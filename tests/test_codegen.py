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
from planner.frontend.load import load_graph
from planner.search.planning import plan_model
from launches import run_launch

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = ("check_runnable(", "build_mesh(", "split_stages(", "materialize(", "tie_weights(", "apply_attention(",
          "apply_tp(", "apply_fp8(", "apply_recompute(", "apply_compile(", "apply_dp(", "build_optimizer(", "build_schedule(")


def _plan(model="llama-tiny", cluster="local-cpu:2", gb=4):
    g = load_graph(model, batch=1)
    p, _ = plan_model(g, parse_cluster(cluster), gb, spec=model, cluster_spec=cluster)
    return p


def _plan_for(spec: str, config: str, world: int, seq_len: int | None = 32, gb: int = 4, cluster: str = ""):
    """The plan of ``config`` (an even stage split) for ``spec`` on ``cluster`` (default
    ``local-cpu:<world>``)."""
    from planner.plan import ParallelConfig
    from planner.search.planning import build_plan, evaluate_config

    cluster = cluster or f"local-cpu:{world}"
    g, c = load_graph(spec, batch=1, seq_len=seq_len), parse_cluster(cluster)
    e, problems = evaluate_config(g, c, ParallelConfig.parse(config), gb, even_split=True)
    assert not problems, problems
    return build_plan(g, c, e, spec=spec, cluster_spec=cluster)


def emitted_tp_plan(text: str) -> dict[str, str]:
    """The emitted program's TP plan (``BLOCK_TP_PLAN`` and ``TP_PLAN``, evaluated alone over the
    style names it imports) expanded over its ``STAGES`` units the way the program does, read
    back as ``{fqn: role}`` (codegen.runtime.tp_styles.roles_of)."""
    from codegen.runtime.tp_plan import tp_plan_for
    from codegen.runtime.tp_styles import STYLE_NAMES, roles_of

    ns: dict = dict(STYLE_NAMES)
    exec(text[text.index("STAGES = ["):text.index("PREDICTED =")], ns)  # noqa: S102 - the emitted literals
    return roles_of(tp_plan_for([u for s in ns["STAGES"] for u in s], ns["BLOCK_TP_PLAN"], ns["TP_PLAN"]))


def styled(plan) -> dict[str, str]:
    """The plan's layout without the roles that get no style (norms without sequence parallel)."""
    from codegen.runtime.tp_styles import style_source

    return {f: r for f, r in plan.tp_layout.items() if style_source(r, plan.config.sp) is not None}


PP2TP2 = "pp=2,tp=2,sp=on,schedule=1f1b,mbs=1,dtype=fp32"


def test_emitted_program_is_readable_python():
    """The planner's own plan, and one without a pipeline (DP2, FSDP): the recipe in order, then
    gradient accumulation over the micro-batches."""
    text = emit(_plan())
    compile(text, "train.py", "exec")
    plan = _plan_for("llama-tiny", "dp=2,zero=fsdp,mbs=1,dtype=fp32", 2)
    text = emit(plan)
    compile(text, "train.py", "exec")
    assert len(text.splitlines()) <= 234
    assert repr(plan.config.to_str()) in text and "checkpoint.load_latest" in text
    assert "parallelize(" not in text and "all_gather_object" not in text
    body = text[text.index("def build("):text.index("def train_step(")]
    assert [body.index(c) for c in RECIPE] == sorted(body.index(c) for c in RECIPE)  # the order of train.py
    assert "for mb in range(pm.n_microbatches):" in text and "pm.microbatch(inputs, targets, mb)" in text


def test_emitted_pp2_tp2_program_writes_the_recipe_out():
    """A PP2 x TP2 plan: the TP plan as a literal dict over the model's module paths, the stage
    split, the pipeline schedule's step, clipping and the learning-rate schedule, in <= 252 lines
    (fp8 and compile a line each, per-batch assignment three, the plan's own schedule two,
    multimodal sample assignment twelve)."""
    plan = _plan_for("llama-tiny", PP2TP2, 4)
    text = emit(plan)
    compile(text, "train.py", "exec")
    lines = text.splitlines()
    assert len(lines) <= 252, len(lines)
    tp = emitted_tp_plan(text)
    assert tp == styled(plan) and tp["layers.0.attn.q_proj"] == "column"
    assert tp["head.proj"] == "vocab_head" and tp["layers.3.mlp.down_proj"] == "row"
    assert "    'layers': {" in lines and "'layers.0.attn.q_proj'" not in text  # one template for the blocks
    assert "    ['embed', 'layers.0', 'layers.1'],  # stage 0" in lines
    assert "    ['layers.2', 'layers.3', 'norm', 'head'],  # stage 1" in lines
    for step in ("inputs, targets = pm.local_batch(batch)", "pm.optimizer.zero_grad()",
                 "loss = pm.pipeline(inputs, targets)", "pm.sync_grads()", "norm = pm.clip_grad_norm_(clip)",
                 "pm.optimizer_step(lr)", "lr = warmup_cosine(step, args.steps, args.lr, args.min_lr, args.warmup_steps)",
                 "mem = peak_memory_per_rank(device)"):
        assert step in text, step
    body = text[text.index("def build("):text.index("def train_step(")]
    assert [body.index(c) for c in RECIPE] == sorted(body.index(c) for c in RECIPE)
    for flag in ("--steps", "--ckpt-dir", "--ckpt-every", "--metrics", "--data", "--seed", "--lr", "--min-lr",
                 "--warmup-steps", "--weight-decay", "--beta1", "--beta2", "--clip", "--optimizer"):
        assert f'"{flag}"' in text, flag
    assert "all_gather_object" not in text and "parallelize(" not in text


@pytest.mark.parametrize("spec,config", [
    ("llama3-8b", "dp=2,pp=2,tp=4,sp=on,schedule=1f1b,mbs=1,recompute=full"),
    ("gpt-small", "dp=4,tp=4,sp=on,mbs=1"),
])
def test_deep_model_tp_plan_is_one_template_per_block(spec, config):
    """A 32-layer (and a 12-layer) model under TP on dgx-h100:2: the TP plan is written once
    per block, so the program stays within 252 lines (240 before multimodal sample
    assignment), and expands to the plan's layout."""
    plan = _plan_for(spec, config, 16, seq_len=None, gb=64, cluster="dgx-h100:2")
    text = emit(plan)
    compile(text, "train.py", "exec")
    assert len(text.splitlines()) <= 252, len(text.splitlines())
    assert emitted_tp_plan(text) == styled(plan) and len(plan.tp_layout) > 90


def test_heterogeneous_blocks_tp_plan_expands_to_the_layout():
    """mllm-tiny (vision blocks and text blocks): one template per block stack; blocks of one
    stack that differ are written by path; the expansion is always the plan's layout."""
    from codegen.emit import split_tp_plan
    from codegen.runtime.tp_plan import tp_plan_for

    plan = _plan_for("mllm-tiny", "tp=2,mbs=1,dtype=fp32", 2)
    text = emit(plan)
    assert emitted_tp_plan(text) == styled(plan)
    assert "    'vision.blocks': {" in text and "    'layers': {" in text
    units = list(plan.model["layers"])
    odd = {f: s for f, s in plan.tp_layout.items() if f != "layers.1.mlp.up_proj"}  # layers.1 differs
    block_plan, rest = split_tp_plan(odd, units)
    assert tp_plan_for(units, block_plan, rest) == odd
    assert "layers" not in block_plan and "vision.blocks" in block_plan and "layers.0.attn.q_proj" in rest


def test_tp_styles_are_one_text_read_both_ways():
    """Each role's ParallelStyle is one source text (codegen.runtime.tp_styles.style_source): the
    in-process API builds the object from it and the program writes it; reading the object
    back gives the role (what the adapters' fix-ups need), and the layouts are torch's."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from codegen.runtime.tp_styles import role_of, sources_for, style_for, style_source, styles_for, ungathered_columns
    from planner.plan import TP_ROLES

    for sp in (False, True):
        for role in TP_ROLES:
            src = style_source(role, sp)
            if src is None:
                assert role == "norm" and not sp
                continue
            assert role_of(style_for(src)) == role, (role, sp, src)
    row = style_for(style_source("row", True))
    assert isinstance(row, RowwiseParallel) and row.output_layouts == (Shard(1),)
    head = style_for(style_source("vocab_head", False))
    assert isinstance(head, ColwiseParallel) and head.input_layouts == (Replicate(),) and not head.use_local_output
    from transformers.pytorch_utils import Conv1D

    from codegen.runtime.tensor_parallel import Conv1DColwise, Conv1DRowwise, for_module

    conv_row = for_module(row, Conv1D(8, 4))  # transformers' Conv1D: torch's layouts through our Conv1D styles
    assert isinstance(conv_row, Conv1DRowwise) and conv_row.output_layouts == (Shard(1),)
    assert conv_row.desired_input_layouts == (Shard(-1),) and conv_row.use_local_output
    assert isinstance(for_module(style_for(style_source("column", True)), Conv1D(8, 4)), Conv1DColwise)
    assert for_module(row, torch.nn.Linear(4, 8)) is row
    layout = {"layers.0.attn.q": "column", "layers.0.attn.o": "row", "layers.0.norm": "norm"}
    assert sources_for(layout, True)["layers.0.attn"] == "GatherSequenceInput()"
    assert sources_for(layout, False)["layers.0.attn"] == "ReplicateRegionInput()"
    assert "layers.0.norm" not in styles_for(layout, False)
    flat = {"layers.0.q": "column", "layers.0.o": "row", "layers.0.norm": "norm"}  # a block holding its linears
    assert "layers.0" not in sources_for(flat, False, ["embed", "layers.0", "head"])
    # BERT's row linears each sit in an output module of their own, fed the sharded activation: no region style
    bert = {"l.attention.self.query": "column", "l.attention.output.dense": "row", "l.intermediate.dense": "column",
            "l.output.dense": "row"}
    for sp in (True, False):
        assert set(sources_for(bert, sp)) == set(bert), sp
    # ... so nothing gathers the sequence for its column linears: the planner's sp limit reads the same rule
    assert ungathered_columns(bert) == ["l.attention.self.query", "l.intermediate.dense"]
    assert ungathered_columns(layout) == [] and ungathered_columns(flat, ["layers.0"]) == ["layers.0.q"]


LINTED = [("llama-tiny", PP2TP2, 4), ("llama-tiny", "dp=2,cp=2,ulysses=2,mbs=1,dtype=fp32", 4),
          ("llama-tiny", "dp=1,cp=4,ulysses=2,mbs=1,dtype=fp32", 4), ("moe-tiny", "dp=2,ep=2,zero=fsdp,mbs=1,dtype=fp32", 2),
          ("gpt-tiny", "dp=2,recompute=selective-op,zero=zero1,mbs=1,dtype=fp32", 2),
          ("gpt-tiny", "tp=2,mbs=1,dtype=fp32", 2)]  # TP without SP: Replicate, absent from the template


def test_emitted_programs_pass_ruff_and_pyflakes(tmp_path):
    """The template is a real module and every emitted program a file ruff (its default rules,
    isolated from any project config) and pyflakes find nothing in: no unused import, no
    undefined name, imports sorted, whatever the layout."""
    from codegen.emit import TEMPLATE_PATH

    files = [str(TEMPLATE_PATH)]
    for i, (spec, config, world) in enumerate(LINTED):
        path = tmp_path / f"train_{i}.py"
        path.write_text(emit(_plan_for(spec, config, world)))
        files.append(str(path))
    for tool in (["ruff", "check", "--isolated", "--output-format", "concise"], ["pyflakes"]):
        r = subprocess.run([sys.executable, "-m", *tool, *files], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_program_comments_are_the_reports_words():
    """Each call's comment is ``planner.describe``'s phrase for the plan, the one the report
    prints: Ulysses is not called a ring, selective-op is not called "full", clipping is ours."""
    from planner.describe import describe
    from planner.report.data import build_report, summary_rows

    cases = {"ulysses": ("llama-tiny", "dp=2,cp=2,ulysses=2,mbs=1,dtype=fp32", 4),
             "hybrid": ("llama-tiny", "dp=1,cp=4,ulysses=2,mbs=1,dtype=fp32", 4),
             "ring": ("llama-tiny", "dp=2,cp=2,mbs=1,dtype=fp32", 4),
             "op": ("gpt-tiny", "dp=2,recompute=selective-op,mbs=1,dtype=fp32", 2)}
    for name, (spec, config, world) in cases.items():
        plan = _plan_for(spec, config, world)
        words, text = describe(plan), emit(plan)
        lines = text.splitlines()
        assert f"    apply_attention(adapter, stages, CONFIG, mesh, per_batch=batch_planner)  # {words.attention}" in lines
        assert f"    apply_recompute(adapter, stages)  # {words.recompute}" in lines
        assert "@" not in "".join(line.partition("#")[2] for line in lines if "# " in line), name
        rows = {key: txt for key, _, txt, _ in summary_rows(build_report(plan, layers=False))}
        assert rows["attention"] == words.attention and rows["recompute"] == words.recompute
    assert describe(_plan_for(*cases["ulysses"])).attention.startswith("Ulysses all-to-all")
    assert "ring attention across" in describe(_plan_for(*cases["hybrid"])).attention
    assert describe(_plan_for(*cases["ring"])).attention.startswith("ring attention over cp=2")
    op = describe(_plan_for(*cases["op"]))
    assert "selective-op" in op.recompute and "whole" not in op.recompute
    assert "torch.nn.utils" not in emit(_plan_for(*cases["op"]))


def one_process_losses(spec: str, steps: int, gb: int = 4, seq: int = 32) -> list[tuple[float, float]]:
    """(loss, gradient norm) per step of the unmodified zoo model in this process, trained the
    way the emitted program's defaults train: AdamW(3e-4, betas (0.9, 0.999), weight decay
    0.1), 2 warmup steps then cosine decay to 3e-5, clipping at global norm 1.0, seed 0,
    the same synthetic batches."""
    from codegen.runtime.data import synthetic
    from codegen.runtime.optim import warmup_cosine
    from planner import zoo

    cfg = zoo.load_model_spec(spec).cfg
    model = zoo.build_model(cfg, device="cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.999), weight_decay=0.1)
    data = synthetic(cfg.vocab, gb, seq, 0)
    out = []
    for step in range(steps):
        batch = data(step)
        for g in opt.param_groups:
            g["lr"] = warmup_cosine(step, steps, 3e-4, 3e-5, 2)
        opt.zero_grad()
        loss = model(batch["input_ids"], labels=batch["labels"])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append((loss.item(), float(norm)))
    return out


def assert_matches_one_process(log: str, spec: str, steps: int, world: int, tol: float = 1e-5) -> None:
    recs = [json.loads(line) for line in open(log)]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert all(len(r["memory_gib"]) == world and r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in recs)
    ref = one_process_losses(spec, steps)
    assert max(r_norm for _, r_norm in ref) > 1.0  # clipping did act, so it is compared too
    for r, (loss, norm) in zip(recs, ref):
        assert abs(r["loss"] - loss) <= tol * abs(loss), (r, loss)
        assert abs(r["grad_norm"] - norm) <= tol * abs(norm), (r, norm)


@pytest.mark.slow
def test_emitted_pp2_tp2_program_matches_one_process(tmp_path):
    """The emitted PP2 x TP2 program (4 processes), with its default optimizer, learning-rate
    schedule and clipping, gives the single-process losses and gradient norms step by step."""
    from planner.entry.launch import run_plan

    plan_path = str(tmp_path / "plan.json")
    _plan_for("llama-tiny", PP2TP2, 4).save(plan_path)
    rc, log = run_plan(plan_path, steps=4, run_dir=str(tmp_path / "run"), timeout_s=240)
    assert rc == 0
    assert_matches_one_process(log, "llama-tiny", 4, world=4)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_auto_parallelize(nproc, tmp_path):
    out, ck = tmp_path / "out.json", tmp_path / "ckpt"
    if nproc == 1:
        cmd = [sys.executable, os.path.join(HERE, "api_worker.py"), str(out), str(ck)]
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    else:
        from planner.entry.launch import torchrun_cmd

        cmd = torchrun_cmd(2, [os.path.join(HERE, "api_worker.py"), str(out), str(ck)])
        env = dict(os.environ)
    r = run_launch(cmd, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["losses"][1] < d["losses"][0]
    assert d["again"] == d["after"]  # load() restored the step-2 state exactly
    # rank 0 planned for this machine, not for the one core it is pinned to (and is pinned again after)
    from cost_models.cluster import parse_cluster

    assert d["cluster_fp"] == parse_cluster(f"local-cpu:{nproc}").fingerprint()
    if nproc == 2 and len(os.sched_getaffinity(0)) >= 2:
        assert len(d["cores"]) == len(os.sched_getaffinity(0)) // 2


@pytest.mark.slow
def test_emitted_pipeline_with_tied_embeddings_runs(tmp_path):
    """A model built on meta whose head shares the embedding: the first stage materialises the
    embedding (and re-ties the head to it), the last one only the head. Every rank must still
    agree on the tied pairs (they create a process group together): this hung before. Under
    PP2 x TP2 (+SP) both ends are vocabulary-sharded; their local shards' gradients are
    summed over the two pp ranks per tp rank. The losses and gradient norms equal one
    process's (the tied weight counted once in the clipping norm)."""
    import signal

    spec = tmp_path / "tied.toml"
    spec.write_text('name = "gpt-tied"\narch = "gpt"\nlayers = 2\nhidden = 32\nffn_hidden = 64\nheads = 2\n'
                    'kv_heads = 2\nvocab = 64\nseq_len = 32\ntie_embeddings = true\n')
    plan_path = tmp_path / "plan.json"
    _plan_for(str(spec), PP2TP2, 4).save(str(plan_path))
    p = subprocess.Popen([sys.executable, "-m", "planner.entry.cli", "run", str(plan_path), "--steps", "3", "--dir",
                          str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the pipelined run of a tied model hung")
    assert p.returncode == 0, out[-2000:]
    assert_matches_one_process(str(tmp_path / "run" / "train_log.jsonl"), str(spec), 3, world=4)


def test_auto_parallelize_refuses_a_plan_file_of_another_batch_shape(tmp_path):
    """A plan file fixes the global batch and sequence length the runtime is built for; an
    example batch of another shape is refused in one line before anything is built."""
    from planner.entry import api
    from planner.errors import AutoparError

    path = tmp_path / "plan.json"
    _plan().save(str(path))  # llama-tiny, 4 sequences of 32 tokens
    ok = {"input_ids": torch.zeros(4, 32, dtype=torch.long)}
    req = api.PlanRequest(cluster="local-cpu:2", plan=str(path))
    assert api.plan_for(None, ok, req, 2).batch["global"] == 4
    with pytest.raises(AutoparError, match="is for 4 sequences of 32 tokens but the example batch is 2 x 32"):
        api.plan_for(None, {"input_ids": torch.zeros(2, 32, dtype=torch.long)}, req, 2)
