"""Activation offload per block (the ``offload`` recompute policy), installed on the model instance.

Each repeated block of a stage whose policy is ``offload`` gets a forward pre-hook that enters
``torch.autograd.graph.saved_tensors_hooks`` and a forward hook that leaves it (hooks on that
block instance, removed when the build's ``Installs`` close; nothing process-wide). Inside,
every tensor autograd saves for the block's backward is copied to host memory (pack) and
copied back when the backward reads it (unpack):

- one forward of one block is a :class:`_Group` (its saved tensors, host copies and, once
  reloaded, device copies). On GPU the host buffers are pinned and both copies run on a side
  stream of the stage's :class:`Offloader` (the device-to-host copy beside the block's own
  forward compute; the compute stream waits for a reload only when it reads it);
- when the backward first reads a group, the group's reload starts (if not started) and so
  does the reload of the group packed just before it in the same stage forward (the block
  before, same micro-batch): its copy overlaps this block's backward (what
  ``cost_models/offload.py`` prices). A reloaded tensor is handed to autograd once and
  dropped; a second read (a split backward's weight pass) copies it again from the host;
- the block's parameters and views of them (a transposed weight a matmul saves) stay where
  they are: a tensor sharing a parameter's storage is not copied; a DTensor (tensor parallel)
  moves its local shard and is rebuilt around it on the way back.

On CPU (gloo) host and device memory are the same: the copies are plain copies, which is what
the parity tests exercise (the same grouping, reload order and release as on GPU).
"""
from __future__ import annotations

from typing import Optional

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from codegen.runtime.installs import Installs


class _Group:
    """The saved tensors of one forward of one block: host copies, device copies once reloaded."""

    def __init__(self, prev: Optional["_Group"]) -> None:
        self.prev = prev
        self.host: list[torch.Tensor] = []
        self.device: dict[int, torch.Tensor] = {}
        self.where: list[torch.device] = []
        self.stored: Optional[torch.cuda.Event] = None  # the device-to-host copies done (GPU)
        self.loaded: Optional[torch.cuda.Event] = None  # the reload done (GPU)
        self.reloading = False


class _Sharded:
    """A packed DTensor: its local shard's handle and what rebuilds it."""

    def __init__(self, local, t: DTensor) -> None:
        self.local, self.mesh, self.placements = local, t.device_mesh, t.placements
        self.shape, self.stride = t.shape, t.stride()


class Offloader:
    """Pack / unpack for the blocks of one stage module, with one side stream on GPU."""

    def __init__(self) -> None:
        self.current: Optional[_Group] = None
        self.block: Optional[nn.Module] = None
        self.weights: Optional[set[int]] = None  # storages of the running block's parameters
        self.last: Optional[weakref.ref] = None  # the group opened last (the graph keeps groups alive)
        self.stream: Optional[torch.cuda.Stream] = None
        self.moved_bytes = 0  # bytes copied to host so far (what the device did not keep)
        self.reloads = 0      # tensors copied back

    def _side(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        if device.type != "cuda":
            return None
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def open(self, block: nn.Module, first: bool) -> None:
        """``block``'s forward begins (``first``: the stage's first offloaded block)."""
        self.current = _Group(None if first or self.last is None else self.last())
        self.last, self.block, self.weights = weakref.ref(self.current), block, None

    def close(self) -> None:
        """The running block's forward ended."""
        self.current = self.block = self.weights = None

    def _is_weight(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares storage with a parameter of the running block (read at its first
        saved tensor: parameters a data-parallel wrapper gathers exist by then)."""
        if self.weights is None:
            locals_ = (p.to_local() if isinstance(p, DTensor) else p for p in self.block.parameters())
            self.weights = {p.untyped_storage().data_ptr() for p in locals_}
        return t.untyped_storage().data_ptr() in self.weights

    def pack(self, t: torch.Tensor):
        if self.current is None or (t.is_leaf and t.requires_grad):
            return t  # outside a forward, or a parameter: kept as is
        if isinstance(t, DTensor):
            with torch.no_grad():
                return _Sharded(self.pack(t.to_local()), t)
        if type(t) is not torch.Tensor or self._is_weight(t):
            return t  # another tensor subclass, or a weight's view: kept
        return self._store(t)

    def _store(self, t: torch.Tensor):
        g = self.current
        side = self._side(t.device)
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=side is not None)
        if side is None:
            host.copy_(t)
        else:
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                g.stored = torch.cuda.Event()
                g.stored.record(side)
            t.record_stream(side)  # its memory is not reused before the copy is done
        g.host.append(host)
        g.where.append(t.device)
        self.moved_bytes += host.numel() * host.element_size()
        return g, len(g.host) - 1

    def _reload(self, g: _Group) -> None:
        """Start copying ``g`` back to its devices (on the side stream on GPU)."""
        if g.reloading:
            return
        g.reloading = True
        side = self._side(g.where[0]) if g.where else None
        if side is None:
            g.device = {i: h.to(d) for i, (h, d) in enumerate(zip(g.host, g.where))}
            return
        with torch.cuda.stream(side):
            if g.stored is not None:
                side.wait_event(g.stored)
            g.device = {i: h.to(d, non_blocking=True) for i, (h, d) in enumerate(zip(g.host, g.where))}
            g.loaded = torch.cuda.Event()
            g.loaded.record(side)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Sharded):
            with torch.no_grad():
                return DTensor.from_local(self.unpack(packed.local), packed.mesh, packed.placements, run_check=False,
                                          shape=packed.shape, stride=packed.stride)
        g, i = packed
        self._reload(g)
        if g.prev is not None:
            self._reload(g.prev)  # overlaps this block's backward
        t = g.device.pop(i, None)
        self.reloads += 1
        if t is None:  # read again (a split backward's second pass): copy once more
            return g.host[i].to(g.where[i])
        if g.loaded is not None:
            torch.cuda.current_stream(t.device).wait_event(g.loaded)
            t.record_stream(torch.cuda.current_stream(t.device))
        return t


def offload_blocks(blocks: list[nn.Module], installs: Optional[Installs] = None) -> Optional[Offloader]:
    """Offload the saved activations of ``blocks`` (one stage's offloaded blocks, in forward
    order) to host memory; hooks on those instances, removed when ``installs`` close; once per
    block per build. Returns the stage's :class:`Offloader` (None when there is nothing to do)."""
    blocks = [b for b in blocks if installs is None or installs.first_time(b, "offload")]
    if not blocks:
        return None
    off = Offloader()
    for k, block in enumerate(blocks):
        _hook(block, off, first=k == 0)
    return off


def _hook(block: nn.Module, off: Offloader, first: bool) -> None:
    ctx: list = []

    def pre(mod, args, kwargs):
        if torch.is_grad_enabled():
            off.open(mod, first)
            ctx.append(torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack))
            ctx[-1].__enter__()

    def post(mod, args, output):
        if ctx:
            ctx.pop().__exit__(None, None, None)
            off.close()

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post, always_call=True)
