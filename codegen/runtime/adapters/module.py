"""Adapter for a user's own ``nn.Module``: a stack of repeated blocks between what runs
before it and what runs after it, the last unit returning logits.

Units come from the planner's capture (every member of the block stack, and every other
child on the way down to it; the plan names them) or from an explicit :class:`ModuleSpec`.
A stage runs its units in sequence, each fed the previous unit's output; a unit whose
``forward`` takes one of :data:`POSITION_ARGS` also gets the token positions (global ones
under context parallelism). Several units before the blocks, none taking positions (nanoGPT's
``wte(ids) + wpe(arange(S))`` summed at the root of the forward), are not a chain: the model's
own forward runs them, from the token ids up to the first block's input
(:meth:`ModuleAdapter.prologue`), and a pipeline stage holds them all. :meth:`ModuleAdapter.check_sequential` verifies once, on fake
tensors, that this sequence computes what the model's own forward computes (the same
floating-point ATen ops in the same order); when it does not (the forward adds positions
at the root, mixes two streams...), it says to pass an explicit spec.

Attention: ``torch.nn.functional.scaled_dot_product_attention`` calls inside a block (no
mask, no dropout) are routed to the runtime's implementation by a ``TorchFunctionMode``
entered by that block's forward pre-hook and left by its post-hook: scoped to that block
of that model instance, also when activation checkpointing recomputes it. The loss is the
summed token cross-entropy of the logits against per-position labels (as given: no
shift), or ``spec.loss(logits, labels)`` returning the summed loss.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from codegen.runtime import kernels as kern
from codegen.runtime.adapters.base import AttentionImpl, ModelAdapter, StageModule, Unit, attach, has_submodule
from planner.errors import first_line

POSITION_ARGS = ("positions", "position_ids", "pos")


@dataclass
class ModuleSpec:
    """An explicit description of a plain module for the runtime (and the planner).

    ``blocks``: path of the ``nn.ModuleList`` / ``nn.Sequential`` of repeated blocks;
    ``before`` / ``after``: unit paths run before / after them, in order, the last of
    ``after`` the head returning logits; ``loss(logits, labels) -> summed loss`` (default:
    token cross-entropy, ``-100`` ignored)."""
    blocks: str
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    loss: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def units(self, model: nn.Module) -> list[Unit]:
        stack = model.get_submodule(self.blocks)
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)) or len(stack) < 1:
            raise ValueError(f"ModuleSpec.blocks {self.blocks!r} is not a ModuleList/Sequential of blocks")
        if not self.after:
            raise ValueError("ModuleSpec.after must end with the head (the unit returning logits)")
        return ([Unit(u, "before") for u in self.before] +
                [Unit(f"{self.blocks}.{n}", "block") for n, _ in stack.named_children()] +
                [Unit(u, "after") for u in self.after[:-1]] + [Unit(self.after[-1], "head")])


def units_in_order(model: nn.Module, names: Sequence[str]) -> list[Unit]:
    """Kinds for the units ``names`` (in execution order, as captured and planned): members of
    the largest stack of repeated blocks are blocks, units before them ``before``, after them
    ``after``, the last one the head."""
    stacks: dict[str, Optional[str]] = {}
    for n in names:
        parent = n.rpartition(".")[0]
        stack = model.get_submodule(parent) if parent else None
        stacks[n] = parent if isinstance(stack, (nn.ModuleList, nn.Sequential)) and len(stack) > 1 else None
    counts: dict[str, int] = {}
    for s in stacks.values():
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    if not counts:
        raise ValueError("no stack of repeated blocks (nn.ModuleList / nn.Sequential) was found")
    stack = max(counts, key=counts.get)
    idx = [i for i, n in enumerate(names) if stacks.get(n) == stack]
    out = []
    for i, n in enumerate(names):
        kind = ("block" if i in idx else "before" if i < idx[0] else "head" if i == len(names) - 1 else "after")
        out.append(Unit(n, kind))
    if out[-1].kind != "head":
        raise ValueError("the last unit is a block: a head returning logits must follow the blocks")
    return out


class _SDPARoute(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` (no mask, no dropout) to ``impl``."""

    def __init__(self, impl: AttentionImpl):
        super().__init__()
        self.impl = impl
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args), **kwargs)
            if a.get("attn_mask") is None and not a.get("dropout_p"):
                self.calls += 1
                return self.impl(a["query"], a["key"], a["value"], causal=bool(a.get("is_causal", False)),
                                 scale=a.get("scale"))
        return func(*args, **kwargs)


