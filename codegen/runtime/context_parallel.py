"""Context parallelism: ring attention, Ulysses and their 2-D hybrid over the cp group, with
zigzag load balancing.

torch's built-in ``context_parallel()`` only shards the CUDA SDPA kernels (on CPU it
fails), so autopar ships its own ring attention:

- The sequence is cut into ``2 * cp`` chunks; cp rank ``r`` holds chunks ``r`` and
  ``2cp-1-r`` ("zigzag", so every rank gets the same causal work), or chunk ``r`` of
  ``cp`` ("contiguous"). :func:`shard_sequence` slices ``input_ids`` / ``labels`` and
  :func:`local_positions` gives the GLOBAL positions of a rank's tokens (RoPE / learned
  positions and the causal mask use them).
- Each rank keeps its queries; K/V (packed in one tensor) travel around the ring in
  ``cp - 1`` steps through :class:`_Rotate`, an autograd Function doing one
  ``batch_isend_irecv`` (send to rank+1, receive from rank-1) forward and the reverse
  exchange of gradients backward.
- Per step, :func:`partial_attention` (plain torch, float32) attends the local queries
  to the visiting block with the causal mask built from global positions and returns
  the output and its natural-log LSE; partial outputs are merged by log-sum-exp.
- A visiting block no query may see is skipped, but a zero product with it is added so its
  rotate op stays in the autograd graph; otherwise the peer waits forever for that
  op's backward exchange.
- Packed documents (``documents.Documents`` holds the micro-batch's ``doc_start``, full
  sequence): each local query's document start is read at its global position; a query
  sees a key only inside its document, and a visiting block no local query may see
  (decided once per micro-batch for every step) is skipped as above.
- Non-causal calls (the MLLM vision encoder, whose tokens are not sequence-sharded)
  fall through to the ``fallback`` local implementation.
- ``flash=True`` (the plan's ``attention == "flash"``): each step's partial attention is
  ``codegen.runtime.kernels.ring_block_attention`` (the flash kernel per contiguous chunk
  pair with q/kv offsets) and partials merge with ``attn_merge``; otherwise the plain-torch
  :func:`partial_attention` / :func:`merge_partials` path.

Ulysses (``ParallelConfig.ulysses`` = u > 1; DeepSpeed-Ulysses, and USP / LoongTrain's
2-D hybrid when u < cp): the cp ranks form ``cp / u`` ring groups of ``u`` consecutive cp
ranks (:func:`cp_rank`). Around each attention call :class:`UlyssesAttention` runs one
all-to-all per tensor inside the Ulysses group: q, k, v [B, H, S/cp, D] become [B, H/u,
u S/cp, D] (this rank's 1/u of the heads, the group's u sequence shards, rank order), the
inner attention runs, and the output goes back the reverse way (the backward is the
reverse exchange of the gradients). The inner attention is the ring over the ``cp / u``
groups (a ring of one for pure Ulysses), whose ranks now hold the union of their
group's zigzag chunks (:meth:`RingCompute.held_positions`). A rank attends them in position
order (:meth:`RingCompute.attention_order`): q, k and v are put in that order before the ring
(K/V travel in it) and the output back after, so a group's adjacent chunks make one
contiguous run (pure Ulysses: the whole row, one flash call per step instead of one per pair
of its ``2u`` chunks; the 2-D hybrid: two runs). The causal masks, skipped blocks and flash
offsets all follow from those global positions.

Gradients of a cp-sharded model must be summed over cp and the loss divided by the
global token count; the runtime folds cp into the data-parallel reduction.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from codegen.runtime.documents import Documents, PerVersion, any_visible, visible_mask
from codegen.runtime.layers import sdpa_attention
from codegen.runtime.torch_compat import funcol
from planner.feasibility import sequence_chunks, sequence_problem

_MASKED = -1e30


# ------------------------------------------------------------------ sequence layout

def chunk_ids(cp: int, rank: int, load_balance: str = "zigzag") -> list[int]:
    """Which chunks of the sequence cp rank ``rank`` holds (2cp chunks zigzag, cp contiguous)."""
    if load_balance == "zigzag":
        return [rank, 2 * cp - 1 - rank]
    if load_balance == "contiguous":
        return [rank]
    raise ValueError(f"load_balance={load_balance!r}: use zigzag or contiguous")


def local_positions(seq_len: int, cp: int, rank: int, load_balance: str = "zigzag",
                    device: Optional[torch.device] = None) -> torch.Tensor:
    """Global token positions [seq_len / cp] held by cp rank ``rank`` of a ``seq_len`` sequence."""
    ids = chunk_ids(cp, rank, load_balance)
    if why := sequence_problem(seq_len, cp, load_balance):
        raise ValueError(why)
    c = seq_len // sequence_chunks(cp, load_balance)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


def cp_rank(ring_rank: int, ulysses_rank: int, ulysses: int) -> int:
    """The cp rank at (ring group ``ring_rank``, place ``ulysses_rank`` in it): Ulysses groups
    are ``ulysses`` consecutive cp ranks, so they stay within a node before the ring does."""
    return ring_rank * ulysses + ulysses_rank


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1, load_balance: str = "zigzag") -> torch.Tensor:
    """The part of ``t`` along ``dim`` that cp rank ``rank`` holds."""
    if cp == 1:
        return t
    idx = local_positions(t.shape[dim], cp, rank, load_balance, device=t.device)
    return t.index_select(dim, idx)


# ------------------------------------------------------------------ block attention

def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                      q_pos: Optional[torch.Tensor] = None, kv_pos: Optional[torch.Tensor] = None,
                      scale: Optional[float] = None,
                      q_doc: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B,H,Sq,D] to one K/V block [B,Hkv,Sk,D] -> (out [B,H,Sq,D] fp32, lse [B,H,Sq] fp32).

    ``lse`` is the natural-log sum of exp(scaled scores) over the visible keys (``scale``
    defaults to 1/sqrt(D)). With
    ``causal``, query at global position ``q_pos[i]`` sees key ``kv_pos[j]`` iff
    ``kv_pos[j] <= q_pos[i]`` (defaults: ``arange``), and with packed documents (``q_doc``
    [B, Sq], each query's document start) also ``kv_pos[j] >= q_doc[b, i]``. Rows with no
    visible key get ``lse`` ~ -1e30 (weight 0 when merged) and a finite dummy output.
    """
    rep = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1) if rep > 1 else k.float()
    vf = v.float().repeat_interleave(rep, dim=1) if rep > 1 else v.float()
    scores = (q.float() @ kf.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    if causal:
        if q_pos is None:
            q_pos = torch.arange(q.shape[2], device=q.device)
        if kv_pos is None:
            kv_pos = torch.arange(k.shape[2], device=q.device)
        if q_doc is None:
            visible = kv_pos[None, :] <= q_pos[:, None]
        else:
            visible = visible_mask(q_pos, kv_pos, q_doc)[:, None]  # [B, 1, Sq, Sk]
        scores = scores.masked_fill(~visible, _MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ vf
    return out, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets by log-sum-exp."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None]
    return out, lse


# ------------------------------------------------------------------ ring exchange

def _exchange(t: torch.Tensor, send_to: int, recv_from: int, group) -> torch.Tensor:
    t = t.contiguous()
    out = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, send_to, group), dist.P2POp(dist.irecv, out, recv_from, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _Rotate(torch.autograd.Function):
    """Forward: send ``x`` to the next rank, return the previous rank's; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, nxt: int, prv: int, group) -> torch.Tensor:  # type: ignore[override]
        ctx.nxt, ctx.prv, ctx.group = nxt, prv, group
        return _exchange(x, nxt, prv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _exchange(grad, ctx.prv, ctx.nxt, ctx.group), None, None, None


def _zero_use(kv: torch.Tensor) -> torch.Tensor:
    """0 (a scalar) that depends on ``kv`` through a product with a saved zero: a skipped
    visiting block's rotate stays in the autograd graph (its backward is the peer's
    exchange), and under recompute the backward reaches a saved tensor before that exchange,
    as it does through a computed block: every rank replays the checkpointed exchanges first,
    then runs the backward ones, in the same order."""
    return (kv.flatten()[:1] * torch.zeros(1, dtype=kv.dtype, device=kv.device)).sum()


def _flash_head_dims() -> tuple[int, ...]:
    from codegen.kernels.attention import SUPPORTED_HEAD_DIMS
    return SUPPORTED_HEAD_DIMS


class RingCompute:
    """The compute of ring attention for cp rank ``rank`` of ``cp``: ``fn(q, k, v, *, causal, scale=None)``.

    ``q``/``k``/``v`` are the local shards [B, H, S/cp, D] laid out by ``load_balance``;
    ``fallback`` handles non-causal calls (default: SDPA). Each of the cp - 1 ring steps
    attends the local queries to the block :meth:`_rotate` returns, with the global
    positions of the rank it came from (causal mask, skipped blocks, log-sum-exp merges).
    Here ``_rotate`` returns this rank's own block: the same work as the runtime's ring
    without the exchange, which is what the profiler times (the communication model
    prices the exchange). :class:`RingAttention` adds the exchange.
    """

    def __init__(self, cp: int, rank: int, load_balance: str = "zigzag", fallback: Optional[Callable] = None,
                 flash: bool = False, ulysses: int = 1, documents: Optional[Documents] = None):
        if not 0 <= rank < cp:
            raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
        self.cp, self.rank, self.ulysses = cp, rank, ulysses  # cp: the ring's degree (cp / ulysses of CP's)
        self.load_balance = load_balance
        self.fallback = fallback or sdpa_attention
        self.flash = flash
        self.documents = documents
        self._positions: dict[tuple, tuple] = {}  # (seq, device) -> positions on that device
        self._doc_views = PerVersion()  # (documents.version, seq) -> (q_doc, seen per step)

    def _ring_positions(self, seq: int, device: torch.device) -> tuple[torch.Tensor, list, Optional[tuple]]:
        """The local queries' global positions in attention order, per ring step the visiting
        block's (in its rank's attention order) and whether no local query may see it, and
        the (order, inverse) index pair of :meth:`attention_order` (None: the held order is
        already sorted), computed once per (seq, device): the same for every layer and step,
        and the skip test needs no device sync."""
        key = (seq, device)
        if key not in self._positions:
            q, order = self.attention_order(seq, self.rank)
            steps = []
            for step in range(1, self.cp):
                kv, _ = self.attention_order(seq, (self.rank - step) % self.cp)
                steps.append((kv.to(device), bool((kv.min() > q).all())))
            identity = torch.equal(order, torch.arange(order.numel()))
            sort = None if identity else (order.to(device), order.argsort().to(device))
            self._positions[key] = (q.to(device), steps, sort)
        return self._positions[key]

    def attention_order(self, seq: int, ring_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(global positions, indices) of ring rank ``ring_rank``'s held tokens
        (:meth:`held_positions`) in position order: the order its queries attend in and its
        K/V travel in, and the indices that put its held tokens in it (module docstring). The
        identity without Ulysses (a rank's zigzag chunks ``r < 2cp - 1 - r``)."""
        return self.held_positions(seq, ring_rank).sort()

    def held_positions(self, seq: int, ring_rank: int) -> torch.Tensor:
        """Global positions of the tokens ring rank ``ring_rank`` attends with: its cp rank's
        zigzag chunks, or under Ulysses its group's (module docstring), in group rank order."""
        u = self.ulysses
        return torch.cat([local_positions(seq, self.cp * u, cp_rank(ring_rank, i, u), self.load_balance)
                          for i in range(u)])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        if not causal:
            return self.fallback(q, k, v, causal=causal, scale=scale)
        q_pos, steps, sort = self._ring_positions(q.shape[2] * self.cp, q.device)
        q_doc, seen = self._document_view(q.shape[2] * self.cp, q_pos, steps)
        if sort is not None:  # attend in position order (attention_order); the output goes back below
            q, k, v = (t.index_select(2, sort[0]) for t in (q, k, v))
        kv = torch.stack((k, v))
        if self.flash and q.shape[-1] in _flash_head_dims():
            from codegen.kernels.attention import attn_merge
            from codegen.runtime.kernels import ring_block_attention
            block = lambda q_, k_, v_, kv_pos: ring_block_attention(q_, k_, v_, q_pos, kv_pos,  # noqa: E731
                                                                    scale=scale, q_doc=q_doc)
            merge = attn_merge
        else:
            block = lambda q_, k_, v_, kv_pos: partial_attention(q_, k_, v_, causal=True, q_pos=q_pos,  # noqa: E731
                                                                 kv_pos=kv_pos, scale=scale, q_doc=q_doc)
            merge = merge_partials
        out, lse = block(q, k, v, q_pos)
        for (kv_pos, unseen), doc_seen in zip(steps, seen):
            kv = self._rotate(kv)
            if unseen or not doc_seen:
                out = out + _zero_use(kv)  # keep the rotate op in the graph (its backward exchanges)
                continue
            o_b, l_b = block(q, kv[0], kv[1], kv_pos)
            out, lse = merge(out, lse, o_b, l_b)
        if sort is not None:
            out = out.index_select(2, sort[1])
        return out.to(q.dtype)

    def _document_view(self, seq: int, q_pos: torch.Tensor, steps: list) -> tuple[Optional[torch.Tensor], list]:
        """(the local queries' document starts [B, Sq] or None, per ring step whether any local
        query may see a key of the visiting block), once per micro-batch (``documents.version``,
        its recomputation included) for all layers: one device sync, none per layer."""
        docs = self.documents
        if docs is None or docs.doc_start is None:
            return None, [True] * len(steps)
        docs.used += 1

        def view() -> tuple:
            q_doc = docs.doc_start.to(q_pos.device).index_select(1, q_pos)
            seen = [any_visible(q_pos, q_doc, kv_pos) for kv_pos, _ in steps]
            return q_doc, (torch.stack(seen).tolist() if seen else [])

        return self._doc_views.get((docs.version, seq), view)

    def _rotate(self, kv: torch.Tensor) -> torch.Tensor:
        return kv


