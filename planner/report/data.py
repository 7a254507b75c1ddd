"""What a report shows, computed from a plan (and a run log): the re-simulated timeline,
the layer table, predicted against measured, rejection groups, and the shared rows the
HTML, Markdown, trace and terminal renderers (planner/report/render.py) draw.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from planner.describe import CP_METHODS, describe, devices_text, wan_words
from planner.plan import ParallelConfig, Plan, PlanError

GiB = 2**30
MEM_CATS = ("weights", "grads", "optimizer", "activations", "buffers", "reserve")
TIME_PARTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "runtime", "p2p", "bubble", "dp_comm",
              "sync", "optimizer")
MAX_SIM_MB = 64          # above this many micro-batches the timeline draws min(m, 4 pp)
MAX_MESH_DEVICES = 32    # devices drawn in the mesh grid (whole nodes, at least one)
WARMUP_STEPS = 2


# ====================================================================== data

@dataclass
class Timeline:
    result: Any                 # cost_models.pipeline.PipelineResult (None if simulation failed)
    schedule: str
    m: int                      # micro-batches simulated
    m_plan: int
    p2p_s: float
    tail: list[tuple[str, float]]
    note: str


@dataclass
class Report:
    plan: Plan
    timeline: Timeline
    layers: list[dict[str, Any]]
    layers_note: str
    run: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def est(self) -> dict[str, Any]:
        return self.plan.estimate


def fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.4g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.4g} ms"
    return f"{s * 1e6:.4g} µs"


def fmt_n(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def simulate_step(plan: Plan) -> Timeline:
    """Re-simulate one step from the plan's per-stage times (cap huge micro-batch counts; a
    plan's own schedule, ``schedule=custom``, is drawn whole)."""
    from cost_models.pipeline import ScheduleError, SplitCost, simulate, simulate_schedule

    cfg, e = plan.config, plan.estimate
    m_plan = int(plan.batch["microbatches"])
    own = plan.schedule_ir if cfg.pp > 1 and cfg.schedule == "custom" else None  # drawn whole: its own order
    m = m_plan if m_plan <= MAX_SIM_MB or own is not None else min(m_plan, 4 * cfg.pp)
    sched = cfg.schedule if cfg.pp > 1 else "1f1b"
    bd = e.get("breakdown", {})
    p2p = float(e.get("p2p_hop_s", 0.0)) if cfg.pp > 1 else 0.0
    if cfg.pp > 1 and not p2p and bd.get("p2p"):  # plans written before the estimate kept the hop time
        p2p = bd["p2p"] / (2 * (m_plan + cfg.pp - 1))
    tail = [(k, float(bd.get(k, 0.0))) for k in ("dp_comm", "sync", "optimizer")]
    note = ""
    if m != m_plan:
        note = (f"{m_plan} micro-batches per step; the timeline draws the first {m} "
                f"(m = min(m, 4·pp)) so it stays readable - the steady state repeats.")
    try:
        split = SplitCost(**e.get("split_backward", {}))  # (plans written before it: the textbook split)
        res = (simulate_schedule(own, e["stage_fwd_s"], e["stage_bwd_s"], p2p=p2p, split=split) if own is not None
               else simulate(sched, cfg.pp, m, e["stage_fwd_s"], e["stage_bwd_s"], p2p=p2p / cfg.seq_chunks, v=cfg.vpp,
                             seq_chunks=cfg.seq_chunks, split=split))  # (sequence chunks drawn as equal parts: the plan
        #                                                    records no attention share per stage)
    except (ScheduleError, KeyError, TypeError, ValueError) as exc:
        return Timeline(None, sched, m, m_plan, p2p, tail, f"timeline not simulated: {exc}")
    return Timeline(res, sched, m, m_plan, p2p, tail, note)


