"""The plain one-process baseline a plan is compared with (``autopar demo``).

The same model, global batch, data and training step in this process (AdamW with
PyTorch's default implementation, gradients clipped to the emitted program's default global
norm, ``codegen.runtime.optim.MAX_GRAD_NORM``), with no parallelism at all and PyTorch's default
intra-op threads (every core of the machine): what a user would run without autopar. The speedup the demo prints is this step time over the
plan's measured one, so a plan slower than no parallelism shows as a speedup below 1.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from planner.errors import AutoparError


@dataclass
class Baseline:
    step_s: float          # median wall seconds per optimizer step after the warm-up
    losses: list[float]    # every step's loss, warm-up included
    threads: int           # intra-op threads it ran with
    times: list[float]     # wall seconds of each step after the warm-up


def single_process_step(spec: str, global_batch: int, seq_len: int, *, steps: int = 3, warmup: int = 1,
                        lr: float = 1e-3, seed: int = 0, max_norm: float | None = None) -> Baseline:
    """Train the zoo or transformers model ``spec`` for ``warmup + steps`` steps on the emitted
    programs' synthetic data in this process; a plain ``package.module:function`` model has no
    loss of its own, so it is refused. ``max_norm``: the global gradient norm clipped to (None:
    the program's default; <= 0: no clipping)."""
    import torch

    from codegen.runtime.data import synthetic
    from codegen.runtime.optim import MAX_GRAD_NORM
    from planner import zoo

    ms = zoo.load_model_spec(spec)
    if ms.cfg is None and not spec.startswith("hf:"):
        raise AutoparError(f"{spec}: the single-process baseline needs a zoo or hf: model (it computes the loss)")
    torch.manual_seed(seed)
    model = ms.build()
    model.train()
    vocab = ms.cfg.vocab if ms.cfg is not None else model.config.vocab_size
    data = synthetic(vocab, global_batch, seq_len, seed, model_shifts_labels=spec.startswith("hf:"))
    clip = MAX_GRAD_NORM if max_norm is None else max_norm
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    times, losses = [], []
    for step in range(warmup + steps):
        batch = data(step)
        t0 = time.perf_counter()
        out = model(batch["input_ids"], labels=batch["labels"])
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return Baseline(step_s=statistics.median(times), losses=losses, threads=torch.get_num_threads(), times=times)
