"""Float8 linears and regional torch.compile as planned options (``ParallelConfig.fp8`` /
``compile``): the plan contract, the request refusals, the pricing, and the runtime's
conversions (codegen/runtime/fp8.py, regional_compile.py): float8 in torchao's emulation on
CPU, compiled blocks in one process here and under FSDP and a pipeline on gloo in
tests/test_precision.py's launch (tests/precision_worker.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from cost_models.cluster import parse_cluster
from planner.errors import PlanError
from planner.feasibility import modes_problem
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig
from planner.search.candidates import compile_problem, fp8_problem
from planner.search.planning import evaluate_config


def test_the_options_are_quiet_in_plans_without_them_and_parse():
    base = ParallelConfig(dp=8, zero="fsdp")
    assert "fp8" not in base.to_str() and "compile" not in base.to_str() and "fp8" not in base.fields_dict()
    cfg = ParallelConfig.parse("dp=8,zero=fsdp,fp8=tensorwise,compile=on")
    assert (cfg.fp8, cfg.compile) == ("tensorwise", True) and ParallelConfig.parse(cfg.to_str()) == cfg
    assert "fp8-tensorwise" in cfg.label() and "compiled" in cfg.label()
    with pytest.raises(PlanError, match="fp8='blockwise'"):
        ParallelConfig(fp8="blockwise").validate()
    with pytest.raises(PlanError, match="needs dtype=bf16"):
        ParallelConfig(fp8="rowwise", dtype="fp32").validate()


def test_refused_in_one_line_where_they_cannot_run(monkeypatch):
    assert fp8_problem("tensorwise", parse_cluster("dgx-h100")) is None
    for cl in ("dgx-a100-80g", "local-cpu:2"):
        why = fp8_problem("tensorwise", parse_cluster(cl))
        assert why and "float8 tensor cores" in why and "\n" not in why
    assert fp8_problem("none", parse_cluster("dgx-a100-80g")) is None
    assert "tp=1" in modes_problem("bf16", compile=True, tp=2) and "cp=1" in modes_problem("bf16", compile=True, cp=2)
    assert "tp=1" in modes_problem("bf16", fp8="rowwise", tp=2)
    assert modes_problem("bf16", "rowwise", True) is None and "loss scaling" in modes_problem("fp16")
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "C++ compiler" in compile_problem(True, parse_cluster("local-cpu:2"))
    assert compile_problem(True, parse_cluster("dgx-h100")) is None


def test_float8_without_compile_warns_in_one_line(capsys):
    """Float8 linears without compiled blocks run, slowly (3.7x bf16 on an H200): plan and evaluate
    say so in one line naming the fix; with --compile, or without float8, nothing is said."""
    from planner.entry.cli import main
    from planner.search.candidates import fp8_caveat

    why = fp8_caveat("tensorwise", False)
    assert why and "\n" not in why and "add --compile" in why
    assert fp8_caveat("tensorwise", True) is None and fp8_caveat("none", False) is None
    args = ["--model", "gpt-small", "--cluster", "dgx-h100:1", "--global-batch", "8", "--seq-len", "512"]
    assert main(["evaluate", *args, "--config", "dp=8,mbs=1,zero=ddp,fp8=tensorwise"]) == 0
    assert "add --compile" in capsys.readouterr().out.replace("\n", " ")
    assert main(["evaluate", *args, "--config", "dp=8,mbs=1,zero=ddp,fp8=tensorwise,compile=on"]) == 0
    assert "add --compile" not in capsys.readouterr().out.replace("\n", " ")
    assert main(["plan", *args, "--fp8", "tensorwise", "--json"]) == 0
    assert "add --compile" in capsys.readouterr().err


def test_pricing_compile_fuses_and_fp8_halves_the_gemms():
    g = load_graph("llama3-8b", batch=1, seq_len=4096)
    cl = parse_cluster("dgx-h100")
    base = ParallelConfig(dp=8, zero="fsdp", mbs=1, recompute="selective-op")
    est = {k: evaluate_config(g, cl, base.replace(**kw), 16, engine="torchtitan")[0]
           for k, kw in (("eager", {}), ("compile", {"compile": True}), ("fp8", {"compile": True, "fp8": "tensorwise"}))}
    assert est["compile"].step_s < est["eager"].step_s  # fused norms / RoPE / activation: less HBM traffic
    # the blocks' GEMMs at the fp8 peak (twice bf16's on an H100): faster, but not twice (casts, attention, head)
    assert est["compile"].step_s / 2 < est["fp8"].step_s < est["compile"].step_s * 0.9
    # compiled blocks keep what fused kernels keep (cost_models/fused_elementwise.py)
    assert est["compile"].memory[0].activations < est["eager"].memory[0].activations


def _step_both(model, ref, vocab: int) -> tuple[float, float]:
    """One forward and backward of ``model`` and of ``ref`` on the same tokens; their losses."""
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, ref):
        loss = m(ids, labels=ids)
        loss.backward()
        losses.append(float(loss.detach()))
    return losses[0], losses[1]


def test_fp8_linears_convert_in_place_and_train_close_to_bf16():
    """torchao's emulated float8 (CPU): every block linear converted, parameter names unchanged,
    the loss within 1e-3 and the gradients within float8's precision (e4m3: 2^-3 relative steps)."""
    pytest.importorskip("torchao")
    from codegen.runtime.adapters import adapter_for
    from codegen.runtime.fp8 import convert_blocks, fp8_device_problem
    from planner import zoo

    cfg = zoo.preset("llama-tiny")
    model = zoo.build_model(cfg, device="cpu", seed=0).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    blocks = [model.get_submodule(b) for b in adapter_for(model).blocks]
    n = convert_blocks(blocks, "tensorwise", emulate=True)
    assert n == 7 * len(blocks) and type(model.head.proj).__name__ == "Linear"  # the head stays bf16
    assert [k for k, _ in model.named_parameters()] == [k for k, _ in ref.named_parameters()]
    lo, lr_ = _step_both(model, ref, cfg.vocab)
    assert abs(lo - lr_) < 1e-3 * abs(lr_)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert float((p.grad.float() - q.grad.float()).abs().max()) <= 0.25 * float(q.grad.float().abs().max()), k
    assert "float8 tensor cores" in fp8_device_problem("tensorwise", torch.device("cpu"))


@pytest.mark.slow
def test_regional_compile_runs_the_same_model(tmp_path):
    """One process: the zoo's llama-tiny with every block's forward compiled (inductor on CPU)
    gives the eager model's loss and gradients (fp32, to 1e-4), keeps its parameter names, and
    compiles once for all its blocks."""
    from codegen.runtime.adapters import adapter_for
    from codegen.runtime.regional_compile import compile_blocks
    from planner import zoo

    if compile_problem(True, parse_cluster("local-cpu:1")):
        pytest.skip("no C++ compiler for inductor on this machine")
    cfg = zoo.preset("llama-tiny")
    model = zoo.build_model(cfg, device="cpu", seed=0)
    ref = copy.deepcopy(model)
    assert compile_blocks(model.get_submodule(b) for b in adapter_for(model).blocks) == cfg.layers
    lo, lr_ = _step_both(model, ref, cfg.vocab)
    assert abs(lo - lr_) < 1e-5 * abs(lr_)
    for (k, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), k
