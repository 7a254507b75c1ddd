"""Triton kernels under the CPU interpreter vs torch references (plus the torch fallbacks).

TRITON_INTERPRET must be set before triton is first imported, hence the top lines.
Shapes are tiny: the interpreter runs ~0.2 GFLOP/s.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import socket  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from codegen.kernels import attention as A  # noqa: E402
from codegen.kernels import attention_triton as T  # noqa: E402
from codegen.kernels import fused_loss as L  # noqa: E402
from codegen.kernels.attention import attn_merge, flash_attention  # noqa: E402
from codegen.kernels.fused_loss import fused_linear_cross_entropy  # noqa: E402

TRITON = T.HAS_TRITON and T.interpreting()
needs_triton = pytest.mark.skipif(not TRITON, reason="triton interpreter not available")
IMPLS = [pytest.param("triton", marks=needs_triton), "torch"]


# --------------------------------------------------------------------------- references
def ref_attention(q, k, v, causal, q_offset=0, kv_offset=0, sm_scale=None):
    """Plain fp32 math: (out, natural-log lse), -inf lse and 0 output for masked rows."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(H // KVH, 1)
    v = v.float().repeat_interleave(H // KVH, 1)
    scale = sm_scale or 1.0 / math.sqrt(q.shape[-1])
    s = q.float() @ k.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(q.shape[2])[:, None] + q_offset
        j = torch.arange(k.shape[2])[None, :] + kv_offset
        s = s.masked_fill(i < j, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    return p @ v, lse


def rand_qkv(B, H, KVH, Sq, Sk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()  # noqa: E731
    return mk(B, H, Sq, D), mk(B, KVH, Sk, D), mk(B, KVH, Sk, D)


def maxerr(a, b):
    return (a.float() - b.float()).abs().max().item()


def grads(out, lse, inputs, gout, glse):
    """Gradients of <out, gout> + <lse, glse> (glse zero on -inf rows)."""
    fin = torch.isfinite(lse.detach())
    obj = (out.float() * gout).sum() + (torch.where(fin, lse, 0.0) * glse).sum()
    return torch.autograd.grad(obj, inputs)


# --------------------------------------------------------------------------- attention
ATTN_CASES = [  # B, H, KVH, Sq, Sk, D, causal, q_offset, kv_offset
    (1, 2, 2, 64, 64, 32, True, 0, 0),
    (1, 2, 2, 100, 100, 64, False, 0, 0),     # ragged, non-causal
    (1, 4, 2, 100, 100, 32, True, 0, 0),      # GQA 4/2, ragged
    (1, 4, 1, 70, 130, 32, False, 0, 0),      # MQA, Sq != Sk
    (1, 4, 1, 96, 160, 32, True, 64, 0),      # bottom-right causal (q_offset = Sk - Sq)
    (2, 2, 1, 64, 96, 32, True, 10, 40),      # offsets, some rows fully masked
    (1, 2, 2, 40, 64, 32, True, 0, 200),      # everything masked: lse -inf, out 0
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "B{}H{}KV{}S{}x{}D{}{}o{}k{}".format(
    c[0], c[1], c[2], c[3], c[4], c[5], "c" if c[6] else "n", c[7], c[8]))
def test_attention_fp32(case, impl):
    B, H, KVH, Sq, Sk, D, causal, qo, ko = case
    q, k, v = rand_qkv(B, H, KVH, Sq, Sk, D)
    out, lse = flash_attention(q, k, v, causal=causal, q_offset=qo, kv_offset=ko, impl=impl)
    rout, rlse = ref_attention(q, k, v, causal, qo, ko)
    assert out.shape == (B, H, Sq, D) and lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    fin = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[~fin] == float("-inf")).all() and (out[~fin] == 0).all()
    assert maxerr(out, rout) < 1e-5
    if fin.any():
        assert maxerr(lse[fin], rlse[fin]) < 1e-5
    gout, glse = torch.randn_like(rout), torch.randn_like(rlse)
    got = grads(out, lse, (q, k, v), gout, glse)          # out and lse both get gradients
    want = grads(rout, rlse, (q, k, v), gout, glse)
    for g, w in zip(got, want):
        assert g.shape == w.shape and maxerr(g, w) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@needs_triton
def test_attention_half(dtype):
    q, k, v = rand_qkv(1, 4, 2, 100, 100, 64, dtype=dtype, seed=1)
    out, lse = flash_attention(q, k, v, causal=True, impl="triton")
    rout, rlse = ref_attention(q, k, v, True)
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    assert out.dtype == dtype and maxerr(out, rout) < tol and maxerr(lse, rlse) < 1e-3
    gout = torch.randn_like(rout)
    got = torch.autograd.grad((out.float() * gout).sum(), (q, k, v))
    want = torch.autograd.grad((rout * gout).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert g.dtype == dtype and maxerr(g, w) < 10 * tol


@pytest.mark.parametrize("impl", IMPLS)
def test_ring_merge_two_halves(impl):
    """KV split in two halves, one call each with kv_offset, merged == one causal call; the
    ring backward (global out/lse passed to each step's flash_attn_bwd) sums to the full grads."""
    q, k, v = rand_qkv(1, 4, 2, 128, 128, 32, seed=2)
    sc = 1 / math.sqrt(32)
    o1, l1 = A.flash_attn_fwd(q, k[:, :, :64], v[:, :, :64], True, sc, 0, 0, impl)
    o2, l2 = A.flash_attn_fwd(q, k[:, :, 64:], v[:, :, 64:], True, sc, 0, 64, impl)
    out, lse = attn_merge(o1, l1, o2, l2)
    full_o, full_l = A.flash_attn_fwd(q, k, v, True, sc, 0, 0, impl)
    assert maxerr(out, full_o) < 1e-5 and maxerr(lse, full_l) < 1e-5
    rout, rlse = ref_attention(q, k, v, True)
    assert maxerr(out, rout) < 1e-5 and maxerr(lse, rlse) < 1e-5
    dout = torch.randn_like(out)
    dq1, dk1, dv1 = A.flash_attn_bwd(dout, q, k[:, :, :64], v[:, :, :64], out, lse, None, True, sc, 0, 0, impl)
    dq2, dk2, dv2 = A.flash_attn_bwd(dout, q, k[:, :, 64:], v[:, :, 64:], out, lse, None, True, sc, 0, 64, impl)
    want = torch.autograd.grad((rout * dout).sum(), (q, k, v))
    assert maxerr(dq1 + dq2, want[0]) < 2e-5
    assert maxerr(torch.cat([dk1, dk2], 2), want[1]) < 2e-5
    assert maxerr(torch.cat([dv1, dv2], 2), want[2]) < 2e-5


def test_attn_merge_neg_inf_and_grad():
    o = torch.randn(2, 3, 4, dtype=torch.float64)
    l1 = torch.tensor([[0.5, float("-inf"), float("-inf")], [1.0, -2.0, float("-inf")]], dtype=torch.float64)
    l2 = torch.tensor([[float("-inf"), 0.3, float("-inf")], [2.0, 1.0, 0.0]], dtype=torch.float64)
    out, lse = attn_merge(o, l1, -o, l2)
    assert torch.isfinite(out).all() and lse[0, 2] == float("-inf") and (out[0, 2] == 0).all()
    assert torch.allclose(lse[1], torch.logaddexp(l1[1], l2[1]))
    g = torch.Generator().manual_seed(9)
    args = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
            for shape in ((2, 3, 4), (2, 3), (2, 3, 4), (2, 3))]
    assert torch.autograd.gradcheck(lambda a, b, c, d: attn_merge(a, b, c, d), args)


@pytest.mark.parametrize("impl", IMPLS)
def test_zigzag_cp2(impl):
    """Zigzag (head-tail) context parallel at CP=2 on S=256: 4 chunks of 64, rank r holds
    chunks r and 3-r. Step 0: local causal; step 1: KV from the other rank, rank 0 -> second
    q half x all KV, rank 1 -> all q x first KV half (no masks off the diagonal)."""
    B, H, KVH, S, D, C = 1, 2, 1, 256, 32, 64
    q, k, v = rand_qkv(B, H, KVH, S, S, D, seed=3)
    chunks = lambda t, r: torch.cat([t[:, :, r * C:(r + 1) * C], t[:, :, (3 - r) * C:(4 - r) * C]], 2)  # noqa: E731
    local = [(chunks(q, r), chunks(k, r), chunks(v, r)) for r in range(2)]
    outs, lses = [], []
    for r in range(2):
        ql, kl, vl = local[r]
        _, ko, vo = local[1 - r]
        o, lse = flash_attention(ql, kl, vl, causal=True, impl=impl)
        if r == 0:
            o1, l1 = flash_attention(ql[:, :, C:], ko, vo, causal=False, impl=impl)
            ob, lb = attn_merge(o[:, :, C:], lse[:, :, C:], o1, l1)
            o, lse = torch.cat([o[:, :, :C], ob], 2), torch.cat([lse[:, :, :C], lb], 2)
        else:
            o1, l1 = flash_attention(ql, ko[:, :, :C], vo[:, :, :C], causal=False, impl=impl)
            o, lse = attn_merge(o, lse, o1, l1)
        outs.append(o)
        lses.append(lse)
    # back to global order: rank0 = chunks 0,3 ; rank1 = chunks 1,2
    order = lambda t0, t1: torch.cat([t0[:, :, :C], t1[:, :, :C], t1[:, :, C:], t0[:, :, C:]], 2)  # noqa: E731
    out, lse = order(*outs), order(*lses)
    rout, rlse = ref_attention(q, k, v, True)
    assert maxerr(out, rout) < 1e-5 and maxerr(lse, rlse) < 1e-5
    gout = torch.randn_like(rout)
    got = torch.autograd.grad((out * gout).sum(), (q, k, v))
    want = torch.autograd.grad((rout * gout).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert maxerr(g, w) < 2e-5


@needs_triton
@pytest.mark.parametrize("bm,bn", [(128, 64), (64, 128), (32, 16), (16, 64)])
def test_attention_block_configs(bm, bn):
    """Other tilings (incl. the GPU's 128x64) through the diagonal/full split logic."""
    q, k, v = rand_qkv(1, 4, 2, 150, 170, 32, seed=10)
    args = (True, 1 / math.sqrt(32), 30, 10)
    out, lse = T.flash_attn_fwd_triton(q.detach(), k.detach(), v.detach(), *args, block_m=bm, block_n=bn)
    rout, rlse = ref_attention(q, k, v, True, 30, 10)
    assert maxerr(out, rout) < 1e-5 and maxerr(lse, rlse) < 1e-5
    dout = torch.randn_like(rout)
    got = T.flash_attn_bwd_triton(dout, q.detach(), k.detach(), v.detach(), out, lse, None, *args,
                                  block_m=bm, block_n=bn)
    want = torch.autograd.grad((rout * dout).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert maxerr(g, w) < 2e-5


def test_attention_validation():
    q, k, v = rand_qkv(1, 2, 2, 16, 16, 48)
    with pytest.raises(ValueError, match="head dim 48"):
        flash_attention(q, k, v)
    q, k, v = rand_qkv(1, 3, 2, 16, 16, 32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        flash_attention(q, k, v)
    with pytest.raises(ValueError, match="powers of two"):
        T.check_blocks(48, 64, 64)
    with pytest.raises(ValueError, match="powers of two"):
        T.check_blocks(8, 64, 64)
    with pytest.raises(ValueError, match="impl"):
        A.use_triton("cuda", torch.device("cpu"))


# --------------------------------------------------------------------------- fused loss
def ref_ce(x, w, t, ignore_index=-100, reduction="mean"):
    return F.cross_entropy(x.float() @ w.float().t(), t, ignore_index=ignore_index, reduction=reduction)


def rand_ce(N, H, V, dtype=torch.float32, seed=0, ignore_every=7, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.2).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[::ignore_every] = ignore_index
    return x, w, t


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N,H,V,reduction", [(200, 48, 1001, "mean"), (64, 64, 256, "sum"),
                                             (100, 32, 515, "none")])
def test_fused_ce_fp32(N, H, V, reduction, impl):
    x, w, t = rand_ce(N, H, V)
    loss = fused_linear_cross_entropy(x, w, t, reduction=reduction, impl=impl)
    ref = ref_ce(x, w, t, reduction=reduction)
    assert loss.shape == ref.shape and maxerr(loss, ref) < 1e-5 * max(1.0, ref.abs().max().item())
    gl = torch.randn_like(ref) if reduction == "none" else torch.ones_like(ref)
    got = torch.autograd.grad((loss * gl).sum(), (x, w))
    want = torch.autograd.grad((ref * gl).sum(), (x, w))
    for g, r in zip(got, want):
        assert maxerr(g, r) < 1e-5 * max(1.0, r.abs().max().item())


@needs_triton
def test_fused_ce_chunked_backward_and_ignore_index():
    """Several backward chunks (dW accumulated across them) and a non-default ignore_index."""
    x, w, t = rand_ce(130, 32, 300, seed=4, ignore_index=5, ignore_every=3)
    lse, tgt = L.linear_ce_fwd_triton(x.detach(), w.detach(), t, 0, 5)
    valid = (t != 5).float()
    dx, dw = L.linear_ce_bwd_triton(x.detach(), w.detach(), t, lse, valid, -valid, 0, 5,
                                    bwd_chunk_bytes=64 * 300 * 4)
    ref = ref_ce(x, w, t, ignore_index=5, reduction="sum")
    rdx, rdw = torch.autograd.grad(ref, (x, w))
    assert maxerr(((lse - tgt) * valid).sum(), ref) < 1e-4
    assert maxerr(dx, rdx) < 1e-5 and maxerr(dw, rdw) < 1e-5


@needs_triton
@pytest.mark.parametrize("cfg", [dict(BLOCK_T=128, BLOCK_V=128, BLOCK_H=64), dict(BLOCK_T=32, BLOCK_V=64, BLOCK_H=16)])
def test_fused_ce_block_configs(cfg):
    x, w, t = rand_ce(150, 80, 700, seed=11)
    lse, tgt = L.linear_ce_fwd_triton(x.detach(), w.detach(), t, 0, -100, cfg=cfg)
    z = x.detach() @ w.detach().t()
    assert maxerr(lse, torch.logsumexp(z, -1)) < 1e-5
    valid = (t != -100).float()
    dx, dw = L.linear_ce_bwd_triton(x.detach(), w.detach(), t, lse, valid, -valid, 0, -100, cfg=cfg)
    rdx, rdw = torch.autograd.grad(ref_ce(x, w, t, reduction="sum"), (x, w))
    assert maxerr(dx, rdx) < 1e-5 and maxerr(dw, rdw) < 1e-5


@needs_triton
def test_fused_ce_bf16():
    x, w, t = rand_ce(64, 64, 300, dtype=torch.bfloat16, seed=5)
    loss = fused_linear_cross_entropy(x, w, t, impl="triton")
    ref = ref_ce(x, w, t)
    gx, gw = torch.autograd.grad(loss, (x, w))
    rgx, rgw = torch.autograd.grad(ref, (x, w))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item()
    assert maxerr(gx, rgx) < 2e-2 * rgx.abs().max().item() and maxerr(gw, rgw) < 2e-2 * rgw.abs().max().item()


def test_fused_ce_validation():
    x, w, t = rand_ce(8, 16, 32)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="expected x"):
        fused_linear_cross_entropy(x, w[:, :8], t)
    with pytest.raises(ValueError, match="BLOCK_V"):
        L.check_blocks(dict(BLOCK_T=64, BLOCK_V=100, BLOCK_H=64))


# --------------------------------------------------------------------------- vocab parallel, TP=2
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, path, impl):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        x, w, t = rand_ce(96, 32, 250, seed=6)
        vs = w.shape[0] // world
        xs = x.detach().clone().requires_grad_()
        ws = w.detach()[rank * vs:(rank + 1) * vs].clone().requires_grad_()
        loss = fused_linear_cross_entropy(xs, ws, t, group=dist.group.WORLD, impl=impl)
        loss.backward()
        torch.save({"loss": loss.detach(), "dx": xs.grad, "dw": ws.grad}, f"{path}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    from codegen.runtime.mesh import exit_process
    exit_process(0)  # the gloo exit abort at interpreter exit (codegen/runtime/mesh.py)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_vocab_parallel_tp2(tmp_path, impl):
    import torch.multiprocessing as mp
    mp.spawn(_tp_worker, args=(2, _free_port(), str(tmp_path), impl), nprocs=2, join=True)
    x, w, t = rand_ce(96, 32, 250, seed=6)
    ref = ref_ce(x, w, t)
    rdx, rdw = torch.autograd.grad(ref, (x, w))
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert maxerr(res["loss"], ref) < 1e-5
        assert maxerr(res["dx"], rdx) < 1e-6
        assert maxerr(res["dw"], rdw[r * 125:(r + 1) * 125]) < 1e-6


# --------------------------------------------------------------------------- op registration
def test_opcheck_attention_ops():
    q, k, v = rand_qkv(1, 4, 2, 24, 40, 16, seed=7)
    sc = 0.25
    torch.library.opcheck(torch.ops.autopar.flash_attn_fwd, (q, k, v, True, sc, 16, 0, "torch"))
    out, lse = A.flash_attn_fwd(q.detach(), k.detach(), v.detach(), True, sc, 16, 0, "torch")
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.autopar.flash_attn_bwd,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, torch.randn_like(lse),
                           True, sc, 16, 0, "torch"))
    torch.library.opcheck(torch.ops.autopar.attn_merge,
                          (out.requires_grad_(), lse.requires_grad_(), torch.randn_like(out), torch.randn_like(lse)))