def layer_rows(plan: Plan) -> tuple[list[dict[str, Any]], str]:
    """The model's layer table, re-captured from ``model.spec`` (names only if that fails)."""
    names = plan.model["layers"]
    stage_of = {n: j for j, s in enumerate(plan.stages) for n in s["layers"]}
    rows = [{"index": i, "name": n, "stage": stage_of.get(n, -1)} for i, n in enumerate(names)]
    spec = plan.model.get("spec")
    if not spec:
        return rows, "the plan names no model spec: layer names only"
    try:
        from planner.frontend.load import load_graph

        g = load_graph(spec, batch=1, seq_len=plan.batch.get("seq_len"))
    except Exception as exc:  # noqa: BLE001 - any capture failure degrades to names
        return rows, f"could not capture {spec!r} again ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}): layer names only"
    if [l.name for l in g.layers] != names:
        return rows, f"{spec!r} captures different layers today than the plan lists: layer names only"
    for r, l in zip(rows, g.layers):
        r.update(kind=l.kind, module_type=l.module_type, params=l.params, fwd_flops=l.fwd_flops / g.batch,
                 bwd_flops=l.bwd_flops / g.batch, act_bytes=l.act_bytes / g.batch, repeat_of=l.repeat_of or "")
    note = f"captured from {spec!r} at 1 sequence of {g.seq_len} tokens; figures per sequence"
    if g.fingerprint() != plan.model.get("fingerprint"):
        note += " (note: the model's fingerprint differs from the plan's: the model changed since planning)"
    return rows, note


