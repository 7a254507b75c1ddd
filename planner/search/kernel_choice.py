"""The attention kernel a search plans with: the pinned one, else the faster one the model can use.

autopar's runtime has two attention kernels (``ParallelConfig.attention``): ``flash``, its own
Triton kernel (packed documents' masked blocks skipped, CP's ring blocks fused), and ``eager``,
torch's ``scaled_dot_product_attention`` (fused by torch on CUDA and CPU alike, but under CP its
ring blocks run in plain torch: ``cost_models.engines.Engine.attention_kernel_of``). Which is
faster depends on the device: on an H200 SDPA's own backend ran llama-1b's steps 6% faster than
the Triton kernel (benchmarks/measured/gpu_check_h200_2026-12-04b.json), and packed short
documents favour the kernel that skips their masked blocks.

The rule (:func:`attention_choice`): a ``--fix attention=...`` pin is kept at every CP degree.
Otherwise layouts with CP run ``flash`` where the model can use it
(``planner.feasibility.default_attention``), and layouts without CP run the kernel whose
attention block the kernel model prices faster, forward and backward, on this GPU cluster for
the request's micro-batch of one (``flash`` on ties and on CPU clusters, whose torch runs both
kernels of an unpacked causal call as the same SDPA).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.cluster import Cluster
from cost_models.gpu_layer import gpu_layer_time
from planner.feasibility import default_attention
from planner.graph import ModelGraph
from planner.plan import ModelFacts, ParallelConfig


@dataclass(frozen=True)
class AttentionChoice:
    """The search's attention kernel without CP (``local``) and under CP (``ring``)."""
    local: str
    ring: str

    def of(self, cp: int) -> str:
        """The kernel of a layout with context-parallel degree ``cp``."""
        return self.local if cp == 1 else self.ring


def attention_choice(graph: ModelGraph, cluster: Cluster, facts: ModelFacts, dtype: str, loss: str,
                     pinned: str | None = None) -> AttentionChoice:
    """The search's kernels (module docstring: the rule)."""
    if pinned is not None:
        return AttentionChoice(pinned, pinned)
    default = default_attention(facts.limits)
    block = next((l for l in graph.layers if l.attention is not None), None)
    if default != "flash" or block is None or cluster.backend == "gloo":
        return AttentionChoice(default, default)
    base = ParallelConfig(mbs=1, dtype=dtype, loss=loss, attention="flash")
    seconds = {k: sum(_pass_s(block, graph, cluster, base.replace(attention=k))) for k in ("flash", "eager")}
    return AttentionChoice("eager" if seconds["eager"] < seconds["flash"] else default, default)


def _pass_s(block, graph: ModelGraph, cluster: Cluster, cfg: ParallelConfig) -> tuple[float, float]:
    """(forward s, backward s) of ``block`` under ``cfg`` by the GPU kernel model."""
    t = gpu_layer_time(block, graph, cluster, cfg)
    return t.fwd_s, t.bwd_s
