"""Tests for planner.zoo: presets, parameter counts, forward/backward, attention, specs."""
from __future__ import annotations

import math
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from planner.errors import AutoparError
from codegen.runtime import layers as attn_mod
from codegen.runtime.layers import SelfAttention
from planner.zoo import PRESETS, PUBLISHED_PARAMS, ModelConfig, build_model, example_batch, load_model_spec
TINY = ["gpt-tiny", "llama-tiny", "mllm-tiny"]


def _real(name: str, seed: int = 0) -> nn.Module:
    model = build_model(PRESETS[name], "meta")
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


# ------------------------------------------------------------------ presets

@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_on_meta_with_analytic_param_count(name):
    cfg = PRESETS[name]
    t0 = time.perf_counter()
    model = build_model(cfg, "meta")
    assert time.perf_counter() - t0 < 5.0
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    children = [n for n, _ in model.named_children()]
    expected = ["embed", "layers", "norm", "head"]
    assert children == (["vision", "projector"] + expected if cfg.arch == "mllm" else expected)
    assert len(model.layers) == cfg.layers


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_large_presets_match_published_counts(name):
    published = PUBLISHED_PARAMS[name]
    assert abs(PRESETS[name].num_params() - published) / published < 0.005


def test_meta_construction_of_405b_is_fast_under_device_context():
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = build_model(PRESETS["llama3-405b"])
    assert time.perf_counter() - t0 < 5.0
    assert next(model.parameters()).is_meta


def test_config_validation_errors_are_one_line():
    base = PRESETS["llama-tiny"]
    for changes in [dict(hidden=63), dict(kv_heads=3), dict(arch="rnn"), dict(layers=0), dict(vocab=2.5)]:
        with pytest.raises(AutoparError) as exc:
            base.replace(**changes)
        _one_line(exc)
    mllm = PRESETS["mllm-tiny"]
    with pytest.raises(AutoparError):
        mllm.replace(seq_len=mllm.num_patches)
    assert base.replace(seq_len=4096).max_seq_len == 4096


# ------------------------------------------------------------- real runs

@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name):
    cfg = PRESETS[name]
    model = _real(name)
    batch = example_batch(cfg, 2, device="cpu")
    loss = model(**batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(cfg.vocab)) < 0.3
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    logits = model(**{k: v for k, v in batch.items() if k != "labels"})
    assert logits.shape == (2, cfg.seq_len, cfg.vocab)


@pytest.mark.parametrize("name", TINY)
def test_init_weights_is_deterministic(name):
    a, b = _real(name, 0), _real(name, 0)
    c = _real(name, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    a.init_weights(0)
    assert all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())


def test_tied_embeddings_survive_to_empty():
    cfg = PRESETS["gpt-tiny"].replace(tie_embeddings=True)
    assert cfg.tie_embeddings
    model = build_model(cfg, "meta")
    model.to_empty(device="cpu")
    model.init_weights(0)
    assert model.head.proj.weight is model.embed.tok.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_meta_forward_shapes():
    for name in TINY:
        cfg = PRESETS[name]
        model = build_model(cfg, "meta")
        out = model(**example_batch(cfg, 3, with_labels=False))
        assert out.is_meta and out.shape == (3, cfg.seq_len, cfg.vocab)


def test_mllm_labels_padded_or_full():
    cfg = PRESETS["mllm-tiny"]
    model = _real("mllm-tiny")
    batch = example_batch(cfg, 2, device="cpu")
    short = model(**batch)
    pad = torch.full((2, cfg.num_patches), -100, dtype=torch.long)
    full = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                 labels=torch.cat((pad, batch["labels"]), dim=1))
    torch.testing.assert_close(short, full)
    with pytest.raises(AutoparError):
        example_batch(cfg, 1, seq_len=cfg.num_patches)


def test_llama_explicit_positions_equal_default():
    cfg = PRESETS["llama-tiny"]
    model = _real("llama-tiny")
    ids = example_batch(cfg, 2, device="cpu")["input_ids"]
    s = ids.shape[1]
    ref = model(ids)
    torch.testing.assert_close(model(ids, positions=torch.arange(s)), ref)
    torch.testing.assert_close(model(ids, positions=torch.arange(s).expand(2, s)), ref)
    # positions matter: shifting them changes the output of a RoPE model.
    assert not torch.allclose(model(ids, positions=torch.arange(s) + 7), ref)


