"""``--config`` in either form (planner/config_text.py): key=value pairs or the label a plan prints."""
from __future__ import annotations

import pytest

from planner.config_text import config_keys, is_label, parse_config
from planner.errors import PlanError
from planner.plan import ParallelConfig

CONFIGS = [
    ParallelConfig(dp=8, pp=8, tp=2, zero="fsdp", sp=True, seq_chunks=4),
    ParallelConfig(dp=2, pp=4, tp=2, schedule="interleaved-1f1b", vpp=2, zero="zero1", recompute="selective",
                   sp=True),
    ParallelConfig(dp=4, cp=4, ulysses=2, tp=2, ep=4, mbs=2, zero="zero2", recompute="selective-op", sp=True),
    ParallelConfig(dp=2, pp=2, schedule="dualpipev", vpp=2, recompute="full", threads=2),
    ParallelConfig(dp=16, tp=8, zero="fsdp", fp8="rowwise", compile=True, low_comm="2x16:bf16"),
    ParallelConfig(dp=1, pp=2, schedule="zb-h1", recompute="offload"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_a_printed_label_reads_back_as_its_configuration(cfg):
    assert is_label(cfg.label()) and parse_config(cfg.label()) == cfg
    assert parse_config(cfg.to_str()) == cfg and not is_label(cfg.to_str())


def test_keys_given_and_bad_words():
    assert config_keys("dp8 pp8 cp1 tp2 mbs1 1f1b fsdp sp") == {"dp", "pp", "cp", "tp", "mbs", "schedule", "zero", "sp"}
    assert config_keys("dp=2,attention=eager") == {"dp", "attention"}
    with pytest.raises(PlanError, match="label word 'zb' is not one autopar prints"):
        parse_config("dp2 pp2 zb")
    with pytest.raises(PlanError, match="dp given twice"):
        parse_config("dp2 dp4")
    with pytest.raises(PlanError, match="schedule 'interleaved' is not one of"):
        parse_config("pp2 interleaved(v2)")
