"""Graph capture: FLOPs, parameters and activations against independent references."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from planner import zoo
from planner.frontend.trace import capture
from planner.errors import AutoparError
from planner.frontend.load import load_graph
from planner.graph import ModelGraph


def test_gpt3_flops_match_korthikanti():
    g = load_graph("gpt3-175b", batch=1, seq_len=2048)
    L, s, h, V = 96, 2048, 12288, 50257
    formula = 72 * L * s * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    assert g.flops_per_seq() == pytest.approx(formula, rel=0.02)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "llama3-405b", "gpt3-175b"])
def test_large_preset_params_published(name):
    g = load_graph(name, batch=1, seq_len=256)
    assert g.params == pytest.approx(zoo.PUBLISHED_PARAMS[name], rel=0.005)
    # repeated blocks are analysed once: one class for all transformer blocks
    blocks = [l for l in g.layers if l.kind == "transformer_block"]
    assert len({l.signature for l in blocks}) == 1
    assert all(l.repeat_of == blocks[0].name for l in blocks[1:])


def _measured_block_saved_bytes(cfg, batch, seq):
    """Saved-for-backward bytes of layers[1] on a real CPU forward (each storage once)."""
    torch.manual_seed(0)
    model = zoo.build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(0)
    ex = zoo.example_batch(cfg, batch, seq, device="cpu")
    x = model.embed(ex["input_ids"]).detach().requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t):
        k = t.untyped_storage().data_ptr()
        if k not in seen and k not in params:
            seen.add(k)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[1](x)
    return total[0]


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_block_activations_match_autograd(name):
    cfg = zoo.PRESETS[name]
    batch, seq = 2, cfg.seq_len
    g = load_graph(name, batch=batch, seq_len=seq)
    measured = _measured_block_saved_bytes(cfg, batch, seq)
    predicted = g.layer("layers.1").act_bytes
    assert predicted == pytest.approx(measured, rel=0.05)


def test_gpt_tiny_structure_and_roles():
    g = load_graph("gpt-tiny", batch=2)
    kinds = [l.kind for l in g.layers]
    assert kinds[0] == "embedding" and kinds[-1] == "head" and kinds[-2] == "norm"
    assert kinds.count("transformer_block") == zoo.PRESETS["gpt-tiny"].layers
    blk = g.layer("layers.0")
    roles = {l.name: l.role for l in blk.linears}
    assert roles["attn.o_proj"] == "row" and roles["attn.q_proj"] == "column"
    assert roles["mlp.fc1"] == "column" and roles["mlp.fc2"] == "row"
    a = blk.attention
    cfg = zoo.PRESETS["gpt-tiny"]
    assert (a.heads, a.kv_heads, a.head_dim, a.causal) == (cfg.heads, cfg.heads, cfg.hidden // cfg.heads, True)
    assert g.layers[-1].vocab == cfg.vocab
    assert 0 < blk.act_bytes_tp < blk.act_bytes
    # params add up to the model's
    model = zoo.build_model(cfg, device="meta")
    assert g.params == sum(p.numel() for p in model.parameters())


def test_llama_gqa_dims():
    g = load_graph("llama-tiny", batch=1)
    cfg = zoo.PRESETS["llama-tiny"]
    a = g.layer("layers.0").attention
    assert (a.heads, a.kv_heads) == (cfg.heads, cfg.kv_heads)


def test_mllm_layers_unequal():
    g = load_graph("mllm-tiny", batch=1)
    kinds = {l.kind for l in g.layers}
    assert "vision_block" in kinds and "transformer_block" in kinds and "projector" in kinds
    v = next(l for l in g.layers if l.kind == "vision_block")
    t = next(l for l in g.layers if l.kind == "transformer_block")
    assert v.signature != t.signature and v.fwd_flops != t.fwd_flops


def test_graph_json_roundtrip():
    g = load_graph("llama-tiny", batch=1)
    d = json.loads(json.dumps(g.to_dict()))
    g2 = ModelGraph.from_dict(d)
    assert g2.fingerprint() == g.fingerprint() and g2.params == g.params


def test_real_weights_untouched():
    cfg = zoo.PRESETS["gpt-tiny"]
    model = zoo.build_model(cfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, zoo.example_batch(cfg, 1, device="cpu"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.device.type == "cpu" for p in model.parameters())


class _Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList([_DataDependent(), _DataDependent()])

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for l in self.layers:
            x = l(x)
        return x.sum()


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if self.lin(x).sum().item() > 0:  # data-dependent: cannot run on fake tensors
            return x
        return -x


def test_untraceable_model_names_module_and_op():
    with pytest.raises(AutoparError) as e:
        capture(_Bad(), {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    msg = str(e.value)
    assert "layers.0" in msg and "aten." in msg and "\n" not in msg


hf = pytest.importorskip if False else None


@pytest.mark.parametrize("spec,block", [("hf:llama-tiny", "model.layers.0"), ("hf:gpt-tiny", "transformer.h.0")])
def test_hf_models_capture(spec, block):
    pytest.importorskip("transformers")
    g = load_graph(spec, batch=1, seq_len=16)
    blk = g.layer(block)
    assert blk.kind == "transformer_block" and blk.attention is not None
    assert blk.fwd_flops > 0 and blk.act_bytes > 0
    assert blk.attention.causal  # a causal LM (transformers hands the kernel an explicit mask under fake tensors)
    model = zoo.load_model_spec(spec).build("meta")
    assert g.params == sum(p.numel() for p in model.parameters())
    assert any(l.kind == "head" for l in g.layers)



def test_hf_loss_is_captured_with_the_head():
    """transformers computes a causal LM's loss at the model's root after its head: the capture
    gives those ops (the vocabulary-wide log-softmax and its backward) to the head, the unit that
    ran last, as the zoo's own head holds its loss, not to the embedding (the first unit):
    a pipeline prices the loss on its last stage."""
    pytest.importorskip("transformers")
    hf, own = load_graph("hf:llama-tiny", batch=1, seq_len=16), load_graph("llama-tiny", batch=1, seq_len=16)
    hf_head, own_head = (next(l for l in g.layers if l.kind == "head") for g in (hf, own))
    assert hf_head.bwd_bytes == pytest.approx(own_head.bwd_bytes, rel=0.01)
    assert hf_head.act_bytes == pytest.approx(own_head.act_bytes, rel=0.01)
    assert hf.layers[0].kind == "embedding"
    assert hf.layers[0].bwd_bytes == pytest.approx(own.layers[0].bwd_bytes, rel=0.01)

def test_kernel_causal_reads_the_flag_or_the_masked_module():
    """An attention kernel is causal by its own flag (wherever its schema puts it), or, handed a
    mask, by the ``is_causal`` attribute of the module running it; never for a module that says
    it is not causal or says nothing."""
    from planner.frontend.layer_kinds import kernel_causal

    from codegen.runtime.torch_compat import CPU_FLASH_ATTENTION_OP, EFFICIENT_ATTENTION_OP, saved_attention_ops

    ops = {str(op).split(".")[-2]: op for op in saved_attention_ops()}  # aten.<kernel>.default
    cpu = ops[CPU_FLASH_ATTENTION_OP]
    eff = ops[EFFICIENT_ATTENTION_OP]
    q, mask = torch.zeros(1, 2, 4, 8), torch.ones(4, 4, dtype=torch.bool)

    def attn(flag):
        m = nn.Module()
        m.inner = nn.Linear(2, 2)
        if flag is not None:
            m.inner.is_causal = flag
        return m
    assert kernel_causal(cpu, (q, q, q, 0.0, True), {}, None)
    assert kernel_causal(eff, (q, q, q, None, False, 0.0, True), {}, None)  # is_causal is its 7th argument
    assert not kernel_causal(cpu, (q, q, q, 0.0, False), {}, attn(True))  # no mask: the flag decides
    assert kernel_causal(cpu, (q, q, q, 0.0, False), {"attn_mask": mask}, attn(True))
    assert not kernel_causal(cpu, (q, q, q, 0.0, False), {"attn_mask": mask}, attn(False))
    assert not kernel_causal(cpu, (q, q, q, 0.0, False), {"attn_mask": mask}, attn(None))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "planner.entry.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_graph_json_and_errors(capsys):
    from planner.entry.cli import main

    r = _cli("graph", "--model", "gpt-tiny", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["name"] == "gpt-tiny" and len(d["layers"]) == zoo.PRESETS["gpt-tiny"].layers + 3
    r = _cli("graph", "--model", "gpt-tinyy")  # a bad input ends the process with one line
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "gpt-tiny" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(SystemExit) as bad:  # the rest in this process: the same main()
        main(["graph", "--model", "gpt-tiny", "--batch", "x"])
    assert bad.value.code == 2
    assert main(["graph", "--model", "gpt-tiny"]) == 0 and "layers.0" in capsys.readouterr().out


@pytest.mark.parametrize("args, want", [
    (["plan", "--global-batch", "-4"], "argument --global-batch: must be a positive integer, got -4"),
    (["plan", "--global-batch", "4", "--seq-len", "0"], "argument --seq-len: must be a positive integer, got 0"),
    (["plan", "--global-batch", "4", "--moe-imbalance", "0.5"], "argument --moe-imbalance: must be >= 1.0"),
    (["plan", "--global-batch", "4", "--fix", "tp<4"], "bad --fix operator '<'"),
    (["plan", "--global-batch", "4", "--seq-lens", "/nonexistent/lens.txt"], "lens.txt"),
    (["evaluate", "--global-batch", "4", "--config", "dp=2,tp=two"], "--config tp='two': expected int"),
])
def test_bad_arguments_are_refused_before_calibration_or_capture(args, want, capsys, monkeypatch):
    """A bad flag is one line before any work: neither this machine's calibration nor the
    model's capture runs (both are replaced here by functions that fail the test)."""
    from planner.entry import calibration
    from planner.entry.cli import main
    from planner.frontend import load

    def never(*a, **k):
        pytest.fail("work started before the arguments were checked")

    monkeypatch.setattr(calibration, "machine_profile", never)
    monkeypatch.setattr(load, "load_graph", never)
    try:
        rc = main([args[0], "--model", "llama-tiny", "--cluster", "local-cpu:2", *args[1:]])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert want in err and err.startswith("error: ") and err.count("\n") == 1, err
