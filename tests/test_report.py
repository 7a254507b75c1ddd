"""`autopar report`: HTML (structure, numbers, offline, headless Chromium), Markdown,
Perfetto trace, terminal text, run-log comparison, atomic and refused writes."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser

import pytest

from cost_models.cluster import parse_cluster
from planner.entry.cli import main
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Plan, PlanError
from planner.search.planning import build_plan, evaluate_config, plan_model
from planner.report.render import build_report, render_html, render_markdown, trace_events, write_reports

SECTIONS = ("summary", "mesh", "stages", "memory", "timeline", "breakdown", "alternatives", "rejected", "layers")
SVGS = ("mesh-svg", "memory-svg", "timeline-svg", "breakdown-svg")


# ---------------------------------------------------------------------- plans

@pytest.fixture(scope="module")
def plan_files(tmp_path_factory):
    """The two reference plans of the issue plus two pipelined ones (interleaved, zero bubble)."""
    d = tmp_path_factory.mktemp("plans")
    out = {}
    plan, _ = plan_model(load_graph("llama3-70b", batch=1, seq_len=8192), parse_cluster("dgx-h100:128"), 1024,
                         spec="llama3-70b", cluster_spec="dgx-h100:128")
    out["llama3-70b"] = plan
    plan, _ = plan_model(load_graph("mllm-small", batch=1), parse_cluster("local-cpu:4"), 8,
                         spec="mllm-small", cluster_spec="local-cpu:4")
    out["mllm-small"] = plan
    g, c = load_graph("llama-tiny", batch=1, seq_len=128), parse_cluster("local-cpu:4")
    for name, cfg, gb in (("interleaved", "dp=1,pp=2,tp=2,schedule=interleaved-1f1b,vpp=2,zero=zero1,sp=on", 8),
                          ("zb-h1", "dp=1,pp=4,schedule=zb-h1", 8),
                          ("many-mb", "dp=2,pp=2,schedule=1f1b", 512)):
        e, _ = evaluate_config(g, c, ParallelConfig.parse(cfg), gb, even_split=True)
        out[name] = build_plan(g, c, e, spec="llama-tiny", cluster_spec="local-cpu:4")
    paths = {}
    for k, p in out.items():
        paths[k] = str(d / f"{k}.json")
        p.save(paths[k])
    return paths


class _Collect(HTMLParser):
    """Every element's attributes, by id and by class."""

    def __init__(self):
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.by_class: dict[str, list[dict]] = {}
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        a["_tag"] = tag
        if "id" in a:
            self.by_id[a["id"]] = a
        for c in (a.get("class") or "").split():
            self.by_class.setdefault(c, []).append(a)
        for k in ("src", "href", "xlink:href", "action"):
            if a.get(k):
                self.urls.append(a[k])


def _parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    return p


# ---------------------------------------------------------------------- HTML structure

