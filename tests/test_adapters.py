"""The model adapters end to end: what is refused at plan time, instance isolation, the CLI on
a transformers model and on a user's ``package.module:function`` module, and
``auto_parallelize`` on a transformers model under 1, 2 and 4 processes."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from codegen.runtime import torch_compat
from planner.errors import AutoparError

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from user_models import RootPositionsLM, UserLM  # noqa: E402
from launches import run_launch  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)


def _hf(model_type: str, **kw):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kw))


def _graph(model, name):
    from planner.frontend.load import example_for_module, graph_of
    return graph_of(model, example_for_module(model, 1, 32), name=name, seq_len=32)


@pytest.mark.parametrize("model_type,kw,word", [
    ("jetmoe", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, num_local_experts=4),
     "ExpertsInterface"),
])
def test_models_the_runtime_cannot_run_are_refused_in_one_line(model_type, kw, word):
    with pytest.raises(AutoparError) as e:
        _graph(_hf(model_type, **kw), model_type)
    msg = str(e.value)
    assert word in msg and "\n" not in msg and msg.startswith(f"{model_type}: cannot run")


@pytest.mark.parametrize("model_type,kw,experts,top_k", [
    ("mixtral", dict(TINY, num_local_experts=4), 4, 2),
    ("qwen2_moe", dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64), 8, 2),
    ("olmoe", dict(TINY, num_experts=4, num_experts_per_tok=2), 4, 2),
])
def test_transformers_moe_is_captured_through_experts_interface(model_type, kw, experts, top_k):
    """Routed experts of transformers' ExpertsInterface families are captured (balanced load on
    fake tensors) with their shape; under TP the MoE layer stays whole (its router and shared
    experts replicated, whatever the model's own TP plan says), the attention is split."""
    from planner.frontend.tp_layout import tp_layout

    g = _graph(_hf(model_type, **kw), model_type)
    moe = [l.moe for l in g.layers if l.moe is not None]
    assert len(moe) == 2 and moe[0].experts == experts and moe[0].top_k == top_k
    assert "any" not in g.limits
    if model_type == "olmoe":  # its attention normalises the whole q / k projections
        assert "colwise_gather_output" in g.limits["tp"] and "experts" not in g.limits["tp"]
    else:
        assert "tp" not in g.limits
    blk = next(l for l in g.layers if l.moe is not None)
    in_moe = [lin for lin in blk.linears if blk.in_moe(lin.name)]
    assert all(lin.role == "replicated" for lin in in_moe)
    if model_type == "qwen2_moe":  # an nn.Linear router and a shared expert, all left whole
        assert len(in_moe) >= 4
    layout = tp_layout(g)
    assert not [f for f in layout if f".{moe[0].part}." in f] and any("q_proj" in f for f in layout)
    ffn = moe[0].expert_ffn
    # the routed GEMMs' FLOPs at the balanced load: 32 tokens x top_k x 3 x 2 x hidden x ffn, at least
    assert blk.fwd_flops >= 32 * top_k * 3 * 2 * 64 * ffn


def test_experts_are_installed_on_one_instance_only():
    """Two Mixtral models from ONE config object: autopar's experts implementation on one leaves
    the other on the library's own, and both compute the same outputs."""
    from codegen.runtime.adapters import adapter_for
    cfg = transformers.MixtralConfig(**dict(TINY, num_local_experts=4), max_position_embeddings=64)
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(cfg)
    b = transformers.AutoModelForCausalLM.from_config(cfg)
    b.load_state_dict(a.state_dict())
    adapter_for(a)
    assert a.config._experts_implementation.startswith("autopar_")
    assert not b.config._experts_implementation.startswith("autopar")
    ids = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(a(input_ids=ids, use_cache=False).logits, b(input_ids=ids, use_cache=False).logits,
                               rtol=1e-5, atol=1e-5)


def test_plain_module_whose_units_do_not_compose_asks_for_a_spec():
    from planner.frontend.load import graph_of
    with pytest.raises(AutoparError) as e:
        graph_of(RootPositionsLM(), (torch.zeros(1, 32, dtype=torch.long),), name="root", seq_len=32,
                 loss_fn=lambda out: out.float().sum())
    assert "ModuleSpec(blocks=" in str(e.value) and "\n" not in str(e.value)


def test_capture_failures_are_one_line_naming_the_module_and_op(monkeypatch):
    """An exception inside a unit's forward (a chain feeding an embedding the hidden state) or
    while reading a unit's captured record is one AutoparError naming the module and the op."""
    from planner.frontend import records
    from planner.frontend.load import graph_of
    from user_models import TwoStreamLM

    def capture(model):
        return graph_of(model, (torch.zeros(1, 32, dtype=torch.long),), name="m", seq_len=32,
                        loss_fn=lambda out: out.float().sum())

    with pytest.raises(AutoparError) as e:
        capture(TwoStreamLM())
    msg = str(e.value)
    assert msg.startswith("m: capture failed in mix (aten.embedding)") and "indices" in msg, msg
    assert "ModuleSpec(blocks=" in msg and "\n" not in msg and e.value.__cause__ is not None

    def boom(unit):
        raise TypeError("int() argument must be a string, not 'DeepseekV3MLP'")

    monkeypatch.setattr(records, "moe_dims", boom)
    with pytest.raises(AutoparError) as e:
        capture(UserLM())
    assert str(e.value).startswith("m: capture failed in module 'transformer.wte' (reading its captured ops): "
                                   "TypeError: int() argument"), str(e.value)


def test_nanogpt_runs_its_own_prologue():
    """nanoGPT sums ``wte(ids) + wpe(arange(S))`` at the root of its forward: its units are no
    chain (wpe fed wte's output failed at plan time with a traceback). The model's own forward
    runs them up to the first block (the hook that stops it is removed), they stay in one
    pipeline stage, the stage computes the model's logits; its 64 learned positions bound the
    sequence; its packed q/k/v (split by the global width) refuses TP."""
    from codegen.runtime.adapters.module import ModuleAdapter, units_in_order
    from planner.frontend.load import graph_of
    from planner.search.candidates import facts_of
    from user_models import NanoGPT

    model = NanoGPT(tied=True)
    g = graph_of(model, (torch.zeros(1, 32, dtype=torch.long),), name="nano", seq_len=32,
                 loss_fn=lambda out: out.float().sum())
    names = [l.name for l in g.layers]
    assert names[:3] == ["wte", "wpe", "h.0"] and not g.layer("wpe").stage_start and g.layer("h.0").stage_start
    facts = facts_of(g)
    assert facts.max_seq_len == 64 and "packed q/k/v" in facts.limits["tp"]
    ad = ModuleAdapter(model, units=units_in_order(model, names))
    assert ad.root_prologue == ["wte", "wpe"]
    ids = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(ad.sequential(ids), model(ids))
    assert not torch_compat.module_hook_dicts(model.h[0])["_forward_pre_hooks"]
    stage = ad.build_stage(names[:3], "none")
    torch.testing.assert_close(stage(ids), model.h[0](model.wte(ids) + model.wpe(torch.arange(16))))


def test_plain_module_explicit_spec_and_loose_parameters():
    from codegen.runtime.adapters.module import ModuleAdapter, ModuleSpec
    spec = ModuleSpec(blocks="transformer.h", before=["transformer.wte"], after=["transformer.ln_f", "lm_head"])
    ad = ModuleAdapter(UserLM(), spec)
    assert ad.units[0] == "transformer.wte" and ad.units[-1] == "lm_head" and len(ad.blocks) == 4
    assert ad.limits() == {}
    loose = ModuleAdapter(RootPositionsLM(), spec).limits()
    assert "wpe" in loose["any"]


def test_attention_is_installed_on_one_instance_only():
    """Two transformers models built from ONE config object: routing one model's attention to
    autopar's implementation leaves the other's config and outputs untouched."""
    from codegen.runtime.adapters import adapter_for
    cfg = transformers.LlamaConfig(**TINY, max_position_embeddings=64)
    torch.manual_seed(0)
    a = transformers.AutoModelForCausalLM.from_config(cfg)
    b = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 16))
    before = b(input_ids=ids, use_cache=False).logits
    calls = []

    def counting(q, k, v, *, causal, scale=None):
        calls.append(causal)
        from codegen.runtime.layers import sdpa_attention
        return sdpa_attention(q, k, v, causal=causal, scale=scale)

    ad = adapter_for(a)
    for blk in ad.blocks:
        ad.set_attention(a.get_submodule(blk), counting)
    a(input_ids=ids, use_cache=False)
    assert calls == [True] * len(ad.blocks)
    assert b.config._attn_implementation == "sdpa" and a.config._attn_implementation.startswith("autopar_")
    assert torch.equal(b(input_ids=ids, use_cache=False).logits, before)
    assert len(calls) == len(ad.blocks)  # b did not call it