def load_run_log(path: str) -> list[dict[str, Any]]:
    """JSON lines written by an emitted program: step, loss, step_s, memory_gib (per rank)."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise PlanError(f"run log {path} unreadable ({exc}): pass the train_log.jsonl a run wrote") from None
    recs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            float(r["step_s"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise PlanError(f"run log {path} line {i}: not a metrics record (needs JSON with step_s)") from None
        recs.append(r)
    if not recs:
        raise PlanError(f"run log {path} holds no steps: run the program first")
    return recs


def compare_run(plan: Plan, recs: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    times = [float(r["step_s"]) for r in recs[warmup:]] or [float(r["step_s"]) for r in recs]
    meas = statistics.median(times)
    from codegen.emit import predicted_step  # per-batch assignment's expected step when the plan runs it

    pred = predicted_step(plan)
    world_ranks: dict[int, float] = {}
    for r in recs:
        for g, v in enumerate(r.get("memory_gib") or []):
            world_ranks[g] = max(world_ranks.get(g, 0.0), float(v))
    inner = plan.config.dp * plan.config.cp * plan.config.tp
    pred_mem = plan.estimate.get("memory_gib", [])
    mem = [{"rank": g, "pp": g // inner, "predicted_gib": pred_mem[g // inner] if g // inner < len(pred_mem) else None,
            "measured_gib": v} for g, v in sorted(world_ranks.items())]
    losses = [r["loss"] for r in recs if isinstance(r.get("loss"), (int, float))]
    return {"predicted_step_s": pred, "measured_step_s": meas, "ratio": meas / pred if pred else float("nan"),
            "steps": len(recs), "warmup": min(warmup, len(recs) - 1) if len(recs) > warmup else 0,
            "measured_min_s": min(times), "measured_max_s": max(times),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "memory": mem}


def rejected_groups(plan: Plan) -> list[dict[str, Any]]:
    """Rejected reasons grouped into families: 'why not tp=16', 'out of memory', ..."""
    fams: dict[str, dict[str, Any]] = {}
    for reason, v in plan.rejected.items():
        m = re.match(r"((?:dp|pp|cp|tp|ep|ulysses|mbs|vpp)=\d+)\b", reason)
        if m:
            title = f"why not {m.group(1)}"
        elif reason.startswith("OOM"):
            title = "out of memory"
        else:
            title = reason.split(" (")[0].split(":")[0].split(";")[0]
        f = fams.setdefault(title, {"title": title, "count": 0, "reasons": []})
        f["count"] += int(v.get("count", 0))
        f["reasons"].append({"reason": reason, "count": int(v.get("count", 0)), "examples": list(v.get("examples", []))})
    for f in fams.values():
        f["reasons"].sort(key=lambda r: -r["count"])
    def key(f: dict[str, Any]) -> tuple:
        m = re.match(r"why not (\w+)=(\d+)", f["title"])
        return (0, ("dp", "pp", "cp", "ulysses", "tp", "ep", "mbs", "vpp").index(m.group(1)), int(m.group(2)), 0) if m \
            else (1, 0, 0, -f["count"])

    return sorted(fams.values(), key=key)


_DEGREE = re.compile(r"\b(dp|pp|cp|tp|ep|ulysses)=?(\d+)\b")


def _degrees(label: str, moe: bool) -> list[tuple[str, int]]:
    """The degrees a configuration or rejection label names; for a model with routed experts a
    layout label without ``ep`` (``ParallelConfig.label`` names it only above 1) has ep=1, and
    one with cp > 1 but no ``ulysses`` has ulysses=1 (ring attention)."""
    out = [(d, int(v)) for d, v in _DEGREE.findall(label)]
    if moe and any(d == "dp" for d, _ in out) and not any(d == "ep" for d, _ in out):
        out.append(("ep", 1))
    if any(d == "cp" and v > 1 for d, v in out) and not any(d == "ulysses" for d, _ in out):
        out.append(("ulysses", 1))
    return out


def why_not_degrees(plan: Plan) -> list[dict[str, Any]]:
    """For each degree value the plan did not take ('pp=2'), what happened to configurations
    with it: the best alternative that used it, and the rejection reasons its examples show."""
    cfg = plan.config
    chosen = {"dp": cfg.dp, "pp": cfg.pp, "cp": cfg.cp, "tp": cfg.tp, "ep": cfg.ep, "ulysses": cfg.ulysses}
    found: dict[tuple[str, int], dict[str, Any]] = {}
    moe = bool(plan.facts.experts)

    def entry(dim: str, val: int) -> dict[str, Any]:
        return found.setdefault((dim, val), {"degree": f"{dim}={val}", "alternative": None, "reasons": {}})

    for a in plan.alternatives:
        for dim, val in _degrees(a.get("label", ""), moe):
            if val != chosen[dim]:
                e = entry(dim, val)
                if e["alternative"] is None or a["step_s"] < e["alternative"]["step_s"]:
                    e["alternative"] = a
    for reason, v in plan.rejected.items():
        for ex in v.get("examples", []):
            for dim, val in _degrees(ex, moe):
                if val != chosen[dim]:
                    rs = entry(dim, val)["reasons"]
                    rs[reason] = rs.get(reason, 0) + 1
    for (dim, val), e in found.items():
        if dim == "cp" and (why := _ring_documents(plan, f"cp={val}")):
            e["documents"] = why
    order = {"dp": 0, "pp": 1, "cp": 2, "ulysses": 3, "tp": 4, "ep": 5}
    return [found[k] for k in sorted(found, key=lambda k: (order[k[0]], k[1]))]


def _ring_documents(plan: Plan, layout: str) -> str | None:
    """With packed documents, why a ring of that cp layout hides its K/V transfers behind little
    compute (``batch.documents.ring_visiting``, cost_models/documents.py); None without."""
    d = plan.batch.get("documents") or {}
    v = d.get("ring_visiting", {}).get(layout)
    if not v or not v["one_document"]:
        return None
    from cost_models.documents import visiting_text

    window = d["attention_share"] * v["hiding"]  # the cost model's ring_hiding, as the plan recorded it
    return (f"{layout}: over the packed documents its ring's visiting blocks do {window:.1%} of the attention work "
            f"they do with one document filling the row (the attention is {d['attention_share']:.1%} of one "
            f"document's, {visiting_text(v['share'], v['one_document'])}), so the ring's "
            "K/V transfers are exposed: the attention over short documents is too small to hide them")


def documents_text(plan: Plan) -> str | None:
    """The summary's line on the packed documents (``batch.documents``), or None without."""
    d = plan.batch.get("documents")
    if not d:
        return None
    src = f" from {d['source']}" if d.get("source") else ""
    cut = (f"; {d['cut']:,} longer than the budget cut into {d['budget']}-token pieces" if d.get("cut") else "")
    sample = f"{d['rows']} rows simulated" + (", a sample of the source" if d.get("sampled") else "")
    text = (f"{d['documents']:,} documents{src} (median {d['median']:,}, p90 {d['p90']:,}, longest {d['longest']:,} "
            f"tokens) packed into rows of {d['budget']:,} tokens (the budget; {sample}){cut}; causal attention work "
            f"{d['attention_share']:.1%} of one document filling each row (token-weighted mean document "
            f"{d['mean_tokens']:,.0f} tokens)")
    if d.get("busiest_share") and d["attention_share"] > 0:
        text += (f"; on the chosen layout the busiest rank does {d['busiest_share'] / d['attention_share']:.2f}x "
                 "the mean rank's attention, and every micro-batch waits for it (priced so)")
    chosen = d.get("chosen", "")
    v = d.get("ring_visiting", {}).get(chosen)
    if v:
        from cost_models.documents import visiting_text

        text += f"; the chosen {chosen} ring: {visiting_text(v['share'], v['one_document'])}"
    elif chosen:
        text += f"; the chosen {chosen} runs no ring (no K/V transfers to hide)"
    return text


