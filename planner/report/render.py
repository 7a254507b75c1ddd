"""Plan inspection: ``autopar report plan.json``.

From a plan file (and optionally the metrics log of a run of its program) this writes

- ``report.html``: one self-contained page (inline CSS and SVG, no network) with the
  summary, the mesh on the nodes, the stage table, memory against capacity, the
  pipeline timeline of one step, the time breakdown, alternatives, rejected
  configurations, the layer table and, with a run log, predicted against measured;
- ``report.md``: the same essentials as Markdown for a pull request or an issue;
- ``trace.json``: the simulated step as Chrome / Perfetto trace events;
- a terminal summary (rich) with ``--text``.

The timeline is re-simulated from the plan's per-stage times (``cost_models.pipeline``);
the layer table is re-captured from ``model.spec`` on meta tensors when possible. What is
shown is computed in planner/report/data.py; this module renders it.
"""
from __future__ import annotations

import json
from html import escape
from typing import Any

from planner.files import check_outputs, write_atomic
from planner.plan import Plan
from planner.report import svg
from planner.report.data import (
    GiB, MEM_CATS, MAX_MESH_DEVICES, Report, fmt_s, fmt_n, rejected_groups, why_not_degrees, build_report,
    summary_rows, stage_rows, layer_span, warnings, breakdown_parts, PART_DESC, mesh_groups, stage_nodes)


