"""TensorBoard scalars beside the JSON-lines log (codegen.runtime.metrics.ScalarLog): written
when the tensorboard package is installed, nothing (JSON lines only) when it is not."""
from __future__ import annotations

import importlib.util

import pytest

from codegen.runtime.metrics import TB_DIR, ScalarLog

HAVE_TB = importlib.util.find_spec("tensorboard") is not None
REC = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "step_s": 0.1, "tokens_per_s": 640.0,
       "memory_gib": [0.4, 0.6]}


@pytest.mark.skipif(HAVE_TB, reason="tensorboard is installed: the scalars test covers it")
def test_without_tensorboard_only_the_json_log_is_written(tmp_path):
    with ScalarLog(str(tmp_path / "train_log.jsonl")) as s:
        assert s.writer is None
        s.write(REC)
    assert not (tmp_path / TB_DIR).exists()


@pytest.mark.skipif(not HAVE_TB, reason="tensorboard is not installed (pip install tensorboard); JSON lines only")
def test_scalars_are_written_beside_the_log(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with ScalarLog(str(tmp_path / "train_log.jsonl")) as s:
        s.write(REC)
        s.write(dict(REC, step=4, loss=2.25))
    acc = EventAccumulator(str(tmp_path / TB_DIR))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(3, 2.5), (4, 2.25)]
    assert acc.Scalars("memory/peak_gib")[0].value == pytest.approx(0.6)
