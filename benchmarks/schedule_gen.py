"""Generated pipeline schedules against the best built-in, in simulation.

For each case (per-stage forward / backward seconds, micro-batches, p2p hop) the table gives the
simulated step of 1f1b, zb-h1 and the generated schedule (planner/search/schedule_gen.py, at
1F1B's activation memory per rank) and the speed-up of what ``best_schedule`` keeps over the best
built-in (>= 1 by construction: the generated one is kept only when faster), and how far the
best built-in is above ``order_floor`` (no order of the same one-stage-per-rank split is faster:
the room any generated order has). Cases: uniform
stages; a heavy last stage (a 256K-vocabulary head: 2.5x a block stage); a heavy first stage (a
MoE's dense first blocks or a vision encoder: 2x); random uneven stages; and the stage times of
the planned pipelines of the presets (benchmarks/plan_speed.py's cases that plan pp > 1).

Second table, vocabulary passes (planner/vocab_passes.py: the head split by vocabulary into one
pipeline stage per pp rank, placement looped(p, 2)). On a fixed one-stage-per-rank split no order
beats ``order_floor``, so a heavy head bounds every schedule; the passes move 1/p of it to every
rank. Per case: the layout's best one-stage-per-rank estimate (the search's split and schedule,
generated or built-in, whole head), the passes under the interleaved 1F1B order, and the passes
under a schedule generated for their stage times within each rank's memory (schedule_gen.generate on
looped(p, 2)); the speed-ups are against the first. Synthetic heavy-head stages, and full estimates
of Llama-3 8B (128K vocabulary) on 64 H100 and a 2B model with an untied 256K head
(benchmarks/vocab256k.toml) on 16 H100, at 8K tokens. The search keeps the passes where they are
faster (planner/search/stage_split.with_generated_schedule).

    python -m benchmarks.schedule_gen [--out benchmarks/results/schedule_gen.json]
"""
from __future__ import annotations

import argparse
import random

from benchmarks.plan_speed import CASES
from benchmarks.results import write_json
from cost_models.pipeline import SplitCost, order_floor, simulate, simulate_schedule
from planner.search.schedule_gen import best_schedule


def synthetic() -> list[tuple[str, list[float], list[float], int, float]]:
    out = []
    for p, m in ((4, 8), (8, 8), (8, 32)):
        out.append((f"uniform p{p} m{m}", [1.0] * p, [2.0] * p, m, 0.02))
        out.append((f"heavy head p{p} m{m}", [1.0] * (p - 1) + [2.5], [2.0] * (p - 1) + [5.0], m, 0.02))
        out.append((f"heavy first p{p} m{m}", [2.0] + [1.0] * (p - 1), [4.0] + [2.0] * (p - 1), m, 0.02))
    rnd = random.Random(0)
    for k in range(6):
        p = rnd.choice((4, 8))
        f = [rnd.uniform(0.5, 2.0) for _ in range(p)]
        out.append((f"random {k} p{p} m{p}", f, [x * rnd.uniform(1.6, 2.4) for x in f], p, 0.05))
    return out


def presets() -> list[tuple[str, list[float], list[float], int, float]]:
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model
    out = []
    for model, cluster, gb, seq in CASES:
        g = load_graph(model, batch=1, seq_len=seq)
        _, res = plan_model(g, parse_cluster(cluster), gb, spec=model, cluster_spec=cluster)
        for e in [res.best] + list(res.alternatives):
            if e.config.pp > 1 and e.config.vpp == 1:
                out.append((f"{model} {e.config.label()}", e.stage_fwd_s, e.stage_bwd_s, e.microbatches, e.p2p_hop_s))
                break
    return out


VOCAB_CASES = [("llama3-8b", "dgx-h100:8", 64, 512, (8, 16, 32)),
               ("benchmarks/vocab256k.toml", "dgx-h100:2", 16, 256, (4, 8, 16))]


