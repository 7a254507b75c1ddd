"""Inline SVG charts for ``planner/report/render.py``: the mesh grid, memory per stage, the
pipeline timeline and the time breakdown.

Everything is generated here as text (no plotting library, no scripts, no external
fonts), so the report stays one self-contained file that works offline. Each chart
carries ``<title>`` tooltips and ``data-*`` attributes with the exact figures, which the
tests read back.
"""
from __future__ import annotations

from html import escape
from typing import Any, Sequence

# pp stages: distinguishable, colour-blind-friendly-ish (Tableau 10, then lighter variants)
STAGE_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                "#9c755f", "#bab0ac", "#86bcb6", "#f1ce63", "#a0cbe8", "#ffbe7d", "#8cd17d", "#d4a6c8")
MEM_COLORS = {"weights": "#4e79a7", "grads": "#a0cbe8", "optimizer": "#f28e2b", "activations": "#59a14f",
              "buffers": "#b07aa1", "reserve": "#bab0ac"}
TIME_COLORS = {"compute": "#4e79a7", "recompute": "#a0cbe8", "tp_comm": "#f28e2b", "cp_comm": "#ffbe7d",
               "p2p": "#e15759", "bubble": "#d3d3d3", "dp_comm": "#b07aa1", "optimizer": "#9c755f"}
KIND_COLORS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#edc948"}
FONT = "font-family:system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif"
GiB = 2**30


def stage_color(i: int) -> str:
    return STAGE_COLORS[i % len(STAGE_COLORS)]


def _a(v: Any) -> str:
    return escape(str(v), quote=True)


def _svg(width: float, height: float, body: list[str], sid: str, label: str) -> str:
    return (f'<svg id="{sid}" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{_a(label)}" '
            f'width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
            f'style="{FONT};font-size:12px;max-width:100%;height:auto">' + "".join(body) + "</svg>")


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 12, fill: str = "#222",
          weight: str = "normal") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" fill="{fill}" '
            f'font-weight="{weight}">{escape(s)}</text>')


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "", extra: str = "",
          stroke: str = "none") -> str:
    t = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{h:.2f}" fill="{fill}" '
            f'stroke="{stroke}" {extra}>{t}</rect>')


def _ticks(vmax: float, n: int = 5) -> list[float]:
    """Round tick values from 0 to at least vmax."""
    if vmax <= 0:
        return [0.0, 1.0]
    import math

    raw = vmax / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    k = math.ceil(vmax / step - 1e-9)
    return [i * step for i in range(k + 1)]


