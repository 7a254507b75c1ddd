"""Memory-model fidelity, reduced: predicted per-rank peak (``estimate(...).memory[pp].tensors``)
vs the live-tensor peak of the second AdamW step, measured by benchmarks/memory_fidelity.py's
tracker in one 2-process gloo launch (llama-tiny, seq 128, global batch 4, fp32)."""
from __future__ import annotations

import os
import tempfile

import pytest

from benchmarks import memory_fidelity as mf

pytestmark = pytest.mark.slow

MODEL, SEQ, GB = "llama-tiny", 128, 4


@pytest.fixture(scope="module")
def rows():
    with tempfile.TemporaryDirectory() as tmp:
        measured = mf.launch(2, MODEL, SEQ, GB, ["dp2-ddp", "dp2-fsdp", "pp2-1f1b"], os.path.join(tmp, "m.json"),
                             timeout=240)
    out = mf.compare(measured, MODEL, SEQ, GB)
    mf.print_table(out)
    return out


def _rows(rows, layout, pp_rank=None):
    sel = [r for r in rows if r["layout"] == layout]
    assert sel, f"{layout} did not run"
    for r in sel:
        assert "error" not in r, r
    return [r for r in sel if pp_rank is None or r["pp_rank"] == pp_rank]


def _check(sel):
    for r in sel:
        assert abs(r["err"]) <= mf.TOLERANCE, (
            f"{r['layout']} rank {r['rank']}: predicted {r['predicted']['tensors'] / mf.MiB:.2f} MiB, "
            f"measured {r['measured_peak'] / mf.MiB:.2f} MiB ({r['err']:+.1%}); at peak {r['measured_at_peak']}, "
            f"other by op {r['other_top_ops']}")


def test_fsdp_within_tolerance(rows):
    _check(_rows(rows, "dp2-fsdp"))


def test_pp2_first_stage_within_tolerance(rows):
    _check(_rows(rows, "pp2-1f1b", pp_rank=0))


def test_pp2_last_stage_within_tolerance(rows):
    _check(_rows(rows, "pp2-1f1b", pp_rank=1))


def test_ddp_within_tolerance(rows):
    _check(_rows(rows, "dp2-ddp"))
