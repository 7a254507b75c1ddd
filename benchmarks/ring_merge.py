"""A CPU ring's own work outside the fallback's calls, timed alone, and the fit of its constants.

Each case is one ring rank's attention (llama-mini's 4 heads, 2 kv heads, head dim 64; ``rows``
batch rows of ``tokens`` queries per rank, one document per row) over a ring of ``cp``, forward
+ backward, one thread, with the kernel bodies stubbed: the flash path (``RingCompute`` with
``flash=True``, the fixed layouts' ring on a CPU) with the fallback's forward and backward
bodies replaced by their outputs' allocation (``torch.zeros``, as the fallback allocates them),
so what remains is the ring's own work: the custom ops' wrappers, the run slices and their
gradients, the log-sum-exp merges, the concatenations; the plain path (``flash=False``, the
per-batch runtime's groups) with ``partial_attention`` replaced the same way. Cases run
interleaved rep by rep beside the same process's real fallback on one document of 2,048 (cp 1),
the reference: a case's elements are its median seconds over the reference's times that row's
modelled elements (``cost_models.fallback_attention``), the fallback's units.

It prints per case the counts (``cost_models.ring_merges.ring_steps``, summed over the rank's
steps), the measured elements and the fit's, the least-squares fits (relative error, none
negative) of ``MERGE_ROW_ELEMENTS``, ``CALL_ROW_ELEMENTS``, ``RING_CALL_ELEMENTS`` on the flash
cases and ``PLAIN_ROW_ELEMENTS``, ``PLAIN_RING_ELEMENTS`` on the plain ones, and the errors of
both the fit and the committed constants. ``python -m benchmarks.ring_merge [--reps N]`` (run it
through /tmp/quiet.sh; report the load it prints); writes ``benchmarks/results/ring_merge.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

HEADS, KV_HEADS, HEAD_DIM, REF_SEQ = 4, 2, 64, 2048
FLASH_SHAPES = [(cp, tokens, rows) for cp in (2, 4) for tokens in (256, 512, 1024) for rows in (1, 2, 4)]
PLAIN_SHAPES = [(g, tokens, 1) for g in (2, 4) for tokens in (256, 512, 1024)]


class _Stub(torch.autograd.Function):
    """out [B, H, Sq, D] and lse [B, H, Sq] zeros depending on q, k, v; gradients zeros."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[override]
        ctx.shapes = (q, k, v)
        b, h, s, d = q.shape
        return torch.zeros((b, h, s, d)), torch.zeros((b, h, s))

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        return tuple(torch.zeros_like(t) for t in ctx.shapes)


@contextlib.contextmanager
def stubbed():
    """The fallback's bodies and ``partial_attention`` replaced by their outputs' allocation."""
    import codegen.kernels.attention as A
    import codegen.runtime.context_parallel as C

    saved = (A.flash_attn_fwd_torch, A.flash_attn_bwd_torch, C.partial_attention)
    A.flash_attn_fwd_torch = lambda q, k, v, *a, **kw: (torch.zeros(q.shape), torch.zeros(q.shape[:3]))
    A.flash_attn_bwd_torch = lambda dout, q, k, v, *a, **kw: (torch.zeros_like(q), torch.zeros_like(k),
                                                              torch.zeros_like(v))
    C.partial_attention = lambda q, k, v, **kw: _Stub.apply(q, k, v)
    try:
        yield
    finally:
        A.flash_attn_fwd_torch, A.flash_attn_bwd_torch, C.partial_attention = saved


_RINGS: dict[tuple, object] = {}


def time_null(tokens: int = 512, rows: int = 1) -> float:
    """Seconds of the harness alone (an identity in place of the ring: the inputs, the sum, the
    backward's start), subtracted from every case."""
    q = torch.randn(rows, HEADS, tokens, HEAD_DIM, requires_grad=True)
    t0 = time.perf_counter()
    (q * 1.0).sum().backward()
    return time.perf_counter() - t0


def time_ring(cp: int, rank: int, tokens: int, rows: int, flash: bool) -> float:
    """Seconds of one ring rank's forward + backward (stubbed: call under :func:`stubbed`); one
    ``RingCompute`` per case, kept, as the runtime keeps one (its positions computed once)."""
    from codegen.runtime.context_parallel import RingCompute

    q = torch.randn(rows, HEADS, tokens, HEAD_DIM, requires_grad=True)
    k, v = (torch.randn(rows, KV_HEADS, tokens, HEAD_DIM, requires_grad=True) for _ in range(2))
    ring = _RINGS.setdefault((cp, rank, flash), RingCompute(cp, rank, flash=flash))
    t0 = time.perf_counter()
    ring(q, k, v, causal=True).sum().backward()
    return time.perf_counter() - t0


def counts(cp: int, rank: int, tokens: int, rows: int, flash: bool) -> np.ndarray:
    """The model's counts of a case, batch rows multiplied in (``cost_models.ring_merges``):
    flash path (query rows merged, calls x query rows held, calls: :func:`ring_steps` summed
    over the rank's steps); plain path (query rows merged: one merge of the rank's queries per
    visiting step; 1: the ring's call)."""
    from cost_models.ring_merges import CALL_ROWS, CALLS, MERGED_ROWS, ring_steps

    if not flash:
        return np.array([(cp - 1) * tokens * rows, 1.0])
    c = ring_steps(tokens * cp, cp)[rank].sum(axis=0)
    return np.array([c[MERGED_ROWS] * rows, c[CALL_ROWS] * rows, c[CALLS]])


