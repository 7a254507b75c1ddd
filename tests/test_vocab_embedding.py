"""The vocabulary-parallel embedding style (codegen/runtime/tensor_parallel.py ``VocabParallelEmbedding``)
on 2 gloo ranks against one process: a token embedding tied to a column-parallel head, with and
without sequence parallelism, styled through the one source (codegen/runtime/tp_styles.py). The loss
and the tied weight's gradient equal the unsharded model's; each rank's gradient is its own rows
only, and the lookup's backward builds the gradient of those rows, never of the whole table (torch's
``RowwiseParallel`` builds all ``VOCAB`` rows on every rank)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from launches import spawn_gloo

VOCAB, HIDDEN, PAD = 41, 8, 30  # 41 rows split 21 / 20; the padding row on rank 1's shard
IDS = torch.tensor([[0, 20, 21, 40, 5, 30], [33, 1, 30, 19, 22, 40]])  # both shards, both boundaries
LABELS = torch.tensor([[3, 40, 0, 21, 20, 7], [12, 35, 2, 40, 1, 0]])


class TiedLM(nn.Module):
    """An embedding whose table is also the output projection's weight (as gpt-small ties them)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def _worker(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import profile

    from codegen.runtime.tensor_parallel import apply_tp, loss_context
    from codegen.runtime.tp_styles import styles_for

    mesh, out = init_device_mesh("cpu", (world,)), {}
    for sp in (False, True):
        torch.manual_seed(0)
        model = apply_tp(TiedLM(), mesh, styles_for({"emb": "vocab_embed", "head": "vocab_head"}, sp))
        with loss_context(world), profile(record_shapes=True) as prof:
            loss = nn.functional.cross_entropy(model(IDS).flatten(0, 1), LABELS.flatten())
            loss.backward()
        grad = model.emb.weight.grad
        # the rows each lookup's backward builds a gradient of (its num_weights argument)
        built = sorted({e.concrete_inputs[2] for e in prof.events() if e.name == "aten::embedding_dense_backward"})
        out[sp] = {"loss": loss.full_tensor().item(), "grad": grad.full_tensor(), "local": tuple(grad.to_local().shape),
                   "tied": model.head.weight is model.emb.weight, "built": built}
    torch.save(out, f"{path}/rank{rank}.pt")


@pytest.mark.slow  # a 2-process launch (8-11 s on the shared 2 cores)
def test_vocab_parallel_embedding_equals_one_process_and_keeps_its_rows(tmp_path) -> None:
    spawn_gloo(_worker, 2, str(tmp_path))
    torch.manual_seed(0)
    ref = TiedLM()
    loss = nn.functional.cross_entropy(ref(IDS).flatten(0, 1), LABELS.flatten())
    loss.backward()
    for rank, rows in ((0, 21), (1, 20)):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for sp in (False, True):
            r = res[sp]
            assert abs(r["loss"] - loss.item()) <= 1e-6 * abs(loss.item()), (rank, sp)
            assert torch.allclose(r["grad"], ref.emb.weight.grad, rtol=1e-5, atol=1e-7), (rank, sp)
            assert r["local"] == (rows, HIDDEN) and r["tied"], (rank, sp)
            assert r["built"] == [rows], (rank, sp, r["built"])  # not the whole table's VOCAB rows
