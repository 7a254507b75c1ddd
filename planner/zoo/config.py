"""Model configurations for the zoo and the named presets.

Units: sizes are counts (features, heads, tokens, pixels); ``num_params()`` counts
scalar parameters (not bytes). No dtype lives here: models build in torch's default
dtype. For ``arch="mllm"``, ``seq_len`` is the TOTAL decoder sequence, image tokens
included (``text_seq_len = seq_len - num_patches``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from planner.errors import AutoparError

ARCHS = ("gpt", "llama", "mllm", "moe")
ROUTERS = ("softmax", "sigmoid")  # MoE router score functions (planner/zoo/moe.py)


@dataclass
class ModelConfig:
    """Shape of a zoo model.

    gpt: learned positions (``max_seq_len`` of them), pre-LayerNorm, GELU MLP, biases.
    llama: RoPE (``rope_theta``), RMSNorm, SwiGLU, grouped-query attention, no biases.
    mllm: ViT encoder (``vision_*``, ``image_size``/``patch_size`` in pixels,
    ``channels``) -> 2-layer projector -> llama decoder.
    moe: llama decoder whose MLPs after the first ``dense_layers`` (of ``ffn_hidden``) are
    ``experts`` routed SwiGLU experts of ``expert_ffn_hidden``, ``top_k`` per token, scored by
    ``router`` (softmax or sigmoid), plus ``shared_experts`` always-on ones of the same size.
    """

    name: str
    arch: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    max_seq_len: Optional[int] = None  # learned positions (gpt); defaults to seq_len
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_heads: int = 0
    vision_ffn_hidden: int = 0
    image_size: int = 0
    patch_size: int = 0
    channels: int = 3
    experts: int = 0
    top_k: int = 0
    expert_ffn_hidden: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    router: str = "softmax"

    def __post_init__(self) -> None:
        if self.max_seq_len is None:
            self.max_seq_len = self.seq_len
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_patches(self) -> int:
        """Image tokens per image (0 unless mllm)."""
        if self.arch != "mllm":
            return 0
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        """Features of one flattened patch: channels * patch_size**2."""
        return self.channels * self.patch_size ** 2

    @property
    def text_seq_len(self) -> int:
        """Text tokens per sample at the default ``seq_len``."""
        return self.seq_len - self.num_patches

    # --------------------------------------------------------------- validation
    def validate(self) -> "ModelConfig":
        """Raise AutoparError on the first bad value; return self."""
        where = f"model config {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise AutoparError(f"{where}: 'name' must be a non-empty string")
        if self.arch not in ARCHS:
            raise AutoparError(f"{where}: unknown arch {self.arch!r}; use one of {', '.join(ARCHS)}")
        ints = ["layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len", "max_seq_len"]
        if self.arch == "moe":
            ints += ["experts", "top_k", "expert_ffn_hidden"]
        if self.arch == "mllm":
            ints += ["vision_layers", "vision_hidden", "vision_heads", "vision_ffn_hidden",
                     "image_size", "patch_size", "channels"]
        for key in ints:
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise AutoparError(f"{where}: {key!r} must be a positive integer, got {val!r}")
        for key in ("rope_theta", "norm_eps"):
            val = getattr(self, key)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val < float("inf"):
                raise AutoparError(f"{where}: {key!r} must be a positive finite number, got {val!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise AutoparError(f"{where}: 'tie_embeddings' must be true or false, got {self.tie_embeddings!r}")
        if self.hidden % self.heads:
            raise AutoparError(f"{where}: hidden {self.hidden} is not divisible by heads {self.heads}; "
                               "pick heads dividing hidden")
        if self.heads % self.kv_heads:
            raise AutoparError(f"{where}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}; "
                               "pick kv_heads dividing heads")
        if self.arch != "gpt" and self.head_dim % 2:
            raise AutoparError(f"{where}: head dim {self.head_dim} must be even for RoPE; change hidden or heads")
        if self.arch == "gpt" and self.max_seq_len < self.seq_len:
            raise AutoparError(f"{where}: max_seq_len {self.max_seq_len} < seq_len {self.seq_len}; "
                               "raise max_seq_len")
        if self.arch == "moe":
            if self.top_k > self.experts:
                raise AutoparError(f"{where}: top_k {self.top_k} exceeds experts {self.experts}; lower top_k")
            for key in ("shared_experts", "dense_layers"):
                val = getattr(self, key)
                if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                    raise AutoparError(f"{where}: {key!r} must be a non-negative integer, got {val!r}")
            if self.dense_layers >= self.layers:
                raise AutoparError(f"{where}: dense_layers {self.dense_layers} leaves no MoE layer of "
                                   f"{self.layers}; lower dense_layers")
            if self.router not in ROUTERS:
                raise AutoparError(f"{where}: router {self.router!r}: use one of {', '.join(ROUTERS)}")
        if self.arch == "mllm":
            if self.image_size % self.patch_size:
                raise AutoparError(f"{where}: image_size {self.image_size} is not a multiple of "
                                   f"patch_size {self.patch_size}")
            if self.vision_hidden % self.vision_heads:
                raise AutoparError(f"{where}: vision_hidden {self.vision_hidden} is not divisible by "
                                   f"vision_heads {self.vision_heads}")
            if self.seq_len <= self.num_patches:
                raise AutoparError(f"{where}: seq_len {self.seq_len} must exceed the {self.num_patches} image "
                                   "tokens (seq_len counts image + text tokens)")
        return self

    def replace(self, **changes) -> "ModelConfig":
        """A validated copy with ``changes`` applied.

        Changing ``seq_len`` of a RoPE model (llama/mllm) also resets ``max_seq_len``
        to it unless given; a gpt model keeps its learned-position table size.
        """
        if "seq_len" in changes and "max_seq_len" not in changes and self.arch != "gpt":
            changes["max_seq_len"] = None
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ param count
    def num_params(self) -> int:
        """Parameters of the model ``build_model(self)`` builds (tied weights counted once)."""
        h, f, v = self.hidden, self.ffn_hidden, self.vocab
        kv = self.kv_heads * self.head_dim
        head = 0 if self.tie_embeddings else v * h
        if self.arch == "gpt":
            attn = 2 * (h * h + h) + 2 * (h * kv + kv)
            mlp = h * f + f + f * h + h
            block = attn + mlp + 4 * h
            return v * h + self.max_seq_len * h + self.layers * block + 2 * h + head
        attn = 2 * h * h + 2 * h * kv
        block = attn + 3 * h * f + 2 * h
        total = v * h + self.layers * block + h + head
        if self.arch == "moe":
            moe_layers = self.layers - self.dense_layers
            ef = self.expert_ffn_hidden
            moe_mlp = h * self.experts + (self.experts + self.shared_experts) * 3 * h * ef
            total += moe_layers * (moe_mlp - 3 * h * f)
        if self.arch == "mllm":
            vh, vf = self.vision_hidden, self.vision_ffn_hidden
            vblock = 4 * (vh * vh + vh) + vh * vf + vf + vf * vh + vh + 4 * vh
            vision = (self.patch_dim * vh + vh) + self.num_patches * vh + self.vision_layers * vblock + 2 * vh
            projector = (vh * h + h) + (h * h + h)
            total += vision + projector
        return total


def _llama(name: str, layers: int, hidden: int, ffn: int, heads: int, kv: int, *, vocab: int = 128256,
           seq_len: int = 8192, tie: bool = False) -> ModelConfig:
    return ModelConfig(name=name, arch="llama", layers=layers, hidden=hidden, ffn_hidden=ffn, heads=heads,
                       kv_heads=kv, vocab=vocab, seq_len=seq_len, rope_theta=500000.0, norm_eps=1e-5,
                       tie_embeddings=tie)


def _gpt(name: str, layers: int, hidden: int, heads: int, *, vocab: int, seq_len: int,
         tie: bool = True) -> ModelConfig:
    # GPT-2/GPT-3 tie the output projection to the token embedding (gpt-tiny does not, so the
    # parity tests also cover an untied head).
    return ModelConfig(name=name, arch="gpt", layers=layers, hidden=hidden, ffn_hidden=4 * hidden, heads=heads,
                       kv_heads=heads, vocab=vocab, seq_len=seq_len, norm_eps=1e-5, tie_embeddings=tie)


PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in [
        _gpt("gpt-tiny", 4, 64, 4, vocab=256, seq_len=32, tie=False),
        _llama("llama-tiny", 4, 64, 176, 4, 2, vocab=256, seq_len=32),
        ModelConfig(name="mllm-tiny", arch="mllm", layers=3, hidden=64, ffn_hidden=176, heads=4, kv_heads=2,
                    vocab=256, seq_len=32, rope_theta=500000.0, vision_layers=2, vision_hidden=32,
                    vision_heads=2, vision_ffn_hidden=128, image_size=16, patch_size=4),
        # The demo's model (autopar demo) and the reference the first-run calibration measures
        # (planner/entry/calibration.py): small enough for a 2-core machine, and of two
        # architectures, so the demo's prediction is not checked on the model it was fitted to.
        _gpt("gpt-mini", 4, 256, 4, vocab=1024, seq_len=128, tie=False),
        _llama("llama-mini", 4, 256, 640, 4, 2, vocab=768, seq_len=96),
        _gpt("gpt-small", 12, 768, 12, vocab=50257, seq_len=1024),
        _gpt("gpt3-175b", 96, 12288, 96, vocab=50257, seq_len=2048, tie=False),  # untied: pipelines
        _llama("llama-1b", 16, 2048, 8192, 32, 8, tie=True),
        _llama("llama3-8b", 32, 4096, 14336, 32, 8),
        _llama("llama3-70b", 80, 8192, 28672, 64, 8),
        _llama("llama3-405b", 126, 16384, 53248, 128, 8),
        # Mixtures of experts (planner/zoo/moe.py): a tiny one for tests (8 experts, top-2, a
        # shared expert, the first block dense), Mixtral 8x7B / 8x22B, and a DeepSeek-V3-like
        # model (61 layers, 3 dense, 256 fine-grained experts top-8 + 1 shared, sigmoid router;
        # grouped-query attention in place of MLA, so about 1% fewer parameters than its 671B)
        ModelConfig(name="moe-tiny", arch="moe", layers=4, hidden=64, ffn_hidden=176, heads=4, kv_heads=2,
                    vocab=256, seq_len=32, rope_theta=500000.0, experts=8, top_k=2, expert_ffn_hidden=32,
                    shared_experts=1, dense_layers=1),
        ModelConfig(name="mixtral-8x7b", arch="moe", layers=32, hidden=4096, ffn_hidden=14336, heads=32,
                    kv_heads=8, vocab=32000, seq_len=4096, rope_theta=1e6, experts=8, top_k=2,
                    expert_ffn_hidden=14336),
        ModelConfig(name="mixtral-8x22b", arch="moe", layers=56, hidden=6144, ffn_hidden=16384, heads=48,
                    kv_heads=8, vocab=32768, seq_len=4096, rope_theta=1e6, experts=8, top_k=2,
                    expert_ffn_hidden=16384),
        ModelConfig(name="deepseek-v3-like", arch="moe", layers=61, hidden=7168, ffn_hidden=18432, heads=128,
                    kv_heads=8, vocab=129280, seq_len=4096, rope_theta=10000.0, experts=256, top_k=8,
                    expert_ffn_hidden=2048, shared_experts=1, dense_layers=3, router="sigmoid"),
        # ViT-B/16 encoder (196 patches) + a 12-layer, 1024-wide GQA decoder; 2048 tokens in all.
        ModelConfig(name="mllm-small", arch="mllm", layers=12, hidden=1024, ffn_hidden=4096, heads=16,
                    kv_heads=8, vocab=32000, seq_len=2048, rope_theta=500000.0, vision_layers=12,
                    vision_hidden=768, vision_heads=12, vision_ffn_hidden=3072, image_size=224, patch_size=16),
    ]
}

# Published totals (parameters) for the large presets, for tests and the report.
PUBLISHED_PARAMS: dict[str, float] = {
    "gpt-small": 124.4e6,
    "gpt3-175b": 175.0e9,
    "llama-1b": 1.236e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "mixtral-8x7b": 46.7e9,
    "mixtral-8x22b": 140.6e9,
}