def multimodal_text(b: dict) -> str:
    """The summary's line on assigning a multimodal batch's samples (``batch.multimodal``,
    planner/search/multimodal.py): why, and the per-rank balance before and after."""
    text = ("chosen: " if b.get("chosen") else "not chosen: ") + b["why"]
    if "spread_before" not in b:
        return text
    return (f"{text}. On {b['batches']} batches sampled from images per sample "
            f"{', '.join(f'{k}:{v:g}' for k, v in b['images'].items())} the busiest of "
            f"the {b['dp']} dp ranks does {b['spread_before']:.2f}x the mean work on the fixed split, "
            f"{b['spread_after']:.3f}x after assignment; {b['ideal_gap']:.3f}x the step of an ideal balance")


def per_batch_text(plan: Plan) -> str | None:
    """The summary's line on per-batch assignment (``batch.per_batch``, planner/search/per_batch.py):
    chosen or not and why, the per-batch balance (busiest over mean worker) on the sampled
    batches before (the fixed layout) and after assignment, and the gap to an ideal balance."""
    b = plan.batch.get("per_batch")
    if not b:
        return None
    text = ("chosen: " if b.get("chosen") else "not chosen: ") + b["why"]
    if "spread_before" in b:
        text += (f". On {b['batches']} sampled batches the busiest of the {b['workers']} dp x cp ranks does "
                 f"{b['spread_before']:.2f}x the mean work on the fixed layout, {b['spread_after']:.2f}x after "
                 f"assignment ({b['method']} groups of 1 to {b['max_group']}, at most {b['capacity']:,} tokens per "
                 f"rank); {b['ideal_gap']:.3f}x the step of an ideal balance")
    if "memory_capacity" in b:
        text += (f". Under the pipeline each of the {b['microbatches']} micro-batches is assigned on its own and "
                 f"every rank's row padded to {b['capacity']:,} tokens (memory allows {b['memory_capacity']:,}): "
                 "the padding is priced")
    return text


def threads_text(plan: Plan) -> str | None:
    """The summary's line on the plan's intra-op threads per rank (``ParallelConfig.threads``),
    None when it has none set; when one process with every thread won, it says so and what the
    fastest layout with more processes was predicted to take (``alternatives``)."""
    cfg = plan.config
    if not cfg.threads:
        return None
    if cfg.world > 1:
        return f"{cfg.world} processes x {cfg.threads} intra-op threads each"
    step = float(plan.estimate.get("step_s", 0.0))
    more = [a for a in plan.alternatives if ParallelConfig.parse(a["config"]).world > 1]
    best = min(more, key=lambda a: a["step_s"], default=None)
    beside = (f", against {fmt_s(best['step_s'])} for {best['label']}, the fastest with more processes"
              if best else "")
    return f"one process with {cfg.threads} threads is fastest: {fmt_s(step)} per step{beside}"


