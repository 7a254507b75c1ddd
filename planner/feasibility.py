"""What can run: the one feasibility rule the search, ``autopar evaluate`` and the runtime all
apply to a configuration and a model's facts (``ModelFacts``): one function per parallelism
(``tp_problem``, ``cp_problem``, ``pp_problem``, ``ep_problem``, ``sp_problem``,
``zero_problem``; ``planner.plan.recompute_problem``, which plan files need too), each returning the one-line reason with its fix or
None, and ``config_problems`` collecting them. Pure Python on the plan contract.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from planner.plan import SHARDED_PARAMS, ModelFacts, recompute_problem

if TYPE_CHECKING:
    from planner.plan import ParallelConfig


def expert_groups(dp: int, cp: int, ep: int, tp: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, the experts' data-parallel groups) as indices into the
    flattened dp x cp x tp ranks of one pipeline stage (tp inner, as the mesh numbers them):
    ``ep`` consecutive ranks share one layer's experts out; the ranks at the same place in
    each such group hold the same experts. With tp > 1 the MoE layers run on each rank's
    sequence shard (sequence parallel, :func:`ep_problem`), so every one of these ranks
    routes tokens of its own."""
    n = dp * cp * tp
    ep_groups = [list(range(g * ep, (g + 1) * ep)) for g in range(n // ep)]
    edp_groups = [list(range(i, n, ep)) for i in range(ep)]
    return ep_groups, edp_groups


def tp_problem(tp: int, f: ModelFacts) -> str | None:
    """Why the runtime cannot shard this model ``tp`` ways (None if it can)."""
    if tp == 1:
        return None
    if "tp" in f.limits:
        return f"tp={tp}: {f.limits['tp']}"
    if any(h % tp for h in f.heads) or (f.hidden and f.hidden % tp):
        return f"tp={tp} does not divide {max(f.heads, default=1)} heads / hidden {f.hidden}"
    if any(h % tp for h in f.kv_heads):
        return (f"tp={tp} does not divide the {min(f.kv_heads)} kv heads "
                "(the runtime does not replicate kv heads yet)")
    return None


def cp_problem(cp: int, f: ModelFacts, ulysses: int = 1, tp: int = 1) -> str | None:
    """Why the runtime cannot split this model's sequence ``cp`` ways (zigzag chunks) with a
    Ulysses degree ``ulysses`` under ``tp``: each tp rank's heads and kv heads must split
    ``ulysses`` ways (the all-to-all trades the sequence split for a head split; kv heads
    are not replicated)."""
    if cp == 1:
        return None
    if "cp" in f.limits:
        return f"cp={cp}: {f.limits['cp']}"
    if f.seq_len % (2 * cp):
        return f"cp={cp} does not split sequence {f.seq_len} into 2*cp zigzag chunks"
    if ulysses > 1 and cp % ulysses:
        return f"ulysses={ulysses} does not divide cp={cp}"
    if ulysses > 1 and any(h % (ulysses * tp) for h in f.heads + f.kv_heads):
        return (f"ulysses={ulysses} x tp={tp} does not divide the {min(f.kv_heads + f.heads, default=0)} "
                "(kv) heads each attention splits; use a smaller Ulysses degree (ring attention has no such limit)")
    return None


def pp_problem(pp: int, f: ModelFacts) -> str | None:
    """Why the runtime cannot pipeline this model over ``pp`` stages."""
    if pp == 1:
        return None
    if "pp" in f.limits:
        return f"pp={pp}: {f.limits['pp']}"
    if pp > f.units:
        return f"pp={pp} exceeds the {f.units} pipeline stages this model can be cut into"
    return None


def ep_problem(ep: int, dp: int, cp: int, f: ModelFacts, tp: int = 1, sp: bool = False) -> str | None:
    """Why the runtime cannot run the routed experts split ``ep`` ways under ``tp`` / ``sp``.

    Under TP the MoE layers (router, shared and routed experts) are not tensor-parallel
    (expert tensor parallelism 1, as torchtitan's default): each tp rank runs them on its
    own sequence shard, so a MoE model needs sequence parallel with tp > 1. ``ep`` needs
    routed experts and must divide their count and the dp x cp x tp ranks it splits
    (:func:`expert_groups`); the data-parallel sharding it needs is :func:`zero_problem`'s."""
    if f.experts and tp > 1 and not sp:
        return (f"tp={tp} without sequence parallel: the routed experts run on each tp rank's own "
                "sequence shard (they are not tensor-parallel); use sp=on")
    if ep == 1:
        return None
    if not f.experts:
        return f"ep={ep}: the model has no routed experts; use ep=1"
    if "ep" in f.limits:
        return f"ep={ep}: {f.limits['ep']}"
    if f.experts % ep:
        return f"ep={ep} does not divide the {f.experts} experts"
    if (dp * cp * tp) % ep:
        return (f"ep={ep} does not divide dp x cp x tp = {dp * cp * tp} (expert parallelism splits the "
                "ranks holding distinct tokens)")
    return None


def sp_problem(tp: int, cp: int, f: ModelFacts) -> str | None:
    """Why sequence parallel cannot run: it needs tp > 1, an adapter that shards the
    sequence, and each cp rank's ``seq_len / cp`` tokens divisible by tp."""
    if tp == 1:
        return "sequence parallel needs tp > 1"
    if "sp" in f.limits:
        return f"sequence parallel: {f.limits['sp']}"
    if (f.seq_len // cp) % tp:
        return (f"sequence parallel needs seq_len/cp = {f.seq_len // cp} divisible by tp={tp}")
    return None


def config_problems(cfg: "ParallelConfig", f: ModelFacts) -> list[str]:
    """Everything about ``cfg`` the runtime cannot run for the model of ``f``: the one
    feasibility rule the search, ``autopar evaluate`` and the runtime all apply."""
    out = [f"this model cannot run: {f.limits['any']}"] if "any" in f.limits else []
    out += [p for p in (tp_problem(cfg.tp, f), cp_problem(cfg.cp, f, cfg.ulysses, cfg.tp), pp_problem(cfg.pp * cfg.vpp, f),
                        ep_problem(cfg.ep, cfg.dp, cfg.cp, f, cfg.tp, cfg.sp)) if p]
    if cfg.sp and (p := sp_problem(cfg.tp, cfg.cp, f)):
        out.append(p)
    if cfg.loss == "fused" and "fused_loss" in f.limits:
        out.append(f"loss=fused: {f.limits['fused_loss']}")
    if cfg.attention == "flash" and "flash_attention" in f.limits:
        out.append(f"attention=flash: {f.limits['flash_attention']}")
    if (p := zero_problem(cfg.zero, cfg.tp, cfg.dp * cfg.cp, f, cfg.ep)):
        out.append(p)
    if (p := recompute_problem(cfg.recompute, cfg.schedule, cfg.pp)):
        out.append(p)
    return out


def documents_problem(limits: dict[str, str], causal_only: bool = True) -> str | None:
    """Why this model cannot train on packed documents (None if it can): only causal text
    (``causal_only`` False: the model also has non-causal attention, a vision encoder), and
    only where autopar's attention and token positions run, as context parallelism needs (a
    model whose limits refuse ``cp`` or ``any`` keeps its own attention, which would attend
    across documents, or takes no positions)."""
    if not causal_only:
        return "packed documents (--seq-lens, cu_seqlens) are for text-only causal models; this one has non-causal attention"
    for key in ("any", "cp"):
        if key in limits:
            return ("packed documents (--seq-lens, cu_seqlens) need autopar's attention and token positions, as "
                    f"context parallelism does: {limits[key]}")
    return None


def default_attention(limits: dict[str, str]) -> str:
    """The attention kernel to plan with: flash unless the model's limits (``ModelFacts.limits``)
    say it cannot use it."""
    return "eager" if "flash_attention" in limits else "flash"


def zero_problem(zero: str, tp: int, dp: int, f: ModelFacts, ep: int = 1) -> str | None:
    """Why the runtime cannot shard this model's parameters over dp with ``zero`` under ``tp``
    and ``ep`` (``dp``: the dp x cp ranks): expert parallelism needs sharded data parallelism
    (FSDP2 shards the experts over their own data-parallel group, ``dp * tp / ep`` ranks;
    DDP's reducer would all-reduce them over every rank), unless there is no data
    parallelism and no rank shares its experts (dp = 1, ep = tp)."""
    if zero in SHARDED_PARAMS and tp > 1 and dp > 1 and "fsdp_with_tp" in f.limits:
        return f"zero={zero} with tp={tp}: {f.limits['fsdp_with_tp']}; use zero=ddp or zero1"
    if ep > 1 and zero not in SHARDED_PARAMS and (dp > 1 or tp > ep):
        return f"ep={ep} with zero={zero}: the experts are sharded by FSDP over their own data-parallel group; use zero=fsdp"
    return None
