"""Per-batch assignment in the runtime against the fixed layout on the same batches (gloo, fp32).

One torchrun launch of 4 processes (``tests/batch_worker.py``): llama-tiny and gpt-tiny train 3
SGD steps on packed batches of one 32-token document and 24 short ones, on the fixed layout
(dp4) and with per-batch assignment over the dp x cp pool (codegen/runtime/batch_parallel.py):
ring groups of the size the rule picks, of 3 (non-power-of-two) and of 4 (dp1 x cp4), and
Ulysses groups of 2 and 4; under a pipeline (pp2 x cp2 ring with 1f1b, pp2 x dp2 Ulysses with gpipe; two
micro-batches each assigned on its own, rows padded to the pool's 40 tokens) against the
fixed pp2 x dp2 layout. First-step gradients, their global norm and the 3 losses must
match the fixed layout's within 1e-5 relative, and the long document must have run on the
group size asked for. In the same launch (tests/mm_worker.py) mllm-tiny trains on multimodal
batches with 0 to 6 images per sample (codegen/runtime/multimodal.py) on dp4 and dp2 with the
per-batch planner's assignment and on dp4's fixed split: losses and first-step gradients
within 1e-5 of one process on the whole batch, and the assignment must lower the busiest rank's
work below the fixed split's.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launches import run_launch  # noqa: E402
from planner.entry.launch import free_port  # noqa: E402
from test_runtime_parity import assert_parity  # noqa: E402

pytestmark = pytest.mark.slow
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batch_worker.py")
EXPECTED_SIZE = {"ring": None, "ring-g3": 3, "ring-cp4-g4": 4, "ulysses-g2": 2, "ulysses-g4": 4,
                 "pp2-cp2-ring": 2, "pp2-dp2-ulysses": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("per_batch") / "w4.json")

    def cmd() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={free_port()}",
                WORKER, out]
    proc = run_launch(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"), timeout=600)
    assert proc.returncode == 0 and os.path.exists(out), proc.stderr[-6000:]
    with open(out) as fh:
        return json.load(fh)


@pytest.mark.parametrize("name", sorted(EXPECTED_SIZE))
def test_per_batch_assignment_matches_fixed_layout(runs, name: str) -> None:
    r = runs[name]
    assert_parity(r)
    long_doc = [g for g in r["groups"] if g[0] == 32]
    assert long_doc, r["groups"]  # the long document ran on a group
    if name.startswith("pp2"):  # every row padded to the capacity: the pads ran (fewer real tokens)
        assert r["row"] == 40 and len(r["held"]) == 2, (r["row"], r["held"])
        assert all(max(h) <= 40 for h in r["held"]) and min(min(h) for h in r["held"]) < 40, r["held"]
    else:
        assert r["row"] is None
    if EXPECTED_SIZE[name] is not None:
        assert long_doc[0][1] == EXPECTED_SIZE[name]
    else:
        assert long_doc[0][1] > 1


@pytest.mark.parametrize("name", ["mm-dp4-assigned", "mm-dp4-fixed", "mm-dp2-assigned"])
def test_multimodal_assignment_matches_one_process(runs, name: str) -> None:
    r = runs[name]
    assert_parity(r)
    dp = 2 if "dp2" in name else 4
    groups = [r["samples"][i:i + dp] for i in range(0, 4, dp)]
    for ranks in groups:  # every sample on exactly one rank of each data-parallel group
        assert sorted(i for mine in ranks for i in mine) == list(range(8)), ranks
    fixed, assigned = r["balance"]["fixed"], r["balance"]["assigned"]
    if name.endswith("fixed"):
        assert r["samples"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert assigned == fixed
    else:
        assert max(assigned) < max(fixed), (assigned, fixed)  # the images no longer bunch on one rank
        assert sum(assigned) == pytest.approx(sum(fixed))
