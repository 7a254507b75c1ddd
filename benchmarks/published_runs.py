"""The GPU cost model against published training runs (the development set).

Every run of the development set (``benchmarks/published/published_runs_dev.json``, a
copy of the team's ``shared/data/published_runs_dev.json``) that autopar can express is
priced at its published layout with ``evaluate_config`` (what ``autopar evaluate``
calls) and compared with its published throughput on the run's own counting basis:

- a run that gives its iteration time is compared on step time;
- one that gives tokens/s per GPU, on tokens/s (the step's tokens / step time);
- one that gives only TFLOP/s per GPU, on TFLOP/s counted the way its paper counts
  them (SC'21: Eq. 3 of Narayanan et al., which includes the recomputed forward).

On each basis the error is ``predicted throughput / published throughput - 1``
(positive: predicted too fast). Printed: per run, the median absolute error, the share
within 25 %, per source; with ``--fit`` also the fitted coefficients and the
leave-one-source-out errors (every source predicted by a fit on the other sources); with
``--plan``, autopar's own pick for each job, priced by the same model, over the published
layout (>= 1.0: at least as fast under the model) and how often the degrees match.

Tiers: *exact* runs are expressed faithfully and make the headline figures;
*approximate* ones (marked ~) ran on a runtime whose behaviour autopar's does not
describe (DeepSpeed's 2021 ZeRO-3; torchtitan's per-layer selective checkpointing, which
autopar's recompute policies are not; its per-op policy is autopar's ``selective-op``) and are
printed, with the figures over all runs beside the headline. Stage splits are even
(the published runs split layers evenly).

How a run is expressed (``express``), and what is assumed where a source is silent:
- zoo architectures: "GPT" -> gpt (GELU MLP, learned positions, untied head),
  Llama -> llama (SwiGLU, GQA, RoPE); sizes from the run;
- clusters: A100 runs on the ``dgx-a100-80g`` preset (MegaScale's "Ampere" GPUs are
  taken as A100 80 GB: its MFU figures use the A100's 312 TFLOP/s); torchtitan's H100s
  are 96 GB parts at 500 W: ``benchmarks/published/h100-96g-500w.toml``;
- torchtitan rows that do not state a sequence length: 8192, the length of
  torchtitan's Llama 3 training configs (their MFU figures match it);
- a global batch not stated: micro-batch x dp (torchtitan accumulates nothing by default);
- recompute not stated: full for SC'21 (its Eq. 3 counts the recomputed forward),
  selective otherwise; torchtitan's "selective" without an option: its default, per-op
  (``selective-op``); sequence parallel not stated: on when tp > 1; optimizer
  sharding not stated: ddp for SC'21 (Megatron had no distributed optimizer then),
  zero1 (Megatron's distributed optimizer) for later Megatron runs.
Skipped, with the reason printed: FP8 runs (autopar has no fp8 training),
torch.compile runs (autopar runs eager), MegaScale's own system (parallel blocks,
sliding-window attention and LAMB are not a zoo architecture).

    python -m benchmarks.published_runs [--fit] [--plan] [--out benchmarks/results/published_runs.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results import write_json  # noqa: E402
from cost_models.cluster import Cluster, load_preset  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "published", "published_runs_dev.json")  # a copy of shared/data's development set
H100_500W = os.path.join(HERE, "published", "h100-96g-500w.toml")
TORCHTITAN_SEQ = 8192


@dataclass
class Case:
    """One published run, expressed in autopar's terms."""
    run_id: str
    source: str
    model: dict[str, Any]          # ModelConfig keys
    cluster: str                   # preset name or TOML path
    nodes: int
    cfg: ParallelConfig
    global_batch: int
    metric: str                    # iteration_time | tokens_per_s | tflops_eq3
    published: float               # in the metric's unit (s, tokens/s per GPU, TFLOP/s per GPU)
    assumptions: list[str] = field(default_factory=list)


def source_of(run: dict) -> str:
    p = run["source_paper"]
    return "torchtitan" if "torchtitan" in p else ("MegaScale" if "MegaScale" in p else "SC21")


