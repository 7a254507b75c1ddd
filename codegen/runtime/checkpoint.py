"""Distributed checkpoints (torch.distributed.checkpoint) of model, optimizer and step.

Layout: ``<dir>/step-<n>/`` (DCP files, ``.metadata`` written last by DCP) and
``<dir>/latest``, a one-line text file naming the newest complete step directory. The
marker is repointed only after every rank finished writing (barrier) and the step's
``.metadata`` exists, by writing ``latest.tmp`` and ``os.replace`` (atomic), so a crash
at any point leaves ``latest`` naming a complete checkpoint. :func:`load_latest` also
ignores any step directory without ``.metadata`` (a write interrupted mid-way).

State: model weights per fqn (``get_model_state_dict`` of each stage module, merged) and
the optimizer states flattened per fqn (``flatten_optimizer_state_dict``; one optimizer
per stage module, merged), so checkpoints are independent of stage placement keys.
ZeRO-1's :class:`ShardedOptimizer` keeps each parameter's optimizer state on its owner
only; it is saved per fqn (``zero1.<fqn>.<state>``) by the owner, so each key has exactly
one writer, and loaded back by the owner. Hyperparameters (lr, betas) come from the
program, not the checkpoint.

Which model: ``<step dir>/autopar.json`` (:data:`ABOUT`), written by rank 0 when the caller
gives ``about`` (the emitted program: the model spec, its adapter kind, the layout), before
``latest`` is repointed; checkpoints without it still load. :func:`read_model_state` reads a
step's model weights back in one process, without the job's world (``autopar export``).
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

LATEST = "latest"
ABOUT = "autopar.json"
ROOT = "train"  # the state dict DCP saves is {ROOT: TrainState}; its "model" entry: weights per fqn
STEP_DIR = re.compile(r"^step-(\d+)$")
_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState(Stateful):
    """Stateful view of a :class:`codegen.runtime.train.ParallelModel` for DCP."""

    def __init__(self, pm: Any):
        self.pm = pm

    def _pairs(self):
        return zip(self.pm.stage_modules, self.pm.optimizer.optimizers)

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        zero1: dict[str, Any] = {}
        for sm, opt in self._pairs():
            model.update(get_model_state_dict(sm))
            if _is_zero1(opt):
                zero1.update(_zero1_state(sm, opt))
            else:
                optim.update(get_optimizer_state_dict(sm, opt, options=_OPTS))
        return {"model": model, "optim": optim, "zero1": zero1, "step": self.pm.step_count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for sm, opt in self._pairs():
            keys = set(get_model_state_dict(sm))
            set_model_state_dict(sm, {k: v for k, v in sd["model"].items() if k in keys})
            if _is_zero1(opt):
                names = {id(p): n for n, p in sm.named_parameters()}
                for p, st in opt.inner.state.items() if opt.inner is not None else ():
                    for k in st:
                        st[k] = sd["zero1"][f"{names[id(p)]}.{k}"]
            else:
                set_optimizer_state_dict(sm, opt, optim_state_dict=sd["optim"], options=_OPTS)
        self.pm.step_count = int(sd["step"])


def _is_zero1(opt: Any) -> bool:
    return type(opt).__name__ == "ShardedOptimizer"


def _zero1_state(sm: Any, opt: Any) -> dict[str, Any]:
    """This rank's shard of a ZeRO-1 optimizer's state, keyed ``<param fqn>.<state name>``."""
    if opt.inner is None:
        return {}
    names = {id(p): n for n, p in sm.named_parameters()}
    return {f"{names[id(p)]}.{k}": v for p, st in opt.inner.state.items() for k, v in st.items()}


def _materialize_zero1_state(pm: Any) -> None:
    """Create the (lazily built) optimizer state of ZeRO-1 shards so DCP can load into it:
    one step with zero gradients and learning rate 0 leaves the parameters unchanged."""

    for opt in pm.optimizer.optimizers:
        if not _is_zero1(opt) or opt.inner is None or opt.inner.state:
            continue
        params = [p for g in opt.inner.param_groups for p in g["params"]]
        saved = [(g, g["lr"]) for g in opt.inner.param_groups]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g, _ in saved:
            g["lr"] = 0.0
        opt.inner.step()
        for g, lr in saved:
            g["lr"] = lr
        for p, gr in zip(params, grads):
            p.grad = gr


def step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step}")


def is_complete(path: str) -> bool:
    """A step directory is complete iff DCP's ``.metadata`` exists in it."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def save(pm: Any, ckpt_dir: str, about: Optional[dict] = None) -> str:
    """Save at ``pm.step_count`` into ``<ckpt_dir>/step-<n>`` and repoint ``latest``. Collective.
    ``about``: small JSON-able facts of the run (model spec, adapter, layout) rank 0 writes
    to ``<step dir>/autopar.json``, so the checkpoint says which model it holds."""
    path = step_dir(ckpt_dir, pm.step_count)
    dcp.save({ROOT: TrainState(pm)}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        if not is_complete(path):
            raise RuntimeError(f"checkpoint {path} has no .metadata after save; not repointing {LATEST}")
        if about is not None:
            _write_atomic(os.path.join(path, ABOUT), json.dumps(dict(about, step=pm.step_count), indent=1) + "\n")
        _write_atomic(os.path.join(ckpt_dir, LATEST), os.path.basename(path) + "\n")
    dist.barrier()
    return path


def _write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through ``path.tmp``, flushed to disk, then ``os.replace`` (a
    crash leaves the old file or the new one, never half of either)."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def latest_path(ckpt_dir: str) -> Optional[str]:
    """The newest complete step directory: ``latest``'s target if complete, else the
    highest-numbered ``step-<n>`` with ``.metadata``; None if there is none."""
    marker = os.path.join(ckpt_dir, LATEST)
    if os.path.isfile(marker):
        with open(marker) as fh:
            name = fh.read().strip()
        path = os.path.join(ckpt_dir, name)
        if name and is_complete(path):
            return path
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted((int(m.group(1)), n) for n in os.listdir(ckpt_dir) if (m := STEP_DIR.match(n)))
    for _, n in reversed(steps):
        if is_complete(os.path.join(ckpt_dir, n)):
            return os.path.join(ckpt_dir, n)
    return None


def trim_log(path: str, step: int) -> None:
    """Keep only the JSON lines of steps ``<= step`` of the metrics log at ``path`` (atomic).

    A resumed run calls it with the checkpoint's step: the steps logged after that
    checkpoint, before the crash, are run again and logged again, so the log never
    holds a step twice nor misses one. A line cut short by the crash is dropped too."""
    if not os.path.isfile(path):
        return
    keep = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    _write_atomic(path, "".join(keep))


def load_latest(pm: Any, ckpt_dir: str) -> Optional[int]:
    """Load the newest complete checkpoint into ``pm``; returns its step, or None. Collective."""
    path = latest_path(ckpt_dir)
    if path is None:
        return None
    _materialize_zero1_state(pm)
    dcp.load({ROOT: TrainState(pm)}, checkpoint_id=path)
    return pm.step_count


def read_about(path: str) -> Optional[dict]:
    """The step directory's ``autopar.json`` (which model, which layout), or None (older checkpoints)."""
    f = os.path.join(path, ABOUT)
    if not os.path.isfile(f):
        return None
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


def read_model_state(path: str) -> dict[str, torch.Tensor]:
    """The model weights of the complete step directory ``path``, per fqn, as full (unsharded)
    CPU tensors, read in this one process without a process group (DCP keeps each tensor's
    logical shape: TP / FSDP / EP shards and every pipeline stage's units come back whole).
    Optimizer state is not read. Entries that are not tensors are left out."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    prefix = f"{ROOT}.model."
    model = {k[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in reader.read_metadata().state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({ROOT: {"model": model}}, storage_reader=reader, no_dist=True)
    return model
