"""Mixed-precision worker for tests/test_precision.py (torchrun, gloo on CPU).

``python -m torch.distributed.run --nproc-per-node N tests/precision_worker.py OUT.json``
trains each layout family of N processes under ``dtype=bf16`` for 3 SGD steps and compares
with one process in bf16 mixed precision written out here, independently of the runtime:
fp32 master weights; each step a copy of the model whose parameters (not buffers) are cast
to bf16 runs the model's own forward and loss (fp32 from bf16 logits) and backward; its
gradients, upcast to fp32, step the masters. Per layout it records the losses, the
first-step gradients' worst relative error, and what ran: the dtype of every 2-D (or
larger) parameter each module computed with (forward pre-hooks on the stage modules), and
the dtypes of the parameters and gradients the optimizer steps. fp32 runs of two layouts
serve as the control (nothing cast).
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from codegen.runtime.experts import balance_experts, moe_layers  # noqa: E402
from codegen.runtime.mesh import init_distributed  # noqa: E402
from codegen.runtime.train import parallelize  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402

from dist_worker import LR, NORM, STEPS, compare  # noqa: E402
from model_cases import GB, SEED, SEQ, case, planner_view, refusals, stages_for  # noqa: E402
from worker_io import failure, finish, report  # noqa: E402

# (name, ParallelConfig kwargs, virtual stages): every layout family, per world size
LAYOUTS = {
    2: [("dp2-ddp", dict(dp=2, zero="ddp"), 1), ("dp2-zero1", dict(dp=2, zero="zero1"), 1),
        ("dp2-fsdp", dict(dp=2, zero="fsdp"), 1), ("dp2-zero2", dict(dp=2, zero="zero2"), 1),
        ("tp2-sp", dict(tp=2, sp=True), 1), ("pp2-1f1b", dict(pp=2, schedule="1f1b"), 2),
        ("pp2-interleaved-v2", dict(pp=2, schedule="interleaved-1f1b", vpp=2), 4),
        ("cp2-zigzag", dict(cp=2), 1), ("cp2-ulysses", dict(cp=2, ulysses=2), 1),
        ("dp2-ep2-fsdp", dict(dp=2, ep=2, zero="fsdp"), 1), ("tp2-ep2-sp", dict(tp=2, sp=True, ep=2), 1),
        # regional torch.compile (inductor on CPU) under FSDP and a pipeline
        ("dp2-fsdp-compiled", dict(dp=2, zero="fsdp", compile=True), 1),
        ("pp2-1f1b-compiled", dict(pp=2, schedule="1f1b", compile=True), 2)],
    4: [("dp2xtp2-fsdp-sp", dict(dp=2, tp=2, sp=True, zero="fsdp"), 1),
        ("pp2xdp2-fsdp", dict(pp=2, dp=2, zero="fsdp", schedule="1f1b"), 2),
        ("pp2xtp2-1f1b-sp", dict(pp=2, tp=2, sp=True, schedule="1f1b"), 2),
        ("pp2xcp2-1f1b", dict(pp=2, cp=2, schedule="1f1b"), 2),
        ("dp2xcp2-ep4-fsdp", dict(dp=2, cp=2, ep=4, zero="fsdp"), 1)],
}
MODELS = {2: ("llama-tiny", "hf-llama", "moe-tiny"), 4: ("llama-tiny", "moe-tiny")}
COMPILED_MODELS = ("llama-tiny",)  # compiled layouts run for these only (each compile takes ~30 s on 2 cores)
FP32_CONTROL = ("dp2-ddp", "tp2-sp", "dp2xtp2-fsdp-sp")  # the same layouts in fp32: nothing may be cast
BF16 = torch.bfloat16


MOE_DENSE = ("dp2-fsdp", "pp2-1f1b", "pp2xdp2-fsdp")  # the dense layouts the MoE model runs too


def layouts_of(world: int, model: str) -> list[tuple[str, dict, int]]:
    """Expert parallelism for the MoE model only (and a few dense layouts)."""
    lays = [lay for lay in LAYOUTS[world] if model in COMPILED_MODELS or not lay[1].get("compile")]
    if model.startswith("moe"):
        return [lay for lay in lays if "ep" in lay[1] or lay[0] in MOE_DENSE]
    return [lay for lay in lays if "ep" not in lay[1]]


def mixed_reference(model_name: str, data: list[dict]) -> tuple[list[float], dict]:
    """One process, bf16 mixed precision (module docstring): the losses and the first step's
    fp32 gradients of the masters."""
    c = case(model_name)
    master = c.build("cpu")
    moe = moe_layers([master])
    opt = torch.optim.SGD(master.parameters(), lr=LR)
    losses, grads = [], None
    for s, b in enumerate(data):
        work = copy.deepcopy(master)
        for p in work.parameters():
            p.data = p.data.to(BF16)
        loss = c.loss(work, b)
        loss.backward()
        for (n, p), w in zip(master.named_parameters(), work.parameters()):
            p.grad = w.grad.float()
        if s == 0:
            grads = {n: p.grad.clone() for n, p in master.named_parameters()}
        opt.step()
        opt.zero_grad()
        balance_experts(moe, first_step=s == 0)
        losses.append(float(loss))
    return losses, grads


def compute_dtypes(modules) -> tuple[dict, list]:
    """Forward pre-hooks recording, per module name, the dtypes of its own 2-D+ parameters
    at forward time; returns (record, handles)."""
    seen: dict[str, set] = {}

    def hook(name):
        def pre(mod, args):
            for p in mod.parameters(recurse=False):
                if p.dim() >= 2:
                    seen.setdefault(name, set()).add(str(p.dtype).replace("torch.", ""))
        return pre
    handles = [m.register_forward_pre_hook(hook(n)) for sm in modules for n, m in sm.named_modules()]
    return seen, handles


def run(model_name: str, kw: dict, n_virtual: int, dtype: str, data: list[dict]) -> dict:
    c = case(model_name)
    pc = ParallelConfig(dtype=dtype, mbs=1, **kw).validate()
    _, layout, facts = planner_view(model_name)
    pm = parallelize(c.build(c.parallel_device), pc, stages_for(model_name, n_virtual), ["none"] * n_virtual,
                     layout, GB, SEQ, "cpu", optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED,
                     facts=facts)
    seen, handles = compute_dtypes(pm.stage_modules)
    losses, grads = [], None
    for s, b in enumerate(data):
        losses.append(pm.step(b))
        if s == 0:
            for h in handles:
                h.remove()
            grads = pm.gradients_for_check()
            grads[NORM] = torch.tensor(pm.clip_grad_norm_(None), dtype=torch.float64)
            held = [p for _, p in pm.named_parameters()]  # what the optimizers step, between steps
            stepped = {str(p.dtype).replace("torch.", "") for p in held}
            grad_dtypes = {str(p.grad.dtype).replace("torch.", "") for p in held if p.grad is not None}
    pm.close()
    compute = sorted({d for ds in seen.values() for d in ds})
    fp32_modules = sorted(n for n, ds in seen.items() if "float32" in ds)
    return {"losses": losses, "grads": grads, "compute": compute, "fp32_modules": fp32_modules[:5],
            "stepped": sorted(stepped), "grad_dtypes": sorted(grad_dtypes)}


STATE_LAYOUTS = ("dp2-ddp", "dp2-zero1", "dp2-fsdp", "dp2-zero2", "tp2-sp", "pp2-1f1b", "dp2xtp2-fsdp-sp",
                 "pp2xdp2-fsdp")  # model-state bytes against the memory model (llama-tiny, AdamW)


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes(model_name: str, kw: dict, n_virtual: int, dtype: str, data: list[dict]) -> dict:
    """This rank's parameter, gradient and AdamW-state bytes after one step, measured (what the
    tensors hold) and predicted (``cost_models.memory.stage_memory`` of the rank's layers)."""
    from cost_models.memory import stage_memory

    c = case(model_name)
    pc = ParallelConfig(dtype=dtype, mbs=1, **kw).validate()
    graph, layout, facts = planner_view(model_name)
    stages = stages_for(model_name, n_virtual)
    pm = parallelize(c.build(c.parallel_device), pc, stages, ["none"] * n_virtual, layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.AdamW(ps, lr=1e-3), seed=SEED, facts=facts)
    pm.step(data[0])
    held = [p for _, p in pm.named_parameters()]
    inner = [getattr(o, "inner", o) for o in pm.optimizer.optimizers]  # ZeRO-1: the optimizer it wraps, or None
    states = [st for o in inner if o is not None for st in o.state.values()]
    measured = {"weights": sum(local_bytes(p) for p in held),
                "grads": sum(local_bytes(p.grad) for p in held if p.grad is not None),
                "optimizer": sum(local_bytes(v) for st in states for v in st.values() if v.dim() > 0)}
    mine = {u for sm in pm.stage_modules for u in sm.units}
    layers = [i for i, l in enumerate(graph.layers) if l.name in mine]
    pred = stage_memory(graph, layers, pc, inflight=1, device_is_gpu=False)
    pm.close()
    return {"measured": measured, "predicted": {k: getattr(pred, k) for k in measured}}


def main() -> None:
    out = sys.argv[1]
    init_distributed()
    world = dist.get_world_size()
    results: dict = {}
    for model_name in MODELS[world]:
        data = case(model_name).batches(STEPS)
        refs = {"bf16": mixed_reference(model_name, data), "fp32": case(model_name).reference(data, LR)}
        for name, kw, nv in layouts_of(world, model_name):
            for dtype in ("bf16", "fp32") if name in FP32_CONTROL else ("bf16",):
                key = f"{model_name}/{name}/{dtype}"
                refused = refusals(ParallelConfig(dtype=dtype, mbs=1, **kw), planner_view(model_name)[2])
                if refused:
                    results[key] = {"refused": refused}
                    continue
                try:
                    r = run(model_name, kw, nv, dtype, data)
                    ref_losses, ref_grads = refs[dtype]
                    r.update(compare(r.pop("grads"), ref_grads, r["losses"], ref_losses), ref_losses=ref_losses)
                    results[key] = r
                except Exception as exc:
                    results[key] = failure(exc)
                report(key, results[key])
    for name, kw, nv in LAYOUTS[world]:
        for dtype in ("bf16", "fp32"):
            if name in STATE_LAYOUTS:
                key = f"states/llama-tiny/{name}/{dtype}"
                try:
                    results[key] = state_bytes("llama-tiny", kw, nv, dtype, case("llama-tiny").batches(1))
                except Exception as exc:
                    results[key] = failure(exc)
                report(key, results[key])
    finish(results, out)


if __name__ == "__main__":
    main()
