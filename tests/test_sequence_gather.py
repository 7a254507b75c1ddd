"""The input of the module around a row-parallel linear (codegen/runtime/tensor_parallel.py
``GatherSequenceInput`` under sequence parallelism, ``ReplicateRegionInput`` without) on 2 gloo
ranks against one process: a block whose attention-like module feeds one input to three
column-parallel linears (q, k, v) and ends in a row-parallel one, styled through the one source
(codegen/runtime/tp_styles.py). The loss and every gradient equal the unsharded block's, and a
forward + backward makes the collectives the layout needs and no others. Sequence parallel: the
gather and its reduce-scatter in the backward, the row linear's reduce-scatter and its all-gather
in the backward; no all-reduce. Without: the row linear's all-reduce and one all-reduce of the
input gradient in the backward (each column linear all-reduced its own input gradient while the
module got a local tensor: q, k, v three). A module holding a parameter the plan leaves whole (a
norm before its linears) gets a local tensor, as before, and trains the same: there its column
linear all-reduces its input gradient. A module whose parameters are all sharded and which adds
its input to its output (a residual inside it) trains the same without SP, with the one all-reduce
(its own code keeps the local tensor; before, it got the DTensor and raised "mixed torch.Tensor and
DTensor"). The same holds where each linear is an FSDP2 unit of its own (whose pre-forward would hand
it a new alias of the input, were the region's hook not first) and under recompute, whose early stop
raises inside the module: no activation outlives the backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from launches import spawn_gloo

B, S, H = 2, 8, 8
KINDS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
# Attn: gather and the row linear's reduce-scatter forward, their all-gather and one reduce-scatter back;
# without SP the row linear's all-reduce forward and one all-reduce back. NormedMLP (a local input): its
# column linear's all-reduce back instead of the reduce-scatter
EXPECTED = {("Attn", True): {"all_reduce": 0, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
            ("Attn", False): {"all_reduce": 2, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0},
            ("NormedMLP", True): {"all_reduce": 1, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 1},
            ("NormedMLP", False): {"all_reduce": 2, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0},
            ("ResidualAttn", False): {"all_reduce": 2, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0}}


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))


class NormedMLP(nn.Module):
    """A user's MLP with its own norm on the gathered input (a module the plan does not style)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.up, self.down = nn.Linear(H, 2 * H, bias=False), nn.Linear(2 * H, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(self.norm(x))))


class ResidualAttn(Attn):
    """A user's attention that adds its (scaled) input back itself: every parameter sharded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x + super().forward(x)


class Block(nn.Module):
    def __init__(self, part: type[nn.Module] = Attn) -> None:
        super().__init__()
        self.attn = part()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


ATTN = {"attn.q": "column", "attn.k": "column", "attn.v": "column", "attn.o": "row"}
MLP = {"attn.up": "column", "attn.down": "row"}
# (module, TP roles, sequence parallel or not, wrapping): a residual inside the module is not sequence-sharded, so
# no SP. "units": each linear its own FSDP2 unit (over a 1-rank dp mesh), as data_parallel.module_units makes for a
# very large block, whose pre-forward hands the linear a new alias of its input; "recompute": the block recomputed
# in the backward (codegen/runtime/recompute.py), whose recompute stops early, raising inside the module
CASES = [(Attn, ATTN, True, None), (Attn, ATTN, False, None), (NormedMLP, MLP, True, None),
         (NormedMLP, MLP, False, None), (ResidualAttn, ATTN, False, None), (Attn, ATTN, False, "units"),
         (ResidualAttn, ATTN, False, "recompute"), (Attn, ATTN, True, "recompute")]
# the recompute repeats the forward up to the last tensor the backward saved, the row linear's input: under SP
# the gather again, never the row linear's own collective
AGAIN = {False: {"all_reduce": 0, "all_gather_into_tensor": 0, "reduce_scatter_tensor": 0},
         True: {"all_reduce": 0, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 0}}


def expected(part: str, sp: bool, wrap: str | None) -> dict[str, int]:
    again = AGAIN[sp] if wrap == "recompute" else dict.fromkeys(KINDS, 0)
    return {k: n + again[k] for k, n in EXPECTED[part, sp].items()}


def wrapped(model: nn.Module, wrap: str | None, dp_mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    from codegen.runtime.recompute import checkpoint_block

    if wrap == "units":
        for name in ("q", "k", "v", "o"):
            fully_shard(getattr(model.attn, name), mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    elif wrap == "recompute":
        checkpoint_block(model)
    return model


def stray_dtensors() -> int:
    """DTensors of the hidden state's shape alive (an activation kept past the backward)."""
    import gc

    from torch.distributed.tensor import DTensor

    return sum(isinstance(o, DTensor) and tuple(o.shape) == (B, S, H) for o in gc.get_objects())


def _worker(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.profiler import profile

    from codegen.runtime.tensor_parallel import apply_tp
    from codegen.runtime.tp_styles import styles_for

    mesh, out = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp")), {}
    for part, roles, sp, wrap in CASES:
        torch.manual_seed(0)
        model = wrapped(apply_tp(Block(part), mesh["tp"], styles_for(roles, sp)), wrap, mesh["dp"])
        x = torch.randn(B, S, H)
        x = (x.chunk(world, dim=1)[rank] if sp else x).requires_grad_()  # this rank's sequence shard, or all
        with profile() as prof:
            loss = (model(x) ** 2).sum()  # this shard's part of the whole loss
            loss.backward()
        loss_value = loss.item()
        calls = {k: sum(e.name == f"_c10d_functional::{k}" for e in prof.events()) for k in KINDS}
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in model.named_parameters()}
        del loss
        out[part.__name__, sp, wrap] = {"loss": loss_value, "grads": grads, "x_grad": x.grad, "calls": calls,
                                        "stray": stray_dtensors()}
    torch.save(out, f"{path}/rank{rank}.pt")


@pytest.mark.slow  # a 2-process launch (8-11 s on the shared 2 cores)
def test_region_input_feeds_column_linears_with_one_gradient_collective_back(tmp_path) -> None:
    spawn_gloo(_worker, 2, str(tmp_path))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for part, _, sp, wrap in CASES:
        torch.manual_seed(0)
        ref = Block(part)
        x = torch.randn(B, S, H).requires_grad_()  # the input's gradient: what the layers before need
        loss = (ref(x) ** 2).sum()
        loss.backward()
        case = (part.__name__, sp, wrap)
        got = [r[case] for r in res]
        # with SP each rank's loss is its shard's part of the whole; without, each rank has all of it
        ranks_loss = sum(r["loss"] for r in got) if sp else got[0]["loss"]
        assert abs(ranks_loss - loss.item()) <= 1e-5 * abs(loss.item()), case
        for rank, r in enumerate(got):
            for name, p in ref.named_parameters():
                assert torch.allclose(r["grads"][name], p.grad, rtol=1e-5, atol=1e-6), (case, rank, name)
            x_grad = x.grad.chunk(2, dim=1)[rank] if sp else x.grad
            assert torch.allclose(r["x_grad"], x_grad, rtol=1e-5, atol=1e-6), (case, rank)
            assert r["calls"] == expected(*case), (case, r["calls"])
            assert r["stray"] == 0, (case, r["stray"])  # nothing of the forward kept past the backward
