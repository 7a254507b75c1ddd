"""Distributed worker for tests/test_runtime_parity.py (launched by torchrun, gloo on CPU).

``python -m torch.distributed.run --nproc-per-node N tests/dist_worker.py GROUP OUT.json``
runs every layout of GROUP (all of one world size) for every model case of
``tests/model_cases.py`` (the zoo, transformers Llama and GPT-2, a user's plain module)
sequentially in one launch and rank 0 writes JSON results: per (model, layout) the losses
of 3 SGD steps and the max relative error of the first-step gradients and of the losses
against the unmodified model in a single process with the same weights and data. Groups
``mllm`` and ``ckpt`` run the MLLM PP training check and the DCP save -> restart -> resume
check.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from codegen.runtime.mesh import init_distributed  # noqa: E402
from codegen.runtime.train import parallelize  # noqa: E402
from planner import zoo  # noqa: E402
from planner.plan import ParallelConfig
from planner.schedule_file import parse, to_csv
from planner.search.schedule_gen import generate

from model_cases import GB, SEED, SEQ, case, planner_view, refusals, stages_for  # noqa: E402
from worker_io import failure, finish, made_once, report  # noqa: E402

STEPS, LR = 3, 0.1
NORM = "<global grad norm>"  # the key of the first step's global gradient norm among the gradients

# (name, ParallelConfig kwargs, number of virtual stages)
LAYOUTS = {
    2: [
        ("dp2-ddp", dict(dp=2, zero="ddp"), 1),
        ("dp2-zero1", dict(dp=2, zero="zero1"), 1),
        ("dp2-fsdp", dict(dp=2, zero="fsdp"), 1),
        # unequal data-parallel shares (planner/dp_shares.py): one micro-batch of 4 rows, 1 + 3 and 3 + 1
        ("dp2-fsdp-shares", dict(dp=2, mbs=2, zero="fsdp", dp_shares="1+3"), 1),
        ("dp2-ddp-shares", dict(dp=2, mbs=2, zero="ddp", dp_shares="3+1"), 1),
        ("tp2-sp", dict(tp=2, sp=True), 1),
        # TP without SP: each attention / MLP module's column linears share one replicated input
        ("tp2", dict(tp=2), 1),
        ("pp2-gpipe", dict(pp=2, schedule="gpipe"), 2),
        ("pp2-1f1b", dict(pp=2, schedule="1f1b"), 2),
        ("pp2-interleaved-v2", dict(pp=2, schedule="interleaved-1f1b", vpp=2), 4),
        ("pp2-zb-h1", dict(pp=2, schedule="zb-h1"), 2),
        # DualPipeV (2 stages per rank, V-shaped, overlapped F+B steps) and a user's CSV schedule
        ("pp2-dualpipev", dict(pp=2, schedule="dualpipev", vpp=2), 4),
        ("pp2-csv", dict(pp=2, schedule="custom"), 2),
        ("pp2-generated", dict(pp=2, schedule="custom"), 2),
        ("cp2-zigzag", dict(cp=2), 1),
        ("cp2-ulysses", dict(cp=2, ulysses=2), 1),
        # recompute: per-stage policies (selective = attention core, full = whole blocks)
        ("pp2-1f1b-recompute", dict(pp=2, schedule="1f1b", recompute="selective"), 2),
        ("cp2-zigzag-selective", dict(cp=2, recompute="selective"), 1),
        # per-op checkpointing (selective-op): FSDP, and PP with a fully recomputed second stage;
        # refused under a split backward (ZB-H1)
        ("dp2-fsdp-op", dict(dp=2, zero="fsdp", recompute="selective-op"), 1),
        ("pp2-1f1b-op", dict(pp=2, schedule="1f1b", recompute="selective-op"), 2),
        ("pp2-zb-h1-op", dict(pp=2, schedule="zb-h1", recompute="selective-op"), 2),
        # expert parallelism (MoE models only): the experts' data-parallel group of one rank,
        # and refused without sharded data parallelism
        ("dp2-ep2-fsdp", dict(dp=2, ep=2, zero="fsdp"), 1),
        ("dp2-ep2-ddp", dict(dp=2, ep=2, zero="ddp"), 1),
        # EP over the two tp ranks' sequence shards; MoE under TP refused without SP
        ("tp2-ep2-sp", dict(tp=2, sp=True, ep=2), 1),
        ("tp2-ep2-nosp", dict(tp=2, ep=2), 1),
    ],
    4: [
        ("dp2xtp2-fsdp-sp", dict(dp=2, tp=2, sp=True, zero="fsdp"), 1),
        ("dp2xtp2-ddp-sp", dict(dp=2, tp=2, sp=True, zero="ddp"), 1),
        ("pp2xtp2-1f1b-sp", dict(pp=2, tp=2, sp=True, schedule="1f1b"), 2),
        ("pp2xcp2-1f1b", dict(pp=2, cp=2, schedule="1f1b"), 2),
        # four pipeline ranks: zero bubble, a user's CSV schedule; DualPipeV under TP2 + SP
        ("pp4-zb-h1", dict(pp=4, schedule="zb-h1"), 4),
        ("pp4-csv", dict(pp=4, schedule="custom"), 4),
        ("pp4-generated", dict(pp=4, schedule="custom"), 4),
        ("pp2xtp2-dualpipev-sp", dict(pp=2, tp=2, sp=True, schedule="dualpipev", vpp=2), 4),
        # Ulysses CP4, the 2-D hybrid (Ulysses 2 x ring 2), Ulysses with TP2 + SP, PP2 x Ulysses
        ("cp4-ulysses", dict(cp=4, ulysses=4), 1),
        ("cp4-hybrid", dict(cp=4, ulysses=2), 1),
        ("cp2xtp2-ulysses-sp", dict(cp=2, ulysses=2, tp=2, sp=True), 1),
        ("pp2xcp2-ulysses", dict(pp=2, cp=2, ulysses=2, schedule="1f1b"), 2),
        ("dp2xcp2-fsdp", dict(dp=2, cp=2, zero="fsdp"), 1),
        ("dp2xtp2-fsdp-sp-op", dict(dp=2, tp=2, sp=True, zero="fsdp", recompute="selective-op"), 1),
        # expert parallelism: EP4, EP2 with two ranks per expert (FSDP over them; per-op and
        # full recompute), EP4 over dp x cp, PP2 x EP2, and with TP2+SP: EP2 over the tp ranks
        # (FSDP over dp), EP4 over dp x tp and over cp x tp, PP2 x TP2 x EP2
        ("dp4-ep4-fsdp", dict(dp=4, ep=4, zero="fsdp"), 1),
        ("dp4-ep2-fsdp-op", dict(dp=4, ep=2, zero="fsdp", recompute="selective-op"), 1),
        ("dp4-ep2-zero2-full", dict(dp=4, ep=2, zero="zero2", recompute="full"), 1),
        ("dp2xcp2-ep4-fsdp", dict(dp=2, cp=2, ep=4, zero="fsdp"), 1),
        ("pp2xdp2-ep2-fsdp", dict(pp=2, dp=2, ep=2, zero="fsdp", schedule="1f1b"), 2),
        ("dp2xtp2-ep2-sp", dict(dp=2, tp=2, sp=True, ep=2, zero="fsdp"), 1),
        ("dp2xtp2-ep4-sp", dict(dp=2, tp=2, sp=True, ep=4, zero="fsdp"), 1),
        ("cp2xtp2-ep4-sp", dict(cp=2, tp=2, sp=True, ep=4, zero="fsdp"), 1),
        ("pp2xtp2-ep2-sp", dict(pp=2, tp=2, sp=True, ep=2, schedule="1f1b"), 2),
    ],
    8: [
        ("dp2xpp2xtp2-fsdp-sp", dict(dp=2, pp=2, tp=2, sp=True, zero="fsdp", schedule="1f1b"), 2),
        # Ulysses CP4 and the hybrid 2 x 2 with TP2 + SP: 8 and 4 heads split per attention
        ("cp4xtp2-ulysses-sp", dict(cp=4, ulysses=4, tp=2, sp=True), 1),
        ("cp4xtp2-hybrid-sp", dict(cp=4, ulysses=2, tp=2, sp=True), 1),
    ],
}
# user-written schedules (torch's CSV action format) of the ``custom`` layouts, 4 micro-batches:
# split backwards (I then W) mixed with full ones, W's deferred, on 2 and 4 pipeline ranks
CUSTOM_CSV = {
    "pp2-csv": "0F0,0F1,0F2,0I0,0F3,0B1,0W0,0I2,0B3,0W2\n1F0,1I0,1F1,1B1,1W0,1F2,1I2,1F3,1B3,1W2\n",
    "pp4-csv": ("0F0,0F1,0F2,0F3,0I0,0I1,0I2,0I3,0W0,0W1,0W2,0W3\n"
                "1F0,1F1,1F2,1I0,1F3,1I1,1I2,1I3,1W0,1W1,1W2,1W3\n"
                "2F0,2F1,2I0,2F2,2I1,2F3,2I2,2I3,2W0,2W1,2W2,2W3\n"
                "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3\n"),
}
# schedules generated (planner/search/schedule_gen.py) for a heavy last stage (a large head)
CUSTOM_CSV.update({f"pp{p}-generated": to_csv(generate([1.0] * (p - 1) + [2.5], [2.0] * (p - 1) + [5.0], 4))
                   for p in (2, 4)})
MODELS = ("gpt-tiny", "llama-tiny", "hf-llama", "hf-gpt2", "user-lm")
MOE_MODELS = ("moe-tiny", "moe-tiny-skewed", "hf-mixtral")
MODELS_BY_WORLD = {2: MODELS + MOE_MODELS, 4: MODELS + ("gpt-tiny-tied",) + MOE_MODELS,
                   8: ("gpt-tiny", "llama-tiny", "hf-llama", "gpt-tiny-h8")}
# models run under some layouts only: a zoo model built on meta whose head shares the token
# embedding, under PP x TP (the tied weight split over tp and held by two pp ranks)
ONLY_LAYOUTS = {"gpt-tiny-tied": ("pp2xtp2-1f1b-sp",),
                # gpt-tiny with 8 heads (head dim 8): Ulysses 4 x TP2 splits each attention's heads 8 ways
                "gpt-tiny-h8": ("cp4xtp2-ulysses-sp", "cp4xtp2-hybrid-sp"),
                # the zoo MoE (8 experts, top-2, a shared expert, a dense first block): DP, FSDP, PP,
                # CP, TP+SP (the MoE layers on each tp rank's sequence shard), their mix, and EP
                "moe-tiny": ("dp2-ddp", "dp2-fsdp", "pp2-1f1b", "cp2-zigzag", "tp2-sp", "dp2xcp2-fsdp",
                             "dp2xtp2-fsdp-sp", "dp2-ep2-fsdp", "dp2-ep2-ddp", "tp2-ep2-sp", "tp2-ep2-nosp",
                             "dp4-ep4-fsdp", "dp4-ep2-fsdp-op", "dp4-ep2-zero2-full", "dp2xcp2-ep4-fsdp",
                             "pp2xdp2-ep2-fsdp", "dp2xtp2-ep2-sp", "dp2xtp2-ep4-sp", "cp2xtp2-ep4-sp",
                             "pp2xtp2-ep2-sp"),
                # experts 6 and 7 never routed to, uneven loads on the others (model_cases.py)
                "moe-tiny-skewed": ("dp2-ep2-fsdp", "tp2-ep2-sp", "dp4-ep4-fsdp", "dp4-ep2-fsdp-op",
                                    "dp2xcp2-ep4-fsdp", "pp2xdp2-ep2-fsdp", "dp2xtp2-ep4-sp"),
                # transformers' Mixtral, its experts run through ExpertsInterface (reference: its own loop)
                "hf-mixtral": ("dp2-fsdp", "pp2-1f1b", "cp2-zigzag", "tp2-sp", "dp2-ep2-fsdp", "tp2-ep2-sp",
                               "dp4-ep4-fsdp", "dp4-ep2-fsdp-op", "dp2xcp2-ep4-fsdp", "pp2xdp2-ep2-fsdp",
                               "dp2xtp2-ep4-sp")}


def layouts_of(world: int, model_name: str) -> list[tuple[str, dict, int]]:
    """The layouts of ``world`` that ``model_name`` runs."""
    only = ONLY_LAYOUTS.get(model_name)
    if only is None:  # expert parallelism only for the MoE models (the others have no experts to split)
        return [lay for lay in LAYOUTS[world] if "ep" not in lay[1]]
    return [lay for lay in LAYOUTS[world] if lay[0] in only]


def units_of(model) -> list[str]:
    from codegen.runtime.adapters import adapter_for
    return adapter_for(model).units


def even_stages(units: list[str], n: int, blocks: list[str] | None = None) -> list[list[str]]:
    """Blocks split evenly; the units before the first block go to stage 0, after the last to the last.
    ``blocks`` defaults to the zoo's decoder blocks (``layers.<i>``)."""
    blocks = [i for i, u in enumerate(units) if (u in blocks if blocks is not None else u.startswith("layers."))]
    lo, hi = blocks[0], blocks[-1] + 1
    nb = hi - lo
    q, r = divmod(nb, n)
    out, a = [], lo
    for j in range(n):
        b = a + q + (1 if j < r else 0)
        out.append(units[a:b])
        a = b
    out[0] = units[:lo] + out[0]
    out[-1] = out[-1] + units[hi:]
    return out


