"""The runtime's optimizer wrappers in one gloo process (no launch)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from codegen.runtime.optim import Optimizers, warmup_cosine


def test_zero1_optimizer_takes_the_learning_rate_it_is_given(tmp_path) -> None:
    """ZeRO-1's ShardedOptimizer steps a wrapped optimizer; a learning rate set on it (by
    Optimizers.set_lr or a torch LR scheduler) must reach the one that steps."""
    from codegen.runtime.data_parallel import ShardedOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        w = torch.nn.Parameter(torch.zeros(3))
        opt = ShardedOptimizer([w], lambda ps: torch.optim.SGD(ps, lr=1.0), dist.group.WORLD)
        assert opt.param_groups[0]["lr"] == 1.0  # the wrapped optimizer's settings, shown on the wrapper
        Optimizers([opt]).set_lr(0.25)
        w.grad = torch.ones(3)
        opt.step()
        assert torch.allclose(w.detach(), torch.full((3,), -0.25))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # lr 0.25 x 0.5
        w.grad = torch.ones(3)
        opt.step()
        sched.step()
        w.grad = torch.ones(3)
        opt.step()
        assert torch.allclose(w.detach(), torch.full((3,), -0.25 - 0.125 - 0.125))
    finally:
        dist.destroy_process_group()


def test_warmup_then_cosine() -> None:
    lrs = [warmup_cosine(s, 10, 1.0, 0.1, 2) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and abs(lrs[-1] - 0.1) < 1e-12
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