@pytest.mark.parametrize("name", ["llama3-70b", "mllm-small", "interleaved"])
def test_html_sections_and_numbers(plan_files, name):
    plan = Plan.load(plan_files[name])
    t0 = time.perf_counter()
    r = build_report(plan)
    html = render_html(r)
    dt = time.perf_counter() - t0
    print(f"\n[bench] report {name}: build + render {dt:.3f} s, {len(html) / 1024:.0f} KiB of HTML")
    doc = _parse(html)
    for sid in SECTIONS + SVGS + ("capacity-line", "stage-table", "memory-table", "breakdown-table", "layer-table"):
        assert sid in doc.by_id, f"missing #{sid}"
    e = plan.estimate
    assert float(doc.by_id["sum-step_s"]["data-value"]) == e["step_s"]
    assert float(doc.by_id["card-step_s"]["data-value"]) == e["step_s"]
    assert float(doc.by_id["sum-mfu"]["data-value"]) == e["mfu"]
    assert float(doc.by_id["sum-tokens_per_s"]["data-value"]) == e["tokens_per_s"]
    assert doc.by_id["sum-source"]["data-value"] == e["source"]
    assert int(doc.by_id["card-world"]["data-value"]) == plan.config.world
    # each stage's memory, in the stage table, the memory table and the chart
    stages = doc.by_class["stage-row"]
    assert len(stages) == len(plan.stages) == plan.config.pp * plan.config.vpp
    for row, s in zip(stages, plan.stages):
        assert int(row["data-rank"]) == s["rank"]
        assert float(row["data-memory-gib"]) == e["memory_gib"][s["rank"]]
    mem = doc.by_class["mem-row"]
    assert [float(x["data-total-gib"]) for x in mem] == e["memory_gib"]
    bars = doc.by_class["mem-bar"]
    assert [float(x["data-total-gib"]) for x in bars] == pytest.approx(e["memory_gib"], rel=1e-4)
    assert float(doc.by_id["capacity-line"]["data-capacity-gib"]) == pytest.approx(e["capacity_gib"])
    # breakdown: every part, summing to the step
    parts = {x["data-part"]: float(x["data-seconds"]) for x in doc.by_class["bd-row"]}
    assert parts == e["breakdown"]
    assert sum(parts.values()) == pytest.approx(e["step_s"], rel=1e-4)
    # alternatives, rejected groups, layers, mesh
    assert [float(x["data-step-s"]) for x in doc.by_class.get("alt-row", [])] == [a["step_s"] for a in plan.alternatives]
    assert sum(int(x["data-count"]) for x in doc.by_class.get("rej-group", [])) == \
        sum(v["count"] for v in plan.rejected.values())
    assert len(doc.by_class["layer-row"]) == len(plan.model["layers"])
    devs = doc.by_class["dev"]
    assert devs and all(0 <= int(d["data-pp"]) < plan.config.pp for d in devs)
    assert len(doc.by_class["ev"]) == len(r.timeline.result.events)
    # offline: no URL anywhere but the SVG namespace; nothing loaded from outside
    assert doc.urls == []
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= {"http://www.w3.org/2000/svg"}
    assert "@import" not in html and "url(" not in html


def test_huge_cluster_mesh_is_summarized(plan_files):
    plan = Plan.load(plan_files["llama3-70b"])
    doc = _parse(render_html(build_report(plan, layers=False)))
    assert 0 < len(doc.by_class["dev"]) <= 32            # first nodes only, not 1024 cells
    assert "mesh-stage-nodes" in doc.by_id
    assert "rejected" in doc.by_id
    html = render_html(build_report(plan, layers=False))
    assert "why not tp=16" in html and "why not pp=128" in html


def test_timeline_caps_many_microbatches(plan_files):
    plan = Plan.load(plan_files["many-mb"])
    assert plan.batch["microbatches"] > 64
    r = build_report(plan, layers=False)
    assert r.timeline.m == 4 * plan.config.pp and r.timeline.m_plan == plan.batch["microbatches"]
    doc = _parse(render_html(r))
    assert int(doc.by_id["timeline-caption"]["data-m"]) == r.timeline.m
    assert "draws the first" in render_html(r)


def test_layer_table_falls_back_to_names(plan_files, tmp_path):
    d = json.load(open(plan_files["mllm-small"]))
    d["model"]["spec"] = "no-such-model-preset"
    p = tmp_path / "p.json"
    p.write_text(json.dumps(d))
    r = build_report(Plan.load(str(p)))
    assert "layer names only" in r.layers_note and len(r.layers) == len(d["model"]["layers"])
    assert len(_parse(render_html(r)).by_class["layer-row"]) == len(d["model"]["layers"])


# ---------------------------------------------------------------------- trace

