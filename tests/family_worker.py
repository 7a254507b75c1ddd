"""Worker for tests/test_hf_families.py: transformers causal-LM families under TP and PP (gloo, 4 ranks).

``python -m torch.distributed.run --nproc-per-node 4 tests/family_worker.py OUT.json`` takes
each tiny config of ``tests/hf_configs``, captures it the way ``autopar plan`` does, builds
the layout pp=2 x tp=2 (sequence parallel, the flash kernel and the fused loss where the
model allows them; pp=2 x dp=2 where the planner refuses tensor parallelism) with the
planner's stage split, trains 3 SGD steps, and compares the losses and first-step
gradients with the unmodified model in one process (its own loss). Rank 0 writes JSON:
per family the layout, the model's limits, the errors.
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_worker import NORM, compare  # noqa: E402
from codegen.runtime.mesh import init_distributed  # noqa: E402
from codegen.runtime.train import parallelize  # noqa: E402
from planner.feasibility import default_attention  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402
from model_cases import fitting_problems  # noqa: E402
from worker_io import failure, finish, made_once, report, write_results  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_configs")
FAMILIES = ("qwen2", "phi", "gpt_neox", "gemma2", "cohere", "stablelm", "opt", "phi3", "olmo2", "deepseek_v3",
            "falcon", "bloom")
GB, SEQ, STEPS, LR, SEED = 4, 32, 3, 0.1, 1234


def spec(family: str) -> str:
    return f"hf:{os.path.join(CONFIGS, family + '-tiny.json')}"


def build(family: str, device: str):
    """The family's model on meta, or on ``device`` with the adapter's seeded init."""
    from codegen.runtime.adapters import adapter_for
    from planner import zoo
    ms = zoo.load_model_spec(spec(family))
    model = ms.build("meta")
    if device != "meta":
        ad = adapter_for(model, seq_len=SEQ)
        ad.materialize(ad.units, torch.device(device), SEED)
    return model


def layout_for(facts) -> ParallelConfig:
    """pp2 x tp2 with what the model allows switched on; pp2 x dp2 where tp is refused."""
    base = dict(pp=2, schedule="1f1b", dtype="fp32", mbs=1,
                attention=default_attention(facts.limits),
                loss="eager" if "fused_loss" in facts.limits else "fused")
    cfg = ParallelConfig(tp=2, sp=True, **base)
    if any("sequence parallel" in p for p in fitting_problems(cfg, facts)):
        cfg = cfg.replace(sp=False)
    if fitting_problems(cfg, facts):
        cfg = ParallelConfig(dp=2, **base)
    return cfg


def run(family: str) -> dict:
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import evaluate_config
    from planner.search.candidates import facts_of
    from planner.frontend.tp_layout import tp_layout

    graph = load_graph(spec(family), batch=1, seq_len=SEQ)
    facts = facts_of(graph)
    cfg = layout_for(facts)
    def split():  # the planner's stage split, made on rank 0 (worker_io.made_once)
        est, problems = evaluate_config(graph, parse_cluster("local-cpu:4"), cfg, GB)
        return est.partition.bounds, list(est.partition.recompute), problems

    bounds, recompute, problems = made_once(split)
    names = [l.name for l in graph.layers]
    stages = [names[a:b] for a, b in bounds]
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": (ids := torch.randint(0, graph.vocab or 128, (GB, SEQ), generator=g)), "labels": ids}
            for _ in range(STEPS)]
    ref = build(family, "cpu")
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_losses, ref_grads = [], None
    for s, b in enumerate(data):
        opt.zero_grad()
        loss = ref(input_ids=b["input_ids"], labels=b["labels"], use_cache=False).loss
        loss.backward()
        if s == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
        opt.step()
        ref_losses.append(loss.item())
    pm = parallelize(build(family, "meta"), cfg, stages, recompute, tp_layout(graph), GB, SEQ, "cpu",
                     seed=SEED, facts=facts, optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR))
    t0 = time.perf_counter()
    losses, grads = [], None
    for s, b in enumerate(data):
        losses.append(pm.step(b))
        if s == 0:
            grads = pm.gradients_for_check()
            grads[NORM] = torch.tensor(pm.clip_grad_norm_(None), dtype=torch.float64)  # tied weights once
    return {"config": cfg.label(), "stages": stages, "limits": facts.limits, "problems": problems,
            "losses": losses, "ref_losses": ref_losses, "seconds": time.perf_counter() - t0,
            **compare(grads, ref_grads, losses, ref_losses)}


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    torch.manual_seed(0)
    results = {}
    for family in os.environ.get("AUTOPAR_FAMILIES", ",".join(FAMILIES)).split(","):
        try:
            results[family] = run(family)
        except Exception as exc:  # report, keep going
            results[family] = failure(exc)
        report(family, results[family], 400)
        write_results(results, out)
    finish(results, out)


if __name__ == "__main__":
    main()
