"""Plan -> a standalone, readable training program (``autopar codegen plan.json -o train.py``).

The program reads top to bottom, in torchtitan's manner:

- the plan as literals: the model spec, the ``ParallelConfig``, the stage split (layer units
  per virtual stage), the recompute policy per stage, and the TP plan torchtitan style:
  ``BLOCK_TP_PLAN`` (per block stack, the style of each module inside one block, applied to
  every block) and ``TP_PLAN`` (the other modules by path), expanded by
  ``codegen.runtime.tp_plan.tp_plan_for`` to ``{module fqn: style}`` - checked here to be
  exactly the plan's layout;
- ``build``: the parallelisation recipe, one runtime helper per concern
  (``codegen/runtime/recipe.py``: ``check_runnable`` -> ``build_mesh`` -> ``split_stages`` ->
  ``materialize`` -> ``tie_weights`` -> ``apply_attention`` -> ``apply_tp`` -> ``apply_ep`` ->
  ``apply_recompute`` -> ``apply_dp`` -> ``build_optimizer`` -> ``build_schedule``), the same helpers
  ``codegen.runtime.train.parallelize`` calls;
- ``train_step``: this rank's share of the global batch, the micro-batches (gradient
  accumulation) or the pipeline schedule's ``step``, the tied-weight gradients, clipping by
  the global gradient norm, the optimizer step;
- ``main``: command-line flags (optimizer, learning rate with warmup + cosine decay, clipping,
  steps, checkpoints, data), resume from the newest complete distributed checkpoint, the
  loop, one JSON line per step (``step``, ``loss``, ``step_s``, ``tokens_per_s``,
  ``memory_gib`` per rank, ``lr``, ``grad_norm``), a checkpoint every K steps.

The model is built on meta for the zoo and transformers models (their adapters initialise
only this rank's units); a plain module built by its own function takes rank 0's weights.
Run it with torchrun.

Only validated values reach the program: the model spec (preset name, .toml path or a
dotted ``package.module:function``), layer names and TP module paths (matched as dotted
identifiers here and by Plan.from_dict), TP styles (one of ``TP_ROLES``) and numbers, all
written with ``repr`` - nothing from a plan file is pasted as code.
"""
from __future__ import annotations

import re
from typing import Optional

from codegen.runtime.tp_plan import block_stack, tp_plan_for
from planner.feasibility import Nodes
from planner.files import write_atomic
from planner.plan import TP_ROLES, Plan, PlanError

_SPEC = re.compile(r"^([A-Za-z0-9_][\w.-]*|[\w./-]+\.toml|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*|hf:[\w./-]+)$")
_FQN = re.compile(r"[A-Za-z_][\w]*(\.[\w]+)*")
WIDTH = 110  # columns of the literal dict and list lines