def _run(cmd, env=None, timeout=600):
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    r = run_launch(cmd, env=env, timeout=timeout)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf:llama-tiny", "tests.user_models:build", "tests.user_models:build_nanogpt"])
def test_cli_plans_and_runs_a_model_autopar_did_not_write(model, tmp_path, monkeypatch):
    from planner.entry.cli import main

    plan = tmp_path / "plan.json"
    cli = [sys.executable, "-m", "planner.entry.cli"]
    monkeypatch.chdir(ROOT)  # `autopar plan` in this process (it starts nothing); `autopar run` as a user would
    pins = ["--fix", "dp=2"] if model.endswith("nanogpt") else []  # (one process with 2 threads may win otherwise)
    assert main(["plan", "--model", model, "--cluster", "local-cpu:2", "--global-batch", "4", "--seq-len", "32",
                 *pins, "-o", str(plan)]) == 0
    p = json.loads(plan.read_text())
    assert p["model"]["adapter"] == ("hf" if model.startswith("hf:") else "module")
    if model.endswith("nanogpt"):  # its root prologue (wte + wpe) and tied head under DP
        assert p["config"].startswith("dp=2,pp=1,cp=1,tp=1"), p["config"]
    _run(cli + ["run", str(plan), "--steps", "6", "--dir", str(tmp_path / "run"), "--data",
                "tests.user_models:fixed_tokens"])
    recs = [json.loads(line) for line in open(tmp_path / "run" / "train_log.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.1, [r["loss"] for r in recs]


@pytest.mark.slow
def test_auto_parallelize_hf_same_losses_on_1_2_4_processes(tmp_path):
    from planner.entry.launch import torchrun_cmd
    worker = os.path.join(ROOT, "tests", "api_hf_worker.py")
    res = {}
    for n in (1, 2, 4):
        out = tmp_path / f"w{n}.json"
        if n == 1:
            env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
            _run([sys.executable, worker, str(out)], env=env)
        else:
            _run(torchrun_cmd(n, [worker, str(out)]))
        res[n] = json.loads(out.read_text())
    ref = res[1]["losses"]
    assert ref[-1] < ref[0]
    for n in (2, 4):
        assert max(abs(a - b) / abs(b) for a, b in zip(res[n]["losses"], ref)) < 1e-5, (n, res[n], ref)