def build_report(plan: Plan, run_log: str | None = None, layers: bool = True) -> Report:
    rows, note = layer_rows(plan) if layers else ([], "layer table not requested")
    run = compare_run(plan, load_run_log(run_log)) if run_log else None
    return Report(plan=plan, timeline=simulate_step(plan), layers=rows, layers_note=note, run=run)


# ---------------------------------------------------------------------- shared rows

def summary_rows(r: Report) -> list[tuple[str, str, str, Any]]:
    """(key, label, text, raw value) for the summary."""
    p, e, cfg = r.plan, r.est, r.plan.config
    c, words = p.cluster, describe(p)
    src = e.get("source", "?")
    srcs = e.get("sources") or {}
    src_txt = src + (f" (compute: {srcs.get('compute')}, communication: {srcs.get('comm')})" if srcs else "")
    rows = [
        ("model", "model", f"{p.model.get('name')} ({fmt_n(p.model.get('params', 0))} parameters, "
                           f"{len(p.model['layers'])} layers, hidden {p.model.get('hidden')}, vocab {p.model.get('vocab')})",
         p.model.get("name")),
        ("cluster", "cluster", f"{c.get('name')}: {c.get('nodes')} node(s) x {c.get('devices_per_node')} "
                               f"{c.get('device', '')} ({float(c.get('memory_gib') or 0):.1f} GiB, {c.get('backend')})", c.get("name")),
        ("degrees", "degrees", f"dp {cfg.dp} x pp {cfg.pp} x cp {cfg.cp} x tp {cfg.tp} = {cfg.world} devices"
         + (f"; routed experts split ep {cfg.ep} ways ({p.facts.experts // cfg.ep} of {p.facts.experts} per rank)"
            if p.facts.experts else "")
         + (f"; context parallel by {CP_METHODS[cfg.cp_method]} (Ulysses {cfg.ulysses} x ring {cfg.cp // cfg.ulysses})"
            if cfg.cp > 1 else ""), cfg.world),
        ("config", "configuration", cfg.label() + f"; {cfg.dtype}, attention {cfg.attention}, loss {cfg.loss}",
         cfg.to_str()),
        ("batch", "batch", f"{p.batch['global']} sequences x {p.batch['seq_len']} tokens; micro-batch {p.batch['micro']}, "
                           f"{p.batch['microbatches']} micro-batches per step", p.batch["global"]),
        ("step", "each step", words.step, cfg.schedule if cfg.pp > 1 else "accumulate"),
        ("attention", "attention", words.attention, cfg.cp_method),
        ("recompute", "recomputation", words.recompute, [s["recompute"] for s in p.stages]),
        ("step_s", "predicted step time", fmt_s(e["step_s"]), e["step_s"]),
        ("tokens_per_s", "tokens/s", f"{e['tokens_per_s']:,.0f}", e["tokens_per_s"]),
        ("mfu", "MFU", f"{e['mfu'] * 100:.1f}%", e["mfu"]),
        ("tflops_per_device", "model TFLOP/s per device", f"{e.get('tflops_per_device', 0):.1f}",
         e.get("tflops_per_device", 0)),
        ("peak_memory_gib", "peak memory", f"{max(e.get('memory_gib') or [0]):.2f} of {e.get('capacity_gib', 0):.2f} GiB",
         max(e.get("memory_gib") or [0])),
        ("source", "source of the figures", src_txt, src),
        ("calibration", "calibration", e.get("calibration", "uncalibrated"), e.get("calibration", "uncalibrated")),
    ]
    if e.get("stage_devices"):  # mixed devices: which stages sit on which devices, or the dp ranks' shares
        title, text = devices_text(cfg, p.stages, e["stage_devices"])
        rows.insert(next(i for i, row in enumerate(rows) if row[0] == "degrees") + 1,
                    ("stage_devices", title, text, cfg.dp_shares or e["stage_devices"]))
    if e.get("wan"):  # after the batch: where the mesh crosses the links between cluster groups
        rows.insert(next(i for i, row in enumerate(rows) if row[0] == "batch") + 1,
                    ("wan", "across the WAN", "; ".join(wan_words(e["wan"])), e["wan"]))
    if (threads := threads_text(p)) is not None:  # after the degrees: how many threads each rank runs
        after_degrees = next(i for i, row in enumerate(rows) if row[0] == "degrees") + 1
        rows.insert(after_degrees, ("threads", "threads per rank", threads, cfg.threads))
    if (docs := documents_text(p)) is not None:  # after the batch: what its rows hold
        after_batch = next(i for i, row in enumerate(rows) if row[0] == "batch") + 1
        rows.insert(after_batch, ("documents", "documents (--seq-lens)", docs, p.batch["documents"].get("documents")))
        if (pb := per_batch_text(p)) is not None:
            rows.insert(after_batch + 1, ("per_batch", "per-batch assignment (--per-batch)", pb,
                                          p.batch["per_batch"].get("chosen")))
    if (mm := p.batch.get("multimodal")) is not None:  # after the batch: its samples over the dp ranks
        after_batch = next(i for i, row in enumerate(rows) if row[0] == "batch") + 1
        rows.insert(after_batch, ("multimodal", "samples over dp ranks (--images-per-sample)", multimodal_text(mm),
                                  mm.get("chosen")))
    if p.search.get("fix"):  # after the configuration: what of it the user pinned
        after_config = next(i for i, row in enumerate(rows) if row[0] == "config") + 1
        rows.insert(after_config, ("fix", "pinned (--fix)", f"{p.search['fix']} (the search kept to these and chose the rest)",
                        p.search["fix"]))
    return rows