def vocab_synthetic() -> list[dict]:
    """Heavy-head stages (the head 1.5x a block stage on the last rank) against the same stages with
    the head as p passes of 1.5/p each."""
    from planner.schedule_ir import looped
    from planner.search.schedule_gen import generate
    rows = []
    for p, m in ((4, 8), (8, 8), (8, 32)):
        f = [1.0] * (p - 1) + [2.5]
        torch = SplitCost(first_whole=True)  # (torch's runtime runs a first stage's split backward whole in W)
        best = min(simulate(s, p, m, f, [2 * x for x in f], p2p=0.02, split=torch).step_s for s in ("1f1b", "zb-h1"))
        vf = [1.0] * p + [1.5 / p] * p
        vb = [2 * x for x in vf]
        il = simulate("interleaved-1f1b", p, m, vf, vb, p2p=0.02, v=2).step_s
        gen = simulate_schedule(generate(vf, vb, m, p2p=0.02, stage_rank=looped(p, 2), split=torch), vf, vb, p2p=0.02,
                                split=torch).step_s
        rows.append({"case": f"heavy head p{p} m{m}", "best_s": best, "interleaved_s": il, "generated_s": gen})
    return rows


def vocab_models() -> list[dict]:
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig
    from planner.search.stage_split import passes_body, split_and_estimate
    from planner.search.vocab_schedule import vocab_pass_estimates
    rows = []
    for model, cluster, world, gb, pps in VOCAB_CASES:
        g, c = load_graph(model, batch=1, seq_len=8192), parse_cluster(cluster)
        for pp in pps:
            cfg = ParallelConfig(dp=world // pp, pp=pp, mbs=1, schedule="1f1b", zero="zero1").validate()
            e, _ = split_and_estimate(g, c, cfg, gb, generate=True, vocab_passes=False)  # the head whole
            v = vocab_pass_estimates(g, c, e, passes_body(g, e.config))
            row = {"case": f"{g.name} {cluster} {e.config.label()}", "best_s": e.step_s, "best_fits": e.fits}
            for k, x in v.items():
                row[f"{k}_s"], row[f"{k}_fits"] = x.step_s, x.fits
            rows.append(row)
    return rows


def print_vocab(rows: list[dict]) -> None:
    print(f"\n{'vocabulary passes: case':62s} {'best':>9s} {'interl.':>9s} {'gener.':>9s} {'x interl.':>9s} {'x gener.':>9s}")
    for r in rows:
        il, gen = r.get("interleaved_s"), r.get("generated_s")
        fit = lambda k: "" if r.get(f"{k}_fits", True) else "*"  # noqa: E731 - * marks a layout over memory
        cell = lambda x, k: f"{x:8.4g}{fit(k)}" if x else f"{'-':>9s}"  # noqa: E731
        print(f"{r['case'][:62]:62s} {r['best_s']:9.4g} {cell(il, 'interleaved'):>9s} {cell(gen, 'generated'):>9s} "
              f"{(r['best_s'] / il if il else float('nan')):9.3f} {(r['best_s'] / gen if gen else float('nan')):9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/schedule_gen.json")
    args = ap.parse_args()
    rows = []
    print(f"{'case':62s} {'1f1b':>9s} {'zb-h1':>9s} {'kept':>9s} {'speed-up':>8s} {'best/floor':>10s}")
    for name, f, b, m, p2p in synthetic() + presets():
        p = len(f)
        one, zb = (simulate(s, p, m, f, b, p2p=p2p).step_s for s in ("1f1b", "zb-h1"))
        c = best_schedule(f, b, m, p2p=p2p)
        row = {"case": name, "p": p, "m": m, "1f1b_s": one, "zb-h1_s": zb, "kept": c.name,
               "kept_s": c.result.step_s, "speedup_vs_best_builtin": min(one, zb) / c.result.step_s,
               "floor_s": order_floor(m, f, b, p2p), "best_builtin_over_floor": min(one, zb) / order_floor(m, f, b, p2p)}
        rows.append(row)
        print(f"{name[:62]:62s} {one:9.4g} {zb:9.4g} {c.name:>9s} {row['speedup_vs_best_builtin']:8.3f} "
              f"{row['best_builtin_over_floor']:10.3f}")
    vocab = vocab_synthetic() + vocab_models()
    print_vocab(vocab)
    write_json(args.out, {"one_stage_per_rank": rows, "vocab_passes": vocab})


if __name__ == "__main__":
    main()
