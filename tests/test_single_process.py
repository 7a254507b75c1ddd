"""The demo's one-process baseline trains as the emitted program does (clipping included)."""
from planner.entry.single_process import single_process_step


def _second_loss(**kw) -> float:
    return single_process_step("gpt-tiny", 2, 16, steps=1, warmup=1, **kw).losses[1]


def test_baseline_clips_the_global_gradient_norm():
    frozen = _second_loss(lr=0.0)                  # the second batch's loss of the untrained model
    clipped = _second_loss(lr=1e-2, max_norm=1e-12)  # Adam's step shrinks to ~lr * g / eps
    free = _second_loss(lr=1e-2, max_norm=0.0)       # no clipping: a full Adam step
    assert abs(clipped - frozen) < 1e-3
    assert abs(free - frozen) > 1e-2
