"""Low-communication data parallelism: the outer loop over groups of ranks (DiLoCo-style).

Each group (a region: ranks that run one inner plan among themselves) trains ``every`` (H)
inner optimizer steps on its own data, exchanging nothing with the other groups; then the
groups exchange **pseudo-gradients** (``anchor - theta``: what H inner steps moved each
parameter since the last exchange), average them, and an **outer optimizer** (SGD with
Nesterov momentum, DiLoCo's ``lr = 0.7``, ``momentum = 0.9``) steps the anchor with that
average; every group then continues from the new anchor. This CHANGES THE OPTIMISATION: it is
not synchronous training (not bitwise, nor in expectation, equal to it), which is why a plan
states it and the user opts in.

- Wire formats (``OUTER_DTYPES``): ``fp32``; ``bf16`` (half the bytes); ``int8`` (a quarter, plus one
  fp32 scale per tensor: ``q = round(x / s)``, ``s = max|x| / 127``). Each rank all-gathers its
  group peers' encoded pseudo-gradients over ``group`` (the ranks holding the same parameter
  shards in every group: one rank per group) and averages the decoded values in fp32, in
  rank order, so every group applies the same update.
- Streaming (``fragments`` F > 1, Streaming DiLoCo): the parameters are cut into F fragments
  of consecutive tensors; fragment f is exchanged at inner steps ``t`` with
  ``t % H == (f + 1) H // F % H``, so a step sends 1/F of the bytes and the peaks spread out.
- Units: ``bytes_sent`` counts what this rank sends (an all-gather of a ``b``-byte buffer over
  ``n`` ranks sends ``(n - 1) b`` from each rank), cumulative.

Operates on the rank's local tensors (the shards of FSDP / TP parameters included: every group
runs the same inner plan, so the rank at the same place in each group holds the same shards).
``close()`` drops the anchor and momentum copies; nothing is installed anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from codegen.runtime.torch_compat import local_tensor
from planner.low_comm import OUTER_DTYPES, LowComm, parse_low_comm

__all__ = ["OuterConfig", "OuterLoop", "decode", "encode", "fragment_of", "outer_loop_for"]


@dataclass(frozen=True)
class OuterConfig:
    """H inner steps per exchange, the pseudo-gradients' wire format, the outer Nesterov SGD and the
    fragments exchanged in turn (1: all at once)."""
    every: int
    dtype: str = "bf16"
    lr: float = 0.7
    momentum: float = 0.9
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"outer every={self.every}: give the inner steps per exchange, >= 1")
        if self.dtype not in OUTER_DTYPES:
            raise ValueError(f"outer dtype={self.dtype!r}: use one of {', '.join(OUTER_DTYPES)}")
        if not 1 <= self.fragments <= self.every:
            raise ValueError(f"outer fragments={self.fragments}: use 1 .. every ({self.every})")

    @classmethod
    def of(cls, low: LowComm, fragments: int = 1) -> "OuterConfig":
        """A plan's ``low_comm`` (planner/low_comm.py)."""
        return cls(every=low.every, dtype=low.dtype, lr=low.lr, momentum=low.momentum, fragments=fragments)


