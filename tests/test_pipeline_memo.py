"""cost_models/pipeline_memo.py: the kept simulation is the simulator's own result for the same
arguments, and every argument is part of the key (a changed one is simulated afresh)."""
from __future__ import annotations

from cost_models.pipeline import simulate
from cost_models.pipeline_memo import simulated

ARGS = dict(p2p=[0.01, 0.2, 0.01, 0.0], v=1, seq_chunks=4, attn_fwd=[0.1, 0.1, 0.1, 0.1], attn_bwd=[0.2, 0.2, 0.2, 0.2])
F, B = [1.0, 1.1, 1.0, 1.2], [2.0, 2.2, 2.0, 2.4]


def test_kept_result_is_the_simulators():
    a = simulated("1f1b", 4, 8, F, B, **ARGS)
    assert simulated("1f1b", 4, 8, list(F), tuple(B), **ARGS) is a  # equal values: the kept result
    ref = simulate("1f1b", 4, 8, F, B, **ARGS)
    assert (a.step_s, a.peak_inflight_chunks, a.busy_s) == (ref.step_s, ref.peak_inflight_chunks, ref.busy_s)


def test_every_argument_is_in_the_key():
    base = simulated("1f1b", 4, 8, F, B, **ARGS)
    changed = [simulated("gpipe", 4, 8, F, B, **ARGS), simulated("1f1b", 4, 12, F, B, **ARGS),
               simulated("1f1b", 4, 8, [1.0] * 4, B, **ARGS), simulated("1f1b", 4, 8, F, [2.0] * 4, **ARGS),
               simulated("1f1b", 4, 8, F, B, **dict(ARGS, p2p=[0.01, 0.4, 0.01, 0.0])),
               simulated("1f1b", 4, 8, F, B, **dict(ARGS, seq_chunks=2)),
               simulated("1f1b", 4, 8, F, B, **dict(ARGS, attn_fwd=0.3)),
               simulated("1f1b", 4, 8, F, B, **dict(ARGS, attn_bwd=0.5)),
               simulated("1f1b", 4, 8, F, B, **dict(ARGS, fixed_fwd=0.05)),
               simulated("1f1b", 4, 8, F, B, **dict(ARGS, fixed_bwd=0.1))]
    for c in changed:
        assert c is not base and c.step_s != base.step_s
    inter = simulated("interleaved-1f1b", 2, 8, F, B, p2p=0.01, v=2)
    assert inter.step_s == simulate("interleaved-1f1b", 2, 8, F, B, p2p=0.01, v=2).step_s


def test_forget_drops_the_kept_results():
    from cost_models.pipeline_memo import forget

    a = simulated("1f1b", 4, 8, F, B, **ARGS)
    forget()
    b = simulated("1f1b", 4, 8, F, B, **ARGS)
    assert b is not a and b.step_s == a.step_s