# ------------------------------------------------------------- attention

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_default_attention_matches_reference(causal, hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k = torch.randn(2, hkv, 5, 8, generator=g)
    v = torch.randn(2, hkv, 5, 8, generator=g)
    got = attn_mod.attention(q, k, v, causal=causal)
    # independent manual reference: per query head, the kv head it shares
    rep = 4 // hkv
    out = torch.empty_like(q)
    for h in range(4):
        s = q[:, h] @ k[:, h // rep].transpose(-1, -2) / math.sqrt(8)
        if causal:
            s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        out[:, h] = s.softmax(-1) @ v[:, h // rep]
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn_mod.reference_attention(q, k, v, causal=causal), out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_instance_attention_impl_is_used_and_isolated(name):
    """An implementation set on one model's attention modules runs there, in call order,
    and never in another model built from the same config (nothing process-wide)."""
    cfg = PRESETS[name]
    model, other = build_model(cfg, "meta"), build_model(cfg, "meta")
    calls: list[bool] = []

    def counting(q, k, v, *, causal, scale=None):
        calls.append(causal)
        return attn_mod.sdpa_attention(q, k, v, causal=causal, scale=scale)

    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.attn_impl = counting
    model(**example_batch(cfg, 1))
    n_vision = cfg.vision_layers if cfg.arch == "mllm" else 0
    assert calls == [False] * n_vision + [True] * cfg.layers
    other(**example_batch(cfg, 1))
    assert len(calls) == n_vision + cfg.layers
    assert all(m.attn_impl is None for m in other.modules() if isinstance(m, SelfAttention))


# ------------------------------------------------------------------ specs

def test_spec_preset_and_unknown():
    spec = load_model_spec("llama-tiny")
    assert spec.cfg is PRESETS["llama-tiny"]
    assert sum(p.numel() for p in spec.build("meta").parameters()) == spec.cfg.num_params()
    with pytest.raises(AutoparError) as exc:
        load_model_spec("llama3-8")
    msg = _one_line(exc)
    assert "llama3-8b" in msg and "gpt-tiny" in msg


TOML_OK = """
name = "my-llama"
arch = "llama"
layers = 2
hidden = 64
ffn_hidden = 128
heads = 4
kv_heads = 1
vocab = 100
seq_len = 16
rope_theta = 1e4
"""


def test_spec_toml(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(TOML_OK)
    spec = load_model_spec(str(path))
    assert spec.cfg == ModelConfig(name="my-llama", arch="llama", layers=2, hidden=64, ffn_hidden=128, heads=4,
                                   kv_heads=1, vocab=100, seq_len=16, rope_theta=1e4)
    model = spec.build("meta")
    assert sum(p.numel() for p in model.parameters()) == spec.cfg.num_params()


@pytest.mark.parametrize("body,needle", [
    ("arch = llama\n", "invalid TOML"),
    (TOML_OK.replace("vocab = 100\n", ""), "'vocab'"),
    (TOML_OK + "dropout = 0.1\n", "'dropout'"),
    (TOML_OK.replace("layers = 2", 'layers = "2"'), "'layers'"),
    (TOML_OK.replace("kv_heads = 1", "kv_heads = 3"), "kv_heads"),
])
def test_spec_toml_errors(tmp_path, body, needle):
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(AutoparError) as exc:
        load_model_spec(str(path))
    msg = _one_line(exc)
    assert str(path) in msg and needle in msg
    with pytest.raises(AutoparError):
        load_model_spec(str(tmp_path / "missing.toml"))


def test_spec_module_function(tmp_path, monkeypatch):
    (tmp_path / "zoo_user_models.py").write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Linear(3, 4)
        def not_a_model():
            return 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_model_spec("zoo_user_models:make")
    assert spec.cfg is None and isinstance(spec.factory(), nn.Linear)
    with pytest.raises(AutoparError) as exc:
        load_model_spec("zoo_user_models:not_a_model").factory()
    _one_line(exc)
    for bad in ["zoo_user_models:missing", "no_such_pkg_xyz.mod:make", "bad-mod:make", "a.b:c:d", "os;rm:x"]:
        with pytest.raises(AutoparError) as exc:
            load_model_spec(bad)
        _one_line(exc)


@pytest.mark.parametrize("spec,says", [
    ("os:system", "system() needs arguments (command)"),      # a function that needs arguments
    ("math:pi", "math.pi is a float, not a function"),         # not callable
    ("os:getpid", "getpid() returned int, not an nn.Module"),  # returns an int
])
def test_spec_function_that_cannot_build_a_model(spec, says, capsys):
    """A ``package.module:function`` that needs arguments, is no function, or returns no
    module is one line naming it and the fix, from the spec and from `autopar graph`."""
    from planner.entry.cli import main
    from planner.frontend.load import load_graph

    with pytest.raises(AutoparError) as exc:
        load_graph(spec)
    _one_line(exc)
    assert says in str(exc.value) and ("name a function" in str(exc.value) or "return the model" in str(exc.value))
    assert main(["graph", "--model", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model spec") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["hf:gpt-tiny", "hf:llama-tiny"])
def test_hf_spec_builds_and_runs(name):
    pytest.importorskip("transformers")
    spec = load_model_spec(name)
    torch.manual_seed(0)
    model = spec.factory()
    assert model.config.use_cache is False
    ids = example_batch(spec.cfg, 2, device="cpu")["input_ids"]
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (2, spec.cfg.seq_len, spec.cfg.vocab) and torch.isfinite(out.loss)
    with pytest.raises(AutoparError):
        load_model_spec("hf:mllm-tiny")


def test_hf_spec_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(AutoparError) as exc:
        load_model_spec("hf:llama-tiny")
    assert "pip install 'autopar[hf]'" in _one_line(exc)
