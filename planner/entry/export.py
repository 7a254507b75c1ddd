"""``autopar export``: a run's sharded checkpoint -> the model's own format, in one process.

The source is a checkpoint folder (its newest complete step, the one a resumed run takes:
``codegen.runtime.checkpoint.latest_path``) or one complete step directory. Its model weights
are read whole, without the job's world (``codegen.runtime.checkpoint.read_model_state``: DCP
keeps every tensor's logical shape, so tensor-, fully-sharded-, expert- and pipeline-parallel
layouts all come back as the full model's ``state_dict``, keyed by the model's own fqns).

Which model: the step's ``autopar.json`` (the emitted program writes it), else ``--plan`` or
``--model``; a plan or spec naming another model than the checkpoint's is refused, and so is a
model whose parameter names or shapes are not the checkpoint's. The model is built on the CPU
from its spec (random initialisation, then overwritten) and loaded strictly.

What is written:

- a transformers model (adapter ``hf``): ``save_pretrained`` (``config.json`` and
  safetensors), so ``AutoModelForCausalLM.from_pretrained(out)`` loads it;
- any other model (zoo, a user's module): ``model.safetensors`` (or ``model.pt``, torch.save)
  with the model's ``state_dict``, beside ``autopar.json`` naming the spec that builds it.

Tied weights (a tied embedding and head): under pipeline parallelism each end is saved by its
own stage; the first end's values are exported (the model ties them again) and the largest
difference between the two copies is reported.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from codegen.runtime import checkpoint
from codegen.runtime.tensor_parallel import tied_params
from planner.errors import AutoparError

FORMATS = ("safetensors", "pt")


@dataclass
class Exported:
    """What :func:`export` wrote: the step it read, the model spec and adapter kind, the files,
    the parameter count, and per tied pair the largest |difference| between its saved copies."""
    step_dir: str
    spec: str
    kind: str
    files: list[str]
    params: int
    tied_drift: dict[str, float] = field(default_factory=dict)


def resolve_step(path: str) -> str:
    """The complete step directory ``path`` names (itself, or a checkpoint folder's newest)."""
    if not os.path.isdir(path):
        raise AutoparError(f"{path}: no such checkpoint folder; give a run's checkpoints/ or one of its step-N folders")
    if checkpoint.is_complete(path):
        return path
    if checkpoint.STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise AutoparError(f"{path} is an incomplete checkpoint (no .metadata: its save was cut off); "
                           "export the folder above it to take its newest complete step")
    step = checkpoint.latest_path(path)
    if step is None:
        raise AutoparError(f"{path} holds no complete checkpoint (no step-N folder with .metadata); "
                           "run with --ckpt-every K to write some")
    return step


def model_spec(step: str, plan_path: Optional[str] = None, model: Optional[str] = None) -> str:
    """The model spec of the checkpoint at ``step``: its ``autopar.json``, checked against a
    ``--plan`` or ``--model`` when given (which name it for checkpoints without one)."""
    about = checkpoint.read_about(step) or {}
    saved = about.get("model")
    given, where = None, ""
    if plan_path is not None:
        from planner.plan import Plan

        given, where = Plan.load(plan_path).model.get("spec"), f"plan {plan_path}"
    elif model is not None:
        given, where = model, "--model"
    if given is not None and saved is not None and given != saved:
        raise AutoparError(f"{where} is for model {given!r} but checkpoint {step} holds {saved!r}: "
                           "give the plan of the run that wrote it, or no plan")
    spec = given if given is not None else saved
    if not isinstance(spec, str) or not spec:
        raise AutoparError(f"checkpoint {step} does not say which model it holds (no {checkpoint.ABOUT}): "
                           "name it with --plan PLAN.json or --model SPEC")
    return spec


def match_state(model: torch.nn.Module, saved: dict[str, torch.Tensor], spec: str) -> dict[str, float]:
    """Make ``saved`` the full ``state_dict`` of ``model`` in place: each tied pair takes its
    first end's values. Refuses names or shapes that differ. Returns per tied pair the largest
    |difference| of the two saved copies (0.0 when one end was not saved)."""
    drift = {}
    for first, other in tied_params(model):
        a, b = saved.get(first), saved.get(other)
        if a is None and b is not None:
            a = saved[first] = b
        if a is not None:
            drift[f"{first} = {other}"] = float((a - b).abs().max()) if b is not None and b.shape == a.shape else 0.0
            saved[other] = a
    want = model.state_dict()
    missing = [k for k in want if k not in saved]
    extra = [k for k in saved if k not in want]
    shapes = [f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in want.items()
              if k in saved and tuple(saved[k].shape) != tuple(v.shape)]
    if missing or extra or shapes:
        what = "; ".join(x for x in (f"missing {missing[:3]}" if missing else "", f"not in the model {extra[:3]}"
                                     if extra else "", f"shapes {shapes[:3]}" if shapes else "") if x)
        raise AutoparError(f"the checkpoint does not hold model {spec!r} ({what}): give the plan or --model "
                           "of the run that wrote it")
    return drift


def export(src: str, out: str, *, plan: Optional[str] = None, model: Optional[str] = None,
           fmt: str = "safetensors", force: bool = False) -> Exported:
    """Gather the checkpoint ``src`` into ``out`` in the model's own format (module docstring)."""
    from codegen.runtime.adapters import adapter_kind
    from planner import zoo

    if fmt not in FORMATS:
        raise AutoparError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not force):
        raise AutoparError(f"{out} exists and is not an empty folder: pass --force to write into it, or choose another")
    step = resolve_step(src)
    spec = model_spec(step, plan, model)
    net = zoo.load_model_spec(spec).build()
    kind = adapter_kind(net)
    saved = checkpoint.read_model_state(step)
    drift = match_state(net, saved, spec)
    net.load_state_dict(saved, strict=True)
    os.makedirs(out, exist_ok=True)
    if kind == "hf":
        net.save_pretrained(out)
        files = sorted(os.listdir(out))
    else:
        files = [_save_state(net, out, fmt), _write_about(out, spec, step)]
    return Exported(step, spec, kind, files, sum(p.numel() for p in net.parameters()), drift)


def _save_state(net: torch.nn.Module, out: str, fmt: str) -> str:
    """The model's state_dict as ``model.safetensors`` (tied names as separate copies: safetensors
    stores no shared tensors) or ``model.pt``; returns the file name."""
    sd = net.state_dict()
    if fmt == "pt":
        torch.save(sd, os.path.join(out, "model.pt"))
        return "model.pt"
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise AutoparError("--format safetensors needs the safetensors package: pip install safetensors, "
                           "or pass --format pt") from None
    seen: set[int] = set()
    flat = {}
    for k, v in sd.items():
        ptr = v.untyped_storage().data_ptr()
        flat[k] = v.detach().clone().contiguous() if ptr in seen else v.detach().contiguous()
        seen.add(ptr)
    save_file(flat, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return "model.safetensors"


def _write_about(out: str, spec: str, step: str) -> str:
    from planner.files import write_atomic

    write_atomic(os.path.join(out, checkpoint.ABOUT), json.dumps({"model": spec, "from": os.path.abspath(step)},
                                                                 indent=1) + "\n", force=True)
    return checkpoint.ABOUT
