"""Launchers: how a plan's program is started. ``local`` runs torchrun on this machine
(``planner/entry/launch.py``); ``slurm`` writes a batch script for the plan's cluster, which
the user submits with ``sbatch`` (autopar never submits it).

The script (:func:`slurm_script`) follows the usual torchrun-under-Slurm pattern: one Slurm
task per node (``--ntasks-per-node=1``), each running ``torchrun`` with the node's ranks
(``--nproc-per-node``), joined by torchrun's c10d rendezvous on the job's first node (from
``scontrol show hostnames``), keyed by the job id. Nodes, GPUs per node and ranks come from
the plan (``planner.feasibility.Nodes.of_plan`` and the layout's world size); CPUs per task
are the node's cores when the plan's cluster records them (local CPU clusters), else left to
the site's default with a commented line to fill in.
"""
from __future__ import annotations

import shlex
from typing import Sequence

from planner.errors import AutoparError

LAUNCHERS = ("local", "slurm")
RDZV_PORT = 29500


def check_launcher(name: str) -> str:
    """``name`` if autopar has that launcher, else one line naming the ones it has."""
    if name not in LAUNCHERS:
        raise AutoparError(f"--launcher {name!r}: autopar has {' and '.join(LAUNCHERS)}; for another scheduler "
                           "use `--launcher slurm` and adapt its script, or run torchrun on each node yourself")
    return name


def job_shape(plan) -> tuple[int, int, int]:
    """(nodes, ranks per node, cores per node; 0: unknown) of the plan's layout on its cluster:
    the layout's world over the cluster's nodes (a layout using fewer devices than the cluster
    has takes whole nodes, the last one possibly partly)."""
    from planner.feasibility import Nodes

    shape = Nodes.of_plan(plan.cluster, plan.config.world)
    world, per_node = plan.config.world, shape.devices_per_node
    nodes = -(-world // per_node)
    if world % per_node and nodes > 1:
        raise AutoparError(f"the plan's {world} ranks do not fill whole nodes of {per_node} devices: "
                           "plan for whole nodes (--fix world=...) to run it under Slurm")
    return nodes, min(world, per_node), shape.cores_per_node


def slurm_script(plan, program: str, args: Sequence[str], *, workdir: str, log_dir: str) -> str:
    """The sbatch script running ``program`` with ``args`` under the plan's layout (module
    docstring). ``workdir``: where the job runs (absolute paths are safest on a cluster);
    ``log_dir``: where Slurm writes the job's output (``slurm-<job id>.out``; absolute: Slurm
    reads it from the folder sbatch is called in)."""
    from planner.feasibility import rank_threads

    nodes, per_node, cores = job_shape(plan)
    gpus = plan.cluster.get("backend") == "nccl"
    threads = rank_threads(plan.config.threads, cores, per_node)
    name = "autopar-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in str(plan.model.get("name", "job")))
    q = shlex.quote
    lines = ["#!/bin/bash",
             f"# autopar: {plan.model.get('name')} as {plan.config.label()} on {plan.cluster.get('name')}",
             f"#SBATCH --job-name={name}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1  # one torchrun per node; it starts the node's ranks",
             *([f"#SBATCH --gpus-per-node={per_node}"] if gpus else []),
             f"#SBATCH --cpus-per-task={cores}" if cores else
             "##SBATCH --cpus-per-task=N  # the plan's cluster does not record its cores: your nodes' cores",
             f"#SBATCH --output={log_dir.rstrip('/')}/slurm-%j.out",
             "set -euo pipefail",
             'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
             f"export OMP_NUM_THREADS={threads} PYTHONFAULTHANDLER=1",
             f"cd {q(workdir)}",
             'PYTHON=${PYTHON:-python}  # an environment with autopar and torch installed on every node',
             f'srun "$PYTHON" -m torch.distributed.run --nnodes {nodes} --nproc-per-node {per_node} \\',
             f'    --rdzv-backend c10d --rdzv-endpoint "$head_node:{RDZV_PORT}" --rdzv-id "$SLURM_JOB_ID" \\',
             "    " + " ".join(q(a) for a in [program, *args])]
    return "\n".join(lines) + "\n"


def write_slurm_script(plan, path: str, program: str, args: Sequence[str], *, workdir: str, log_dir: str,
                       force: bool = False) -> str:
    """Write :func:`slurm_script` to ``path``; returns the command that submits it."""
    from planner.files import write_atomic

    write_atomic(path, slurm_script(plan, program, args, workdir=workdir, log_dir=log_dir), force=force)
    return f"sbatch {shlex.quote(path)}"
