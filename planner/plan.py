"""The plan contract: a parallel configuration, a stage partition, and the Plan file.

Leaf contract: imports nothing else of autopar, so the cost models and codegen can read
it. ``ParallelConfig`` is what the search enumerates and ``autopar evaluate --config``
parses; ``Partition`` is what the stage ILP produces.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
ZERO = ("ddp", "zero1", "zero2", "fsdp")
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp32")
ATTN_KERNELS = ("flash", "eager")      # flash: no S x S scores kept (SDPA flash / our Triton kernel)
LOSS_KERNELS = ("fused", "eager")      # fused: linear + cross-entropy without [tokens x vocab] logits
MESH_DIMS = ("pp", "dp", "cp", "tp")   # outer to inner


class PlanError(ValueError):
    """A malformed configuration or plan file; one line naming the problem and the fix."""


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "on", "yes"):
        return True
    if s.lower() in ("0", "false", "off", "no"):
        return False
    raise PlanError(f"expected on/off, got {s!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """One point of the search space. Degrees multiply to the world size; mesh order is
    ``[pp, dp, cp, tp]`` outer to inner."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    mbs: int = 1                 # micro-batch size, sequences per micro-batch per dp rank
    schedule: str = "1f1b"       # pipeline schedule (ignored when pp == 1)
    vpp: int = 1                 # virtual stages (chunks) per pp rank, interleaved schedule only
    zero: str = "ddp"            # DP sharding: ddp | zero1 | zero2 | fsdp
    recompute: str = "none"      # none | selective | full (uniform; a Partition may choose per stage)
    sp: bool = False             # sequence parallel with TP
    dtype: str = "bf16"          # compute dtype (mixed precision with fp32 master weights unless fp32)
    attention: str = "flash"
    loss: str = "eager"

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    def validate(self) -> "ParallelConfig":
        for k in ("dp", "pp", "cp", "tp", "mbs", "vpp"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"{k}={v!r}: must be a positive integer")
        for k, allowed in (("schedule", SCHEDULES), ("zero", ZERO), ("recompute", RECOMPUTE),
                           ("dtype", DTYPES), ("attention", ATTN_KERNELS), ("loss", LOSS_KERNELS)):
            if getattr(self, k) not in allowed:
                raise PlanError(f"{k}={getattr(self, k)!r}: choose one of {', '.join(allowed)}")
        if self.vpp > 1 and self.schedule != "interleaved-1f1b":
            raise PlanError(f"vpp={self.vpp} needs schedule=interleaved-1f1b")
        if self.sp and self.tp == 1:
            raise PlanError("sp=on needs tp > 1 (sequence parallel shards along the tp group)")
        return self

    def label(self) -> str:
        """Short human label, e.g. 'dp2 pp4 tp8 mbs1 1f1b fsdp sel sp'."""
        parts = [f"dp{self.dp}", f"pp{self.pp}", f"cp{self.cp}", f"tp{self.tp}", f"mbs{self.mbs}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.vpp})" if self.vpp > 1 else ""))
        parts.append(self.zero)
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.sp:
            parts.append("sp")
        return " ".join(parts)

    def to_str(self) -> str:
        return ",".join(f"{f.name}={_fmt(getattr(self, f.name))}" for f in fields(self))

    @staticmethod
    def parse(s: str) -> "ParallelConfig":
        """Parse ``"dp=2,pp=4,tp=8,mbs=1,schedule=1f1b,zero=fsdp,recompute=selective,sp=on"``;
        omitted keys take their defaults."""
        if not isinstance(s, str) or not s.strip():
            raise PlanError("empty --config: give e.g. 'dp=2,pp=2,tp=2'")
        kw: dict[str, Any] = {}
        names = {f.name: f for f in fields(ParallelConfig)}
        for item in s.split(","):
            item = item.strip()
            if not item:
                continue
            m = re.fullmatch(r"([a-z_]+)\s*=\s*(\S+)", item)
            if not m:
                raise PlanError(f"bad --config item {item!r}: write key=value, e.g. tp=8")
            k, v = m.group(1), m.group(2)
            if k not in names:
                raise PlanError(f"unknown --config key {k!r}: use {', '.join(names)}")
            if k in kw:
                raise PlanError(f"--config key {k!r} given twice")
            typ = names[k].type
            try:
                if typ in ("int", int):
                    kw[k] = int(v)
                elif typ in ("bool", bool):
                    kw[k] = _bool(v)
                else:
                    kw[k] = v
            except ValueError:
                raise PlanError(f"--config {k}={v!r}: expected {typ}") from None
        return ParallelConfig(**kw).validate()

    def replace(self, **kw: Any) -> "ParallelConfig":
        return replace(self, **kw)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


@dataclass
class Partition:
    """Stage split of the layers: ``bounds[j]`` is the half-open layer range ``[a, b)`` of
    virtual stage j (``pp * vpp`` entries; virtual stage j runs on pp rank ``j % pp``),
    and ``recompute[j]`` its recompute policy."""
    bounds: list[tuple[int, int]]
    recompute: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bounds = [tuple(b) for b in self.bounds]  # type: ignore[misc]
        if not self.recompute:
            self.recompute = ["none"] * len(self.bounds)

    @staticmethod
    def even(n_layers: int, stages: int, recompute: str = "none") -> "Partition":
        """Equal layer counts (the first stages take the remainder)."""
        if stages > n_layers:
            raise PlanError(f"{stages} stages for {n_layers} layers: use at most {n_layers} stages")
        q, r = divmod(n_layers, stages)
        bounds, a = [], 0
        for j in range(stages):
            b = a + q + (1 if j < r else 0)
            bounds.append((a, b))
            a = b
        return Partition(bounds, [recompute] * stages)

    def validate(self, n_layers: int) -> "Partition":
        a = 0
        for j, (lo, hi) in enumerate(self.bounds):
            if lo != a or hi <= lo:
                raise PlanError(f"stage {j} range [{lo}, {hi}) is not contiguous and non-empty")
            a = hi
        if a != n_layers:
            raise PlanError(f"stages cover {a} of {n_layers} layers")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