def batches(cfg, n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(100 + s)
        b = {"input_ids": torch.randint(0, cfg.vocab, (GB, SEQ), generator=g),
             "labels": torch.randint(0, cfg.vocab, (GB, SEQ), generator=g)}
        out.append(b)
    return out


def tp_layout_for(name: str) -> dict[str, str]:
    # The plan carries this dict; the test derives it the way the planner does.
    return planner_view(name)[1]


def reference(cfg, data):
    return case(cfg.name).reference(data, LR)


def run_layout(model_name, cfg_kw, n_virtual, data, schedule=None, policies=None, before_close=None):
    c = case(model_name)
    pc = ParallelConfig(**{"dtype": "fp32", "mbs": 1, **cfg_kw}).validate()
    _, layout, facts = planner_view(model_name)
    stages = stages_for(model_name, n_virtual)
    # a policy other than none alternates with full over the virtual stages, unless given per stage
    if policies is None:
        policies = ["none"] * n_virtual if pc.recompute == "none" else ([pc.recompute, "full"] * n_virtual)[:n_virtual]
    pm = parallelize(c.build(c.parallel_device), pc, stages, policies, layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED, facts=facts,
                     schedule=schedule)
    losses, grads = [], None
    t0 = time.perf_counter()
    for s, b in enumerate(data):
        losses.append(pm.step(b))
        if s == 0:
            grads = pm.gradients_for_check()
            # the global gradient norm clipping would use (each tied parameter counted once)
            grads[NORM] = torch.tensor(pm.clip_grad_norm_(None), dtype=torch.float64)
    dt = time.perf_counter() - t0
    if before_close is not None:  # a test reads the built model (tests/offload_worker.py)
        before_close(pm)
    pm.close()
    return losses, grads, dt


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    """max |a - b| / max |b|; the denominator is floored (at 1e-3 x the largest gradient of
    the model) because some gradients are zero in exact arithmetic (the attention key bias:
    softmax is invariant to it) and hold only rounding noise (~1e-11)."""
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


# packed documents (tests/packed_documents.py) against every document run alone: the flash path
# (the kernels' torch fallback on CPU) and eager SDPA, the ring, Ulysses and the hybrid, with
# TP + SP, DP (two micro-batches per rank), FSDP and PP (the schedules interleave micro-batches;
# recompute restores the documents of its forward)
DOC_LAYOUTS = {
    2: [("dp2-ddp", dict(dp=2, zero="ddp"), 1), ("tp2-sp", dict(tp=2, sp=True), 1),
        ("cp2-zigzag", dict(cp=2), 1), ("cp2-zigzag-eager", dict(cp=2, attention="eager"), 1),
        ("cp2-ulysses", dict(cp=2, ulysses=2), 1), ("cp2-zigzag-selective", dict(cp=2, recompute="selective"), 1),
        ("pp2-1f1b", dict(pp=2, schedule="1f1b"), 2),
        ("pp2-1f1b-selective", dict(pp=2, schedule="1f1b", recompute="selective"), 2),
        ("pp2-interleaved-v2", dict(pp=2, schedule="interleaved-1f1b", vpp=2), 4),
        ("pp2-zb-h1", dict(pp=2, schedule="zb-h1"), 2)],
    4: [("cp4-zigzag", dict(cp=4), 1), ("cp4-zigzag-eager", dict(cp=4, attention="eager"), 1),
        ("cp4-ulysses", dict(cp=4, ulysses=4), 1), ("cp4-hybrid", dict(cp=4, ulysses=2), 1),
        ("cp2xtp2-sp", dict(cp=2, tp=2, sp=True), 1), ("cp2xtp2-ulysses-sp", dict(cp=2, ulysses=2, tp=2, sp=True), 1),
        ("dp2xcp2-fsdp", dict(dp=2, cp=2, zero="fsdp"), 1),
        ("pp2xcp2-1f1b-full", dict(pp=2, cp=2, schedule="1f1b", recompute="full"), 2),
        ("pp2xcp2-ulysses", dict(pp=2, cp=2, ulysses=2, schedule="1f1b"), 2)],
}
DOC_MODELS = ("gpt-tiny", "llama-tiny", "hf-llama")


def documents_group(world: int) -> dict:
    from packed_documents import packed_batches, per_document_reference
    results = {}
    only = os.environ.get("AUTOPAR_ONLY")
    for model_name in DOC_MODELS:
        c = case(model_name)
        data = packed_batches(c, STEPS)
        ref_losses, ref_grads = per_document_reference(c, data, LR)
        for name, kw, nv in DOC_LAYOUTS[world]:
            if only and name not in only.split(","):
                continue
            key = f"{model_name}/{name}"
            refused = refusals(ParallelConfig(**{"dtype": "fp32", "mbs": 1, **kw}), planner_view(model_name)[2], documents=True)
            if refused:
                results[key] = {"refused": refused}
                continue
            try:
                losses, grads, dt = run_layout(model_name, kw, nv, data)
                results[key] = {"losses": losses, "ref_losses": ref_losses, "seconds": dt,
                                **compare(grads, ref_grads, losses, ref_losses)}
            except Exception as exc:
                results[key] = failure(exc)
            report(key, results[key])
    return results


def layout_parity(models, layouts, run_one) -> dict:
    """Per model the one-process reference once, then per layout ``(name, *rest)`` of ``layouts``
    ``run_one(model_name, rest, data)`` -> (losses, grads, seconds, extra fields), compared with
    it; a failing layout is recorded and the others still run; each result is reported."""
    results = {}
    for model_name in models:
        c = case(model_name)
        data = c.batches(STEPS)
        ref_losses, ref_grads = c.reference(data, LR)
        for name, *rest in layouts:
            key = f"{model_name}/{name}"
            try:
                losses, grads, dt, extra = run_one(model_name, rest, data)
                results[key] = {"losses": losses, "ref_losses": ref_losses, "seconds": dt, **extra,
                                **compare(grads, ref_grads, losses, ref_losses)}
            except Exception as exc:  # report, keep going with the other layouts
                results[key] = failure(exc)
            report(key, results[key])
    return results


def parity_group(world: int) -> dict:
    """Every model and layout of ``world`` in this one launch: each build is closed before the
    next (``ParallelModel.close`` destroys its process groups; tests/test_close.py)."""
    results = {}
    for model_name in MODELS_BY_WORLD[world]:
        c = case(model_name)
        data = c.batches(STEPS)
        ref_losses, ref_grads = c.reference(data, LR)
        only = os.environ.get("AUTOPAR_ONLY")
        for name, kw, nv in layouts_of(world, model_name):
            if only and name not in only.split(","):
                continue
            key = f"{model_name}/{name}"
            refused = refusals(ParallelConfig(**{"dtype": "fp32", "mbs": 1, **kw}), planner_view(model_name)[2])
            if refused:  # the runtime refuses before building anything: record why
                results[key] = {"refused": refused}
                continue
            try:
                custom = parse(CUSTOM_CSV[name], "csv", name) if name in CUSTOM_CSV else None
                losses, grads, dt = run_layout(model_name, kw, nv, data, custom)
                results[key] = {"losses": losses, "ref_losses": ref_losses, "seconds": dt,
                                **compare(grads, ref_grads, losses, ref_losses)}
            except Exception as exc:  # report, keep going with the other layouts
                results[key] = failure(exc)
            report(key, results[key])
    return results


def mllm_ilp_split(pc) -> tuple[list[list[str]], list[str]]:
    """The planner's ILP stage split of mllm-tiny for ``pc`` (unequal layers: vision blocks,
    projector, decoder blocks, head)."""
    from cost_models.cluster import parse_cluster
    from planner.frontend.load import load_graph
    from planner.search.planning import evaluate_config

    g = load_graph("mllm-tiny", batch=1, seq_len=SEQ)

    def split():  # made on rank 0 (worker_io.made_once)
        e, _ = evaluate_config(g, parse_cluster(f"local-cpu:{pc.world}"), pc, GB)
        return e.partition.bounds, list(e.partition.recompute)

    bounds, recompute = made_once(split)
    names = [l.name for l in g.layers]
    return [names[a:b] for a, b in bounds], recompute


def mllm_pp2() -> dict:
    """mllm-tiny under PP2 (1F1B) with the planner's (unequal) ILP split; AdamW, 5 steps on one
    batch; the first loss is checked against the single-process model."""
    cfg = zoo.preset("mllm-tiny")
    pc = ParallelConfig(pp=2, schedule="1f1b", dtype="fp32", mbs=1).validate()
    stages, recompute = mllm_ilp_split(pc)
    batch = zoo.example_batch(cfg, GB, SEQ, device="cpu")
    ref = zoo.build_model(cfg, device="cpu", seed=SEED)
    ref_loss = float(ref(batch["input_ids"], batch["pixel_values"], labels=batch["labels"]))
    model = zoo.build_model(cfg, device="meta")
    pm = parallelize(model, pc, stages, recompute, tp_layout_for("mllm-tiny"), GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=3e-3), seed=SEED)
    losses = [pm.step(batch) for _ in range(5)]
    pm.close()
    return {"mllm-tiny/pp2-unequal": {"losses": losses, "ref_first_loss": ref_loss, "stages": stages,
                                      "recompute": recompute}}