class _BlockInput(Exception):
    """Stops a model's forward at its first block, carrying that block's input."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("first block reached")
        self.hidden = hidden


def _position_kw(mod: nn.Module) -> Optional[str]:
    params = inspect.signature(mod.forward).parameters
    return next((p for p in POSITION_ARGS if p in params), None)


class ModuleAdapter(ModelAdapter):
    kind = "module"

    def __init__(self, model: nn.Module, spec: Optional[ModuleSpec] = None,
                 units: Optional[Sequence[Unit]] = None):
        spec = spec if spec is not None else getattr(model, "autopar_spec", None)
        self.spec = spec
        if spec is not None:
            unit_list = spec.units(model)
        elif units is not None:
            unit_list = list(units)
        else:
            raise ValueError(f"{type(model).__name__}: a plain module's units come from its capture or an explicit "
                             "ModuleSpec(blocks=..., before=..., after=..., loss=...)")
        super().__init__(model, unit_list)
        self.pos_kw = {u: _position_kw(model.get_submodule(u)) for u in self.units}
        self.head = self.unit_list[-1].name
        before = [u.name for u in self.unit_list if u.kind == "before"]
        # the units the model's own forward runs up to the first block (module docstring)
        self.root_prologue = before if len(before) > 1 and not any(self.pos_kw[u] for u in before) else []

    def stage_starts(self) -> list[bool]:
        """A stage may start anywhere but inside the root prologue (:meth:`prologue`)."""
        return [u.name not in self.root_prologue[1:] for u in self.unit_list]

    def prologue(self, ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward on the token ids ``ids`` up to its first block's input (the
        first block does not run: a pre-hook, removed on return, stops the forward there)."""
        first = self.model.get_submodule(self.blocks[0])

        def stop(mod, args, kwargs):
            raise _BlockInput(args[0] if args else next(iter(kwargs.values())))

        handle = first.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self.model(ids)
        except _BlockInput as reached:
            return reached.hidden
        finally:
            handle.remove()
        raise ValueError(f"{type(self.model).__name__}'s forward never reached its first block {self.blocks[0]}")

    def limits(self) -> dict[str, str]:
        out: dict[str, str] = {}
        covered = {id(p) for u in self.units for p in self.model.get_submodule(u).parameters()}
        loose = [n for n, p in self.model.named_parameters() if id(p) not in covered]
        if loose:
            out["any"] = (f"parameters outside every unit ({', '.join(loose[:3])}) would not be trained; move "
                          "them into a unit, or name the units in a ModuleSpec")
        if not any(self.pos_kw.values()):
            out["cp"] = (f"no unit takes token positions (a `{POSITION_ARGS[0]}` argument): context parallel "
                         "would give every rank positions from 0")
        head = self.model.get_submodule(self.head)
        if not isinstance(head, nn.Linear) or head.bias is not None:
            out["fused_loss"] = f"the head {self.head} is not a bias-free nn.Linear returning the logits"
        if self.spec is not None and self.spec.loss is not None:
            out["tp"] = "a custom loss function takes the full logits; tensor parallel shards them by vocabulary"
            out["fused_loss"] = "a custom loss function replaces the cross-entropy the fused kernel computes"
        return out

    def build_stage(self, units: Sequence[str], recompute: str) -> StageModule:
        return ModuleStage(self, units, recompute)

    def tp_fixups(self, stage: StageModule, tp_mesh, layout: dict[str, str], sp: bool) -> None:
        """Head counts held as attributes of attention modules (``self.n_head`` in a view)
        become local: integer attributes named like a head count (``*head*``, not a size or
        dim) on the parents of column-parallel linears, equal to a global head count."""
        tp = tp_mesh.size()
        stage.tp_size = tp
        if tp == 1:
            return
        heads = set(self.facts.heads) | set(self.facts.kv_heads) if self.facts is not None else set()
        parents = {f.rpartition(".")[0] for f, r in layout.items()
                   if r in ("column", "packed_qkv") and has_submodule(stage, f)}
        for name in parents:
            mod = stage.get_submodule(name)
            if not self.installs.first_time(mod, "tp sizes"):
                continue
            for attr, v in list(vars(mod).items()):
                if (isinstance(v, int) and not isinstance(v, bool) and "head" in attr and "dim" not in attr
                        and "size" not in attr and v in heads and v % tp == 0):
                    setattr(mod, attr, v // tp)

    def attention_modules(self, block: nn.Module) -> list[nn.Module]:
        return [block]

    def set_attention(self, block: nn.Module, impl: AttentionImpl) -> None:
        """Route ``block``'s SDPA calls to ``impl`` while it runs (hooks on that instance)."""
        route = _SDPARoute(impl)

        def enter(mod, args):
            route.__enter__()

        def leave(mod, args, out):
            route.__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave, always_call=True)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.spec is not None and self.spec.loss is not None:
            return self.spec.loss(logits, labels)
        return kern.logits_loss(logits, labels)

    def sequential(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None,
                   units: Optional[Sequence[str]] = None) -> torch.Tensor:
        """Run ``units`` (default all) in sequence from ``x`` (see the module docstring)."""
        units = list(units or self.units)
        if self.root_prologue and units[0] == self.root_prologue[0]:
            x, units = self.prologue(x), units[len(self.root_prologue):]
        for u in units:
            mod = self.model.get_submodule(u)
            kw = {self.pos_kw[u]: positions} if self.pos_kw[u] and positions is not None else {}
            x = mod(x, **kw)
        return x

    def check_sequential(self, example: tuple | dict) -> None:
        """Raise ValueError unless running the units in sequence performs the model's own
        floating-point ops in the same order (fake tensors: nothing is allocated)."""
        from codegen.runtime.torch_compat import FakeTensorMode, observe_ops

        class Log:
            """The floating-point ops run under :meth:`watching`, and the last op dispatched."""

            def __init__(self):
                self.ops, self.last = [], "?"

            def watching(self):
                return observe_ops(self.seen, before=self.starting)

            def starting(self, func) -> None:
                self.last = func.overloadpacket.__name__

            def seen(self, func, args, kwargs, out) -> None:
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    self.ops.append((func.overloadpacket.__name__, tuple(out.shape)))

        args, kwargs = (example, {}) if isinstance(example, tuple) else ((), dict(example))
        kwargs.pop("labels", None)
        ids = args[0] if args else kwargs.get("input_ids")
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            fake_ids = mode.from_tensor(torch.zeros(ids.shape, dtype=ids.dtype, device="meta"))
            full, seq = Log(), Log()
            with full.watching():
                self.model(fake_ids, *args[1:], **{k: v for k, v in kwargs.items() if k != "input_ids"})
            with seq.watching():
                self._run_units_or_explain(fake_ids, seq)
        if full.ops != seq.ops:
            at = next((i for i, (a, b) in enumerate(zip(full.ops, seq.ops)) if a != b), min(len(full.ops), len(seq.ops)))
            raise ValueError(
                f"running {type(self.model).__name__}'s units {self.units[0]} ... {self.units[-1]} one after another "
                f"does not compute its forward (they differ at op {at}: "
                f"{full.ops[at:at + 1] or 'end'} vs {seq.ops[at:at + 1] or 'end'}); pass an explicit "
                "ModuleSpec(blocks=..., before=..., after=..., loss=...) (auto_parallelize(..., module_spec=...), "
                "or set model.autopar_spec)")


    def _run_units_or_explain(self, ids: torch.Tensor, log) -> None:
        """:meth:`sequential` on ``ids``; a failure is one ValueError naming the unit and the op
        (``log.last``, the last ATen op dispatched) where the units stop composing."""
        where = {"unit": self.units[0]}
        hooks = [self.model.get_submodule(u).register_forward_pre_hook(lambda m, a, u=u: where.update(unit=u))
                 for u in self.units]
        try:
            self.sequential(ids)
        except Exception as e:
            raise ValueError(
                f"capture failed in {where['unit']} (aten.{log.last}) running "
                f"{type(self.model).__name__}'s units one after another: {first_line(e)}; they do not compute its "
                "forward: pass an explicit ModuleSpec(blocks=..., before=..., after=..., loss=...) "
                "(auto_parallelize(..., module_spec=...), or set model.autopar_spec)") from e
        finally:
            for h in hooks:
                h.remove()


class ModuleStage(StageModule):
    """A run of a plain module's units, fed one into the next (see the module docstring)."""

    def __init__(self, adapter: ModuleAdapter, units: Sequence[str], recompute: str):
        super().__init__(units, adapter.units, recompute)
        self.adapter = adapter
        self.tp_size = 1
        for u in self.units:
            attach(self, u, adapter.model.get_submodule(u))

    def forward(self, *args: torch.Tensor, labels: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, doc_start: Optional[torch.Tensor] = None):
        x = args[0]
        seq = x.shape[1] * (self.tp_size if self.sp and not self.is_first else 1)
        pos = self.take_step(positions, doc_start)
        pos = pos if pos is not None else torch.arange(seq, device=x.device)
        body = self.units[:-1] if self.is_last and labels is not None else self.units
        x = self.adapter.sequential(x, pos, body) if body else x
        if not (self.is_last and labels is not None):
            return x.to_local() if hasattr(x, "to_local") else x
        head = self.get_submodule(self.adapter.head)
        if self.loss_kernel == "fused":
            return kern.linear_loss(head.weight, x, labels, sp=self.sp)
        return self.adapter.loss(head(x), labels)
