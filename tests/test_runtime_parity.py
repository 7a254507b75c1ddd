"""Parity of the parallel runtime (codegen/runtime) against one process, on gloo / CPU.

Every layout of ``tests/dist_worker.py`` trains every model of ``tests/model_cases.py`` (the
zoo's gpt-tiny and llama-tiny, a transformers Llama, a transformers GPT-2 with tied
embeddings and a packed q/k/v, and a user's plain module whose loss is computed outside
it; the zoo's gpt-tiny with a tied head only under PP2 x TP2) for 3 SGD steps (fp32, global batch 4, seq 32, same weights and data as the
unmodified model in one process); the first-step gradients (full tensors, by fqn), their
global norm (what clipping uses: each tied parameter counted once) and the 3 losses must
match within 1e-5 relative. Every pipeline layout runs a schedule IR through torch's schedule
runtime: the built-ins, DualPipeV (2 and 4 ranks), users' CSV files and generated schedules
(``dist_worker.CUSTOM_CSV``, 2 and 4 pipeline ranks). A layout the runtime cannot run for a model
(``REFUSED``) must be refused, with its reason, before anything is built. One torchrun launch per
world size (2, 4 and 8 processes; each build closed before the next, which destroys its process
groups) runs all models and layouts of that size and writes JSON; the first 2-process launch also trains mllm-tiny under an unequal PP2 split,
the first 4-process launch also runs the first half of the checkpoint test, and a last
4-process launch resumes from its DCP checkpoint.
"""
from __future__ import annotations

import json
import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dist_worker.py")
TOL = 1e-5

sys.path.insert(0, os.path.join(ROOT, "tests"))
import dist_worker as W  # noqa: E402
from launches import run_launch  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, group: str, out: str, *extra: str, timeout: int = 600) -> dict:
    def cmd() -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                f"--master-port={_free_port()}", WORKER, group, out, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = run_launch(cmd, env=env, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        raise AssertionError(f"torchrun {nproc} {group} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    with open(out) as fh:
        return json.load(fh)


def assert_parity(r: dict) -> None:
    """The run finished, every gradient was compared, and loss, gradients and the global norm
    equal the reference's within TOL."""
    assert "error" not in r, r["error"]
    assert not r["missing"], r["missing"]
    assert r["grad_rel_err"] <= TOL, (r["worst"], r["grad_rel_err"])
    assert r["norm_rel_err"] <= TOL
    assert r["loss_rel_err"] <= TOL


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """All launches, once per module: {world: results}, plus 'resume'."""
    d = tmp_path_factory.mktemp("runtime")
    ckpt = d / "ckpt"
    ckpt.mkdir()
    res: dict = {}
    for world in W.LAYOUTS:  # one launch per world size
        extra = (str(ckpt),) if world == 4 else ()
        res[world] = launch(world, "parity", str(d / f"w{world}.json"), *extra, timeout=1200)
    res["resume"] = launch(4, "resume", str(d / "resume.json"), str(ckpt))
    return res


CASES = [(world, f"{m}/{name}") for world in W.LAYOUTS for m in W.MODELS_BY_WORLD[world]
         for name, _, _ in W.layouts_of(world, m)]
# (model, layout) the runtime must refuse before building, and a word of the reason
REFUSED = {("hf-gpt2", "dp2xtp2-fsdp-sp"): "zero=fsdp with tp=2",
           ("hf-gpt2", "dp2xtp2-fsdp-sp-op"): "zero=fsdp with tp=2"}
# Ulysses splits each attention's kv heads ulysses x tp ways: the models with 2 kv heads (4 with
# 8 ranks) cannot run the wider splits
_KV2 = ("llama-tiny", "hf-llama", "user-lm")
REFUSED.update({(m, lay): "does not divide the" for m in _KV2 for lay in ("cp4-ulysses", "cp2xtp2-ulysses-sp")})
REFUSED.update({(m, "cp4xtp2-ulysses-sp"): "does not divide the" for m in ("gpt-tiny", "llama-tiny", "hf-llama")})
REFUSED.update({(m, "cp4xtp2-hybrid-sp"): "does not divide the" for m in ("llama-tiny", "hf-llama")})
REFUSED_LAYOUTS = {"pp2-zb-h1-op": "split backward",  # refused for every model that runs them
                   "dp2-ep2-ddp": "use zero=fsdp", "tp2-ep2-nosp": "use sp=on"}


@pytest.mark.parametrize("world,key", CASES, ids=[k for _, k in CASES])
def test_layout_parity(runs, world: int, key: str) -> None:
    r = runs[world][key]
    why = REFUSED.get(tuple(key.split("/"))) or REFUSED_LAYOUTS.get(key.split("/")[1])
    if why is not None:
        assert any(why in p for p in r.get("refused", [])), r
        return
    assert "refused" not in r, r["refused"]
    assert "error" not in r, r.get("error")
    assert not r["missing"], f"gradients missing for {r['missing']}"
    assert r["loss_rel_err"] < TOL, (r["losses"], r["ref_losses"])
    assert r["grad_rel_err"] < TOL, f"worst {r['worst']}: {r['grad_rel_err']}"


def test_mllm_pp2_unequal_split_trains(runs) -> None:
    r = runs[2]["mllm-tiny/pp2-unequal"]
    assert "error" not in r, r.get("error")
    losses = r["losses"]
    assert len(r["stages"]) == 2 and len(r["stages"][0]) != len(r["stages"][1])  # the ILP's unequal split
    assert abs(losses[0] - r["ref_first_loss"]) <= TOL * abs(r["ref_first_loss"])
    assert losses[-1] < losses[0] - 0.3, losses


def test_checkpoint_resume_is_bitwise(runs) -> None:
    first, resumed = runs[4]["ckpt"], runs["resume"]["ckpt"]
    assert "error" not in first and "error" not in resumed, (first, resumed)
    assert first["first_two"] == first["uninterrupted"][:2]
    assert resumed["resumed_from"] == 2
    assert resumed["resumed"] == first["uninterrupted"][2:]  # bitwise: exact float equality
