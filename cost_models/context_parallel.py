"""Context parallelism priced: ring attention, Ulysses and their 2-D hybrid, per attention layer.

The runtime is ``codegen/runtime/context_parallel.py``. With ``cp = u x r`` (``u`` the
Ulysses degree ``ParallelConfig.ulysses``, ``r`` the ring degree), per attention layer, per
micro-batch and rank (``S`` the sequence, ``H`` / ``Hkv`` the query / kv heads, ``D`` the
head dim, ``b`` bytes per element, heads already divided by tp):

- **Ulysses** (u > 1): four all-to-alls inside the Ulysses group (q, k, v in, the output
  back), whose per-rank buffers are ``mbs x S/cp x D x b`` times ``H``, ``Hkv``, ``Hkv``,
  ``H``; ``(u - 1) / u`` of each leaves the rank (``comm.py``'s all-to-all). The backward
  runs the four again, reversed. Nothing hides them: the attention waits for its inputs
  (DeepSpeed-Ulysses, arXiv 2309.14509, §3: communication ``4 N h / P`` per layer).
- **ring** (r > 1): ``r - 1`` steps each passing a K/V block of ``2 x mbs x S/r x Hkv/u x D
  x b`` bytes (after Ulysses each rank holds ``S / r`` tokens of ``1 / u`` of the heads: the
  same bytes as a plain ring's ``S/cp`` tokens of all heads) to the next rank, overlapped
  with the block attention of the step before: exposed ``max(0, comm - core)`` forward and
  ``max(0, 2 comm - 2.5 core)`` backward (K, V and their gradients travel; the backward's
  blocks cost 2.5x the forward's). Ring Attention, arXiv 2310.01889; USP, arXiv 2405.07719
  for the 2-D arrangement. With packed documents (``ModelGraph.documents``) the transfers
  hide only behind the work the visiting blocks really do: ``core`` times ``hide``, the
  mix's share of the attention work on visiting blocks over that of one document filling
  the row (``cost_models.documents.ring_hiding``; 1.0 without documents). Short documents
  keep nearly all their work on a rank's own blocks, so the ring's transfers are exposed.

The Ulysses group is ``u`` consecutive cp ranks (a group of ``u`` with tp's stride on the
``[pp, dp, cp, tp]`` mesh, so it stays inside a node first); the ring links ranks ``u x
tp`` apart. :func:`cp_meshes` gives both as ``comm.Mesh`` views whose ``cp`` dimension is
the group, so ``comm.group_layout`` sees which links each crosses. The attention core's
compute is the same for all three methods (each rank attends ``S / cp`` queries of all
its heads, or ``S / r`` queries of ``1 / u`` of them, to the keys they may see).
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models import comm as comm_mod
from cost_models.cluster import Cluster
from planner.graph import AttentionDims
from planner.plan import ParallelConfig
from planner.precision import DTYPE_BYTES


@dataclass(frozen=True)
class CpComm:
    """One attention layer, one micro-batch, one rank (seconds): the exposed CP communication
    (forward and backward together), its Ulysses all-to-all part, and the figures' source."""
    exposed: float
    alltoall: float
    source: str


def cp_meshes(cfg: ParallelConfig) -> tuple[comm_mod.Mesh, comm_mod.Mesh]:
    """(the ring groups', the Ulysses groups') mesh views, each group as the ``cp`` dimension."""
    u, r = cfg.ulysses, cfg.cp // cfg.ulysses
    ring = comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp, cp=r, tp=cfg.tp * u)
    ulysses = comm_mod.Mesh(pp=cfg.pp, dp=cfg.dp * r, cp=u, tp=cfg.tp)
    return ring, ulysses


def ulysses_bytes(a: AttentionDims, cfg: ParallelConfig) -> float:
    """Per-rank buffer bytes of the forward's four all-to-alls together (module docstring)."""
    heads, kv = a.heads / cfg.tp, max(a.kv_heads / cfg.tp, 1.0)
    return cfg.mbs * a.seq_len / cfg.cp * a.head_dim * DTYPE_BYTES[cfg.dtype] * (2 * heads + 2 * kv)


def ring_step_bytes(a: AttentionDims, cfg: ParallelConfig) -> float:
    """Bytes of the K/V block one ring step passes (module docstring)."""
    kv = 2 * cfg.mbs * (a.seq_len / cfg.cp) * a.kv_heads * a.head_dim * DTYPE_BYTES[cfg.dtype]
    return kv / min(cfg.tp, a.kv_heads)


def cp_comm(a: AttentionDims, cfg: ParallelConfig, cluster: Cluster, core_s: float, profile=None,
            hide: float = 1.0) -> CpComm:
    """The exposed CP communication of one attention layer whose core takes ``core_s`` seconds
    forward on this rank, of which ``core_s x hide`` hides the ring's transfers (module
    docstring); zero without CP."""
    if cfg.cp == 1:
        return CpComm(0.0, 0.0, "none")
    ring_mesh, uly_mesh = cp_meshes(cfg)
    r, source, a2a = cfg.cp // cfg.ulysses, "model", 0.0
    if cfg.ulysses > 1:
        e = comm_mod.collective_time("all_to_all", ulysses_bytes(a, cfg), cluster, uly_mesh, "cp", profile)
        a2a, source = 2 * e.seconds, e.source  # forward, and the backward's reverse
    ring = 0.0
    if r > 1:
        step = comm_mod.collective_time("send_recv", ring_step_bytes(a, cfg), cluster, ring_mesh, "cp", profile)
        fwd = (r - 1) * step.seconds
        window = core_s * hide
        ring, source = max(0.0, fwd - window) + max(0.0, 2 * fwd - 2.5 * window), step.source
    return CpComm(ring + a2a, a2a, source)
