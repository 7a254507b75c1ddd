"""Launchers: ``--launcher slurm`` writes a job script for the plan's cluster (nodes, ranks per
node, GPUs, the c10d rendezvous on the job's first node, the program and its arguments) that
bash parses; nothing is submitted or run; launchers autopar does not have are refused in one line."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from cost_models.cluster import parse_cluster
from planner.entry.cli import main
from planner.frontend.load import load_graph
from planner.search.planning import plan_model


def _plan(tmp_path, cluster: str, fix: str) -> str:
    plan, _ = plan_model(load_graph("llama-tiny", seq_len=32), parse_cluster(cluster), 64, spec="llama-tiny",
                         cluster_spec=cluster, fix=fix)
    path = str(tmp_path / "plan.json")
    plan.save(path)
    return path


def _sbatch(text: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))


def _bash_parses(path: str) -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine")
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_run_with_slurm_writes_a_multinode_gpu_job_script(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan(tmp_path, "dgx-h100:2", "tp=2,pp=2")           # 16 GPUs on 2 nodes of 8
    run = tmp_path / "run"
    assert main(["run", plan, "--launcher", "slurm", "--dir", str(run), "--steps", "50", "--ckpt-every", "10"]) == 0
    out = capsys.readouterr().out
    assert f"sbatch {run / 'job.sbatch'}" in out
    text = (run / "job.sbatch").read_text()
    assert _sbatch(text) == {"job-name": "autopar-llama-tiny", "nodes": "2", "ntasks-per-node": "1",
                             "gpus-per-node": "8", "output": f"{run}/slurm-%j.out"}
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    launch = " ".join(text.split("\\\n"))
    assert re.search(r'srun "\$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node 8 +--rdzv-backend c10d '
                     r'--rdzv-endpoint "\$head_node:29500" --rdzv-id "\$SLURM_JOB_ID"', launch), launch
    assert f"{run}/train_llama_tiny.py --steps 50 --metrics {run}/train_log.jsonl --ckpt-dir {run}/checkpoints " \
           "--ckpt-every 10" in launch
    assert sorted(os.listdir(run)) == ["job.sbatch", "train_llama_tiny.py"]   # written, not run
    _bash_parses(str(run / "job.sbatch"))


def test_codegen_with_slurm_on_a_cpu_cluster_asks_for_the_nodes_cores(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan(tmp_path, "local-cpu:2", "world=2")
    assert main(["codegen", plan, "-o", "train.py", "--launcher", "slurm"]) == 0
    assert "sbatch train.sbatch" in capsys.readouterr().out
    text = (tmp_path / "train.sbatch").read_text()
    tags = _sbatch(text)
    assert tags["nodes"] == "1" and tags["cpus-per-task"] == str(parse_cluster("local-cpu:2").cores_per_node)
    assert "gpus-per-node" not in tags and "--nproc-per-node 2" in text and "train.py --steps 20" in text
    _bash_parses(str(tmp_path / "train.sbatch"))
    assert main(["codegen", plan, "-o", "train.py", "--launcher", "slurm"]) == 2   # both outputs exist
    assert "exists" in capsys.readouterr().err


def test_unknown_launcher_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", str(tmp_path / "plan.json"), "--launcher", "kubernetes"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "autopar has local and slurm" in err, err


def test_cpu_ranks_beyond_the_cores_launch_under_batch_scheduling():
    """``planner.entry.launch.cpu_scheduling``: only gloo launches with more ranks x threads than
    cores get a pre-exec hook, and the process it runs in (and its children) is SCHED_BATCH."""
    import sys

    from planner.entry.launch import cpu_scheduling

    cores = len(os.sched_getaffinity(0))
    assert cpu_scheduling(cores, 1, "nccl") is None and cpu_scheduling(2 * cores, 1, "nccl") is None
    assert cpu_scheduling(cores, 1, "gloo") is None
    hook = cpu_scheduling(cores + 1, 1, "gloo") or cpu_scheduling(cores, 2, "gloo")
    if not hasattr(os, "SCHED_BATCH"):
        assert hook is None
        return
    assert hook is not None and cpu_scheduling(cores, 2, "gloo") is not None
    policy = os.sched_getscheduler(0)  # the test session's own (tests/conftest.py): the default for this check
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    try:
        def child(**kw) -> int:
            return int(subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                                      capture_output=True, text=True, check=True, **kw).stdout)
        assert child() == os.SCHED_OTHER
        assert child(preexec_fn=hook) == os.SCHED_BATCH
    finally:
        os.sched_setscheduler(0, policy, os.sched_param(0))
