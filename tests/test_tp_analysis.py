"""Tensor-parallel roles read by dataflow from captured graphs (planner/frontend/tp_analysis.py).

Real captures of tiny models built on the meta device: the zoo, several transformers
families (checked against the model's own ``_tp_plan`` where it has one), and a user
module written in a style the part-based heuristic of tp_layout.py cannot read.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from planner import zoo
from planner.frontend.trace import capture_fx
from planner.frontend.load import graph_of
from planner.frontend.tp_analysis import analyze
from planner.frontend.tp_layout import tp_layout

IDS = {"input_ids": torch.zeros(1, 32, dtype=torch.long, device="meta"), "use_cache": False}
HF_TINY = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128,
               intermediate_size=128, max_position_embeddings=64)
HF_EXTRA = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "phi3": dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=1),
    "olmo2": dict(num_key_value_heads=2),
    "gpt_neox": dict(),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0),
    "gpt2": dict(n_embd=64, n_head=4, n_layer=2, vocab_size=128, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


@functools.cache
def hf(model_type: str, attn: str | None = None):
    """(model, ModelGraph, analysis) of a tiny transformers model."""
    transformers = pytest.importorskip("transformers")
    kw = dict(HF_TINY, **HF_EXTRA[model_type]) if model_type != "gpt2" else dict(HF_EXTRA["gpt2"])
    if attn:
        kw["attn_implementation"] = attn
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    graph, fx = capture_fx(model, dict(IDS))
    return model, graph, analyze(fx, graph)


@functools.cache
def zoo_model(name: str):
    cfg = zoo.preset(name)
    model = zoo.build_model(cfg, device="meta")
    graph, fx = capture_fx(model, zoo.example_batch(cfg, 1, device="meta"), name=name,
                           hidden=cfg.hidden, vocab=cfg.vocab)
    return model, graph, analyze(fx, graph)


def layout_of(model, example) -> dict[str, str]:
    """The plan's TP layout the planner derives: frontend roles (this analysis, or the model's
    own TP plan) through planner.frontend.tp_layout."""
    return tp_layout(graph_of(model, example, name="test", seq_len=32))


def _layer_roles(analysis, layer: str) -> dict[str, str]:
    return {k[len(layer) + 1:]: v for k, v in analysis.roles.items() if k.startswith(layer + ".")}


@pytest.mark.parametrize("name,mlp,heads", [
    ("gpt-tiny", {"mlp.fc1": "column", "mlp.fc2": "row"}, (4, 4, 16)),
    ("llama-tiny", {"mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}, (4, 2, 16)),
])
def test_zoo(name, mlp, heads):
    _, graph, a = zoo_model(name)
    attn = {"attn.q_proj": "column", "attn.k_proj": "column", "attn.v_proj": "column", "attn.o_proj": "row"}
    assert _layer_roles(a, "layers.0") == {**attn, **mlp}
    assert a.heads == {"layers.0": heads}
    assert a.problems == {}
    # The zoo's blocks are what the part heuristic was written for: both layouts agree.
    model, _, _ = zoo_model(name)
    assert layout_of(model, zoo.example_batch(zoo.preset(name), 1, device="meta")) == tp_layout(graph)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt_neox"])
def test_matches_hf_tp_plan(model_type):
    model, graph, a = hf(model_type)
    want = {"colwise": "column", "rowwise": "row"}
    blocks = [l.name for l in graph.layers if l.kind == "transformer_block"]
    layout = layout_of(model, dict(IDS))
    for pattern, style in model._tp_plan.items():
        if "*" not in pattern:
            continue
        for block in blocks:
            fqn = pattern.replace(pattern[:pattern.index("*") + 1], block)
            assert layout[fqn] == want[style], fqn
    assert a.problems == {}
    assert len(a.roles) == sum("*" in p for p in model._tp_plan)
    kv = 4 if model_type == "gpt_neox" else 2
    assert a.heads == {blocks[0]: (4, kv, 16)}
    if model_type == "qwen2":  # q/k/v with biases: addmm
        assert model.get_submodule("model.layers.0.self_attn.q_proj").bias is not None
    if model_type == "gpt_neox":  # per-head interleaved q|k|v: a plain column, not packed
        assert a.roles["gpt_neox.layers.0.attention.query_key_value"] == "column"


@pytest.mark.parametrize("attn", [None, "eager"])
def test_gpt2_packed_qkv(attn):
    model, graph, a = hf("gpt2", attn)
    assert _layer_roles(a, "transformer.h.0") == {
        "attn.c_attn": "packed_qkv", "attn.c_proj": "row", "mlp.c_fc": "column", "mlp.c_proj": "row"}
    assert a.heads == {"transformer.h.0": (4, 4, 16)}
    assert a.problems == {}
    layout = layout_of(model, dict(IDS))
    assert layout["transformer.h.1.attn.c_attn"] == "packed_qkv"
    assert layout["transformer.h.1.mlp.c_proj"] == "row"
    assert layout["transformer.wte"] == "vocab_embed"
    assert layout["transformer.wpe"] == "embed"
    assert layout["transformer.h.1.ln_2"] == "norm"
    assert layout["lm_head"] == "vocab_head"


def test_opt_nested_layers():
    model, graph, a = hf("opt")
    assert _layer_roles(a, "model.decoder.layers.0") == {
        "self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
        "self_attn.out_proj": "row", "fc1": "column", "fc2": "row"}
    layout = layout_of(model, dict(IDS))
    assert layout["model.decoder.layers.1.fc2"] == "row"
    assert layout["model.decoder.layers.1.self_attn.q_proj"] == "column"
    assert layout["model.decoder.embed_positions"] == "embed"
    assert a.heads == {"model.decoder.layers.0": (4, 4, 16)}


def test_phi3_fused_projections_are_problems():
    model, graph, a = hf("phi3")
    problem = a.problems["model.layers.0"]
    assert "qkv_proj" in problem and "[64, 32, 32]" in problem
    assert "gate_up_proj" in problem and "[128, 128]" in problem
    assert "packed_qkv" not in a.roles.values()
    assert a.heads == {"model.layers.0": (4, 2, 16)}
    g = graph_of(model, dict(IDS), name="phi3", seq_len=32)  # the planner will not propose tp for it
    assert "tp" in g.limits


def test_olmo2_norm_over_projection_is_a_problem():
    _, _, a = hf("olmo2")
    problem = a.problems["model.layers.0"]
    assert "q_proj" in problem and "k_proj" in problem and "v_proj" not in problem


class Block(nn.Module):
    """Attention written inline: q, k, v, out and the MLP are direct children of the block."""

    def __init__(self, d: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, kv_heads * self.hd)
        self.v = nn.Linear(d, kv_heads * self.hd)
        self.out = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q = self.q(h).reshape(b, s, self.heads, self.hd).permute(0, 2, 1, 3)
        k = self.k(h).reshape(b, s, self.kv_heads, self.hd).permute(0, 2, 1, 3)
        v = self.v(h).reshape(b, s, self.kv_heads, self.hd).permute(0, 2, 1, 3)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(a.permute(0, 2, 1, 3).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class UserLM(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 3):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.h = nn.ModuleList(Block(d) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.transformer.wte(ids)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def test_user_module():
    with torch.device("meta"):
        model = UserLM()
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    graph, fx = capture_fx(model, (ids,), loss_fn=lambda out: out.float().sum())
    a = analyze(fx, graph)
    assert _layer_roles(a, "transformer.h.0") == {
        "q": "column", "k": "column", "v": "column", "out": "row", "fc1": "column", "fc2": "row"}
    assert a.heads == {"transformer.h.0": (4, 2, 16)}
    assert a.problems == {}
    g = graph_of(model, (ids,), name="flat", seq_len=32, loss_fn=lambda out: out.float().sum())
    assert "sp" in g.limits and "transformer.h.0.q is a column-parallel linear that no attention / MLP" in g.limits["sp"]
    layout = layout_of(model, (ids,))
    for i in range(3):
        assert layout[f"transformer.h.{i}.out"] == "row"
        assert layout[f"transformer.h.{i}.fc1"] == "column"
        assert layout[f"transformer.h.{i}.ln1"] == "norm"
    assert layout["transformer.wte"] == "vocab_embed"
    assert layout["lm_head"] == "vocab_head"


class StackLM(nn.Module):
    """A token embedding, ``blocks`` (``layers``) and an output head: the LM around a test's blocks."""

    def __init__(self, blocks: list[nn.Module], vocab: int = 128, d: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


class _Dense(nn.Module):  # BERT's output modules: a linear, then the residual and a norm
    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.dense, self.norm = nn.Linear(d_in, d), nn.LayerNorm(d)

    def forward(self, h, x):
        return self.norm(x + self.dense(h))


class _BertBlock(nn.Module):
    """BERT's block layout: attention.self (q, k, v) beside attention.output (dense + norm), then
    intermediate (dense) beside output (dense + norm): each row linear in a module without the
    column linears that feed it."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.query, self.attention.self.key, self.attention.self.value = (
            nn.Linear(d, d) for _ in range(3))
        self.attention.output = _Dense(d, d)
        self.intermediate = nn.Linear(d, 4 * d)
        self.output = _Dense(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        a = self.attention.self
        q, k, v = (lin(x).reshape(b, s, self.heads, -1).transpose(1, 2) for lin in (a.query, a.key, a.value))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = self.attention.output(ctx, x)
        return self.output(F.gelu(self.intermediate(x)), x)


def test_bert_layout_runs_tensor_parallel_without_sequence_parallel():
    """Its rows are read as rows and its columns as columns, and no module gathers the sequence
    shard for the columns under SP (codegen.runtime.tp_styles.ungathered_columns), so the planner
    refuses sp=on for it before anything runs."""
    with torch.device("meta"):
        model = StackLM([_BertBlock(64, 4) for _ in range(2)])
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    g = graph_of(model, (ids,), name="bert-style", seq_len=32, loss_fn=lambda out: out.float().sum())
    roles = {lin.name: lin.role for lin in g.layers[1].linears}
    assert roles["attention.output.dense"] == "row" and roles["output.dense"] == "row", roles
    assert roles["attention.self.query"] == "column" and roles["intermediate"] == "column", roles
    assert "tp" not in g.limits
    assert "layers.0.attention.self.query is a column-parallel linear that no attention / MLP" in g.limits["sp"]


class _ResidualMLP(nn.Module):
    """An MLP module whose residual is inside it (``mode``): ``arg`` adds its input to its output,
    ``kw`` likewise taking it as ``hidden_states=``, ``norm`` adds its normed input, ``beside``
    adds a residual handed in as a second argument (which stays as it comes), ``same`` that with
    one tensor handed in both ways; ``block``: no residual inside (the block adds it)."""

    def __init__(self, d: int, mode: str):
        super().__init__()
        self.up, self.down, self.mode = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), mode
        self.norm = nn.LayerNorm(d)

    def forward(self, hidden_states, residual=None):
        y = self.down(F.gelu(self.up(hidden_states)))
        if self.mode == "block":
            return y
        if self.mode in ("beside", "same"):
            return residual + y
        return (self.norm(hidden_states) if self.mode == "norm" else hidden_states) + y


class _ResidualBlock(nn.Module):
    def __init__(self, d: int, heads: int, mode: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.qkv = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.attn.out = nn.Linear(d, d)
        self.mlp, self.heads = _ResidualMLP(d, mode), heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (lin(self.norm1(x)).reshape(b, s, self.heads, -1).transpose(1, 2) for lin in self.attn.qkv)
        x = x + self.attn.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h, mode = self.norm2(x), self.mlp.mode
        if mode == "kw":
            return self.mlp(hidden_states=h)
        if mode in ("beside", "same"):
            return self.mlp(h, x if mode == "beside" else h)
        return x + self.mlp(h) if mode == "block" else self.mlp(h)


@pytest.mark.parametrize("mode,refused", [("arg", True), ("kw", True), ("norm", True), ("beside", False),
                                          ("same", False), ("block", False)])
def test_a_residual_inside_the_mlp_module_refuses_sequence_parallel(mode, refused):
    """Under SP the MLP module takes its hidden-state input (first argument or ``hidden_states=``,
    ``codegen.runtime.tensor_parallel.region_input_key``) gathered whole and its row linear's output
    leaves as the sequence shard, so a module joining the two (``x + down(..)``, or its norm of x,
    inside it) cannot run SP: the planner refuses sp=on before anything runs and keeps TP (the
    runtime trains it without SP, tests/test_sequence_gather.py). A residual handed in beside it
    stays the shard (BLOOM's), and the block's own residual is outside the module: both keep SP."""
    with torch.device("meta"):
        model = StackLM([_ResidualBlock(64, 4, mode) for _ in range(2)])
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")
    g = graph_of(model, (ids,), name="residual-mlp", seq_len=32, loss_fn=lambda out: out.float().sum())
    roles = {lin.name: lin.role for lin in g.layers[1].linears}
    assert roles["mlp.down"] == "row" and roles["mlp.up"] == "column" and roles["attn.out"] == "row", roles
    assert "tp" not in g.limits
    if refused:
        assert g.limits["sp"].startswith("layers.0.mlp joins its row-parallel linear down's output with its own input")
    else:
        assert "sp" not in g.limits, g.limits


@pytest.mark.slow
def test_layer_costs_are_sums_over_the_fx_graph_and_graph_fx_prints_a_block():
    """Capture's per-layer FLOPs are the sums of its FX nodes' FLOPs (forward and backward);
    ``autopar graph --fx`` prints one block's ATen ops, both phases."""
    import subprocess
    import sys

    from planner.frontend.fx_graph import unit_nodes
    model, graph, _ = hf("gpt2")
    _, fx = capture_fx(model, dict(IDS))
    block = graph.layer("transformer.h.0")
    fwd = sum(n.meta["flops"] for n in unit_nodes(fx, "transformer.h.0", "fwd"))
    bwd = sum(n.meta["flops"] for n in unit_nodes(fx, "transformer.h.0", "bwd"))
    assert fwd == block.fwd_flops > 0 and bwd == block.bwd_flops > 0
    r = subprocess.run([sys.executable, "-m", "planner.entry.cli", "graph", "--model", "hf:gpt-tiny", "--fx", "--layer",
                        "transformer.h.1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "transformer.h.1" in lines[0] and "transformer.h.0" in lines[0]  # captured as its class's first block
    assert any(l.startswith("fwd  attn") and "addmm" in l and "c_attn.weight" in l for l in lines)
    assert any(l.startswith("bwd") for l in lines)


@pytest.mark.parametrize("spec", ["llama-tiny", "moe-tiny", "tests.user_models:build", "hf:tests/hf_configs/opt-tiny.json",
                                  "hf:tests/hf_configs/gpt_neox-tiny.json"])
def test_op_styles_follow_the_linear_roles(spec):
    """One sharding spec: an op's TP style (what compute and memory divide by tp) is read from its
    linears' roles (what the runtime shards). OPT's ``fc2`` sits directly in the block; the
    capture first styled it replicated while the analysis makes it row-parallel, so the cost
    model priced on every tp rank a matmul the runtime splits."""
    from planner.frontend.load import load_graph
    from planner.graph import TP_SPLIT_ROLES, op_linears

    g = load_graph(spec, batch=1, seq_len=32)
    checked = 0
    for layer in g.layers:
        for op in layer.ops:
            mine = op_linears(op, layer.ops, layer.linears)
            if not mine or op.tp_style == "vocab":
                continue
            checked += 1
            split = any(lin.role in TP_SPLIT_ROLES for lin in mine)
            assert (op.tp_style != "replicated") == split, (layer.name, op.name, op.tp_style, [l.role for l in mine])
        total = sum(o.fwd_flops + o.bwd_flops for o in layer.ops)
        if total:
            split_flops = sum(o.fwd_flops + o.bwd_flops for o in layer.ops if o.tp_style != "replicated")
            assert layer.tp_flops_frac == pytest.approx(split_flops / total)
    assert checked
    if "opt" in spec:
        fc2 = next(o for layer in g.layers for o in layer.ops if o.name == "fc2")
        assert fc2.tp_style == "col_row"