TEMPLATE = '''#!/usr/bin/env python
"""Train {model_name} with {label} on {world} {device} ({cluster}).

Emitted by autopar from a plan; predicted step {step_s:.4g} s, {tokens:,.0f} tokens/s, MFU {mfu:.1%}.
Run: torchrun --nproc-per-node {world} {{this file}} --steps 20

build() applies the plan, one codegen/runtime helper per concern; train_step() is one optimizer step.
"""
import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist

from codegen.runtime import checkpoint
from codegen.runtime.adapters import adapter_for
from codegen.runtime.data import packed_documents, synthetic, user_hook
from codegen.runtime.mesh import build_mesh, init_distributed, teardown
from codegen.runtime.metrics import peak_memory_per_rank
from codegen.runtime.optim import build_optimizer, warmup_cosine
from codegen.runtime.recipe import (apply_attention, apply_dp, apply_ep, apply_recompute, apply_tp, build_schedule,
                                    check_runnable, materialize, split_stages, tie_weights)
from codegen.runtime.tp_plan import tp_plan_for
from codegen.runtime.train import ParallelModel, TokenLoss
from planner import zoo
from planner.feasibility import Batch, Nodes
from planner.plan import ModelFacts, ParallelConfig

# ---- the plan --------------------------------------------------------------------------
MODEL, ADAPTER, VOCAB = {model!r}, {adapter!r}, {vocab!r}
# what check_runnable checks before anything is built
FACTS = ModelFacts.from_dict({facts!r})
CONFIG = ParallelConfig.parse({config!r})
CLUSTER = Nodes({cluster!r}, {nodes!r}, {devices_per_node!r})  # the cluster planned for
GLOBAL_BATCH, SEQ_LEN = {global_batch!r}, {seq_len!r}  # sequences per optimizer step, tokens per sequence
# planned with --seq-lens: synthetic rows pack documents of these lengths (drawn uniformly)
DOCUMENT_LENGTHS = {document_lengths!r}
STAGES = {stages}
RECOMPUTE = {recompute!r}  # activation recomputation per virtual stage
{tp_plan}
PREDICTED = {{"step_s": {step_s!r}, "memory_gib": {memory!r}}}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ckpt-dir", default="checkpoints")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (0: never)")
    ap.add_argument("--metrics", default="train_log.jsonl", help="JSON-lines log of every step")
    ap.add_argument("--data", default=None, help="package.module:function(step, global_batch, seq_len) -> batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--min-lr", type=float, default=3e-5, help="learning rate of the last step (cosine decay)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="steps of linear warmup to --lr")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1 (SGD: momentum)")
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    return ap.parse_args()


def make_optimizer(args: argparse.Namespace):
    """params -> optimizer with the command line's settings (one per stage module)."""
    if args.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=args.lr, momentum=args.beta1, weight_decay=args.weight_decay)
    return lambda ps: torch.optim.AdamW(ps, lr=args.lr, betas=(args.beta1, args.beta2),
                                        weight_decay=args.weight_decay)


def build(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> ParallelModel:
    """The plan applied to ``model`` on this rank (collective: every rank runs it)."""
    units = [u for s in STAGES for u in s]  # the model's layer units in order
    adapter = adapter_for(model, order=units, seq_len=SEQ_LEN, facts=FACTS)
    batch = Batch(GLOBAL_BATCH, SEQ_LEN, documents=bool(DOCUMENT_LENGTHS))
    check_runnable(CONFIG, adapter, FACTS, batch, CLUSTER)  # refuse what cannot run, before building
    mesh = build_mesh(CONFIG)  # dims (pp, dp, cp, tp) = {mesh_shape!r}
    stages = split_stages(adapter, STAGES, RECOMPUTE, CONFIG, mesh)  # this pp rank's stage modules
    materialize(adapter, stages, device, args.seed)  # meta: initialise own units; else take rank 0's weights
    # weights tied across pp ranks (pp > 1), found before TP splits them: their grads are summed
    tied = tie_weights(adapter, stages, mesh)
    apply_attention(adapter, stages, CONFIG, mesh)  # {attention}
    apply_tp(adapter, stages, tp_plan_for(units, BLOCK_TP_PLAN, TP_PLAN), mesh, CONFIG.sp)  # {tp}
    experts = apply_ep(stages, CONFIG)  # {ep}
    apply_recompute(adapter, stages)  # checkpoint the blocks of "full" stages
    dp_mesh = apply_dp(adapter, stages, CONFIG, mesh, experts)  # {dp}
    optimizer = build_optimizer(stages.modules, make_optimizer(args), CONFIG.zero, dp_mesh.size(),
                                dp_mesh.get_group())  # one per stage module{zero1}
    loss_fn = TokenLoss(dp_mesh.size())  # summed token loss / global token count * dp*cp size
    # {schedule}
    schedule = build_schedule(stages, CONFIG, mesh, GLOBAL_BATCH, loss_fn, device)
    return ParallelModel(adapter, CONFIG, mesh, stages, optimizer, loss_fn, GLOBAL_BATCH, device,
                         dp_mesh=dp_mesh, schedule=schedule, tied=tied)


def train_step(pm: ParallelModel, batch: dict, lr: float, clip: float) -> tuple[float, float]:
    """One optimizer step on the GLOBAL batch (the same on every rank) at learning rate ``lr``;
    returns (mean token loss of the batch, global gradient norm before clipping)."""
    inputs, targets = pm.local_batch(batch)  # this rank's dp rows and cp sequence shard
    pm.optimizer.zero_grad()
{forward_backward}
    pm.sync_grads()
    norm = pm.clip_grad_norm_(clip)  # torch.nn.utils clipping by the norm over all ranks' gradients
    pm.optimizer_step(lr)
    return pm.global_loss(loss), norm


def main() -> None:
    args = parse_args()
    device = init_distributed()  # gloo on CPU, nccl on GPU
    spec = zoo.load_model_spec(MODEL)
    model = spec.build(None if ADAPTER == "module" else "meta")
    pm = build(model, args, device)
    mllm = spec.cfg if spec.cfg is not None and spec.cfg.arch == "mllm" else None
    if args.data:
        data = user_hook(args.data, GLOBAL_BATCH, SEQ_LEN)
        if DOCUMENT_LENGTHS and dist.get_rank() == 0:
            print("--data: this plan was made for packed documents (--seq-lens); give the batches cu_seqlens")
    elif DOCUMENT_LENGTHS:  # packed documents, as planned: attention within each
        data = packed_documents(VOCAB, GLOBAL_BATCH, SEQ_LEN, DOCUMENT_LENGTHS, args.seed,
                                model_shifts_labels=ADAPTER == "hf")
    else:
        data = synthetic(VOCAB, GLOBAL_BATCH, SEQ_LEN, args.seed, mllm=mllm, model_shifts_labels=ADAPTER == "hf")
    start = checkpoint.load_latest(pm, args.ckpt_dir) or 0
    rank = dist.get_rank()
    if rank == 0:  # drop steps logged after the checkpoint we resume from (they are run again)
        checkpoint.trim_log(args.metrics, start)
    with (open(args.metrics, "a") if rank == 0 else contextlib.nullcontext()) as log:
        for step in range(start, args.steps):
            batch = data(step)
            lr = warmup_cosine(step, args.steps, args.lr, args.min_lr, args.warmup_steps)
            t0 = time.perf_counter()
            loss, norm = train_step(pm, batch, lr, args.clip)
            step_s = time.perf_counter() - t0
            mem = peak_memory_per_rank(device)  # GiB, one all-reduce of a tensor
            if log:  # logged before the checkpoint, so a checkpointed step is always in the log
                rec = {{"step": step + 1, "loss": loss, "step_s": step_s, "memory_gib": mem, "lr": lr,
                       "grad_norm": norm, "tokens_per_s": GLOBAL_BATCH * SEQ_LEN / step_s}}
                log.write(json.dumps(rec) + "\\n")
                log.flush()
                print(f"step {{step + 1:4d}}  loss {{loss:.4f}}  {{step_s * 1e3:8.1f}} ms  "
                      f"{{rec['tokens_per_s']:,.0f}} tok/s  peak {{max(mem):.2f}} GiB", flush=True)
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                checkpoint.save(pm, args.ckpt_dir)
    pm.close()  # the build's process groups, hooks and registry entries
    teardown()  # a barrier, then the default process group


if __name__ == "__main__":
    main()
'''