class RingAttention(RingCompute):
    """Ring attention over ``group`` (a cp process group): :class:`RingCompute` whose
    visiting K/V blocks really travel around the ring (:class:`_Rotate`)."""

    def __init__(self, group, load_balance: str = "zigzag", fallback: Optional[Callable] = None,
                 flash: bool = False, ulysses: int = 1, documents: Optional[Documents] = None):
        super().__init__(dist.get_world_size(group), dist.get_rank(group), load_balance, fallback, flash, ulysses,
                         documents)
        self.group = group
        self.nxt = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prv = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def _rotate(self, kv: torch.Tensor) -> torch.Tensor:
        """Send the packed K/V to the next cp rank, return the previous rank's (autograd-aware)."""
        return _Rotate.apply(kv, self.nxt, self.prv, self.group)


# ------------------------------------------------------------------ Ulysses

def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all of equal slices of ``x`` along dim 0 over ``group``."""
    n = dist.get_world_size(group)
    split = [x.shape[0] // n] * n
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), split, split, group))


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H, S, D] (all heads of this rank's tokens) -> [B, H/u, u S, D]: the ``u`` ranks of
    ``group`` trade heads for tokens, each keeping 1/u of the heads (consecutive ones, so a
    query head and its kv head stay together) for the tokens of all u, in group rank order."""
    u = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, u, h // u, s, d).transpose(0, 1)          # [u (to), B, H/u, S, D]
    got = _all_to_all(parts, group)                                 # [u (from), B, H/u, S, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, d)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`heads_to_sequence`: [B, H/u, u S, D] -> [B, H, S, D]."""
    u = dist.get_world_size(group)
    b, hu, us, d = x.shape
    parts = x.reshape(b, hu, u, us // u, d).permute(2, 0, 1, 3, 4)  # [u (to), B, H/u, S, D]
    got = _all_to_all(parts, group)                                 # [u (from: head group), B, H/u, S, D]
    return got.transpose(0, 1).reshape(b, hu * u, us // u, d)


class UlyssesAttention:
    """Ulysses context parallelism around ``inner`` (module docstring): q, k, v trade their
    sequence split for a head split inside ``group`` (the Ulysses group), ``inner`` attends
    (a :class:`RingAttention` over the ring groups, built with the same ``ulysses``; a ring
    of one rank for pure Ulysses), and the output trades back."""

    def __init__(self, inner: Callable, group):
        self.inner, self.group = inner, group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                 scale: Optional[float] = None) -> torch.Tensor:
        q, k, v = (heads_to_sequence(t, self.group) for t in (q, k, v))
        return sequence_to_heads(self.inner(q, k, v, causal=causal, scale=scale), self.group)
