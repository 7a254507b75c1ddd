"""Plan -> a standalone, readable training program (``autopar codegen plan.json -o train.py``).

The program is ``codegen/program_template.py`` (a real module that linters check) with the
plan filled in: its docstring, the block of plan literals between its markers, and the
comments that say what each call does under this plan (``planner.describe``, the words the
report prints). It reads top to bottom, in torchtitan's manner:

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

import ast
import re
from pathlib import Path
from typing import Optional

from codegen.runtime.cpu_env import run_prefix
from codegen.runtime.tp_plan import block_stack, tp_plan_for
from codegen.runtime.tp_styles import IMPORTS, sources_for
from planner.vocab_passes import parse_unit, stage_layers
from planner.batch_assign import METHODS
from planner.batch_multimodal import layout_problem
from planner.describe import describe
from planner.feasibility import Nodes
from planner.files import write_atomic
from planner.plan import TP_ROLES, Plan, PlanError
from planner.schedule_file import to_json

_SPEC = re.compile(r"^([A-Za-z0-9_][\w.-]*|[\w./-]+\.toml|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*|hf:[\w./-]+)$")
_FQN = re.compile(r"[A-Za-z_][\w]*(\.[\w]+)*")
WIDTH = 110  # columns of the literal dict and list lines


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
    out = ["[  # layer units per virtual stage; stage j on pp rank j % pp (dualpipev: V-shaped; custom: SCHEDULE's placement)"]
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
    """``entries`` (fqn -> style source) written ``'fqn': Style(...),``, the entries of one unit on their own line(s), in
    the model's unit order (entries outside every unit last)."""
    order = {u: i for i, u in enumerate(units)}
    groups: dict[int, list[str]] = {}
    for fqn in sorted(entries, key=lambda f: (order.get(_unit_of(f, units), len(units)), f)):
        groups.setdefault(order.get(_unit_of(fqn, units), len(units)), []).append(f"{fqn!r}: {entries[fqn]}")
    return [line for items in groups.values() for line in _wrapped(items, indent)]


def tp_plan_literal(layout: dict[str, str], units: list[str], tp: int, sp: bool) -> str:
    """``BLOCK_TP_PLAN = {stack: {path in block: ParallelStyle}}`` and ``TP_PLAN = {fqn:
    ParallelStyle}`` (the modules outside the templated blocks), torchtitan style (see
    :func:`split_tp_plan`), each style written as ``codegen.runtime.tp_styles.style_source``
    states it for the plan's role; both ``{}`` when tp == 1 (nothing is sharded)."""
    if tp == 1 or not layout:
        return "BLOCK_TP_PLAN, TP_PLAN = {}, {}  # tp=1: no tensor parallelism"
    block_plan, rest = split_tp_plan(sources_for(layout, sp, units), units)
    out = ["# tensor-parallel style per module (torch's ParallelStyle; ours in codegen/runtime/tensor_parallel.py):",
           "# per block stack, the style of each module inside one block, applied to every block of it"]
    if block_plan:
        out.append("BLOCK_TP_PLAN = {")
        for stack, template in block_plan.items():
            out.append(f"    {stack!r}: {{")
            out.extend(f"        {k!r}: {v}," for k, v in template.items())
            out.append("    },")
        out.append("}")
    else:
        out.append("BLOCK_TP_PLAN = {}  # no stack of identical blocks")
    one_line = "TP_PLAN = {" + ", ".join(f"{f!r}: {s}" for f, s in rest.items()) + "}  # other modules, by path"
    if len(one_line) <= WIDTH:
        return "\n".join(out + [one_line])
    out.append("TP_PLAN = {  # the other modules, by path")
    out.extend(_by_unit(rest, units, "    "))
    return "\n".join(out + ["}"])


def import_lines(module: str, names: list[str]) -> list[str]:
    """``from module import names`` as isort writes it: one line within 88 columns, else one
    name per line in parentheses."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= 88:
        return [line]
    return [f"from {module} import ("] + [f"    {n}," for n in names] + [")"]


def prune_style_imports(lines: list[str], block: str) -> list[str]:
    """The template's style imports (from the modules of ``codegen.runtime.tp_styles.IMPORTS``, on
    one line or parenthesised over several) written with the names of ``IMPORTS`` that ``block``
    calls, whichever the template names (its placeholder plan cannot call them all); an import
    left with no name is dropped."""
    out, i = [], 0
    while i < len(lines):
        m = re.fullmatch(r"from ([\w.]+) import (\(?)(.*)", lines[i])
        i += 1
        if m is None or m.group(1) not in IMPORTS:
            out.append(lines[i - 1])
            continue
        while m.group(2) and lines[i - 1] != ")":  # skip the parenthesised names, up to the line ")"
            i += 1
        used = [n for n in IMPORTS[m.group(1)] if re.search(rf"\b{n}\(", block)]
        out += import_lines(m.group(1), used) if used else []
    return out


TEMPLATE_PATH = Path(__file__).with_name("program_template.py")
PLAN_START, PLAN_END = "# ---- the plan ", "# ---- end of the plan "
_WORD = re.compile(r"(#.*?)@([a-z_]+)")


def header(plan: Plan) -> str:
    """The program's docstring: what it trains, how, where, and what the plan predicts."""
    c, est = plan.config, plan.estimate
    device = "GPUs" if plan.cluster.get("backend") == "nccl" else "CPU processes"
    return (f'"""Train {plan.model["name"]} with {c.label()} on {c.world} {device} ({plan.cluster["name"]}).\n\n'
            f"Emitted by autopar from a plan; predicted step {float(est['step_s']):.4g} s, "
            f"{float(est['tokens_per_s']):,.0f} tokens/s, MFU {float(est['mfu']):.1%}.\n"
            f"Run: {run_prefix(plan.cluster.get('backend', ''))}torchrun --nproc-per-node {c.world} {{this file}} "
            "--steps 20\n\n"
            "build() applies the plan, one codegen/runtime helper per concern; train_step() is one optimizer step.\n"
            '"""')