def _fmt_t(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


# ---------------------------------------------------------------------- mesh grid

def mesh_svg(cfg: Any, nodes: int, dpn: int, max_nodes: int) -> str:
    """Nodes (rows) x devices (columns), coloured by pp stage, labelled with dp/cp/tp."""
    shown = min(nodes, max_nodes)
    cw = max(56.0, min(120.0, 1100.0 / max(dpn, 1)))
    ch, lw, gap = 46.0, 78.0, 6.0
    width = lw + dpn * cw + 10
    height = 24 + shown * (ch + gap) + (22 if shown < nodes else 0) + 30
    body = [_text(lw, 14, "device →", size=11, fill="#555")]
    inner = cfg.dp * cfg.cp * cfg.tp
    for n in range(shown):
        y = 22 + n * (ch + gap)
        body.append(_text(lw - 8, y + ch / 2 + 4, f"node {n}", anchor="end", weight="bold"))
        for d in range(dpn):
            g = n * dpn + d
            if g >= cfg.world:
                continue
            pp, rest = divmod(g, inner)
            dp, rest = divmod(rest, cfg.cp * cfg.tp)
            cp, tp = divmod(rest, cfg.tp)
            x = lw + d * cw
            title = f"rank {g}: node {n} device {d}; pp {pp}, dp {dp}, cp {cp}, tp {tp}"
            body.append(_rect(x + 1, y, cw - 2, ch, stage_color(pp), title, stroke="#fff",
                              extra=f'rx="4" class="dev" data-rank="{g}" data-pp="{pp}" data-dp="{dp}" '
                                    f'data-cp="{cp}" data-tp="{tp}"'))
            small = cw < 90
            body.append(_text(x + cw / 2, y + 16, f"pp{pp} · r{g}", "middle", 10 if small else 11, "#fff", "bold"))
            lab = f"dp{dp} cp{cp} tp{tp}"
            body.append(_text(x + cw / 2, y + 33, lab, "middle", 9 if small else 11, "#fff"))
    y = 22 + shown * (ch + gap)
    if shown < nodes:
        body.append(_text(lw, y + 12, f"… nodes {shown}–{nodes - 1} not drawn ({nodes} nodes, "
                                      f"{nodes * dpn} devices in all; the pattern repeats, see the table below)",
                          size=12, fill="#555"))
        y += 22
    x = lw
    for s in range(min(cfg.pp, 16)):
        body.append(_rect(x, y + 6, 12, 12, stage_color(s)))
        body.append(_text(x + 16, y + 16, f"pp stage {s}", size=11))
        x += 90
    if cfg.pp > 16:
        body.append(_text(x, y + 16, f"… ({cfg.pp} stages; colours repeat)", size=11))
    return _svg(max(width, x + 200), height, body, "mesh-svg", "device mesh on the nodes")


# ---------------------------------------------------------------------- memory bars

def memory_svg(memory: Sequence[dict], capacity_gib: float) -> str:
    """Stacked bars per pp rank (GiB) with a dashed capacity line."""
    cats = list(MEM_COLORS)
    n = len(memory)
    totals = [sum(m.get(c, 0.0) for c in cats) / GiB for m in memory]
    vmax = max([capacity_gib, *totals]) * 1.08
    ticks = _ticks(vmax)
    vmax = ticks[-1]
    bw = max(14.0, min(70.0, 900.0 / max(n, 1) * 0.7))
    step = max(bw / 0.7, 240.0 / max(n, 1))
    left, top, ph = 60.0, 20.0, 280.0
    width = left + n * step + 150
    height = top + ph + 50
    y_of = lambda v: top + ph - v / vmax * ph  # noqa: E731
    body = []
    for t in ticks:
        body.append(f'<line x1="{left}" x2="{left + n * step}" y1="{y_of(t):.1f}" y2="{y_of(t):.1f}" '
                    f'stroke="#e5e5e5"/>')
        body.append(_text(left - 6, y_of(t) + 4, f"{t:g}", "end", 11, "#555"))
    body.append(_text(14, top + ph / 2, "GiB", "middle", 11, "#555"))
    for r, m in enumerate(memory):
        x = left + r * step + (step - bw) / 2
        acc = 0.0
        for c in cats:
            v = m.get(c, 0.0) / GiB
            if v <= 0:
                continue
            body.append(_rect(x, y_of(acc + v), bw, y_of(acc) - y_of(acc + v), MEM_COLORS[c],
                              f"pp rank {r}: {c} {v:.2f} GiB"))
            acc += v
        body.append(f'<g class="mem-bar" data-rank="{r}" data-total-gib="{totals[r]:.6g}"></g>')
        if n <= 24 or r % max(1, n // 16) == 0:
            body.append(_text(x + bw / 2, top + ph + 16, str(r), "middle", 11))
            if bw >= 40:
                body.append(_text(x + bw / 2, y_of(totals[r]) - 4, f"{totals[r]:.1f}", "middle", 10, "#333"))
    body.append(_text(left + n * step / 2, top + ph + 34, "pipeline rank", "middle", 11, "#555"))
    yc = y_of(capacity_gib)
    body.append(f'<line id="capacity-line" data-capacity-gib="{capacity_gib:.6g}" x1="{left}" '
                f'x2="{left + n * step}" y1="{yc:.1f}" y2="{yc:.1f}" stroke="#c00" stroke-width="2" '
                f'stroke-dasharray="6 4"><title>capacity {capacity_gib:.2f} GiB</title></line>')
    lx = left + n * step + 16
    body.append(_text(left + 4, yc - 5, f"capacity {capacity_gib:.1f} GiB", size=11, fill="#c00", weight="bold"))
    for i, c in enumerate(reversed(cats)):
        yy = top + 10 + i * 18
        body.append(_rect(lx, yy, 12, 12, MEM_COLORS[c]))
        body.append(_text(lx + 16, yy + 10, c, size=11))
    return _svg(width, height, body, "memory-svg", "memory per pipeline rank against capacity")


# ---------------------------------------------------------------------- timeline

def timeline_svg(events: Sequence[Any], p: int, v: int, pipe_s: float, tail: Sequence[tuple[str, float]],
                 width: float = 1240.0) -> str:
    """Gantt of one simulated step: one row per (pp rank, chunk); F blue, B green, W yellow;
    after the pipeline, the exposed DP communication and the optimizer step."""
    rows = p * v
    left, top, rh = 110.0, 26.0, 22.0
    total = pipe_s + sum(t for _, t in tail)
    total = total if total > 0 else 1.0
    pw = width - left - 20
    x_of = lambda t: left + t / total * pw  # noqa: E731
    height = top + rows * (rh + 4) + 58
    body = []
    for t in _ticks(total, 8):
        if t > total * 1.0001:
            break
        body.append(f'<line x1="{x_of(t):.1f}" x2="{x_of(t):.1f}" y1="{top - 4}" y2="{top + rows * (rh + 4)}" '
                    f'stroke="#eee"/>')
        body.append(_text(x_of(t), top - 8, _fmt_t(t), "middle", 10, "#555"))
    for r in range(p):
        for c in range(v):
            y = top + (r * v + c) * (rh + 4)
            lab = f"rank {r}" + (f" · chunk {c}" if v > 1 else "")
            body.append(_text(left - 8, y + rh / 2 + 4, lab, "end", 11))
            body.append(_rect(left, y, pw, rh, "#f7f7f7"))
    for e in events:
        y = top + (e.rank * v + e.chunk) * (rh + 4)
        x0, x1 = x_of(e.start), x_of(e.end)
        color = KIND_COLORS.get(e.kind, "#999")
        if v > 1 and e.chunk % 2 == 1:
            extra_op = ' fill-opacity="0.7"'
        else:
            extra_op = ""
        body.append(_rect(x0, y, max(x1 - x0, 0.5), rh, color,
                          f"{e.kind} mb {e.mb} · stage {e.stage} (rank {e.rank}, chunk {e.chunk}): "
                          f"{_fmt_t(e.start)} → {_fmt_t(e.end)}",
                          extra=f'class="ev" data-kind="{e.kind}" data-rank="{e.rank}"{extra_op}', stroke="#fff"))
        if x1 - x0 > 16:
            body.append(_text((x0 + x1) / 2, y + rh / 2 + 4, str(e.mb), "middle", 10, "#fff"))
    t0 = pipe_s
    tail_colors = {"dp_comm": TIME_COLORS["dp_comm"], "optimizer": TIME_COLORS["optimizer"]}
    for name, dur in tail:
        if dur <= 0:
            continue
        for r in range(p):
            for c in range(v):
                y = top + (r * v + c) * (rh + 4)
                body.append(_rect(x_of(t0), y, max(x_of(t0 + dur) - x_of(t0), 0.5), rh, tail_colors.get(name, "#999"),
                                  f"{name.replace('_', ' ')} (after the pipeline): {_fmt_t(dur)}"))
        t0 += dur
    y = top + rows * (rh + 4) + 14
    x = left
    for lab, col in (("F forward", KIND_COLORS["F"]), ("B backward", KIND_COLORS["B"]),
                     ("I input grad", KIND_COLORS["I"]), ("W weight grad", KIND_COLORS["W"]), ("DP comm (exposed)", TIME_COLORS["dp_comm"]),
                     ("optimizer", TIME_COLORS["optimizer"])):
        body.append(_rect(x, y, 12, 12, col))
        body.append(_text(x + 16, y + 10, lab, size=11))
        x += 150
    body.append(_text(left, y + 32, "numbers in the bars: micro-batch; hover for times", size=11, fill="#666"))
    return _svg(width, height, body, "timeline-svg", "pipeline timeline of one step")


# ---------------------------------------------------------------------- breakdown

def breakdown_svg(parts: Sequence[tuple[str, float]], step_s: float, width: float = 1000.0) -> str:
    """One horizontal bar: the step split into compute, exposed communication, bubble, optimizer."""
    left, top, bh = 10.0, 10.0, 34.0
    total = sum(v for _, v in parts) or 1.0
    pw = width - 2 * left
    body = []
    x = left
    for k, v in parts:
        if v <= 0:
            continue
        w = v / total * pw
        body.append(_rect(x, top, w, bh, TIME_COLORS.get(k, "#999"),
                          f"{k.replace('_', ' ')}: {_fmt_t(v)} ({v / step_s * 100:.1f}% of the step)",
                          extra=f'class="bd" data-part="{k}" data-seconds="{v:.6g}"', stroke="#fff"))
        if w > 60:
            body.append(_text(x + w / 2, top + bh / 2 + 4, f"{k.replace('_', ' ')} {v / step_s * 100:.0f}%",
                              "middle", 11, "#fff", "bold"))
        x += w
    y = top + bh + 16
    x = left
    for k, _ in parts:
        body.append(_rect(x, y, 12, 12, TIME_COLORS.get(k, "#999")))
        body.append(_text(x + 16, y + 10, k.replace("_", " "), size=11))
        x += 118
    return _svg(width, y + 24, body, "breakdown-svg", "time breakdown of one step")