def test_opcheck_loss_ops():
    x, w, t = rand_ce(24, 16, 40, seed=8)
    torch.library.opcheck(torch.ops.autopar.linear_ce_fwd, (x, w, t, 0, -100, "torch"))
    lse, _ = L.linear_ce_fwd(x.detach(), w.detach(), t, 0, -100, "torch")
    g = torch.randn(24)
    torch.library.opcheck(torch.ops.autopar.linear_ce_bwd,
                          (x.detach(), w.detach(), t, lse, g, -g, 0, -100, "torch"))


def test_make_fx_single_nodes():
    from torch.fx.experimental.proxy_tensor import make_fx
    q, k, v = rand_qkv(1, 2, 1, 16, 16, 16)
    gm = make_fx(lambda q, k, v: flash_attention(q, k, v, causal=True, impl="torch"))(q.detach(), k.detach(), v.detach())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autopar.flash_attn_fwd.default) == 1
    assert all("aten.bmm" not in str(t) and "aten.mm" not in str(t) for t in targets)
    x, w, t = rand_ce(8, 16, 32)
    gm = make_fx(lambda x, w, t: fused_linear_cross_entropy(x, w, t, impl="torch"))(x.detach(), w.detach(), t)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autopar.linear_ce_fwd.default) == 1
    assert all("aten.mm" not in str(t) for t in targets)


@pytest.mark.slow
def test_torch_compile_aot_eager():
    """Ops compose under torch.compile(fullgraph=True) incl. backward (fallback path)."""
    def f(q, k, v, x, w, t):
        o, lse = flash_attention(q, k, v, causal=True, impl="torch")
        return o.sum() + lse.sum() + fused_linear_cross_entropy(x, w, t, impl="torch")
    q, k, v = rand_qkv(1, 2, 1, 16, 16, 16)
    x, w, t = rand_ce(8, 16, 32)
    inputs = (q, k, v, x, w)
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(*inputs, t), inputs)
    want = torch.autograd.grad(f(*inputs, t), inputs)
    for g, r in zip(got, want):
        assert maxerr(g, r) < 1e-6