PIPELINE = '''\
    # the {schedule} schedule: forward and backward of {n} micro-batches of {mbs} over the pp ranks
    loss = pm.pipeline(inputs, targets)'''
ACCUMULATE = '''\
    loss = torch.zeros((), dtype=torch.float64, device=pm.device)
    for mb in range(pm.n_microbatches):  # gradient accumulation: {n} micro-batches of {mbs} sequences
        loss += pm.microbatch(inputs, targets, mb)  # forward + backward of one micro-batch'''


def _wrapped(items: list[str], indent: str = "    ") -> list[str]:
    """``items`` (already ``repr``-written) joined with ", " into lines of at most WIDTH columns."""
    lines, cur = [], ""
    for it in items:
        if cur and len(indent) + len(cur) + len(it) + 2 > WIDTH:
            lines.append(indent + cur.rstrip())
            cur = ""
        cur += it + ", "
    if cur:
        lines.append(indent + cur.rstrip())
    return lines


def stages_literal(stages: list[list[str]]) -> str:
    """``[...]`` with one line per virtual stage (wrapped), the stage's index as a comment."""
    out = ["[  # layer units per virtual stage; stage j runs on pp rank j % pp"]
    for j, s in enumerate(stages):
        rows = _wrapped([repr(u) for u in s], "    ")
        rows[0] = "    [" + rows[0][4:]
        rows[-1] = rows[-1].rstrip(",") + "],"
        rows[-1] += f"  # stage {j}"
        out.extend(rows if len(rows) == 1 else [rows[0]] + ["    " + r for r in rows[1:]])
    return "\n".join(out + ["]"])