CKPT_CFG = dict(dp=2, pp=2, schedule="interleaved-1f1b", vpp=2, zero="fsdp")


def _ckpt_model():
    cfg = zoo.preset("llama-tiny")
    pc = ParallelConfig(dtype="fp32", mbs=1, **CKPT_CFG).validate()
    model = zoo.build_model(cfg, device="meta")
    stages = even_stages(units_of(model), 4)
    pm = parallelize(model, pc, stages, ["selective", "none", "full", "none"], tp_layout_for("llama-tiny"),
                     GB, SEQ, "cpu", optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=1e-3), seed=SEED)
    return cfg, pm


def ckpt_first(ckpt_dir: str) -> dict:
    """Uninterrupted 4 steps, then a fresh run of 2 steps saving at step 2 (and a fake
    interrupted step-3 directory without .metadata that resume must ignore)."""
    from codegen.runtime import checkpoint as ck
    cfg, pm = _ckpt_model()
    data = batches(cfg, 4)
    full = [pm.step(b) for b in data]
    pm.close()
    cfg, pm = _ckpt_model()
    first = [pm.step(b) for b in data[:2]]
    ck.save(pm, ckpt_dir)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(ckpt_dir, "step-3"), exist_ok=True)
        with open(os.path.join(ckpt_dir, "step-3", "__0_0.distcp"), "w") as fh:
            fh.write("partial")
    dist.barrier()
    pm.close()
    return {"uninterrupted": full, "first_two": first}


