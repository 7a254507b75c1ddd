"""Worker for tests/test_close.py: ten models built and closed one after another in one process.

``python -m torch.distributed.run --nproc-per-node 2 tests/close_worker.py OUT.json`` builds
each of ``BUILDS`` (zoo models, transformers Llama / GPT-2 / Mixtral (experts registry) /
Gemma-2 (keeps its own attention: the masked registries), a user's plain module; DP, FSDP,
TP+SP, PP, ring and Ulysses CP, EP, selective recompute), trains 2 steps, closes it, and
compares what the process and the model hold with what they held before the build:
transformers' attention, mask and experts registries, ``os.environ``, the live process groups
and every module's ``__dict__`` (its attributes, children and hook ids). Rank 0 writes, per
build, the differences found (empty: none) and what the build had added while it was open.

``python tests/close_worker.py --single OUT.json`` (one plain process, no torchrun) does the
same for ``auto_parallelize`` on a transformers Llama, which sets ``RANK`` / ``WORLD_SIZE`` /
``MASTER_*`` and creates the default process group itself: after ``close()`` both are gone.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from codegen.runtime.torch_compat import live_process_groups, module_hook_dicts  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_configs")
# (model case, ParallelConfig kwargs, virtual stages)
BUILDS = [
    ("gpt-tiny", dict(dp=2, zero="fsdp"), 1),
    ("hf-llama", dict(tp=2, sp=True), 1),
    ("hf-mixtral", dict(dp=2, ep=2, zero="fsdp"), 1),
    ("user-lm", dict(pp=2, schedule="1f1b"), 2),
    ("llama-tiny", dict(cp=2, ulysses=2), 1),
    ("hf-gpt2", dict(pp=2, schedule="1f1b", recompute="selective"), 2),
    ("moe-tiny", dict(tp=2, sp=True, ep=2), 1),
    ("hf-llama", dict(tp=2, sp=True, recompute="selective"), 1),  # the mesh of build 1 again: DTensor caches
    ("user-lm", dict(tp=2, sp=True, recompute="full"), 1),
    ("gemma2", dict(dp=2, zero="ddp", attention="eager"), 1),
]
_TORCH_KEYS = frozenset(nn.Module().__dict__)


def registries() -> dict[str, dict]:
    """{registry: {name: id(function)}} of transformers' attention, mask and experts registries."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return {name: {k: id(v) for k, v in reg.items()}  # (a GeneralInterface is a Mapping: local over global)
            for name, reg in (("attention", AttentionInterface()), ("mask", ALL_MASK_ATTENTION_FUNCTIONS),
                              ("experts", ALL_EXPERTS_FUNCTIONS))}


def module_state(model: nn.Module) -> dict[str, dict]:
    """Per module (by fqn): its attributes by identity (torch's containers aside), its children
    and its hook ids."""
    out = {}
    for name, m in model.named_modules():
        attrs = {k: id(v) for k, v in m.__dict__.items() if k not in _TORCH_KEYS}
        attrs["<keys>"] = sorted(m.__dict__)
        attrs["<children>"] = {k: id(v) for k, v in m.named_children()}
        attrs["<hooks>"] = {k: sorted(d) for k, d in module_hook_dicts(m).items()}
        out[name] = attrs
    return out


def process_state() -> dict:
    return {"registries": registries(), "environ": dict(os.environ),
            "groups": [id(g) for g in live_process_groups()]}


def differences(before: dict, after: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two nested dicts (at most 10)."""
    out = []
    for k in sorted(set(before) | set(after), key=str):
        a, b = before.get(k, "<absent>"), after.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{k}/")
        elif a != b:
            out.append(f"{prefix}{k}: {str(a)[:80]} -> {str(b)[:80]}")
    return out[:10]


def build(name: str):
    """(model, stages per virtual stage, tp layout, facts, batches) of case ``name``."""
    from model_cases import case, planner_view

    if name == "gemma2":  # a transformers family that keeps its own attention (sliding window)
        from planner import zoo
        from codegen.runtime.adapters import adapter_for
        model = zoo.load_model_spec(f"hf:{os.path.join(CONFIGS, 'gemma2-tiny.json')}").build("meta")
        ad = adapter_for(model, seq_len=32)
        units = ad.units
        ad.close()
        g = torch.Generator().manual_seed(3)
        data = [{"input_ids": (ids := torch.randint(0, 128, (4, 32), generator=g)), "labels": ids} for _ in range(2)]
        return model, units, {}, None, data
    c = case(name)
    _, layout, facts = planner_view(name)
    return c.build(c.parallel_device), None, layout, facts, c.batches(2)


def run_one(name: str, kw: dict, n_virtual: int) -> dict:
    from codegen.runtime.train import parallelize
    from model_cases import GB, SEED, SEQ, stages_for
    from planner.plan import ParallelConfig

    model, units, layout, facts, data = build(name)
    stages = [units] if units is not None else stages_for(name, n_virtual)
    pc = ParallelConfig(dtype="fp32", mbs=1, **kw).validate()
    policies = [pc.recompute] * n_virtual
    before_proc, before_model = process_state(), module_state(model)
    pm = parallelize(model, pc, stages, policies, layout, GB, SEQ, "cpu",
                     optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1), seed=SEED, facts=facts)
    losses = [pm.step(b) for b in data]
    open_proc = process_state()
    added = {"groups": len(set(open_proc["groups"]) - set(before_proc["groups"])),
             "registry entries": sum(len(set(open_proc["registries"][r]) - set(before_proc["registries"][r]))
                                     for r in open_proc["registries"]),
             "module changes": len(differences(before_model, module_state(model)))}
    pm.close()
    return {"losses": losses, "added": added, "process": differences(before_proc, process_state()),
            "modules": differences(before_model, module_state(model))}


def single(out: str) -> None:
    """auto_parallelize on a transformers Llama in one plain process, closed (module docstring)."""
    from model_cases import case
    import planner

    c = case("hf-llama")
    model = c.build("cpu")
    data = c.batches(1)[0]
    before_proc, before_model = process_state(), module_state(model)
    par = planner.auto_parallelize(model, data, cluster="local-cpu:1",
                                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    loss = par.step(data)
    was = {"initialized": dist.is_initialized(), "world": os.environ.get("WORLD_SIZE")}
    par.close()
    with open(out, "w") as fh:
        json.dump({"loss": loss, "while_open": was, "initialized": dist.is_initialized(),
                   "process": differences(before_proc, process_state()),
                   "modules": differences(before_model, module_state(model))}, fh)


def main() -> None:
    if sys.argv[1] == "--single":
        single(sys.argv[2])
        return
    from codegen.runtime.mesh import init_distributed
    from worker_io import failure, report, write_results

    init_distributed()
    results = {}
    for i, (name, kw, nv) in enumerate(BUILDS):
        key = f"{i}:{name}"
        try:
            results[key] = run_one(name, kw, nv)
        except Exception as exc:
            results[key] = failure(exc)
        report(key, results[key])
        write_results(results, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