def _check_trace(doc: dict, pp: int, vpp: int) -> list[dict]:
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    names = {}
    tracks: dict[tuple, list[dict]] = {}
    for ev in doc["traceEvents"]:
        for k in ("name", "ph", "ts", "pid", "tid"):
            assert k in ev, f"{k} missing in {ev}"
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
        if ev["ph"] == "M":
            if ev["name"] == "process_name":
                names[ev["pid"]] = ev["args"]["name"]
            continue
        assert ev["ph"] == "X", ev
        assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
        tracks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    assert set(names) == set(range(pp)) and all(names[r] == f"pp rank {r}" for r in range(pp))
    assert {k[0] for k in tracks} == set(range(pp))
    assert {k[1] for k in tracks} <= set(range(vpp))
    xs = []
    for key, evs in tracks.items():   # in file order: monotone, non-overlapping
        for a, b in zip(evs, evs[1:]):
            assert b["ts"] >= a["ts"], f"track {key}: timestamps go back"
            assert b["ts"] >= a["ts"] + a["dur"] - 1e-9, f"track {key}: {a} overlaps {b}"
        xs += evs
    return xs


@pytest.mark.parametrize("name", ["interleaved", "zb-h1", "mllm-small", "llama3-70b"])
def test_trace_is_valid_trace_event_json(plan_files, name):
    plan = Plan.load(plan_files[name])
    r = build_report(plan, layers=False)
    doc = json.loads(json.dumps(trace_events(r)))
    xs = _check_trace(doc, plan.config.pp, plan.config.vpp)
    res = r.timeline.result
    assert len([x for x in xs if x["cat"] in ("forward", "backward", "input grad", "weight grad")]) == len(res.events)
    end = max(x["ts"] + x["dur"] for x in xs)
    assert end == pytest.approx(plan.estimate["step_s"] * 1e6, rel=0.02)   # pipeline + DP tail + optimizer
    if name == "zb-h1":
        assert any(x["name"].startswith("W ") for x in xs)
    if name == "interleaved":
        assert {x["tid"] for x in xs} == {0, 1}


# ---------------------------------------------------------------------- markdown, text, CLI

def test_markdown_has_the_essentials(plan_files):
    plan = Plan.load(plan_files["llama3-70b"])
    md = render_markdown(build_report(plan, layers=False))
    for h in ("#### Stages", "#### Time breakdown", "#### Alternatives", "#### Rejected"):
        assert h in md
    assert f"{plan.estimate['mfu'] * 100:.1f}%" in md
    assert plan.alternatives[0]["label"] in md
    assert "why not tp=16" in md
    assert all(line.count("|") >= 3 for line in md.splitlines() if line.startswith("|"))


