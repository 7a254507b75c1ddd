"""Closing a build leaves the process and the model as they were (codegen/runtime/installs.py).

Ten models (zoo, transformers Llama / GPT-2 / Mixtral / Gemma-2, a user's module; DP, FSDP,
TP+SP, PP, ring and Ulysses CP, EP, recompute) are built, trained and closed one after another
in one 2-rank gloo launch (tests/close_worker.py): after each close, transformers' attention,
mask and experts registries, ``os.environ``, the live process groups and every module's
``__dict__`` (attributes, children, hook ids) equal what they were before the build, although
the build added groups, hooks and attributes (and registry entries for the transformers
models) while it was open. ``auto_parallelize`` in one plain process: ``close()`` also removes
the environment variables and the default process group it created.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from planner.entry.launch import torchrun_cmd, worker_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # torchrun launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "close_worker.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
import close_worker as CW  # noqa: E402
from launches import run_launch  # noqa: E402


def _run(cmd: list[str], out: str) -> dict:
    env = dict(worker_env(), PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = run_launch(cmd, env=env, timeout=900)
    assert proc.returncode == 0 and os.path.exists(out), (proc.stdout[-3000:], proc.stderr[-5000:])
    with open(out) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def closed(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("close") / "close.json")
    return _run(torchrun_cmd(2, [WORKER, out]), out)


@pytest.mark.parametrize("i", range(len(CW.BUILDS)), ids=[f"{i}:{b[0]}" for i, b in enumerate(CW.BUILDS)])
def test_close_restores_process_and_model(closed, i):
    r = closed[f"{i}:{CW.BUILDS[i][0]}"]
    assert "error" not in r, r.get("error")
    assert r["added"]["groups"] > 0 and r["added"]["module changes"] > 0, r["added"]  # the build did install
    if CW.BUILDS[i][0].startswith(("hf-", "gemma")):
        assert r["added"]["registry entries"] > 0, r["added"]
    assert r["process"] == [], r["process"]    # registries, environment, process groups
    assert r["modules"] == [], r["modules"]    # every module's attributes, children and hooks


def test_ten_builds_in_one_process(closed):
    """All ten builds ran in the one launch, one after another, and each reported."""
    assert len(CW.BUILDS) == 10 and sorted(closed) == sorted(f"{i}:{b[0]}" for i, b in enumerate(CW.BUILDS))


def test_auto_parallelize_close_removes_its_environment_and_group(tmp_path):
    out = str(tmp_path / "single.json")
    r = _run([sys.executable, WORKER, "--single", out], out)
    assert r["while_open"] == {"initialized": True, "world": "1"}
    assert not r["initialized"] and r["process"] == [] and r["modules"] == [], r