def plan_block(plan: Plan, stages: list[list[str]], layout: dict[str, str], lengths: list[int]) -> list[str]:
    """The plan's literals (the lines between the template's plan markers), all ``repr``-written."""
    est, shape = plan.estimate, Nodes.of_plan(plan.cluster, plan.config.world)
    spec = plan.model.get("spec") or plan.model["name"]
    adapter, vocab = str(plan.model.get("adapter", "zoo")), int(plan.model.get("vocab") or 0)
    memory = [float(x) for x in est.get("memory_gib", [])]
    return [
        f"MODEL, ADAPTER, VOCAB = {spec!r}, {adapter!r}, {vocab!r}",
        "# what check_runnable checks before anything is built",
        f"FACTS = ModelFacts.from_dict({plan.facts.to_dict()!r})",
        f"CONFIG = ParallelConfig.parse({plan.config.to_str()!r})",
        f"CLUSTER, DP_SPANS = Nodes({plan.cluster['name']!r}, {shape.nodes!r}, {shape.devices_per_node!r}"
        + (f", {shape.cores_per_node!r}" if shape.cores_per_node else "")
        + f"), {int(plan.cluster.get('dp_spans', 1))!r}  # the cluster planned for; regions dp x cp spans",
        f"GLOBAL_BATCH, SEQ_LEN = {int(plan.batch['global'])!r}, {int(plan.batch['seq_len'])!r}"
        "  # sequences per optimizer step, tokens per sequence",
        "# planned with --seq-lens: synthetic rows pack documents of these lengths (drawn uniformly)",
        f"DOCUMENT_LENGTHS = {lengths!r}",
        "# per-batch assignment of each batch's documents to context-parallel groups (None: the fixed layout)",
        f"PER_BATCH = per_batch_of({per_batch_literal(plan)!r})",
        f"MULTIMODAL = multimodal_of({multimodal_literal(plan)!r})"
        "  # each batch's samples (images, text) assigned to the dp ranks (None: fixed split)",
        f"STAGES = {stages_literal(stages)}",
        f"RECOMPUTE = {[str(s['recompute']) for s in plan.stages]!r}  # activation recomputation per virtual stage",
        tp_plan_literal(layout, [u for s in stages for u in s], plan.config.tp, plan.config.sp),
        f"PREDICTED = {{'step_s': {predicted_step(plan)!r}, 'memory_gib': {memory!r}}}"
        "  # per step, per rank: printed beside what the run measures",
        schedule_literal(to_json(plan.schedule_ir) if plan.schedule_ir else None),
    ]


def schedule_literal(text: str | None) -> str:
    """``SCHEDULE = plan_schedule(...)``: the plan's own schedule as its JSON text, cut into
    string pieces of at most 72 characters (None: the built-in ``CONFIG.schedule``)."""
    note = "  # the plan's own pipeline schedule (schedule=custom); None: CONFIG's built-in"
    if text is None:
        return f"SCHEDULE = plan_schedule(None){note}"
    pieces = [f"    {text[i:i + 72]!r}" for i in range(0, len(text), 72)]
    return "\n".join([f"SCHEDULE = plan_schedule({note}", *pieces, ")"])


def per_batch_literal(plan: Plan) -> Optional[dict]:
    """The plan's per-batch assignment as the program's literal: None unless chosen, else its
    pool and rates, checked to be plain numbers (and the method a name autopar has)."""
    rec = plan.batch.get("per_batch") or {}
    if not rec.get("chosen"):
        return None
    cost = rec.get("cost") or {}
    keys = ("linear", "attention", "exchange", "alltoall", "latency", "merge", "ring")
    nums = [cost.get(k, 0.0 if k in ("merge", "ring") else None) for k in keys]  # merge, ring: absent from older plans
    ints = [rec.get(k) for k in ("workers", "max_group", "capacity")]
    if (not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in nums)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ints)
            or cost.get("method") not in METHODS):
        raise PlanError("batch.per_batch in the plan must hold non-negative rates, positive worker counts and "
                        f"a method of {', '.join(METHODS)}; plan again with `autopar plan --per-batch`")
    return {"chosen": True, "workers": ints[0], "max_group": ints[1], "capacity": ints[2],
            "aligned": bool(rec.get("aligned", False)),
            "cost": dict(zip(keys, nums), method=cost["method"])}


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0


