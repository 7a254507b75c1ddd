"""Private torch APIs live in one module, ``codegen/runtime/torch_compat.py`` (with the torch
versions it was checked on): no other module of ours, tests included, imports a torch module
or name starting with ``_`` or reaches one through an attribute of torch (``torch._foreach_norm``,
``torch.ops._c10d_functional``, ``aten._scaled_dot_product_*`` through ``aten = torch.ops.aten``),
or calls the private DeviceMesh / process-group methods named in ``PRIVATE_METHODS``, or matches a
private ATen op by its name (``"_unsafe_view"``), or replaces an attribute of torch (a process-wide patch)."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPAT = os.path.join("codegen", "runtime", "torch_compat.py")
SCANNED = ("planner", "cost_models", "codegen", "benchmarks", "tests")
# private methods of torch objects (a DeviceMesh, a process group) an attribute chain cannot tell
# from our own: named here so a call outside torch_compat fails
PRIVATE_METHODS = {"_flatten", "_unflatten", "_get_root_mesh", "_get_backend", "_set_default_backend",
                   "_modules", "_cdata", "_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                   "_parameters", "_buffers", "_local_tensor", "_ddp", "_comm_hooks",
                   "_opname", "_apply", "_partition_linear_fn", "_prepare_input_fn", "_prepare_output_fn"}  # and private attributes of modules, storages, DTensors, DDP states, ops


# private hooks of torch's TP styles a subclass could override (torch calls them): only torch_compat
# may reach them; our styles pass their own functions (``torch_compat.apply_as_linear``). ``_apply``,
# ParallelStyle's one method to implement, is how every custom style is written.
PRIVATE_HOOKS = {"_partition_linear_fn", "_prepare_input_fn", "_prepare_output_fn", "_partition_embedding_fn"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_aten_op(name: str) -> bool:
    """Whether ``name`` is a private ATen op's base name (``_softmax``, ``_unsafe_view``)."""
    import torch

    if not _private(name) or not name.isidentifier():
        return False
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_torch_uses(source: str) -> list[str]:
    """``line: what`` for each private torch name ``source`` touches (module docstring)."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add(a.asname or "torch")
                    if any(map(_private, a.name.split("."))):
                        found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                torch_names.add(a.asname or a.name)
                if any(map(_private, node.module.split(".") + [a.name])):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):  # aliases: aten = torch.ops.aten
        if isinstance(node, ast.Assign) and (c := _chain(node.value)) and c[0] in torch_names:
            torch_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    affixes = {id(a) for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in ("endswith", "startswith") for a in node.args}  # "_backward": a suffix
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            c = _chain(node)
            if c and c[0] in torch_names and any(map(_private, c[1:])):
                found.append(f"{node.lineno}: {'.'.join(c)}")
            elif node.attr in PRIVATE_METHODS:
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and (c := _chain(t)) and c[0] in torch_names
                                                  for t in node.targets):
            found.append(f"{node.lineno}: patches {'.'.join(c)}")  # a torch attribute replaced: a side channel
        elif isinstance(node, ast.FunctionDef) and node.name in PRIVATE_HOOKS:
            found.append(f"{node.lineno}: def {node.name}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in affixes
              and private_aten_op(node.value)):
            found.append(f"{node.lineno}: names aten {node.value}")  # a private op matched by its name
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_METHODS):
            found.append(f"{node.lineno}: getattr(..., {node.args[1].value!r})")
    return sorted(set(found))


def test_the_scan_sees_each_kind_of_private_use():
    src = ("import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_map\n"
           "aten = torch.ops.aten\nx = aten._scaled_dot_product_flash_attention\ny = torch._foreach_norm\n"
           "z = dist.distributed_c10d._world\nm = mesh._flatten('a')\nok = torch.ops.aten.mm\n"
           "kids = block._modules\nsid = t.untyped_storage()._cdata\nname = getattr(op, '_opname', None)\n"
           "class S(ColwiseParallel):\n    def _prepare_output_fn(self, *a):\n        pass\n"
           "torch.UntypedStorage.resize_ = len\nVIEWS = {'view', '_unsafe_view', '_tp_plan'}\n")
    assert sorted(u.split(": ", 1)[1] for u in private_torch_uses(src)) == sorted([
        "from torch.utils._pytree import tree_map", "aten._scaled_dot_product_flash_attention",
        "torch._foreach_norm", "dist.distributed_c10d._world", "._flatten", "._modules", "._cdata",
        "getattr(..., '_opname')", "def _prepare_output_fn", "patches torch.UntypedStorage.resize_",
        "names aten _unsafe_view"])


def test_private_torch_apis_only_in_torch_compat():
    bad = []
    for pkg in SCANNED:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in (f for f in files if f.endswith(".py")):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if rel == COMPAT:
                    continue
                with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                    bad += [f"{rel}:{u}" for u in private_torch_uses(fh.read())]
    assert not bad, "private torch APIs outside codegen/runtime/torch_compat.py (move them there):\n" + "\n".join(bad)


def test_torch_compat_names_the_versions_it_was_checked_on():
    import torch
    from codegen.runtime import torch_compat

    assert torch_compat.CHECKED_ON and all(v in torch_compat.__doc__ for v in torch_compat.CHECKED_ON)
    if torch.__version__.split("+")[0] not in torch_compat.CHECKED_ON:  # a new torch: the list must be re-checked
        import warnings
        warnings.warn(f"torch {torch.__version__} is not among torch_compat.CHECKED_ON {torch_compat.CHECKED_ON}")