def encode(x: torch.Tensor, dtype: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A flat fp32 pseudo-gradient on the wire: (payload, per-tensor scale or None)."""
    if dtype == "fp32":
        return x, None
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    scale = (x.abs().max() / 127.0).clamp_min(1e-30).reshape(1)
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def decode(payload: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 values ``encode`` sent."""
    return payload.float() * scale if scale is not None else payload.float()


def fragment_of(n_params: int, fragments: int) -> list[range]:
    """Consecutive parameter indices per fragment (sizes differ by at most one tensor)."""
    q, r = divmod(n_params, fragments)
    out, a = [], 0
    for f in range(fragments):
        b = a + q + (1 if f < r else 0)
        out.append(range(a, b))
        a = b
    return out


class OuterLoop:
    """The outer loop on one rank: call :meth:`after_step` after every inner optimizer step."""

    def __init__(self, params: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], cfg: OuterConfig):
        self.params = list(params)
        self.group, self.cfg = group, cfg
        self.n = dist.get_world_size(group) if group is not None else 1
        with torch.no_grad():
            self.anchor = [p.detach().float().clone() for p in self.params]
        self.buf = [torch.zeros_like(a) for a in self.anchor]
        self.frags = fragment_of(len(self.params), cfg.fragments)
        self.bytes_sent = 0
        self.exchanges = 0

    def due(self, step: int) -> list[int]:
        """Fragments exchanged after inner step ``step`` (1-based)."""
        H, F = self.cfg.every, self.cfg.fragments
        return [f for f in range(F) if step % H == (f + 1) * H // F % H]

    def after_step(self, step: int) -> list[int]:
        """Exchange the fragments due after inner step ``step`` (1-based); returns them."""
        done = self.due(step)
        for f in done:
            self._exchange(self.frags[f])
        return done

    @torch.no_grad()
    def _exchange(self, idx: range) -> None:
        if not len(idx):
            return
        delta = torch.cat([(self.anchor[i] - self.params[i].detach().float()).reshape(-1) for i in idx])
        avg = self._average(delta, [self.anchor[i].numel() for i in idx])
        c, off = self.cfg, 0
        for i in idx:
            g = avg[off:off + self.anchor[i].numel()].view_as(self.anchor[i])
            off += g.numel()
            self.buf[i].mul_(c.momentum).add_(g)
            self.anchor[i].sub_(c.lr * (g + c.momentum * self.buf[i]))  # Nesterov, as torch.optim.SGD
            self.params[i].copy_(self.anchor[i].to(self.params[i].dtype))
        self.exchanges += 1

    def _average(self, delta: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The mean over the group of the ranks' pseudo-gradients as each decodes them (int8: one
        scale per tensor, so a large tensor does not flatten a small one's values)."""
        if self.cfg.dtype == "int8":
            parts = [encode(t, "int8") for t in torch.split(delta, sizes)]
            payload = torch.cat([p for p, _ in parts])
            scale = torch.cat([s for _, s in parts])
        else:
            payload, scale = encode(delta, self.cfg.dtype)
        if self.n == 1:
            return decode(payload, None) if scale is None else self._decode(payload, scale, sizes)
        payloads = [torch.empty_like(payload) for _ in range(self.n)]
        dist.all_gather(payloads, payload, group=self.group)
        self.bytes_sent += (self.n - 1) * payload.numel() * payload.element_size()
        if scale is None:
            return torch.stack([decode(p, None) for p in payloads]).mean(0)
        scales = [torch.empty_like(scale) for _ in range(self.n)]
        dist.all_gather(scales, scale, group=self.group)
        self.bytes_sent += (self.n - 1) * scale.numel() * scale.element_size()
        return torch.stack([self._decode(p, s, sizes) for p, s in zip(payloads, scales)]).mean(0)

    @staticmethod
    def _decode(payload: torch.Tensor, scale: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat([decode(p, s.reshape(1)) for p, s in zip(torch.split(payload, sizes), scale)])

    def close(self) -> None:
        """Drop the anchor and momentum copies."""
        self.anchor, self.buf = [], []


def outer_loop_for(cfg, mesh, modules: Sequence[torch.nn.Module]) -> Optional[OuterLoop]:
    """The outer loop of a plan's ``low_comm`` (``ParallelConfig``) over the local tensors of
    ``modules``' parameters and ``mesh["outer"]`` (codegen/runtime/mesh.py), or None without it."""
    low = parse_low_comm(cfg.low_comm)
    if low is None:
        return None
    params = [local_tensor(p) for m in modules for p in m.parameters()]
    return OuterLoop(params, mesh["outer"].get_group(), OuterConfig.of(low))