def stage_rows(r: Report) -> list[dict[str, Any]]:
    p, e = r.plan, r.est
    m = p.batch["microbatches"]
    out = []
    for j, s in enumerate(p.stages):
        f, b = e["stage_fwd_s"][j], e["stage_bwd_s"][j]
        rank = s["rank"]
        out.append({"stage": j, "rank": rank, "chunk": s["chunk"], "first": s["layers"][0], "last": s["layers"][-1],
                    "n_layers": len(s["layers"]), "recompute": s["recompute"], "fwd_s": f, "bwd_s": b,
                    "step_compute_s": m * (f + b), "memory_gib": e["memory_gib"][rank]})
    return out


def layer_span(s: dict[str, Any]) -> str:
    return f'{s["first"]} … {s["last"]}' if s["n_layers"] > 1 else s["first"]


def warnings(r: Report) -> list[str]:
    """Things in the plan or the run log that the reader should not miss."""
    e, out = r.est, []
    if e.get("mfu", 0) > 1:
        out.append(f"MFU {e['mfu'] * 100:.0f}% is above 100%: the estimated compute time implies more FLOP/s than "
                   f"the peak the cluster description gives {r.plan.cluster.get('device')}; measure the cluster "
                   "with `autopar profile` or correct its peak")
    if e.get("fits") is False:
        out.append("the plan does not fit in memory on at least one stage")
    if r.run and r.run["memory"] and len(r.run["memory"]) != r.plan.config.world:
        out.append(f"the run log reports {len(r.run['memory'])} ranks but the plan has {r.plan.config.world}: "
                   "is it the log of this plan's program?")
    return out


def breakdown_parts(r: Report) -> list[tuple[str, float]]:
    bd = r.est.get("breakdown", {})
    return [(k, float(bd.get(k, 0.0))) for k in TIME_PARTS if k in bd]


PART_DESC = {"compute": "compute (busiest pipeline rank)", "recompute": "activation recomputation",
              "tp_comm": "exposed TP communication", "cp_comm": "exposed CP communication",
              "ep_comm": "expert all-to-all (dispatch, combine)",
              "runtime": "CPU runtime work (data-parallel wrappers)",
              "p2p": "pipeline send/recv", "bubble": "pipeline bubble", "dp_comm": "exposed DP communication",
              "sync": "the step's scalar all-reduces (loss, gradient norm)", "optimizer": "optimizer step"}


