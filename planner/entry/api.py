"""``auto_parallelize``: capture, plan (on rank 0, broadcast) and apply, in one call.

Inside a script started by torchrun (or a plain single process)::

    par = planner.auto_parallelize(model, example_batch, cluster="detect")
    for batch in data:
        loss = par.step(batch)          # one optimizer step on the global batch
    par.save("ckpt")                    # distributed checkpoint; par.load("ckpt") resumes

``model`` is a zoo model, any transformers causal LM, or the user's own ``nn.Module``
with a stack of repeated blocks whose last unit returns logits (its runtime adapter,
``codegen/runtime/adapters``, says how it is split, sharded and pipelined; an explicit
``module_spec`` names the units when they cannot be inferred). ``example_batch`` is the
global batch of one step (``input_ids``, ``labels`` in the model's own convention: a
transformers model shifts them itself, and, for the vision+language model,
``pixel_values``); its shape fixes the global batch and sequence length of the plan.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from planner.errors import AutoparError
from planner.plan import Plan


def detect_cluster(world: int) -> str:
    """A cluster spec for the processes of this job: ``local-cpu:N`` on CPUs, the preset of
    the GPU model (``dgx-h100:nodes``, ...) on CUDA."""
    if not torch.cuda.is_available():
        return f"local-cpu:{world}"
    name = torch.cuda.get_device_name().upper()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    nodes = max(1, world // max(local, 1))
    for key, preset in (("H200", "h200-8x"), ("H100", "dgx-h100"), ("A100", "dgx-a100-80g")):
        if key in name:
            return f"{preset}:{nodes}"
    raise AutoparError(f"no cluster preset for GPU {name!r}: pass cluster='my_cluster.toml'")


class Parallelized:
    """The model parallelised per ``plan`` on this rank; ``installs``: what ``auto_parallelize``
    set up in the process (environment, the default process group), undone by :meth:`close`."""

    def __init__(self, pm: Any, plan: Plan, installs: Any = None):
        self._pm, self.plan, self._installs = pm, plan, installs

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on the global batch (the same on every rank); returns the loss."""
        return self._pm.step(batch)

    @property
    def optimizer(self):
        return self._pm.optimizer

    def save(self, ckpt_dir: str) -> str:
        from codegen.runtime import checkpoint

        about = {"model": self.plan.model.get("spec"), "adapter": self.plan.model.get("adapter"),
                 "config": self.plan.config.to_str()}
        return checkpoint.save(self._pm, ckpt_dir, about=about)

    def load(self, ckpt_dir: str) -> int | None:
        """Load the newest complete checkpoint; returns its step (None when there is none)."""
        from codegen.runtime import checkpoint

        return checkpoint.load_latest(self._pm, ckpt_dir)

    def close(self) -> None:
        """Release the model's build (collective), then the process group and environment
        variables ``auto_parallelize`` created. Without it, the groups are destroyed at exit."""
        self._pm.close()
        if self._installs is not None:
            self._installs.close()


@dataclass(frozen=True)
class PlanRequest:
    """How ``auto_parallelize`` gets its plan, besides the model and the example batch: a plan
    file (``plan``), or a search for ``cluster`` (``detect``: this job's devices) with the
    model's name ``spec``, a ``profile`` file, the user's ``pins`` and packed-document lengths
    ``seq_lens``; ``module_spec`` names a plain module's units."""
    cluster: str = "detect"
    spec: str | None = None
    profile: str | None = None
    plan: str | None = None
    module_spec: Any = None
    pins: Any = None
    seq_lens: Any = None