def multimodal_literal(plan: Plan) -> Optional[dict]:
    """The plan's multimodal sample assignment as the program's literal: None unless chosen,
    else its images-per-sample weights, rates, capacity and patches, checked to be plain
    numbers on a layout that runs it (``planner.batch_multimodal.layout_problem``)."""
    rec = plan.batch.get("multimodal") or {}
    if not rec.get("chosen"):
        return None
    if why := layout_problem(plan.config):
        raise PlanError(f"batch.multimodal is chosen but {why}")
    cost, images = rec.get("cost") or {}, rec.get("images") or {}
    keys = ("linear", "attention", "exchange", "alltoall", "latency", "vision")
    ints = [rec.get(k) for k in ("capacity", "patches")]
    if (not images or not all(str(k).isdigit() and _number(v) for k, v in images.items())
            or not all(_number(cost.get(k, 0.0)) for k in keys) or cost.get("method", "ring") not in METHODS
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in ints)):
        raise PlanError("batch.multimodal in the plan must hold images-per-sample weights, non-negative rates and "
                        "a positive capacity and patches; plan again with `autopar plan --images-per-sample`")
    return {"images": {int(k): float(v) for k, v in images.items()}, "capacity": ints[0], "patches": ints[1],
            "cost": dict({k: float(cost.get(k, 0.0)) for k in keys}, method=cost.get("method", "ring"))}


def predicted_step(plan: Plan) -> float:
    """The step time the program prints beside its own: per-batch (or multimodal sample)
    assignment's expected step when the plan runs it, else the estimate's."""
    rec = plan.batch.get("per_batch") or {}
    if rec.get("chosen"):
        return float(rec["expected_step_s"])
    mm = plan.batch.get("multimodal") or {}
    return float(mm["assigned_s"]) if mm.get("chosen") else float(plan.estimate["step_s"])


def comment_words(plan: Plan) -> dict[str, str]:
    """What each ``@name`` in the template's comments becomes: the plan's words
    (``planner.describe``) and its mesh shape."""
    return dict(describe(plan).as_dict(), mesh=repr(tuple(int(x) for x in plan.config.mesh_shape)))


def fill_template(template: str, docstring: str, block: list[str], words: dict[str, str]) -> str:
    """``template`` with its module docstring replaced by ``docstring``, the lines between its
    plan markers by ``block`` and every ``@name`` in a comment by ``words[name]``."""
    lines = template.splitlines()
    doc = ast.parse(template).body[0]
    start = next(i for i, line in enumerate(lines) if line.startswith(PLAN_START))
    end = next(i for i, line in enumerate(lines) if line.startswith(PLAN_END))
    head = prune_style_imports(lines[doc.end_lineno:start + 1], "\n".join(block))
    out = lines[:doc.lineno - 1] + docstring.splitlines() + head + block + lines[end:]

    def word(m: re.Match) -> str:
        if m.group(2) not in words:
            raise KeyError(f"{TEMPLATE_PATH.name}: no words for @{m.group(2)}")
        return m.group(1) + words[m.group(2)]
    return "\n".join(_WORD.sub(word, line) for line in out) + "\n"


def check_plan(plan: Plan) -> tuple[list[list[str]], dict[str, str], list[int]]:
    """The plan's stages, TP layout and document lengths, each checked to be what may be
    written into a program (module paths, styles of ``TP_ROLES``, positive integers)."""
    spec = plan.model.get("spec") or plan.model["name"]
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise PlanError(f"model spec {spec!r} in the plan is not a preset, .toml path or package.module:function")
    names = stage_layers(plan.model["layers"], plan.config.vocab_passes, plan.config.pp)
    stages = [list(s["layers"]) for s in plan.stages]
    for n in (n for s in stages for n in s):
        if n not in names or not _FQN.fullmatch(vp.head if (vp := parse_unit(n)) else n):  # (a pass: its head)
            raise PlanError(f"layer name {n!r} in the plan is not a module path")
    layout = dict(plan.tp_layout)
    for fqn, role in layout.items():
        if not isinstance(fqn, str) or not _FQN.fullmatch(fqn) or role not in TP_ROLES:
            raise PlanError(f"tensor-parallel entry {fqn!r}: {role!r} in the plan is not a module path and style")
    lengths = (plan.batch.get("documents") or {}).get("lengths") or []
    if not isinstance(lengths, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                for n in lengths):
        raise PlanError("batch.documents.lengths in the plan must be a list of positive integers (token counts)")
    return stages, layout, lengths


def emit(plan: Plan) -> str:
    """The program text for ``plan``: ``program_template.py`` filled in."""
    stages, layout, lengths = check_plan(plan)
    return fill_template(TEMPLATE_PATH.read_text(encoding="utf-8"), header(plan),
                         plan_block(plan, stages, layout, lengths), comment_words(plan))


def write_program(plan: Plan, path: str, force: bool = False) -> None:
    write_atomic(path, emit(plan), force=force)