def approx_reason(run: dict) -> str | None:
    """Why autopar can price ``run`` only approximately: its runtime differs from autopar's
    in a way the cost model does not describe (None when the expression is faithful)."""
    if "DeepSpeed" in (run.get("zero_or_dist_optimizer") or ""):
        return "DeepSpeed ZeRO-3 (2021) priced as autopar's FSDP2"
    if source_of(run) == "torchtitan" and "layer" in (run.get("activation_recompute") or ""):
        return "torchtitan's per-layer selective checkpointing (every other block) priced as autopar's selective"
    return None


def skip_reason(run: dict) -> str | None:
    """Why autopar cannot express ``run`` (None when it can)."""
    if "FP8" in (run.get("precision") or "").upper():
        return "FP8 training: autopar has no fp8 mode"
    if "compile" in (run.get("notes") or "") or "compile" in run["id"]:
        return "torch.compile: autopar runs eager"
    if "parallel transformer block" in run["arch"]:
        return "parallel blocks + sliding-window attention + LAMB: not a zoo architecture"
    return None


def _model(run: dict, seq: int) -> dict[str, Any]:
    h, heads = run["hidden_size"], run["num_attention_heads"]
    llama = "SwiGLU" in run["arch"]
    return {"name": run["model_name"].replace(" ", "-").lower(), "arch": "llama" if llama else "gpt",
            "layers": run["num_layers"], "hidden": h, "ffn_hidden": run["ffn_hidden_size"] or 4 * h,
            "heads": heads, "kv_heads": run["num_kv_heads"] or heads, "vocab": run["vocab_size"],
            "seq_len": seq, "tie_embeddings": False, **({"rope_theta": 500000.0} if llama else {})}