def auto_parallelize(model: nn.Module, example_batch: dict[str, torch.Tensor], loss_fn: Callable | None = None,
                     cluster: str = "detect", optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
                     *, spec: str | None = None, profile: str | None = None, seed: int | None = None,
                     plan: str | None = None, module_spec: Any = None, fix: str | None = None,
                     seq_lens: Any = None) -> Parallelized:
    """Capture ``model`` on ``example_batch``, plan it for ``cluster`` on rank 0, broadcast the
    plan, apply it; returns an object with ``.step(batch)``, ``.plan``, ``.save``, ``.load``.

    ``optimizer`` is a factory ``params -> torch.optim.Optimizer`` (AdamW by default);
    ``plan`` uses a plan file instead of planning; ``loss_fn(logits, labels) -> summed loss``
    replaces the token cross-entropy of a plain module (``module_spec`` =
    ``codegen.runtime.adapters.module.ModuleSpec(blocks=..., before=..., after=..., loss=...)``
    names its units explicitly); ``fix`` keeps part of the layout, as ``autopar plan --fix``
    (``"tp=8,pp=1"``, ``"tp<=4,zero=fsdp"``: see planner/search/pins.py); ``seq_lens`` plans each sequence as
    a row of packed documents of those lengths (a file, a list of lengths or {length: count}, as
    ``autopar plan --seq-lens``; planner/search/seq_lens.py). Without ``profile``, a plan for
    this machine's CPUs uses its cached first-run calibration when there is one (``autopar plan``
    or ``autopar demo`` make it).
    """
    from codegen.runtime.adapters import adapter_for
    from codegen.runtime.train import default_optimizer, parallelize_plan
    from planner.search.pins import Pins

    module_spec = _module_spec(model, loss_fn, module_spec)
    req = PlanRequest(cluster, spec, profile, plan, module_spec, Pins.parse(fix), seq_lens)  # a bad pin fails
    if not isinstance(example_batch, dict) or "input_ids" not in example_batch:             # on every rank
        raise AutoparError("example_batch must be a dict with input_ids (and labels): the global batch of one step")
    from codegen.runtime.installs import Installs

    installs = Installs()
    try:
        device = _init_process_group(installs)
        the_plan = _broadcast_plan(model, example_batch, req)
        adapter = adapter_for(model, module_spec, order=the_plan.model["layers"],
                              seq_len=_sequence(model, example_batch), facts=the_plan.facts)
        pm = parallelize_plan(model, the_plan, device, optimizer_factory=optimizer or default_optimizer, seed=seed,
                              adapter=adapter)
    except BaseException:
        installs.close()
        raise
    return Parallelized(pm, the_plan, installs)


def _module_spec(model: nn.Module, loss_fn: Callable | None, module_spec: Any) -> Any:
    """The plain module's units with the user's loss (``loss_fn`` needs them named)."""
    from codegen.runtime.adapters import adapter_kind

    if loss_fn is None:
        return module_spec
    if adapter_kind(model) != "module":
        raise AutoparError("auto_parallelize(loss_fn=...) applies to a plain module; a zoo or transformers "
                           "model computes its own loss")
    from codegen.runtime.adapters.module import ModuleSpec
    if module_spec is None:
        raise AutoparError("loss_fn needs the units named too: pass module_spec=ModuleSpec(blocks=..., "
                           "before=..., after=..., loss=loss_fn)")
    return ModuleSpec(module_spec.blocks, module_spec.before, module_spec.after, loss_fn)


def _init_process_group(installs: Any) -> torch.device:
    """This process's group (a one-rank group for a plain single process) and its device; the
    environment variables set and the group created are recorded in ``installs``."""
    from codegen.runtime.mesh import init_distributed
    from codegen.runtime.torch_compat import live_process_groups

    if "WORLD_SIZE" not in os.environ:  # a plain single process: a one-rank group
        from planner.entry.launch import free_port

        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(free_port()))):
            installs.setenv(key, value)
    before = live_process_groups()
    device = init_distributed()
    installs.own_groups_since(before)
    return device


def _sequence(model: nn.Module, example: dict[str, torch.Tensor]) -> int:
    """Tokens per sequence the model runs (a vision+language model's image tokens included)."""
    seq = int(example["input_ids"].shape[1])
    if "pixel_values" in example:
        seq += getattr(getattr(model, "config", None), "num_patches", 0)
    return seq