def modelled(cp: int, rank: int, tokens: int, rows: int, flash: bool) -> float:
    """The committed constants' elements for a case (``own_work`` / ``plain_ring_elements``)."""
    from cost_models.ring_merges import own_work, plain_ring_elements, ring_steps

    if not flash:
        per_row, fixed = plain_ring_elements(cp)
        return per_row * tokens * (cp - 1) * rows + fixed
    return float(own_work(ring_steps(tokens * cp, cp)[rank].sum(axis=0), rows))


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of the relative error, coefficients of ``x @ coef ~ y``, none negative (a
    column whose coefficient would be is dropped and the rest refitted)."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones(len(y)), rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


@dataclass
class Measured:
    """Median seconds per case, the reference row's and the empty harness's, the load before / after."""
    seconds: dict[tuple, float]
    ref_s: float
    null_s: float
    load: tuple


def measure(cases: list[tuple], reps: int) -> Measured:
    """Each case ``reps`` times (after one warm-up round) with the kernel bodies stubbed, beside the
    real one-document reference row and the empty harness."""
    from benchmarks.fallback_rows import time_call

    ref_doc = torch.zeros(1, REF_SEQ, dtype=torch.int64)
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    ref, null = [], []
    load0 = os.getloadavg()
    for _ in range(reps + 1):  # the first a warm-up
        ref.append(time_call(ref_doc))
        null.append(statistics.median(time_null() for _ in range(5)))
        with stubbed():
            for c in cases:
                times[c].append(time_ring(*c))
    return Measured({c: statistics.median(t[1:]) for c, t in times.items()}, statistics.median(ref[1:]),
                    statistics.median(null[1:]), (load0, os.getloadavg()))


def table(cases: list[tuple], m: Measured, y: np.ndarray, pred: np.ndarray) -> list[dict]:
    """Print and return one row per case: counts, ms, measured and fitted elements, the committed constants'."""
    print(f"{'path':6s} {'cp':>3s} {'rank':>4s} {'tokens':>6s} {'rows':>4s} {'counts':>20s} {'ms':>7s} "
          f"{'elements':>9s} {'fit':>9s} {'fit/meas':>8s}")
    rows = []
    for c, ys, ps in zip(cases, y, pred):
        xs, ms = counts(*c), m.seconds[c] * 1e3
        print(f"{'flash' if c[4] else 'plain':6s} {c[0]:3d} {c[1]:4d} {c[2]:6d} {c[3]:4d} "
              f"{' '.join(f'{v:.0f}' for v in xs):>20s} {ms:7.2f} {ys:9.0f} {ps:9.0f} {ps / ys:8.2f}")
        rows.append({"path": "flash" if c[4] else "plain", "cp": c[0], "rank": c[1], "tokens": c[2], "rows": c[3],
                     "counts": xs.tolist(), "ms": ms, "elements": ys, "fit": ps, "committed": modelled(*c)})
    return rows


def main() -> None:
    from benchmarks.results import write_json
    from cost_models.documents import pack_mix
    from cost_models.fallback_attention import rank_elements

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ring_merge.json"))
    args = ap.parse_args()
    os.environ.pop("AUTOPAR_KERNEL_IMPL", None)  # "auto": the fallback on CPU
    torch.set_num_threads(1)
    cases = [(cp, r, t, b, True) for cp, t, b in FLASH_SHAPES for r in range(cp)]
    cases += [(g, r, t, b, False) for g, t, b in PLAIN_SHAPES for r in range(g)]
    m = measure(cases, args.reps)
    ref_elements = float(rank_elements(pack_mix([REF_SEQ], REF_SEQ), 1, 1)[1][0])
    y = np.array([(m.seconds[c] - m.null_s) / m.ref_s * ref_elements for c in cases])
    flash = np.array([c[4] for c in cases])
    xf = np.array([counts(*c) for c in cases if c[4]])
    xp = np.array([counts(*c) for c in cases if not c[4]])
    coef_f, coef_p = fit(xf, y[flash]), fit(xp, y[~flash])
    pred = np.zeros(len(cases))
    pred[flash], pred[~flash] = xf @ coef_f, xp @ coef_p
    print(f"load {m.load[0]} -> {m.load[1]}  torch {torch.__version__}  {args.reps} reps; reference row "
          f"{m.ref_s * 1e3:.1f} ms = {ref_elements:.0f} elements ({m.ref_s / ref_elements * 1e9:.1f} ns each); "
          f"harness {m.null_s * 1e3:.2f} ms (subtracted)")
    print("fit, flash path (per row merged, call x row held, call): " + "  ".join(f"{c:.2f}" for c in coef_f))
    print("fit, plain path (per row merged, ring call): " + "  ".join(f"{c:.2f}" for c in coef_p))
    rows = table(cases, m, y, pred)
    committed = np.array([r["committed"] for r in rows])
    for name, sel in (("flash", flash), ("plain", ~flash)):
        for what, p in (("fit", pred), ("committed constants", committed)):
            err = p[sel] / y[sel] - 1
            print(f"{name}: {what}/measured {1 + err.min():.2f} .. {1 + err.max():.2f} "
                  f"(rms {np.sqrt((err ** 2).mean()):.3f})")
    write_json(args.out, {"load": list(m.load), "reps": args.reps, "reference_s": m.ref_s,
                          "reference_elements": ref_elements, "harness_s": m.null_s, "flash": coef_f.tolist(),
                          "plain": coef_p.tolist(), "cases": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
