"""``--config`` in either form (planner/config_text.py): key=value pairs or the label a plan prints."""
from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.config_text import config_keys, is_label, parse_config
from planner.errors import PlanError
from planner.plan import FP8_RECIPES, RECOMPUTE, RUN_SCHEDULES, ParallelConfig
from planner.sharding import ZERO

CONFIGS = [
    ParallelConfig(dp=8, pp=8, tp=2, zero="fsdp", sp=True, seq_chunks=4),
    ParallelConfig(dp=2, pp=4, tp=2, schedule="interleaved-1f1b", vpp=2, zero="zero1", recompute="selective",
                   sp=True),
    ParallelConfig(dp=4, cp=4, ulysses=2, tp=2, ep=4, mbs=2, zero="zero2", recompute="selective-op", sp=True),
    ParallelConfig(dp=2, pp=2, schedule="dualpipev", vpp=2, recompute="full", threads=2),
    ParallelConfig(dp=16, tp=8, zero="fsdp", fp8="rowwise", compile=True, low_comm="2x16:bf16"),
    ParallelConfig(dp=1, pp=2, schedule="zb-h1", recompute="offload"),
    ParallelConfig(dp=4, mbs=2, zero="fsdp", dp_shares="1x2+3x2"),
    ParallelConfig(dp=2, pp=4, schedule="custom", vpp=2, zero="zero1", vocab_passes=True),
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


@settings(max_examples=300, deadline=None)
@given(dp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 4]),
       tp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2]), ulysses=st.sampled_from([1, 2]),
       mbs=st.sampled_from([1, 3]), schedule=st.sampled_from(RUN_SCHEDULES), vpp=st.sampled_from([1, 2]),
       zero=st.sampled_from(ZERO), recompute=st.sampled_from(RECOMPUTE), sp=st.booleans(),
       threads=st.sampled_from([0, 2]), fp8=st.sampled_from(FP8_RECIPES), compile=st.booleans(),
       low_comm=st.sampled_from(["", "2x4:bf16"]), seq_chunks=st.sampled_from([1, 2]),
       dp_shares=st.sampled_from(["", "1+5", "2x4+4x4"]))
@pytest.mark.slow
def test_every_label_reads_back(**kw):
    """The label's words and the parser's cannot drift apart: any valid configuration's label (every
    field it shows) reads back as that configuration."""
    try:
        cfg = ParallelConfig(**kw).validate()
    except PlanError:
        assume(False)
    assume(cfg.pp > 1 or cfg.schedule == "1f1b")  # without a pipeline the label shows no schedule (none runs)
    assert parse_config(cfg.label()) == cfg