def _broadcast_plan(model: nn.Module, example: dict[str, torch.Tensor], req: PlanRequest) -> Plan:
    """The plan rank 0 makes (or loads), on every rank; rank 0's error is raised on all."""
    import json

    import torch.distributed as dist

    from codegen.runtime.mesh import unpinned

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            with unpinned():  # plan for the machine the job runs on, not this rank's cores
                box[0] = plan_for(model, example, req, dist.get_world_size()).to_json()
        except AutoparError as e:
            box[0] = {"error": str(e)}
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], dict):
        raise AutoparError(box[0]["error"])
    return Plan.from_dict(json.loads(box[0]), source="broadcast plan")


def plan_for(model: nn.Module | None, example: dict[str, torch.Tensor], req: PlanRequest, world: int) -> Plan:
    """The plan ``auto_parallelize`` runs ``model`` with on ``world`` processes: ``req.plan``
    (its batch shape checked against ``example``'s) or a fresh search (one process, no launch)."""
    gb, seq = (int(x) for x in example["input_ids"].shape[:2])
    if req.plan:
        if req.pins or req.seq_lens is not None:
            raise AutoparError("auto_parallelize(plan=..., fix=... or seq_lens=...): a plan file is already chosen; "
                               "drop fix= / seq_lens= or plan again with `autopar plan --fix / --seq-lens`")
        p = Plan.load(req.plan)
        if (p.batch["global"], p.batch["seq_len"]) != (gb, seq):
            raise AutoparError(f"plan {req.plan} is for {p.batch['global']} sequences of {p.batch['seq_len']} tokens "
                               f"but the example batch is {gb} x {seq}: pass a batch of the plan's shape or plan again")
        return p
    from cost_models.cluster import parse_cluster
    from planner.search.pins import Pins
    from planner.search.planning import plan_model

    c = parse_cluster(detect_cluster(world) if req.cluster == "detect" else req.cluster)
    if c.world != world:
        raise AutoparError(f"cluster {c.name} has {c.world} devices but this job has {world} processes: "
                           "launch one process per device or pass a matching cluster")
    graph, name = _capture(model, example, req.module_spec)
    pins = req.pins or Pins()  # the job's processes are launched: a layout uses every one of them
    pins = Pins({**pins.lo, "world": world}, {**pins.hi, "world": world}, pins.choice)
    c, profile = _profile(c, req.profile)
    p, _ = plan_model(graph, c, gb, spec=req.spec or name, cluster_spec=c.name, profile=profile,
                      fix=pins, seq_lens=req.seq_lens)
    return p


def _capture(model: nn.Module, example: dict[str, torch.Tensor], module_spec: Any):
    """(ModelGraph, name) of ``model`` on ``example``, as its adapter runs it."""
    from codegen.runtime.adapters import adapter_kind
    from planner.frontend.load import graph_of

    cfg = getattr(model, "config", None)
    kind = "module" if module_spec is not None else adapter_kind(model)
    name = getattr(cfg, "name", None) or getattr(cfg, "model_type", None) or type(model).__name__
    seq = int(example["input_ids"].shape[1])
    if kind == "module":  # a plain module takes the token ids; its logits stand in for the loss in capture
        return graph_of(model, (example["input_ids"],), name=name, seq_len=seq, module_spec=module_spec,
                        loss_fn=lambda out: out.float().sum()), name
    if kind == "hf":
        return graph_of(model, dict(example, use_cache=False), name=name, seq_len=seq), name
    return graph_of(model, example, name=name, seq_len=seq, hidden=getattr(cfg, "hidden", None),
                    vocab=getattr(cfg, "vocab", None)), name


def _profile(cluster, path: str | None):
    """``(cluster, profile)`` to plan with: ``path``, else this machine's cached calibration
    (profiling it would launch processes inside this job) and the cluster at its thread figures."""
    if path:
        from cost_models.profile_db import ProfileDB

        return cluster, ProfileDB.load(path)
    from planner.entry.calibration import machine_profile

    mp = machine_profile(cluster, allow_profile=False)
    return mp.cluster, mp.profile