def express(run: dict) -> Case | str:
    """The run as a Case, or the reason it cannot be expressed."""
    why = skip_reason(run)
    if why:
        return why
    src, notes = source_of(run), []
    seq = run["seq_length"]
    if seq is None:
        seq = TORCHTITAN_SEQ
        notes.append(f"seq {seq} (torchtitan default)")
    tp, pp, dp, cp = run["tp"], run["pp"], run["dp"], run["cp"] or 1
    mbs = run["micro_batch_size"] or 1
    if run["micro_batch_size"] is None:
        notes.append("mbs 1")
    gb = run["global_batch_size_seqs"]
    if gb is None:
        gb = mbs * dp
        notes.append(f"global batch {gb} = mbs x dp")
    opt = (run.get("zero_or_dist_optimizer") or "").lower()
    if "zero-3" in opt or "fsdp" in opt:
        zero = "fsdp"
    elif src == "SC21":
        zero = "ddp"
    else:
        zero = "zero1"
        notes.append("distributed optimizer (zero1)")
    rc_text = (run.get("activation_recompute") or "").lower()
    if rc_text.startswith("full") or (src == "SC21"):
        recompute = "full"
    elif src == "torchtitan" and "selective" in rc_text and "layer" not in rc_text:
        recompute = "selective-op"  # torchtitan's per-op policy (its default selective option, "op")
        if "op" not in rc_text:
            notes.append("selective = torchtitan's default option, op")
    elif "selective" in rc_text:
        recompute = "selective"
    else:
        recompute = "selective"
        notes.append("selective recompute")
    sp = run["sequence_parallel"]
    if sp is None:
        sp = tp > 1
        if sp:
            notes.append("sequence parallel")
    vpp = run["virtual_pipeline_stages"] or 1
    sched = "interleaved-1f1b" if vpp > 1 else "1f1b"
    cfg = ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, mbs=mbs, schedule=sched, vpp=vpp, zero=zero,
                         recompute=recompute, sp=bool(sp and tp > 1), dtype="bf16")
    gpu = run["gpu_type"] or ""
    cluster = H100_500W if gpu.startswith("H100") else "dgx-a100-80g"
    if "Ampere" in gpu:
        notes.append("A100 80GB")
    if run.get("iteration_time_s"):
        metric, value = "iteration_time", float(run["iteration_time_s"])
    elif run.get("tokens_per_sec_per_gpu"):
        metric, value = "tokens_per_s", float(run["tokens_per_sec_per_gpu"])
    else:
        metric, value = "tflops_eq3", float(run["tflops_per_gpu"])
    n = run["num_gpus"]
    return Case(run["id"], src, _model(run, seq), cluster, n // 8, cfg, gb, metric, value, notes)


def eq3_flops(model: dict[str, Any], batch: int) -> float:
    """FLOPs of one step as Narayanan et al. (SC'21) count them, Eq. 3:
    96 B s l h^2 (1 + s / 6h + V / 16 l h) (forward, recomputed forward and backward)."""
    s, l, h, v = model["seq_len"], model["layers"], model["hidden"], model["vocab"]
    return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def published_step_s(c: Case) -> float:
    """The published throughput as a step time for ``c``'s global batch."""
    if c.metric == "iteration_time":
        return c.published
    n = c.cfg.world
    if c.metric == "tokens_per_s":
        return c.global_batch * c.model["seq_len"] / (c.published * n)
    return eq3_flops(c.model, c.global_batch) / (c.published * 1e12 * n)


def cluster_for(c: Case) -> Cluster:
    cl = Cluster.from_toml(c.cluster) if c.cluster.endswith(".toml") else load_preset(c.cluster)
    cl.nodes = c.nodes
    return cl


class Graphs:
    """Captured graphs by model (ModelConfig keys), each captured once."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def get(self, model: dict[str, Any]):
        from planner.frontend.load import graph_of_config
        from planner.zoo import ModelConfig

        key = json.dumps(model, sort_keys=True)
        if key not in self.cache:
            self.cache[key] = graph_of_config(ModelConfig(**model))
        return self.cache[key]


FIT_KEYS = ("gpu.gemm_eff_max", "gpu.attn_eff_max", "gpu.mem_eff", "overlap")
OVERLAP_DOCUMENTED = 0.8  # the DP-overlap prior (cost_models/estimate.py OVERLAP)


def predict(c: Case, graphs: Graphs, cal: dict[str, float] | None = None) -> dict[str, Any]:
    """Price ``c`` at its published layout with an even stage split (the published runs split
    layers evenly), with the defaults or the coefficients ``cal``."""
    from cost_models.calibrate import with_calibration
    from planner.search.planning import evaluate_config

    cluster = cluster_for(c)
    profile = with_calibration(None, cal, cluster) if cal else None  # an empty profile carrying the coefficients
    e, problems = evaluate_config(graphs.get(c.model), cluster, c.cfg, c.global_batch, even_split=True,
                                  profile=profile)
    pub = published_step_s(c)
    return {"step_s": e.step_s, "published_step_s": pub, "error": pub / e.step_s - 1.0, "fits": e.fits,
            "memory_gib": max(m.total for m in e.memory) / 2**30, "problems": problems,
            "breakdown": e.breakdown, "mfu": e.mfu}


def fit(cases: list[Case], graphs: Graphs) -> dict[str, float]:
    """Coefficients minimising the mean squared log error of step time over ``cases``, with a
    weak prior (0.1 per unit log) pulling each to its documented figure (never to a value
    fitted on other runs, so held-out errors are honest)."""
    from cost_models.calibrate import nelder_mead
    from cost_models.gpu_kernels import DOCUMENTED as d

    x0 = [math.log(d.gemm_eff_max), math.log(d.attn_eff_max), math.log(d.mem_eff), math.log(OVERLAP_DOCUMENTED)]

    def cal_of(x: list[float]) -> dict[str, float]:
        return {k: min(math.exp(v), 1.0) for k, v in zip(FIT_KEYS, x)}

    def loss(x: list[float]) -> float:
        cal = cal_of(x)
        errs = [math.log(predict(c, graphs, cal)["step_s"] / published_step_s(c)) for c in cases]
        return sum(e * e for e in errs) / len(errs) + 0.01 * sum((a - b) ** 2 for a, b in zip(x, x0))

    x, _ = nelder_mead(loss, x0, step=0.2, iters=200)
    return cal_of(x)


def summary(errors: list[float]) -> dict[str, float]:
    a = [abs(x) for x in errors]
    return {"n": len(a), "median_abs": statistics.median(a) if a else math.nan,
            "within_25": sum(x <= 0.25 for x in a) / len(a) if a else math.nan,
            "max_abs": max(a) if a else math.nan}


def _fmt(s: dict[str, float]) -> str:
    return (f"n={s['n']:<3} median |err| {s['median_abs'] * 100:5.1f}%   within 25%: {s['within_25'] * 100:3.0f}%"
            f"   max {s['max_abs'] * 100:.1f}%")


def plan_against(c: Case, graphs: Graphs) -> dict[str, Any]:
    """autopar's pick for the same job, priced by the same model as the published layout."""
    from planner.search.planning import plan_model

    g, cl = graphs.get(c.model), cluster_for(c)
    plan, res = plan_model(g, cl, c.global_batch, spec=c.model["name"], cluster_spec=cl.name)
    ours = res.best
    theirs = predict(c, graphs)["step_s"]
    deg = ("dp", "pp", "cp", "tp")
    return {"pick": ours.config.label(), "speedup": theirs / ours.step_s,
            "degrees_match": all(getattr(ours.config, k) == getattr(c.cfg, k) for k in deg)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--fit", action="store_true", help="fit the coefficients and print leave-one-source-out errors")
    ap.add_argument("--plan", action="store_true", help="plan every exactly expressed job and compare picks")
    ap.add_argument("--out", default="benchmarks/results/published_runs.json")
    args = ap.parse_args()
    runs = json.load(open(args.data, encoding="utf-8"))["runs"]
    graphs = Graphs()
    cases, tier, skipped = [], {}, []
    for run in runs:
        c = express(run)
        if isinstance(c, str):
            skipped.append({"id": run["id"], "why": c})
            continue
        cases.append(c)
        tier[c.run_id] = approx_reason(run)
    exact = [c for c in cases if tier[c.run_id] is None]
    rows = []
    for c in cases:
        r = predict(c, graphs)
        rows.append({"id": c.run_id, "source": c.source, "config": c.cfg.label(), "approximate": tier[c.run_id],
                     "assumptions": c.assumptions, **r})
    print(f"{'run':<46}{'layout':<56}{'pub s':>8}{'pred s':>8}{'err':>8}  fits")
    for r in rows:
        print(f"{r['id'] + (' ~' if r['approximate'] else ''):<46}{r['config']:<56}{r['published_step_s']:>8.3g}"
              f"{r['step_s']:>8.3g}{r['error'] * 100:>+7.1f}%  {'yes' if r['fits'] else 'NO'}")
    print(f"skipped {len(skipped)} runs autopar cannot express: " + "; ".join(sorted({s['why'] for s in skipped})))
    print("~ approximate: " + "; ".join(sorted({v for v in tier.values() if v})))
    out: dict[str, Any] = {"rows": rows, "skipped": skipped}
    err = {r["id"]: r["error"] for r in rows}
    out["summary"] = summary([err[c.run_id] for c in exact])
    print("exact runs:         ", _fmt(out["summary"]))
    for src in sorted({c.source for c in exact}):
        print(f"  {src:<18}", _fmt(summary([err[c.run_id] for c in exact if c.source == src])))
    print("exact + approximate:", _fmt(summary(list(err.values()))))
    fits = [r for r in rows if r["fits"]]
    print(f"judged to fit: {len(fits)} of {len(rows)} (exact: {sum(r['fits'] for r in rows if not r['approximate'])}"
          f" of {len(exact)})")
    if args.fit:
        cal = fit(exact, graphs)
        print("fitted on all exact runs:", {k: round(v, 3) for k, v in cal.items()})
        ins = [predict(c, graphs, cal)["error"] for c in exact]
        print("  in-sample:          ", _fmt(summary(ins)))
        held = []
        for src in sorted({c.source for c in exact}):
            train = [c for c in exact if c.source != src]
            cal_src = fit(train, graphs)
            e = [predict(c, graphs, cal_src)["error"] for c in exact if c.source == src]
            held += e
            print(f"  held out {src:<11}", _fmt(summary(e)), {k: round(v, 3) for k, v in cal_src.items()})
        print("  leave-one-source-out:", _fmt(summary(held)))
        out["fit"] = {"coefficients": cal, "in_sample": summary(ins), "leave_one_source_out": summary(held)}
    if args.plan:
        picks = [dict(id=c.run_id, **plan_against(c, graphs)) for c in exact]
        for p in picks:
            print(f"  {p['id']:<44} our pick {p['pick']:<56} {p['speedup']:.3f}x  "
                  f"{'same degrees' if p['degrees_match'] else ''}")
        sp = [p["speedup"] for p in picks]
        print(f"planner vs published layouts: median {statistics.median(sp):.3f}x, min {min(sp):.3f}x, "
              f"degrees match {sum(p['degrees_match'] for p in picks)} of {len(picks)}")
        out["plans"] = picks
    write_json(args.out, out)


if __name__ == "__main__":
    main()
