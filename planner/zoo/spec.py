"""From a config or a model spec string to a model and example inputs.

A model spec string is one of:
- a preset name (``llama3-8b``; see ``PRESETS``);
- a path to a ``.toml`` file with the ModelConfig keys (flat, or under ``[model]``);
- ``package.module:function`` -- ``function()`` is called with no arguments and must
  return an ``nn.Module``;
- ``hf:<preset>`` -- a randomly initialised Hugging Face ``transformers`` model
  (GPT2LMHeadModel / LlamaForCausalLM) mirroring a gpt/llama preset; nothing is
  downloaded;
- ``hf:<config.json or a folder holding one>`` -- any transformers causal LM, built
  from that local config with random weights (``AutoModelForCausalLM.from_config``).
Bad specs raise a one-line ``AutoparError``.
"""
from __future__ import annotations

import contextlib
import difflib
import importlib
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from planner.errors import AutoparError
from planner.feasibility import length_problem
from planner.plan import ModelFacts
from planner.zoo.config import PRESETS, ModelConfig
from codegen.runtime.data import FUNC_SPEC
from planner.zoo.gpt import GPT
from planner.zoo.llama import Llama
from planner.zoo.mllm import MLLM
from planner.zoo.moe import MoE

Device = Union[str, torch.device, None]
_ARCH_CLASSES = {"gpt": GPT, "llama": Llama, "mllm": MLLM, "moe": MoE}
_SPEC_HELP = "use a preset name, a .toml file, package.module:function or hf:<preset>"


# ---------------------------------------------------------------- build / inputs

def build_model(cfg: ModelConfig, device: Device = None, seed: Optional[int] = None) -> nn.Module:
    """Build the zoo model for ``cfg`` on ``device`` (default: torch's default device).

    The model is constructed on the meta device (no allocation, no default init); on
    any other device it is then materialised with ``to_empty`` and initialised with
    ``init_weights(seed)``. On ``"meta"`` it stays uninitialised: call
    ``model.to_empty(device=...)`` then ``model.init_weights(seed)`` later.
    """
    cfg.validate()
    dev = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = _ARCH_CLASSES[cfg.arch](cfg)
    if dev.type != "meta":
        model.to_empty(device=dev)
        model.init_weights(seed)
    return model


def example_batch(cfg: ModelConfig, batch: int, seq_len: Optional[int] = None, device: Device = "meta",
                  with_labels: bool = True) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``model(**batch)``: ``input_ids``, ``labels``, and ``pixel_values`` (mllm).

    ``seq_len`` (default ``cfg.seq_len``) is the decoder sequence in tokens; for mllm
    it includes the ``num_patches`` image tokens, so text = seq_len - num_patches.
    On ``"meta"`` the tensors are meta tensors; elsewhere the values are random with a
    fixed seed (ids uniform over the vocabulary, pixels standard normal in the
    default dtype). ``labels`` have the text shape [batch, S_text].
    """
    seq = cfg.seq_len if seq_len is None else seq_len
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise AutoparError(f"example_batch: batch must be a positive integer, got {batch!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise AutoparError(f"example_batch: seq_len must be a positive integer, got {seq!r}")
    text = seq - cfg.num_patches
    if text <= 0:
        raise AutoparError(f"example_batch: seq_len {seq} leaves no text after the {cfg.num_patches} image "
                           f"tokens of {cfg.name}; use seq_len > {cfg.num_patches}")
    if cfg.arch == "gpt" and (why := length_problem(seq, ModelFacts(max_seq_len=cfg.max_seq_len))):
        raise AutoparError(f"example_batch: {cfg.name}: {why}")
    dev = torch.device(device) if device is not None else torch.get_default_device()
    out: dict[str, torch.Tensor] = {}
    if dev.type == "meta":
        out["input_ids"] = torch.empty(batch, text, dtype=torch.long, device=dev)
        if with_labels:
            out["labels"] = torch.empty(batch, text, dtype=torch.long, device=dev)
        if cfg.arch == "mllm":
            out["pixel_values"] = torch.empty(batch, cfg.channels, cfg.image_size, cfg.image_size, device=dev)
        return out
    gen = torch.Generator().manual_seed(0)
    out["input_ids"] = torch.randint(0, cfg.vocab, (batch, text), generator=gen).to(dev)
    if with_labels:
        out["labels"] = torch.randint(0, cfg.vocab, (batch, text), generator=gen).to(dev)
    if cfg.arch == "mllm":
        out["pixel_values"] = torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size,
                                          generator=gen).to(dev)
    return out


# ---------------------------------------------------------------------- specs

@dataclass
class ModelSpec:
    """A resolved model spec: ``factory()`` builds the model on torch's default device.

    ``cfg`` is the zoo config (None for ``package.module:function`` specs).
    """

    name: str
    cfg: Optional[ModelConfig]
    factory: Callable[[], nn.Module]

    def build(self, device: Device = None) -> nn.Module:
        """``factory()`` under ``torch.device(device)`` when given (``"meta"`` allocates nothing)."""
        ctx = torch.device(device) if device is not None else contextlib.nullcontext()
        with ctx:
            return self.factory()


def preset(name: str) -> ModelConfig:
    """The preset ``name``, or an AutoparError suggesting close matches."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, list(PRESETS), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise AutoparError(f"unknown model {name!r}{hint}; presets: {', '.join(PRESETS)}; or {_SPEC_HELP}")