# ====================================================================== HTML

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1280px;
color:#222;padding:0 16px;line-height:1.4}
h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin:0 0 12px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:grid;grid-template-columns:repeat(4,minmax(0,1fr));gap:10px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:8px;padding:10px 12px;background:#fafafa}
.card .k{color:#666;font-size:12px}.card .v{font-size:22px;font-weight:600}
dl.sum{display:grid;grid-template-columns:220px 1fr;gap:2px 12px;margin:6px 0}dl.sum dt{color:#555}dl.sum dd{margin:0}
.note{color:#666;font-size:13px}.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:4px;
vertical-align:-1px}
details{margin:4px 0}summary{cursor:pointer}code{background:#f3f4f6;padding:0 3px;border-radius:3px}
.bad{color:#b00}.good{color:#070}
#js-errors:empty{display:none}#js-errors{color:#b00;border:1px solid #b00;padding:6px}
"""

# Collects any script error into the DOM (the headless-browser test reads it back) and
# marks the page rendered once every chart has a non-empty box.
_JS = """
(function(){var errs=[];function show(){var el=document.getElementById('js-errors');if(el)el.textContent=errs.join('\\n');}
window.addEventListener('error',function(e){errs.push('error: '+e.message);show();});
window.addEventListener('unhandledrejection',function(e){errs.push('rejection: '+e.reason);show();});
var ce=console.error;console.error=function(){errs.push('console.error: '+Array.prototype.join.call(arguments,' '));show();
return ce.apply(console,arguments);};
window.addEventListener('DOMContentLoaded',function(){var svgs=document.querySelectorAll('svg'),ok=0;
for(var i=0;i<svgs.length;i++){var b=svgs[i].getBBox();if(b.width>0&&b.height>0)ok++;}
document.body.setAttribute('data-svg-count',String(svgs.length));document.body.setAttribute('data-svg-ok',String(ok));
document.body.setAttribute('data-rendered','ok');show();});})();
"""


def _td(text: Any, num: bool = False, attrs: str = "") -> str:
    return f'<td{" class=num" if num else ""}{(" " + attrs) if attrs else ""}>{escape(str(text))}</td>'


def _table(head: list[str], rows: list[str], tid: str = "") -> str:
    h = "".join(f"<th>{escape(x)}</th>" for x in head)
    return f'<table{f" id={tid!r}" if tid else ""}><thead><tr>{h}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _sec(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>{body}</section>'


def _summary_html(r: Report) -> str:
    e = r.est
    cfg = r.plan.config
    cards = [("predicted step time", fmt_s(e["step_s"]), "step_s", e["step_s"]),
             ("tokens/s", f"{e['tokens_per_s']:,.0f}", "tokens_per_s", e["tokens_per_s"]),
             ("MFU", f"{e['mfu'] * 100:.1f}%", "mfu", e["mfu"]),
             ("degrees dp·pp·cp·tp", f"{cfg.dp}·{cfg.pp}·{cfg.cp}·{cfg.tp}", "world", cfg.world)]
    cards_html = "".join(f'<div class="card"><div class="k">{escape(k)}</div><div class="v" id="card-{key}" '
                         f'data-value="{escape(str(raw))}">{escape(v)}</div></div>' for k, v, key, raw in cards)
    dl = "".join(f'<dt>{escape(lab)}</dt><dd id="sum-{key}" data-value="{escape(str(raw), quote=True)}">{escape(txt)}</dd>'
                 for key, lab, txt, raw in summary_rows(r))
    return _sec("summary", "Summary", f'<div class="cards">{cards_html}</div><dl class="sum">{dl}</dl>')


def _mesh_html(r: Report) -> str:
    p = r.plan
    cfg = r.plan.config
    nodes = int(p.cluster.get("nodes", 1) or 1)
    dpn = int(p.cluster.get("devices_per_node", 1) or 1)
    max_nodes = max(1, MAX_MESH_DEVICES // dpn)
    mesh_body = [f'<p class="sub">Mesh order [pp, dp, cp, tp], outer to inner: global rank = '
                 f'((pp·{cfg.dp} + dp)·{cfg.cp} + cp)·{cfg.tp} + tp; node = rank // {dpn}. Colour: pp stage.</p>',
                 svg.mesh_svg(cfg, nodes, dpn, max_nodes),
                 "<ul>" + "".join(f"<li>{escape(x)}</li>" for x in mesh_groups(p)) + "</ul>"]
    sn = stage_nodes(p)
    rows = [f'<tr>{_td(s)}<td><span class="swatch" style="background:{svg.stage_color(s)}"></span>'
            f'nodes {a}–{b}</td>{_td(b - a + 1, True)}</tr>' for s, a, b in sn[:64]]
    if len(sn) > 64:
        rows.append(f"<tr><td colspan=3>… {len(sn) - 64} more stages</td></tr>")
    mesh_body.append(_table(["pp stage", "nodes", "node count"], rows, "mesh-stage-nodes"))
    return _sec("mesh", "Mesh on the nodes", "".join(mesh_body))


def _stages_html(r: Report) -> str:
    p = r.plan
    cfg = r.plan.config
    rows = []
    for s in stage_rows(r):
        rows.append(f'<tr class="stage-row" data-stage="{s["stage"]}" data-rank="{s["rank"]}" '
                    f'data-memory-gib="{s["memory_gib"]}" data-fwd-s="{s["fwd_s"]}" data-bwd-s="{s["bwd_s"]}">'
                    + _td(s["stage"], True) + _td(s["rank"], True) + _td(s["chunk"], True)
                    + _td(layer_span(s))
                    + _td(s["n_layers"], True) + _td(s["recompute"]) + _td(fmt_s(s["fwd_s"]), True)
                    + _td(fmt_s(s["bwd_s"]), True) + _td(fmt_s(s["step_compute_s"]), True)
                    + _td(f'{s["memory_gib"]:.2f}', True) + "</tr>")
    head = ["virtual stage", "pp rank", "chunk", "layers", "#", "recompute", "fwd / micro-batch",
            "bwd / micro-batch", "busy per step", "rank memory GiB"]
    split = f" Stage split: {escape(p.search['split'])}." if p.search.get("split") else ""
    return (_sec("stages", "Pipeline stages", _table(head, rows, "stage-table") +
                      f'<p class="note">{p.batch["microbatches"]} micro-batches per step; '
                      f'schedule {cfg.schedule if cfg.pp > 1 else "none (pp = 1)"}'
                      f'{f", {cfg.vpp} chunks per rank" if cfg.vpp > 1 else ""}.{split}</p>'))


def _memory_html(r: Report) -> str:
    p = r.plan
    e = r.est
    mem = e.get("memory") or []
    rows = []
    for rank, m in enumerate(mem):
        rows.append(f'<tr class="mem-row" data-rank="{rank}" data-total-gib="{e["memory_gib"][rank]}">' + _td(rank, True)
                    + "".join(_td(f"{m.get(c, 0) / GiB:.2f}", True) for c in MEM_CATS)
                    + _td(f'{e["memory_gib"][rank]:.2f}', True) + _td(m.get("inflight", ""), True) + "</tr>")
    return (_sec("memory", "Memory per pipeline rank",
                      svg.memory_svg(mem, float(e.get("capacity_gib", p.cluster.get("memory_gib", 0)))) +
                      _table(["pp rank", *MEM_CATS, "total", "in-flight micro-batches"], rows, "memory-table")))


def _timeline_html(r: Report) -> str:
    cfg = r.plan.config
    tl = r.timeline
    if tl.result is not None:
        res = tl.result
        if cfg.pp > 1:
            cap = (f"One step, {tl.schedule}, pp {cfg.pp}" + (f", {cfg.vpp} chunks per rank" if cfg.vpp > 1 else "")
                   + f", {tl.m} micro-batches: pipeline {fmt_s(res.step_s)} (bubble {res.bubble_frac * 100:.1f}%), "
                   "then exposed DP communication and the optimizer."
                   + (f" p2p {fmt_s(tl.p2p_s)} per hop." if tl.p2p_s else ""))
        else:
            cap = (f"One step without pipeline (pp = 1): {tl.m} micro-batches of gradient accumulation, forward "
                   f"then backward each ({fmt_s(res.step_s)}), then exposed DP communication and the optimizer.")
        body = (f'<p class="sub" id="timeline-caption" data-m="{tl.m}" data-m-plan="{tl.m_plan}">{escape(cap)} '
                f'{escape(tl.note)}</p>' + svg.timeline_svg(res.events, cfg.pp, cfg.vpp, res.step_s, tl.tail))
    else:
        body = f'<p class="note" id="timeline-caption">{escape(tl.note)}</p>'
    return _sec("timeline", "Pipeline timeline of one step", body)


def _breakdown_html(r: Report) -> str:
    e = r.est
    bparts = breakdown_parts(r)
    total = sum(v for _, v in bparts)
    rows = [f'<tr class="bd-row" data-part="{k}" data-seconds="{v}">' + _td(k) + _td(PART_DESC.get(k, k))
            + _td(fmt_s(v), True) + _td(f"{v / e['step_s'] * 100:.1f}%", True) + "</tr>" for k, v in bparts]
    rows.append("<tr>" + _td("total") + _td("sum of the above") + _td(fmt_s(total), True)
                + _td(f"{total / e['step_s'] * 100:.1f}%", True) + "</tr>")
    return (_sec("breakdown", "Where the step time goes", svg.breakdown_svg(bparts, e["step_s"]) +
                      _table(["part", "what", "seconds", "share of step"], rows, "breakdown-table") +
                      '<p class="note">Compute and TP/CP communication are those of the busiest pipeline rank; '
                      'communication counts only where not overlapped with compute.</p>'))


def _alternatives_html(r: Report) -> str:
    p = r.plan
    rows = [f'<tr class="alt-row" data-step-s="{a["step_s"]}" data-delta-pct="{a["delta_pct"]}">' + _td(i + 1, True)
            + _td(a["label"]) + _td(fmt_s(a["step_s"]), True) + _td(f'{a["delta_pct"]:+.1f}%', True)
            + _td(f'{a["mfu"] * 100:.1f}%', True) + _td(f'{a["memory_gib"]:.1f}', True) + _td(a["why_not"]) + "</tr>"
            for i, a in enumerate(p.alternatives)]
    alt_body = _table(["#", "configuration", "step", "vs plan", "MFU", "peak GiB", "why not"], rows, "alt-table") \
        if rows else '<p class="note">No alternatives recorded.</p>'
    return _sec("alternatives", f"Top {len(p.alternatives)} alternatives", alt_body)


def _rejected_html(r: Report) -> str:
    p = r.plan
    s = p.search
    body = [f'<p class="sub">{s.get("considered", "?")} configurations considered, {s.get("pruned", "?")} pruned by '
            f'bounds, {s.get("estimated", "?")} estimated, {s.get("fully_solved", "?")} fully solved.</p>']
    for fam in rejected_groups(p):
        inner = "".join(f'<li><b>{rr["count"]}</b> × {escape(rr["reason"])}'
                        + (f' <span class="note">e.g. {escape("; ".join(rr["examples"][:3]))}</span>' if rr["examples"] else "")
                        + "</li>" for rr in fam["reasons"])
        body.append(f'<details class="rej-group" data-count="{fam["count"]}"{" open" if len(fam["reasons"]) <= 3 else ""}>'
                    f'<summary><b>{escape(fam["title"])}</b> ({fam["count"]})</summary><ul>{inner}</ul></details>')
    wn = why_not_degrees(p)
    if wn:
        rows = []
        for w in wn:
            alt = w["alternative"]
            reasons = "; ".join(([w["documents"]] if "documents" in w else [])
                                + [f"{k}" for k, _ in sorted(w["reasons"].items(), key=lambda kv: -kv[1])[:3]])
            rows.append("<tr>" + _td(f'why not {w["degree"]}')
                        + _td(f'{alt["label"]}: {alt["delta_pct"]:+.1f}%' if alt else "—") + _td(reasons or "—") + "</tr>")
        body.append("<h3>By degree</h3>" + _table(["question", "best alternative with it", "rejections seen"], rows,
                                                  "why-not-table")
                    + '<p class="note">From the alternatives and the rejection examples the plan records.</p>')
    return _sec("rejected", "Rejected configurations", "".join(body))


def _layers_html(r: Report) -> str:
    rows = []
    full = any("kind" in x for x in r.layers)
    for x in r.layers:
        cells = _td(x["index"], True) + _td(x["name"]) + _td(x["stage"], True)
        if full:
            cells += (_td(x.get("kind", "")) + _td(x.get("module_type", "")) + _td(fmt_n(x.get("params", 0)), True)
                      + _td(fmt_n(x.get("fwd_flops", 0)), True) + _td(fmt_n(x.get("bwd_flops", 0)), True)
                      + _td(f'{x.get("act_bytes", 0) / 2**20:.1f}', True) + _td(x.get("repeat_of", "")))
        rows.append(f'<tr class="layer-row">{cells}</tr>')
    head = ["#", "layer", "stage"] + (["kind", "module", "params", "fwd FLOPs", "bwd FLOPs", "activations MiB",
                                      "repeat of"] if full else [])
    return _sec("layers", "Layers", f'<p class="note">{escape(r.layers_note)}</p>' + _table(head, rows, "layer-table"))


def render_html(r: Report) -> str:
    """The self-contained HTML report: one section per part of the plan (the ``_*_html`` helpers)."""
    p, e, cfg = r.plan, r.est, r.plan.config
    sections = [_summary_html(r), _mesh_html(r), _stages_html(r), _memory_html(r), _timeline_html(r),
                _breakdown_html(r), _alternatives_html(r), _rejected_html(r)]
    if r.run:
        sections.append(_sec("measured", "Predicted and measured", _run_html(r)))
    sections.append(_layers_html(r))
    title = f"autopar plan: {p.model.get('name')} on {p.cluster.get('name')} ({cfg.world} devices)"
    csp = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{escape(title)}</title><style>{_CSS}</style><script>{_JS}</script></head><body>"
            f"<h1>{escape(title)}</h1><p class=\"sub\">{escape(cfg.label())} · predicted {fmt_s(e['step_s'])} per step "
            f"· {escape(str(e.get('source', '')))} estimate</p><pre id=\"js-errors\"></pre>"
            + "".join(f'<p class="bad warning">warning: {escape(w)}</p>' for w in warnings(r))
            + "".join(sections) + "</body></html>\n")


def _run_html(r: Report) -> str:
    c = r.run
    assert c is not None
    rows = [f'<tr id="measured-step" data-predicted="{c["predicted_step_s"]}" data-measured="{c["measured_step_s"]}">'
            + _td("step time") + _td(fmt_s(c["predicted_step_s"]), True) + _td(fmt_s(c["measured_step_s"]), True)
            + _td(f'{c["ratio"]:.2f}', True) + "</tr>"]
    body = _table(["", "predicted", f"measured (median after {c['warmup']} warm-up steps)", "measured / predicted"],
                  rows, "measured-table")
    body += (f'<p class="note">{c["steps"]} steps; measured min {fmt_s(c["measured_min_s"])}, max '
             f'{fmt_s(c["measured_max_s"])}' + (f'; loss {c["first_loss"]:.4f} → {c["last_loss"]:.4f}'
                                                   if c["first_loss"] is not None else "") + ".</p>")
    rows = [f'<tr class="measured-mem" data-rank="{x["rank"]}">' + _td(x["rank"], True) + _td(x["pp"], True)
            + _td("" if x["predicted_gib"] is None else f'{x["predicted_gib"]:.2f}', True)
            + _td(f'{x["measured_gib"]:.2f}', True) + "</tr>" for x in c["memory"]]
    if rows:
        body += _table(["rank", "pp rank", "predicted GiB", "measured peak GiB"], rows, "measured-memory")
        body += ('<p class="note">Predicted: tensors plus reserve on the rank\'s pipeline stage; measured: what the '
                 'program reports (peak device memory, or peak RSS on CPU, which includes the Python process).</p>')
    return body


# ====================================================================== Markdown

def render_markdown(r: Report) -> str:
    p, e, cfg = r.plan, r.est, r.plan.config

    def tbl(head: list[str], rows: list[list[Any]]) -> list[str]:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |" for row in rows]
        return out

    L = [f"### autopar plan: {p.model.get('name')} on {p.cluster.get('name')} ({cfg.world} devices)", ""]
    L += tbl(["", ""], [[lab, txt] for _, lab, txt, _ in summary_rows(r)]) + [""]
    L += [f"> **warning:** {w}" for w in warnings(r)] + ([""] if warnings(r) else [])
    L += ["#### Stages", ""]
    L += tbl(["stage", "pp rank", "chunk", "layers", "#", "recompute", "fwd/mb", "bwd/mb", "rank memory GiB"],
             [[s["stage"], s["rank"], s["chunk"], layer_span(s),
               s["n_layers"], s["recompute"], fmt_s(s["fwd_s"]), fmt_s(s["bwd_s"]), f'{s["memory_gib"]:.2f}']
              for s in stage_rows(r)]) + [""]
    L += ["#### Time breakdown", ""]
    L += tbl(["part", "seconds", "share"], [[PART_DESC.get(k, k), f"{v:.4g}", f"{v / e['step_s'] * 100:.1f}%"]
                                            for k, v in breakdown_parts(r)]) + [""]
    if r.run:
        c = r.run
        L += ["#### Predicted and measured", "",
              f"step time: predicted {fmt_s(c['predicted_step_s'])}, measured median {fmt_s(c['measured_step_s'])} "
              f"(measured/predicted {c['ratio']:.2f}, {c['steps']} steps)", ""]
    if p.alternatives:
        L += ["#### Alternatives", ""]
        L += tbl(["configuration", "step", "vs plan", "MFU", "why not"],
                 [[f"`{a['label']}`", fmt_s(a["step_s"]), f"{a['delta_pct']:+.1f}%", f"{a['mfu'] * 100:.1f}%",
                   a["why_not"]] for a in p.alternatives]) + [""]
    groups = rejected_groups(p)
    if groups:
        L += ["#### Rejected", ""]
        for g in groups:
            ex = g["reasons"][0]["examples"][:2]
            L.append(f"- **{g['title']}** ({g['count']}): " + "; ".join(rr["reason"] for rr in g["reasons"][:3])
                     + (f" (+{len(g['reasons']) - 3} more)" if len(g["reasons"]) > 3 else "")
                     + (f" — e.g. `{ex[0]}`" if ex else ""))
        L.append("")
    L.append(f"<sub>{e.get('source', '')} estimate; written by `autopar report`</sub>")
    return "\n".join(L) + "\n"


# ====================================================================== trace

def trace_events(r: Report) -> dict[str, Any]:
    """Chrome / Perfetto trace-event JSON of the simulated step: pid = pp rank, tid = chunk."""
    cfg, tl = r.plan.config, r.timeline
    ev: list[dict[str, Any]] = []
    for rank in range(cfg.pp):
        ev.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
                   "args": {"name": f"pp rank {rank}"}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
                   "args": {"sort_index": rank}})
        for c in range(cfg.vpp):
            ev.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": c, "ts": 0,
                       "args": {"name": f"chunk {c} (stage {c * cfg.pp + rank})"}})
    if tl.result is None:
        return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"note": tl.note}}

    def us(t: float) -> int:
        return round(t * 1e9)  # integer nanoseconds, so adjacent events stay adjacent after rounding

    xs = []
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    for e in tl.result.events:
        a, b = us(e.start), us(e.end)
        xs.append({"name": f"{e.kind} mb{e.mb}", "cat": names.get(e.kind, e.kind), "ph": "X", "pid": e.rank,
                   "tid": e.chunk, "ts": a / 1000, "dur": (b - a) / 1000,
                   "args": {"stage": e.stage, "chunk": e.chunk, "microbatch": e.mb}})
    t0 = us(tl.result.step_s)
    for name, dur in tl.tail:
        if dur <= 0:
            continue
        t1 = t0 + us(dur)
        for rank in range(cfg.pp):
            xs.append({"name": name, "cat": name, "ph": "X", "pid": rank, "tid": 0, "ts": t0 / 1000,
                       "dur": (t1 - t0) / 1000, "args": {"note": "after the pipeline"}})
        t0 = t1
    xs.sort(key=lambda x: (x["pid"], x["tid"], x["ts"]))
    return {"traceEvents": ev + xs, "displayTimeUnit": "ms",
            "otherData": {"model": r.plan.model.get("name"), "config": cfg.label(), "schedule": tl.schedule,
                          "microbatches_simulated": tl.m, "microbatches_planned": tl.m_plan,
                          "predicted_step_s": r.est["step_s"], "note": tl.note}}


# ====================================================================== terminal

def print_text(r: Report, con: Any) -> None:
    from rich.table import Table

    p, e = r.plan, r.est
    t = Table(title=f"{p.model.get('name')} on {p.cluster.get('name')}", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    for _, lab, txt, _ in summary_rows(r):
        t.add_row(lab, txt)
    con.print(t)
    for w in warnings(r):
        con.print(f"[yellow]warning[/yellow]: {w}")
    t = Table(title="stages")
    for c in ("stage", "rank", "chunk", "layers", "#", "recompute", "fwd/mb", "bwd/mb", "memory GiB"):
        t.add_column(c, justify="left" if c in ("layers", "recompute") else "right")
    for s in stage_rows(r):
        t.add_row(str(s["stage"]), str(s["rank"]), str(s["chunk"]), layer_span(s),
                  str(s["n_layers"]), s["recompute"], fmt_s(s["fwd_s"]), fmt_s(s["bwd_s"]), f'{s["memory_gib"]:.2f}')
    con.print(t)
    t = Table(title="time breakdown")
    for c in ("part", "seconds", "share"):
        t.add_column(c, justify="left" if c == "part" else "right")
    for k, v in breakdown_parts(r):
        t.add_row(PART_DESC.get(k, k), f"{v:.4g}", f"{v / e['step_s'] * 100:.1f}%")
    con.print(t)
    if r.timeline.result is not None:
        res = r.timeline.result
        con.print(f"pipeline ({r.timeline.schedule}, {r.timeline.m} micro-batches simulated): "
                  f"{fmt_s(res.step_s)}, bubble {res.bubble_frac * 100:.1f}%  {r.timeline.note}")
    if p.alternatives:
        t = Table(title="alternatives")
        for c in ("configuration", "step", "vs plan", "why not"):
            t.add_column(c)
        for a in p.alternatives:
            t.add_row(a["label"], fmt_s(a["step_s"]), f"{a['delta_pct']:+.1f}%", a["why_not"])
        con.print(t)
    groups = rejected_groups(p)
    if groups:
        t = Table(title="rejected")
        t.add_column("why not")
        t.add_column("count", justify="right")
        t.add_column("reasons")
        for g in groups[:15]:
            t.add_row(g["title"], str(g["count"]), "; ".join(rr["reason"] for rr in g["reasons"][:2])
                      + (" …" if len(g["reasons"]) > 2 else ""))
        con.print(t)
    if r.run:
        c = r.run
        con.print(f"measured: median step {fmt_s(c['measured_step_s'])} after {c['warmup']} warm-up steps vs "
                  f"predicted {fmt_s(c['predicted_step_s'])} (ratio {c['ratio']:.2f})")


# ====================================================================== entry point

def write_reports(plan_path: str, *, html: str | None = None, md: str | None = None, trace: str | None = None,
                  run_log: str | None = None, force: bool = False, layers: bool = True) -> Report:
    """Build the report of ``plan_path`` and write the requested files (atomic). Every output
    is checked first (``planner.files.check_outputs``: existing without ``force``, a parent
    that cannot be written), so a refused one leaves the others unwritten too."""
    check_outputs([x for x in (html, md, trace) if x], force)
    plan = Plan.load(plan_path)
    r = build_report(plan, run_log=run_log, layers=layers and bool(html))
    if html:
        write_atomic(html, render_html(r), force=force)
    if md:
        write_atomic(md, render_markdown(r), force=force)
    if trace:
        write_atomic(trace, json.dumps(trace_events(r), separators=(",", ":")) + "\n", force=force)
    return r
