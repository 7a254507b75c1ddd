"""cost_models/model_states.py: bytes per parameter a rank holds, as autopar's runtime holds them and
as Megatron-Core's distributed optimizer does (its guide's "bf16 param, fp32 grads" row: 6 + 12 / dp)."""
from __future__ import annotations

import pytest

from cost_models.engines import ENGINES, Engine
from cost_models.model_states import per_param_bytes
from planner.plan import ParallelConfig

MEGATRON = ENGINES["megatron-core"]


def at_rest(f: dict) -> float:
    return f["weights"] + f["grads"] + f["optimizer"] + f["buffers"]


@pytest.mark.parametrize("dp", [1, 8, 64])
def test_megatron_distributed_optimizer_holds_6_plus_12_over_dp_in_bf16(dp):
    f = per_param_bytes(ParallelConfig(dp=dp, zero="zero1", dtype="bf16"), engine=MEGATRON)
    assert (f["weights"], f["grads"], f["buffers"]) == (2, 4, 0)  # bf16 params read in place, fp32 main grads
    assert at_rest(f) == pytest.approx(6 + 12 / dp)
    fp32 = per_param_bytes(ParallelConfig(dp=dp, zero="zero1", dtype="fp32"), engine=MEGATRON)
    assert at_rest(fp32) == pytest.approx(8 + 8 / dp)  # no separate master copy


def test_autopar_runtime_keeps_fp32_masters_and_a_compute_copy():
    """The same ZeRO-1 on autopar's runtime: fp32 masters and grads, the moments sharded, and
    replicate's bf16 compute copy: 10 + 8 / dp, more than Megatron's from dp 2 on; one rank has no
    wrapper and no copy: 16 bytes, Megatron's 18."""
    for dp in (2, 8, 64):
        cfg = ParallelConfig(dp=dp, zero="zero1", dtype="bf16")
        ours = at_rest(per_param_bytes(cfg))
        assert ours == pytest.approx(10 + 8 / dp)
        assert ours > at_rest(per_param_bytes(cfg, engine=MEGATRON))
    one = ParallelConfig(dp=1, zero="zero1", dtype="bf16")
    assert (at_rest(per_param_bytes(one)), at_rest(per_param_bytes(one, engine=MEGATRON))) == (16, 18)


def test_switch_only_changes_zero1():
    """FSDP and DDP states are the DP wrapper's whatever the engine; the experts shard their
    optimizer over their own group under the distributed optimizer too."""
    on = Engine("on", dist_opt_states=True)
    for zero in ("ddp", "fsdp", "zero2"):
        cfg = ParallelConfig(dp=8, zero=zero, dtype="bf16")
        assert per_param_bytes(cfg, engine=on) == per_param_bytes(cfg)
    cfg = ParallelConfig(dp=8, tp=4, ep=8, zero="zero1", dtype="bf16", sp=True)  # experts' group: 8 x 4 / 8 = 4
    assert per_param_bytes(cfg, experts=True, engine=on)["optimizer"] == pytest.approx(12 / 4)