def load_model_spec(spec: str) -> ModelSpec:
    """Resolve a model spec string (see module docstring) to a ModelSpec."""
    if not isinstance(spec, str) or not spec.strip():
        raise AutoparError(f"empty model spec {spec!r}; {_SPEC_HELP}")
    spec = spec.strip()
    if spec.startswith("hf:"):
        return _hf_spec(spec)
    if spec.lower().endswith(".toml") or os.path.isfile(spec):
        cfg = load_config_toml(spec)
        return ModelSpec(cfg.name, cfg, lambda: build_model(cfg))
    if ":" in spec:
        return _function_spec(spec)
    cfg = preset(spec)
    return ModelSpec(cfg.name, cfg, lambda: build_model(cfg))


# ---------------------------------------------------------------------- TOML

_REQUIRED = ("arch", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len")
_VISION = ("vision_layers", "vision_hidden", "vision_heads", "vision_ffn_hidden", "image_size", "patch_size")
_TYPES: dict[str, tuple[type, ...]] = {f.name: (int,) for f in fields(ModelConfig)}
_TYPES.update(name=(str,), arch=(str,), rope_theta=(int, float), norm_eps=(int, float), tie_embeddings=(bool,))


def load_config_toml(path: str) -> ModelConfig:
    """A ModelConfig from a TOML file (keys flat or under ``[model]``); ``name`` defaults to the file stem."""
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise AutoparError("reading a model .toml on Python 3.10 needs tomli; pip install tomli") from None
    if not os.path.isfile(path):
        raise AutoparError(f"model file {path!r} not found; check the path")
    try:
        with open(path, "rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise AutoparError(f"{path}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise AutoparError(f"{path}: cannot read: {exc.strerror}") from None
    if set(data) == {"model"} and isinstance(data["model"], dict):
        data = data["model"]
    for key, val in data.items():
        if key not in _TYPES:
            close = difflib.get_close_matches(key, list(_TYPES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise AutoparError(f"{path}: unknown key {key!r}{hint}; allowed: {', '.join(_TYPES)}")
        want = _TYPES[key]
        ok = isinstance(val, want) and (bool in want or not isinstance(val, bool))
        if not ok:
            raise AutoparError(f"{path}: key {key!r} must be {' or '.join(t.__name__ for t in want)}, "
                               f"got {type(val).__name__} {val!r}")
    required = _REQUIRED + (_VISION if data.get("arch") == "mllm" else ())
    for key in required:
        if key not in data:
            raise AutoparError(f"{path}: missing key {key!r}; required keys: {', '.join(required)}")
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    try:
        return ModelConfig(**data)
    except AutoparError as exc:
        raise AutoparError(f"{path}: {exc}") from None


# ----------------------------------------------------------- module:function

def _function_spec(spec: str) -> ModelSpec:
    if not FUNC_SPEC.match(spec):
        raise AutoparError(f"bad model spec {spec!r}: expected package.module:function (or a preset, a .toml "
                           "file, hf:<preset>)")
    mod_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:  # any import-time failure is the user's module
        raise AutoparError(f"model spec {spec!r}: cannot import {mod_name!r} ({type(exc).__name__}: {exc}); "
                           "check it is on PYTHONPATH") from None
    fn = getattr(module, func_name, None)
    if fn is None:
        raise AutoparError(f"model spec {spec!r}: module {mod_name!r} has no callable {func_name!r}; "
                           "define def {0}() -> nn.Module".format(func_name))
    if not callable(fn):
        raise AutoparError(f"model spec {spec!r}: {mod_name}.{func_name} is a {type(fn).__name__}, not a function; "
                           "name a function def {0}() -> nn.Module".format(func_name))
    _check_no_arguments(spec, fn)

    def factory() -> nn.Module:
        try:
            model = fn()
        except TypeError as exc:
            if exc.__traceback__ is None or exc.__traceback__.tb_next is not None:
                raise  # raised inside the function: the user's code, with its traceback
            # raised by the call itself: a builtin without a readable signature that wants arguments
            raise AutoparError(f"model spec {spec!r}: {func_name}() cannot be called without arguments ({exc}); "
                               "name a function that takes none and returns the nn.Module") from None
        if not isinstance(model, nn.Module):
            raise AutoparError(f"model spec {spec!r}: {func_name}() returned {type(model).__name__}, "
                               "not an nn.Module; return the model")
        return model

    return ModelSpec(spec, None, factory)


def _check_no_arguments(spec: str, fn: Callable[..., Any]) -> None:
    """A one-line error when ``fn`` cannot be called with no arguments (``os:system``)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: the call itself is checked
        return
    try:
        sig.bind()
    except TypeError:
        need = [n for n, p in sig.parameters.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise AutoparError(f"model spec {spec!r}: {getattr(fn, '__name__', 'it')}() needs arguments "
                           f"({', '.join(need)}); name a function that takes none and returns the nn.Module") from None


# ---------------------------------------------------------------- hf:<preset>

def _hf_spec(spec: str) -> ModelSpec:
    try:
        importlib.import_module("transformers")
    except ImportError:
        raise AutoparError(f"model spec {spec!r} needs Hugging Face transformers; "
                           "pip install 'autopar[hf]'") from None
    if os.path.exists(spec[3:]):
        return _hf_config_spec(spec)
    cfg = preset(spec[3:])
    if cfg.arch not in ("gpt", "llama"):
        raise AutoparError(f"model spec {spec!r}: hf: supports gpt and llama presets, not {cfg.arch}")
    if cfg.arch == "gpt" and cfg.kv_heads != cfg.heads:
        raise AutoparError(f"model spec {spec!r}: GPT-2 has no grouped-query attention; use kv_heads = heads")
    return ModelSpec(spec, cfg, lambda: build_hf_model(cfg))


def _hf_config_spec(spec: str) -> ModelSpec:
    """``hf:<config.json | folder>``: a transformers causal LM from a local config, no download."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = spec[3:]
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise AutoparError(f"model spec {spec!r}: cannot read a transformers config there "
                           f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); give a config.json or its folder") from None
    hf_cfg.use_cache = False

    def factory() -> nn.Module:
        try:
            return AutoModelForCausalLM.from_config(hf_cfg)
        except ValueError as e:
            raise AutoparError(f"model spec {spec!r}: {type(hf_cfg).__name__} is not a causal LM transformers "
                               f"can build ({str(e).splitlines()[0][:160]})") from None

    name = "hf:" + os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    return ModelSpec(name, None, factory)


def build_hf_model(cfg: ModelConfig) -> nn.Module:
    """A randomly initialised transformers GPT2LMHeadModel / LlamaForCausalLM shaped like ``cfg``.

    SDPA attention, ``use_cache=False``, no dropout; built on torch's default device.
    """
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if cfg.arch == "gpt":
        hf_cfg = GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.max_seq_len, n_embd=cfg.hidden,
                            n_layer=cfg.layers, n_head=cfg.heads, n_inner=cfg.ffn_hidden,
                            layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                            bos_token_id=cfg.vocab - 1, eos_token_id=cfg.vocab - 1)
    else:
        hf_cfg = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
                             num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                             num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
                             rope_theta=float(cfg.rope_theta), rms_norm_eps=cfg.norm_eps,
                             tie_word_embeddings=cfg.tie_embeddings, use_cache=False)
    return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