def test_cli_writes_refuses_and_forces(plan_files, tmp_path, capsys):
    plan = plan_files["interleaved"]
    html, md, tr = (str(tmp_path / n) for n in ("r.html", "r.md", "t.json"))
    assert main(["report", plan, "-o", html, "--md", md, "--trace", tr]) == 0
    for p in (html, md, tr):
        assert os.path.getsize(p) > 0
    os.remove(html)
    open(md, "w").write("keep me")
    assert main(["report", plan, "-o", html, "--md", md]) == 2
    assert "exists" in capsys.readouterr().err and open(md).read() == "keep me"
    assert not os.path.exists(html)                     # refused before anything was written
    assert main(["report", plan, "-o", html, "--md", md, "--force"]) == 0
    assert open(md).read().startswith("### autopar plan")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("bad_md,says", [
    ("a_file/r.md", "is a file, not a folder"),   # the parent of --md cannot be made
    ("a_folder", "is a folder"),                  # --md names a folder
    ("r.html", "two outputs name"),               # --md is the HTML file too
])
def test_cli_checks_every_output_before_writing_any(plan_files, tmp_path, capsys, bad_md, says):
    """A refused --md (or --trace) leaves the HTML unwritten: every output is checked first."""
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    html = str(tmp_path / "r.html")
    assert main(["report", plan_files["interleaved"], "-o", html, "--md", str(tmp_path / bad_md), "--force"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert not os.path.exists(html)
    assert main(["report", plan_files["interleaved"], "--trace", str(tmp_path / "t.json"), "-o", html,
                 "--md", str(tmp_path / bad_md), "--force"]) == 2
    assert not os.path.exists(tmp_path / "t.json") and not os.path.exists(html)


def test_cli_text(plan_files, capsys):
    assert main(["report", plan_files["mllm-small"], "--text"]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(plan_files["mllm-small"])
    assert "predicted step time" in out and "time breakdown" in out and "alternatives" in out
    assert plan.alternatives[0]["label"] in out
    assert main(["report", "/nonexistent/plan.json", "--text"]) == 2


def test_run_log_side_by_side(plan_files, tmp_path):
    plan = Plan.load(plan_files["mllm-small"])
    log = tmp_path / "train_log.jsonl"
    steps = [30.0, 20.0, 5.0, 7.0, 6.0]      # median after 2 warm-up steps: 6.0
    with open(log, "w") as f:
        for i, s in enumerate(steps):
            f.write(json.dumps({"step": i + 1, "loss": 10 - i, "step_s": s,
                                "memory_gib": [1.0 + i * 0.1, 2.0, 3.0, 4.0 - i * 0.1]}) + "\n")
    r = build_report(plan, run_log=str(log), layers=False)
    assert r.run["measured_step_s"] == 6.0 and r.run["predicted_step_s"] == plan.estimate["step_s"]
    assert [m["measured_gib"] for m in r.run["memory"]] == pytest.approx([1.4, 2.0, 3.0, 4.0])
    doc = _parse(render_html(r))
    assert "measured" in doc.by_id
    assert float(doc.by_id["measured-step"]["data-measured"]) == 6.0
    assert float(doc.by_id["measured-step"]["data-predicted"]) == plan.estimate["step_s"]
    assert len(doc.by_class["measured-mem"]) == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n')
    with pytest.raises(PlanError, match="line 1"):
        build_report(plan, run_log=str(bad), layers=False)


# ---------------------------------------------------------------------- headless Chromium

def _chromium(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    return subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
                           "--no-first-run", "--disable-extensions", f"--user-data-dir={cwd}/profile", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium not on PATH (Debian: apt-get install -y chromium)")
@pytest.mark.parametrize("name", ["llama3-70b", "mllm-small"])
def test_html_renders_in_headless_chromium(plan_files, tmp_path, name):
    html = str(tmp_path / f"report-{name}.html")
    t0 = time.perf_counter()
    write_reports(plan_files[name], html=html)
    print(f"\n[bench] report {name}: plan file -> report.html in {time.perf_counter() - t0:.3f} s")
    url = "file://" + html
    dom = _chromium(["--dump-dom", url], str(tmp_path))
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r"<body[^>]*>", dom.stdout)
    assert m, dom.stdout[:500]
    body = m.group(0)
    assert 'data-rendered="ok"' in body, "the page's script did not run to the end"
    n_svg = int(re.search(r'data-svg-count="(\d+)"', body).group(1))
    assert n_svg >= 4 and f'data-svg-ok="{n_svg}"' in body, f"an SVG chart has an empty box: {body}"
    errs = re.search(r'<pre id="js-errors">(.*?)</pre>', dom.stdout, re.S)
    assert errs is not None and errs.group(1).strip() == "", errs.group(1) if errs else dom.stdout[:500]
    shot = str(tmp_path / f"report-{name}.png")
    run = _chromium([f"--screenshot={shot}", "--window-size=1400,3000", url], str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    for out in (dom, run):
        console = [l for l in out.stderr.splitlines() if ":CONSOLE" in l or "Uncaught" in l or "Refused to" in l]
        assert not console, "\n".join(console)
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(shot) > 20_000
    keep = os.environ.get("AUTOPAR_REPORT_SCREENSHOTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, os.path.join(keep, os.path.basename(shot)))
    print(f"[report] screenshot {shot}", file=sys.stderr)
