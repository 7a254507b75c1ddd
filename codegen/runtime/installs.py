"""What one build installs, recorded so that closing it leaves the process and the model as
they were (``ParallelModel.close``, ``auto_parallelize(...).close()``).

A build (an adapter, then ``parallelize``) changes three kinds of things outside the objects
it creates, and :class:`Installs` records each as it happens:

- **the model's modules**: :meth:`Installs.__init__` snapshots every module's own attributes
  (``__dict__`` entries outside torch's containers: head counts, ``config``, an attention
  slot) and the ids of its hooks; :meth:`Installs.close` deletes the attributes and hooks
  added since and puts back the values replaced (a TP head count, a model's config copy).
  Parameters and the module classes FSDP2 swaps are not restored: a closed model is done;
- **registries of other libraries** (transformers' ``AttentionInterface``, mask and experts
  registries): :meth:`Installs.register` adds an entry under a name unique to this build
  (:attr:`Installs.tag`) and close removes it, restoring an entry it replaced;
- **the process**: environment variables (:meth:`Installs.setenv`) and the process groups
  created while the build ran (:meth:`Installs.own_groups_since`), destroyed at close; an
  ``atexit`` hook destroys them if the program ends without closing (gloo's threads are then
  joined before the interpreter tears down, see ``codegen/runtime/mesh.py``), and close
  removes it.

Nothing is stamped on the modules to remember what was done: per-module marks (blocks
already checkpointed, head counts already made local) are kept by :meth:`Installs.first_time`.
"""
from __future__ import annotations

import atexit
import itertools
import os
from typing import Any, Callable, Hashable, Optional

from torch import nn

from codegen.runtime.torch_compat import clear_dtensor_caches, live_process_groups, module_hook_dicts

_TAGS = itertools.count(1)
_MISSING = object()
_TORCH_KEYS = frozenset(nn.Module().__dict__)  # nn.Module's own containers and flags


class Installs:
    """The record of one build (module docstring)."""

    def __init__(self, model: Optional[nn.Module] = None):
        self.tag = f"b{next(_TAGS)}"
        self._undo: list[Callable[[], None]] = []
        self._marks: set[tuple[int, Hashable]] = set()
        self._groups: list = []
        self._exit_hook: Optional[Callable[[], None]] = None
        self._module_state = _snapshot(model) if model is not None else []
        self.closed = False

    def first_time(self, obj: Any, what: Hashable) -> bool:
        """True the first time ``(obj, what)`` is asked in this build (``obj`` kept alive by the model)."""
        key = (id(obj), what)
        if key in self._marks:
            return False
        self._marks.add(key)
        return True

    def register(self, registry: Any, key: str, value: Any) -> None:
        """``registry.register(key, value)`` (a transformers ``GeneralInterface``), undone at close. The
        one place that reaches its class-wide ``_global_mapping`` (transformers has no public way
        to remove a registered key); everything else reads registries as the Mappings they are."""
        mapping = registry._global_mapping
        prev = mapping.get(key, _MISSING)
        registry.register(key, value)
        self._undo.append(lambda: mapping.__setitem__(key, prev) if prev is not _MISSING else mapping.pop(key, None))

    def setenv(self, key: str, value: str) -> None:
        """``os.environ[key] = value`` when unset, restored (unset) at close."""
        if key in os.environ:
            return
        os.environ[key] = value
        self._undo.append(lambda: os.environ.pop(key, None))

    def own_groups_since(self, before: list) -> None:
        """Take over the process groups created since ``before`` (a :func:`live_process_groups`
        list): destroyed at close, or at exit when the program never closes."""
        known = {id(g) for g in before}
        self._groups += [g for g in live_process_groups() if id(g) not in known]
        if self._groups and self._exit_hook is None:
            self._exit_hook = self._at_exit
            atexit.register(self._exit_hook)

    def _at_exit(self) -> None:
        """The program ends without closing: destroy the groups, then collect the garbage still
        holding them, so each gloo group's threads are joined now, not during the interpreter's
        teardown (where a rank can abort: ``codegen/runtime/mesh.py``)."""
        import gc

        self._destroy_groups()
        gc.collect()

    def _destroy_groups(self) -> None:
        import torch.distributed as dist

        if not self._groups:
            return
        clear_dtensor_caches()  # cached DTensor specs hold meshes over these groups (torch_compat)
        live = {id(g) for g in live_process_groups()}
        for g in reversed(self._groups):  # the default group (if ours) was created first: it goes last
            if id(g) in live:
                dist.destroy_process_group(g if g is not _default_group() else None)
        self._groups = []

    def close(self) -> None:
        """Undo everything recorded, newest first; then the modules' attributes and hooks. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._destroy_groups()
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        while self._undo:
            self._undo.pop()()
        for mod, attrs, hooks in self._module_state:
            _restore(mod, attrs, hooks)


def _default_group():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


def _snapshot(model: nn.Module) -> list[tuple[nn.Module, dict, dict]]:
    """(module, its own attributes, its hook ids per hook dict) for every module of ``model``."""
    return [(m, {k: v for k, v in m.__dict__.items() if k not in _TORCH_KEYS},
             {name: set(d) for name, d in module_hook_dicts(m).items()}) for m in model.modules()]


def _restore(mod: nn.Module, attrs: dict, hooks: dict) -> None:
    for k in [k for k in mod.__dict__ if k not in _TORCH_KEYS and k not in attrs]:
        del mod.__dict__[k]
    for k, v in attrs.items():
        if mod.__dict__.get(k, _MISSING) is not v:
            mod.__dict__[k] = v
    for name, d in module_hook_dicts(mod).items():
        for hid in [h for h in d if h not in hooks.get(name, ())]:
            del d[hid]
