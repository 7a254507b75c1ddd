"""Kernel benchmark (CUDA only): our Triton attention vs SDPA flash, fused linear+CE vs eager.

    python -m benchmarks.kernels [--quick] [--out benchmarks/results/kernels.json]

Attention: bf16, D=128, H=32, KVH=8, B*S=16k tokens, causal, S in {1k, 4k, 8k, 16k}, and D=64 at
S=2k (llama-1b's heads); ours, SDPA forced to its FlashAttention-2 backend, SDPA as it chooses
(what ``attention=eager`` runs on CUDA) and SDPA given the causal mask as a boolean tensor (what
packed documents and sequence chunks run under ``attention=eager``);
TFLOP/s with fwd FLOPs = 4*B*H*S^2*D * 0.5 (causal) and bwd = 2.5 x fwd; peak memory =
torch.cuda.max_memory_allocated above the inputs during one fwd+bwd, in MiB.
Fused loss: bf16, N=8192 tokens, H=4096, V=128256, ~10% ignore_index; median fwd and
fwd+bwd times, TFLOP/s at 6*N*H*V for fwd+bwd, peak memory above inputs. Times are medians
of triton.testing.do_bench (ms). Correctness vs an fp32 reference runs first.
Prints "skipped: no CUDA" and exits 0 without a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from benchmarks.results import write_json


def _attn_ref_fp32(q, k, v, causal):
    import torch
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _sdpa(q, k, v, causal, forced=True):
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if forced else contextlib.nullcontext():
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except (RuntimeError, TypeError):
            g = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                  is_causal=causal)


def _sdpa_masked(q, k, v, mask):
    """SDPA given the causal mask as a boolean tensor, with the backend it picks: what
    ``attention=eager`` runs for packed documents and what sequence chunks run (their masks are
    not ``is_causal``), so the cost model's ``torch-sdpa`` factor can be checked for them."""
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def check_attention(dev):
    """bf16 errors of ours and SDPA-flash vs fp32 math (O, dQ, dK, dV max abs; LSE rel)."""
    import torch
    from codegen.kernels.attention import flash_attention
    torch.manual_seed(0)
    q = torch.randn(1, 8, 1024, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 1024, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 1024, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
    ro, rl = _attn_ref_fp32(q, k, v, True)
    rg = torch.autograd.grad((ro * dout.float()).sum(), (q, k, v))
    res = {}
    for name, fn in (("ours", lambda: flash_attention(q, k, v, causal=True)), ("sdpa_flash", lambda: (_sdpa(q, k, v, True), None))):
        o, l = fn()
        g = torch.autograd.grad((o.float() * dout.float()).sum(), (q, k, v))
        err = {"out": (o.float() - ro).abs().max().item()}
        for n_, a, b in zip(("dq", "dk", "dv"), g, rg):
            err[n_] = (a.float() - b).abs().max().item()
        if l is not None:
            err["lse_rel"] = ((l - rl).abs() / rl.abs().clamp(min=1e-6)).max().item()
        res[name] = err
    ok = all(res["ours"][n_] <= 2 * res["sdpa_flash"][n_] + 1e-3 for n_ in ("out", "dq", "dk", "dv"))
    res["ok"] = bool(ok and res["ours"]["lse_rel"] <= 1e-3)
    return res


def check_loss(dev):
    import torch
    import torch.nn.functional as F
    from codegen.kernels.fused_loss import fused_linear_cross_entropy
    torch.manual_seed(0)
    x = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(32000, 1024, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 32000, (1024,), device=dev)
    t[::10] = -100
    loss = fused_linear_cross_entropy(x, w, t)
    gx, gw = torch.autograd.grad(loss, (x, w))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(xf @ wf.t(), t)
    rgx, rgw = torch.autograd.grad(ref, (xf, wf))
    res = {"loss_rel": abs(loss.item() - ref.item()) / abs(ref.item()),
           "dx_rel": ((gx.float() - rgx).norm() / rgx.norm()).item(),
           "dw_rel": ((gw.float() - rgw).norm() / rgw.norm()).item()}
    res["ok"] = res["loss_rel"] <= 1e-4 and res["dx_rel"] < 2e-2 and res["dw_rel"] < 2e-2
    return res


def _peak_mib(fn):
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_attention(dev, seqs, tokens=16384, H=32, KVH=8, D=128):
    """Rows of ours / SDPA-flash / SDPA's own choice at each length of ``seqs``."""
    import torch
    from triton.testing import do_bench
    from codegen.kernels.attention import flash_attention
    rows = []
    for S in seqs:
        B = max(1, tokens // S)
        mk = lambda h: torch.randn(B, h, S, D, device=dev, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
        q, k, v = mk(H), mk(KVH), mk(KVH)
        dout = torch.randn_like(q)
        fwd_flop = 4 * B * H * S * S * D * 0.5
        mask = torch.ones(S, S, dtype=torch.bool, device=dev).tril()[None, None]
        for name, fn in (("ours", lambda: flash_attention(q, k, v, causal=True)[0]),
                         ("sdpa_flash", lambda: _sdpa(q, k, v, True)),
                         ("sdpa_default", lambda: _sdpa(q, k, v, True, forced=False)),
                         ("sdpa_masked", lambda: _sdpa_masked(q, k, v, mask))):
            row = {"kernel": "attention", "impl": name, "S": S, "B": B, "D": D}
            try:
                t_f = do_bench(fn)
                o = fn()
                t_b = do_bench(lambda: o.backward(dout, retain_graph=True), grad_to_none=[q, k, v])
                o = None
                row.update(fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=fwd_flop / t_f * 1e-9,
                           bwd_tflops=2.5 * fwd_flop / t_b * 1e-9,
                           peak_mib=_peak_mib(lambda: fn().backward(dout)))
            except Exception as e:  # keep the table going; record the failure
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            q.grad = k.grad = v.grad = None
            rows.append(row)
            print(_fmt(row), flush=True)
        q = k = v = dout = mask = None  # free the inputs before the next length
        torch.cuda.empty_cache()
    return rows


def bench_loss(dev, N=8192, H=4096, V=128256):
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench
    from codegen.kernels.fused_loss import fused_linear_cross_entropy
    torch.manual_seed(0)
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device=dev)
    t[torch.rand(N, device=dev) < 0.1] = -100
    rows = []
    fns = (("ours", lambda: fused_linear_cross_entropy(x, w, t)),
           ("eager", lambda: F.cross_entropy((x @ w.t()).float(), t)))
    for name, fn in fns:
        row = {"kernel": "linear_ce", "impl": name, "N": N, "H": H, "V": V}
        try:
            t_f = do_bench(fn)
            t_fb = do_bench(lambda: fn().backward(), grad_to_none=[x, w])
            row.update(fwd_ms=t_f, fwd_bwd_ms=t_fb, tflops=6 * N * H * V / t_fb * 1e-9,
                       peak_mib=_peak_mib(lambda: fn().backward()))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        x.grad = w.grad = None
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


def _fmt(row):
    return "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    ap.add_argument("--quick", action="store_true", help="S in {1k, 4k} and a 4096-token loss only")
    args = ap.parse_args(argv)
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        print("skipped: no CUDA")
        return 0
    dev = torch.device("cuda")
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "quick": args.quick}
    import triton
    result["triton"] = triton.__version__
    result["check"] = {"attention": check_attention(dev), "linear_ce": check_loss(dev)}
    print("correctness:", json.dumps(result["check"]), flush=True)
    seqs = [1024, 4096] if args.quick else [1024, 4096, 8192, 16384]
    result["attention"] = bench_attention(dev, seqs) + bench_attention(dev, [2048], D=64)
    result["linear_ce"] = bench_loss(dev, N=4096 if args.quick else 8192)
    result["wall_s"] = time.time() - t0
    write_json(args.out, result)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0 if result["check"]["attention"]["ok"] and result["check"]["linear_ce"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