def ckpt_resume(ckpt_dir: str) -> dict:
    from codegen.runtime import checkpoint as ck
    cfg, pm = _ckpt_model()
    data = batches(cfg, 4)
    step = ck.load_latest(pm, ckpt_dir)
    resumed = [pm.step(b) for b in data[step:]]
    pm.close()
    return {"resumed_from": step, "resumed": resumed}


def compare(grads: dict, ref_grads: dict, losses: list, ref_losses: list) -> dict:
    """Worst relative gradient and loss errors against one process (the global gradient norm,
    ``NORM``, compared as one more gradient when ``grads`` has it); ``missing`` lists the
    parameters the layout produced no gradient for (absent, or None)."""
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    if NORM in grads and NORM not in ref_grads:
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in ref_grads.values()))
        ref_grads = dict(ref_grads, **{NORM: norm})
    errs = {n: rel(grads[n], ref_grads[n], 1e-3 * scale) for n in ref_grads if grads.get(n) is not None}
    worst = max(errs, key=errs.get)
    return {"grad_rel_err": errs[worst], "worst": worst, "norm_rel_err": errs.get(NORM),
            "missing": sorted(n for n in ref_grads if grads.get(n) is None),
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))}


def main() -> None:
    group, out = sys.argv[1], sys.argv[2]
    init_distributed()
    torch.manual_seed(0)
    world = dist.get_world_size()

    def guarded(key, fn, *a):
        try:
            return fn(*a)
        except Exception as exc:
            return {key: failure(exc)}

    results: dict = {}
    if group == "parity":
        results.update(parity_group(world))
        if world == 2 and not os.environ.get("AUTOPAR_ONLY"):
            results.update(guarded("mllm-tiny/pp2-unequal", mllm_pp2))
        if world == 4 and len(sys.argv) > 3:
            results["ckpt"] = guarded("error", ckpt_first, sys.argv[3])
    elif group == "documents":
        results.update(documents_group(world))
    elif group == "resume":
        results["ckpt"] = guarded("error", ckpt_resume, sys.argv[3])
    elif group == "mllm":
        results.update(mllm_pp2())
    elif group == "vocab":  # vocabulary passes (tests/vocab_worker.py)
        from vocab_worker import vocab_group
        results.update(vocab_group(world, os.path.dirname(os.path.abspath(out))))
    else:
        raise SystemExit(f"unknown group {group}")
    finish(results, out)


if __name__ == "__main__":
    main()