def mesh_groups(plan: Plan) -> list[str]:
    """One line per mesh dimension: its group stride and whether its groups cross nodes."""
    cfg = plan.config
    dpn = int(plan.cluster.get("devices_per_node", 1) or 1)
    lines = []
    stride = 1
    for dim, deg in (("tp", cfg.tp), ("cp", cfg.cp), ("dp", cfg.dp), ("pp", cfg.pp)):
        if deg > 1:
            block = stride * deg
            if block <= dpn and dpn % block == 0:
                where = "inside one node"
            elif stride >= dpn:
                where = f"each member on a different node, {deg} nodes per group"
            else:
                where = f"spanning {-(-block // dpn)} nodes"
            lines.append(f"{dim}={deg}: groups of ranks {stride} apart ({where})")
        else:
            lines.append(f"{dim}=1: no groups")
        stride *= deg
    if cfg.ulysses > 1:  # Ulysses groups: consecutive cp ranks (codegen/runtime/context_parallel.cp_rank)
        block = cfg.ulysses * cfg.tp
        where = "inside one node" if block <= dpn and dpn % block == 0 else f"spanning {-(-block // dpn)} nodes"
        ring = cfg.cp // cfg.ulysses
        lines.append(f"cp={cfg.cp} = Ulysses {cfg.ulysses} x ring {ring}: all-to-all groups of {cfg.ulysses} "
                     f"consecutive cp ranks ({where})" + (f", ring across {ring} of them" if ring > 1 else ""))
    if cfg.cp > 1 and (traffic := cp_traffic(plan)):
        lines.append(traffic)
    if cfg.ep > 1:  # expert parallelism: consecutive dp x cp x tp ranks (ParallelConfig.expert_mesh)
        block = cfg.ep
        where = "inside one node" if block <= dpn and dpn % block == 0 else f"spanning {-(-block // dpn)} nodes"
        ranks = "dp x cp x tp" if cfg.tp > 1 else "dp x cp"
        lines.append(f"ep={cfg.ep}: groups of {cfg.ep} consecutive {ranks} ranks ({where}) exchange tokens; the "
                     f"experts' data-parallel groups have {cfg.expert_mesh[0]} ranks")
    return lines


def cp_traffic(plan: Plan) -> str | None:
    """What context parallelism moves per attention layer and micro-batch on one rank (the
    largest attention of the model's facts; ``cost_models/context_parallel.py``), or None
    when the plan does not record the heads."""
    from cost_models.context_parallel import ring_step_bytes, ulysses_bytes
    from planner.graph import AttentionDims

    cfg, f = plan.config, plan.facts
    if not f.heads or not f.hidden:
        return None
    heads, kv = max(f.heads), max(f.kv_heads or f.heads)
    seq = int(plan.batch.get("seq_len", f.seq_len) or f.seq_len)
    a = AttentionDims(heads, kv, f.hidden // heads, seq, seq, True)
    ring = cfg.cp // cfg.ulysses
    parts = [f"all-to-alls {ulysses_bytes(a, cfg) / 2**20:.1f} MiB forward (again backward)"] if cfg.ulysses > 1 else []
    if ring > 1:
        parts.append(f"{ring - 1} ring steps of {ring_step_bytes(a, cfg) / 2**20:.1f} MiB (K, V; twice backward)")
    return f"cp traffic per attention layer and micro-batch: {', '.join(parts)}"


def stage_nodes(plan: Plan) -> list[tuple[int, int, int]]:
    cfg = plan.config
    dpn = int(plan.cluster.get("devices_per_node", 1) or 1)
    inner = cfg.dp * cfg.cp * cfg.tp
    return [(s, s * inner // dpn, ((s + 1) * inner - 1) // dpn) for s in range(cfg.pp)]