def _unit_of(fqn: str, units: list[str]) -> Optional[str]:
    """The unit holding module ``fqn`` (the longest unit path that is ``fqn`` or a prefix of it)."""
    return max((u for u in units if fqn == u or fqn.startswith(u + ".")), key=len, default=None)


def split_tp_plan(layout: dict[str, str], units: list[str]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """``(block_plan, rest)`` for ``tp_plan_for(units, block_plan, rest)``: a template per block
    stack whose blocks all have the same entries (module path inside the block -> style), every
    other entry by its full path. Checked: the expansion is exactly ``layout`` (else the
    whole layout is written by path)."""
    per_unit: dict[str, dict[str, str]] = {}
    for fqn, style in layout.items():
        u = _unit_of(fqn, units)
        if u is not None:
            per_unit.setdefault(u, {})[fqn[len(u) + 1:]] = style
    stacks: dict[str, list[str]] = {}
    for u in units:
        if block_stack(u) is not None:
            stacks.setdefault(block_stack(u), []).append(u)
    block_plan: dict[str, dict[str, str]] = {}
    for stack, blocks in stacks.items():
        first = per_unit.get(blocks[0], {})
        if first and all(per_unit.get(b, {}) == first for b in blocks) and "" not in first:
            block_plan[stack] = first
    templated = {u for u in units if block_stack(u) in block_plan}
    rest = {f: s for f, s in layout.items() if _unit_of(f, units) not in templated}
    if tp_plan_for(units, block_plan, rest) != layout:
        return {}, dict(layout)
    return block_plan, rest


def _by_unit(entries: dict[str, str], units: list[str], indent: str) -> list[str]:
    """``entries`` written ``'fqn': 'style',``, the entries of one unit on their own line(s), in
    the model's unit order (entries outside every unit last)."""
    order = {u: i for i, u in enumerate(units)}
    groups: dict[int, list[str]] = {}
    for fqn in sorted(entries, key=lambda f: (order.get(_unit_of(f, units), len(units)), f)):
        groups.setdefault(order.get(_unit_of(fqn, units), len(units)), []).append(f"{fqn!r}: {entries[fqn]!r}")
    return [line for items in groups.values() for line in _wrapped(items, indent)]


def tp_plan_literal(layout: dict[str, str], units: list[str], tp: int) -> str:
    """``BLOCK_TP_PLAN = {stack: {path in block: style}}`` and ``TP_PLAN = {fqn: style}`` (the
    modules outside the templated blocks), torchtitan style (see :func:`split_tp_plan`);
    both ``{}`` when tp == 1 (nothing is sharded)."""
    if tp == 1 or not layout:
        return "BLOCK_TP_PLAN, TP_PLAN = {}, {}  # tp=1: no tensor parallelism"
    block_plan, rest = split_tp_plan(layout, units)
    out = ["# tensor-parallel style per module (codegen/runtime/tensor_parallel.py), torchtitan style:",
           "# per block stack, the style of each module inside one block, applied to every block of it"]
    if block_plan:
        out.append("BLOCK_TP_PLAN = {")
        for stack, template in block_plan.items():
            out.append(f"    {stack!r}: {{")
            out.extend(_wrapped([f"{k!r}: {v!r}" for k, v in template.items()], " " * 8))
            out.append("    },")
        out.append("}")
    else:
        out.append("BLOCK_TP_PLAN = {}  # no stack of identical blocks")
    one_line = "TP_PLAN = {" + ", ".join(f"{f!r}: {s!r}" for f, s in rest.items()) + "}  # other modules, by path"
    if len(one_line) <= WIDTH:
        return "\n".join(out + [one_line])
    out.append("TP_PLAN = {  # the other modules, by path")
    out.extend(_by_unit(rest, units, "    "))
    return "\n".join(out + ["}"])


def _comments(plan: Plan) -> dict[str, str]:
    """The end-of-line comments of ``build`` and the step's forward/backward, per the plan."""
    c = plan.config
    n = int(plan.batch["global"]) // (c.dp * c.mbs)
    attention = ("ring attention over cp, " if c.cp > 1 else "") + f"{c.attention} attention kernel"
    dp = (f"{c.zero} over dp x cp = {c.dp * c.cp} ranks" if c.dp * c.cp > 1 else "dp x cp = 1: nothing to do")
    if c.pp > 1:
        schedule = f"{c.schedule}, {n} micro-batches" + (f", {c.vpp} stages per pp rank" if c.vpp > 1 else "")
        step = PIPELINE.format(schedule=c.schedule, n=n, mbs=c.mbs)
    else:
        schedule = "pp=1: None"
        step = ACCUMULATE.format(n=n, mbs=c.mbs)
    ep = (f"ep={c.ep}: each rank keeps {plan.facts.experts // c.ep} experts per routed layer, tokens by all-to-all"
          if c.ep > 1 else "ep=1: nothing to do")
    return dict(attention=attention, dp=dp, ep=ep, schedule=schedule, forward_backward=step,
                tp=f"tp={c.tp}" + (", sequence parallel" if c.sp else "") if c.tp > 1 else "tp=1: nothing to do",
                zero1=", ZeRO-1: this rank steps its share" if c.zero == "zero1" and c.dp * c.cp > 1 else "")


def emit(plan: Plan) -> str:
    """The program text for ``plan``."""
    spec = plan.model.get("spec") or plan.model["name"]
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise PlanError(f"model spec {spec!r} in the plan is not a preset, .toml path or package.module:function")
    names = plan.model["layers"]
    stages = [list(s["layers"]) for s in plan.stages]
    for s in stages:
        for n in s:
            if n not in names or not _FQN.fullmatch(n):
                raise PlanError(f"layer name {n!r} in the plan is not a module path")
    layout = dict(plan.tp_layout)
    for fqn, role in layout.items():
        if not isinstance(fqn, str) or not _FQN.fullmatch(fqn) or role not in TP_ROLES:
            raise PlanError(f"tensor-parallel entry {fqn!r}: {role!r} in the plan is not a module path and style")
    est = plan.estimate
    lengths = (plan.batch.get("documents") or {}).get("lengths") or []
    if not isinstance(lengths, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                for n in lengths):
        raise PlanError("batch.documents.lengths in the plan must be a list of positive integers (token counts)")
    shape = Nodes.of_plan(plan.cluster, plan.config.world)
    return TEMPLATE.format(
        model_name=plan.model["name"], label=plan.config.label(), world=plan.config.world,
        device="GPUs" if plan.cluster.get("backend") == "nccl" else "CPU processes", cluster=plan.cluster["name"],
        step_s=float(est["step_s"]), tokens=float(est["tokens_per_s"]), mfu=float(est["mfu"]),
        model=spec, adapter=str(plan.model.get("adapter", "zoo")), vocab=int(plan.model.get("vocab") or 0),
        facts=plan.facts.to_dict(), config=plan.config.to_str(), stages=stages_literal(stages),
        recompute=[str(s["recompute"]) for s in plan.stages],
        tp_plan=tp_plan_literal(layout, [u for s in stages for u in s], plan.config.tp),
        global_batch=int(plan.batch["global"]), seq_len=int(plan.batch["seq_len"]), document_lengths=lengths,
        mesh_shape=tuple(int(x) for x in plan.config.mesh_shape), nodes=shape.nodes,
        devices_per_node=shape.devices_per_node,
        memory=[float(x) for x in est.get("memory_gib", [])], **_comments(plan))


def write_program(plan: Plan, path: str, force: bool = False) -> None:
    write_atomic(path, emit(plan), force=force)
