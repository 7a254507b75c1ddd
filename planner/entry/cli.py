"""The ``autopar`` command line: its parser and ``main``.

Every subcommand turns bad input into one line on stderr (``error: ...``) and exit status 2;
``--debug`` shows the traceback instead. Numeric flags are checked as they are parsed, before
any work; what the commands do is ``planner/entry/commands.py`` and ``planner/entry/measure.py``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from cost_models.engines import ENGINES
from planner.entry import commands as cmd
from planner.entry import measure
from planner.errors import AutoparError
from planner.plan import FP8_RECIPES, LOSS_KERNELS
from planner.precision import DTYPES


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line with exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def positive_int(text: str) -> int:
    """A flag's value that must be a whole number >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def count(text: str) -> int:
    """A flag's value that must be a whole number >= 0."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {v}")
    return v


def nonnegative_float(text: str) -> float:
    """A flag's value that must be a finite number >= 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def imbalance(text: str) -> float:
    """``--moe-imbalance``: the busiest expert-parallel rank's tokens over the mean, >= 1."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1.0, got {text!r}") from None
    if not v >= 1.0:
        raise argparse.ArgumentTypeError(f"must be >= 1.0 (the busiest rank's tokens over the mean), got {v}")
    return v


def launcher(text: str) -> str:
    """``--launcher``: one autopar has (``planner.entry.slurm.LAUNCHERS``)."""
    from planner.entry.slurm import check_launcher

    try:
        return check_launcher(text)
    except AutoparError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--cluster", required=True, help="preset[:nodes] (dgx-h100:128), local-cpu:N or cluster.toml")
    p.add_argument("--global-batch", type=positive_int, required=True, help="sequences per optimizer step")
    p.add_argument("--profile", default=None, help="profile.json measured by `autopar profile`")
    p.add_argument("--no-calibrate", action="store_true",
                   help="local-cpu: plan uncalibrated instead of with this machine's cached calibration "
                        "(profiled on first use, about 15-30 s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--moe-imbalance", type=imbalance, default=1.0, metavar="X",
                   help="mixtures of experts: the busiest expert-parallel rank's tokens over the mean (default 1.0)")
    p.add_argument("--seq-lens", default=None, metavar="FILE",
                   help="document lengths packed into rows of --seq-len tokens (default: the longest, rounded up "
                        "to 128): one length per line, a JSON list, {\"length\": count} or length,count lines")
    p.add_argument("--fix", default=None, metavar="PINS", help="keep part of the layout, e.g. 'tp=8,pp=1' or "
                   "'tp<=4,zero=fsdp': dp pp cp tp ep mbs vpp with =, <=, >=; schedule zero recompute sp with = "
                   "(evaluate: check --config against them)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="zoo preset (e.g. llama3-8b), spec.toml, hf:<preset>, or package.module:function")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the model's)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autopar", description="Plan and compile parallel training for PyTorch models.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="cmd", parser_class=_Parser)

    _add_planning_commands(sub)
    _add_running_commands(sub)
    _add_inspection_commands(sub)
    return ap


def _add_planning_commands(sub) -> None:
    """graph, plan, evaluate."""
    g = sub.add_parser("graph", help="capture a model and print its layer table")
    _add_model_args(g)
    g.add_argument("--batch", type=positive_int, default=1, help="sequences in the example batch")
    g.add_argument("--json", action="store_true", help="print the ModelGraph as JSON")
    g.add_argument("--fx", action="store_true", help="print the captured torch.fx graph (ATen ops) of one layer")
    g.add_argument("--layer", default=None, help="with --fx: the layer (default: the first block)")
    g.set_defaults(fn=cmd.cmd_graph)

    p = sub.add_parser("plan", help="search the parallel configurations and write a plan")
    _add_plan_args(p)
    p.add_argument("--top-k", type=count, default=5, help="alternatives to keep")
    p.add_argument("--loss", choices=LOSS_KERNELS, default="eager", help="loss kernel to plan with")
    p.add_argument("--fp8", choices=FP8_RECIPES, default="none",
                   help="the blocks' linears in float8 (torchao recipe; H100/H200-class GPUs; bf16 plans)")
    p.add_argument("--compile", action="store_true", help="each block through torch.compile (regional compilation)")
    p.add_argument("--low-comm", default="", metavar="GxH:DTYPE",
                   help="also price low-communication DP (DiLoCo-style: G groups of replicas, pseudo-gradients in "
                        "DTYPE every H steps, e.g. 2x16:bf16) and choose it when faster; it changes the optimisation")
    p.add_argument("--per-batch", action="store_true",
                   help="with --seq-lens: price assigning each batch's documents to context-parallel groups of the "
                        "size they need and run it when it is faster (batch.per_batch in the plan)")
    p.add_argument("--images-per-sample", default="", metavar="N:W,...",
                   help="a vision + language model's images per sample as IMAGES:WEIGHT pairs (e.g. 0:0.4,1:0.4,16:0.2): "
                        "price assigning each batch's samples to the dp ranks (batch.multimodal in the plan)")
    p.add_argument("--schedule", default=None, metavar="FILE",
                   help="plan for your own pipeline schedule (.csv in torch's action format or .json): the layouts "
                        "with its pp and micro-batches, priced running it; the plan carries it")
    p.add_argument("-o", "--out", default=None, help="plan file to write (JSON)")
    p.add_argument("--force", action="store_true", help="overwrite an existing plan file")
    p.set_defaults(fn=cmd.cmd_plan)

    p = sub.add_parser("evaluate", help="price a configuration you already run")
    _add_plan_args(p)
    p.add_argument("--config", required=True,
                   help="e.g. dp=8,pp=2,cp=1,tp=4,mbs=1,schedule=1f1b,vpp=1,zero=fsdp,recompute=selective,sp=on")
    p.add_argument("--even-split", action="store_true", help="equal layers per stage instead of the ILP split")
    p.add_argument("--engine", choices=list(ENGINES), default="autopar",
                   help="price the overlaps of this engine (cost_models/engines.py); plans run on autopar's")
    p.add_argument("--schedule", default=None, metavar="FILE",
                   help="your own pipeline schedule: .csv (torch's action format, one row per pp rank: 0F0,0B0,...) "
                        "or .json; checked, priced and, with -o, written into the plan so the program runs it")
    p.add_argument("-o", "--out", default=None, help="write this configuration as a plan file (JSON) to run")
    p.add_argument("--force", action="store_true", help="overwrite an existing plan file")
    p.set_defaults(fn=cmd.cmd_evaluate)


def _add_running_commands(sub) -> None:
    """codegen, run, export, demo."""
    p = sub.add_parser("codegen", help="emit the training program of a plan")
    p.add_argument("plan")
    p.add_argument("-o", "--out", default=None)
    p.add_argument("--force", action="store_true", help="overwrite an existing program")
    p.add_argument("--launcher", type=launcher, default="local",
                   help="slurm: also write OUT.sbatch, a Slurm job script for the plan's cluster (default: local)")
    p.set_defaults(fn=cmd.cmd_codegen)

    p = sub.add_parser("run", help="emit and run a plan's program on this machine (torchrun)")
    p.add_argument("plan")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--dir", default="runs/latest", help="where the program, log and checkpoints go")
    p.add_argument("--ckpt-every", type=count, default=0, help="checkpoint every K steps")
    p.add_argument("--max-restarts", type=count, default=0, help="relaunch a job whose process died")
    p.add_argument("--data", default=None, metavar="PATH|hf:PATH|pkg.mod:fn",
                   help="a flat file of token ids (nanoGPT/Megatron .bin), hf:PATH (a tokenized dataset saved with "
                        "save_to_disk) or package.module:function(step, global_batch, seq_len) -> batch "
                        "(default: synthetic tokens)")
    p.add_argument("--data-dtype", default=None, metavar="uint16|uint32",
                   help="a token file's ids (default: uint16 if the model's vocabulary fits, else uint32)")
    p.add_argument("--data-eos", type=count, default=None, metavar="ID",
                   help="token id that ends each document of a token file (plans made with --seq-lens then "
                        "train on packed documents)")
    p.add_argument("--launcher", type=launcher, default="local",
                   help="local: torchrun here (default); slurm: write DIR/job.sbatch for the plan's cluster and "
                        "print the sbatch command (nothing is submitted)")
    p.add_argument("--rig-mbit", type=nonnegative_float, default=None, metavar="MBIT",
                   help="run the ranks as two regions (half the ranks each) in two network namespaces joined by a "
                        "link limited to MBIT Mbit/s per direction (0: no limit); Linux and root only")
    p.set_defaults(fn=cmd.cmd_run)

    p = sub.add_parser("export", help="gather a run's sharded checkpoint into the model's own format")
    p.add_argument("ckpt", help="a run's checkpoint folder (its newest complete step) or one step-N folder")
    p.add_argument("-o", "--out", required=True, help="folder to write (save_pretrained for transformers models)")
    p.add_argument("--plan", default=None, help="the run's plan (checkpoints that do not say which model they hold)")
    p.add_argument("--model", default=None, help="the model spec, instead of --plan")
    p.add_argument("--format", choices=("safetensors", "pt"), default="safetensors",
                   help="other than transformers models: model.safetensors or model.pt (torch.save)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.set_defaults(fn=cmd.cmd_export)

    p = sub.add_parser("demo", help="plan a model for this machine, run it, compare predicted and measured")
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--cluster", default="local-cpu", help="local-cpu (one process per core) or local-cpu:N")
    p.add_argument("--global-batch", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--steps", type=positive_int, default=30)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the run and the baseline")
    p.add_argument("--no-calibrate", action="store_true", help="plan uncalibrated (no machine profile)")
    p.add_argument("--dir", default="runs/demo")
    p.set_defaults(fn=cmd.cmd_demo)


def _add_inspection_commands(sub) -> None:
    """report, profile, calibrate."""
    p = sub.add_parser("report", help="explain a plan: HTML, Markdown, Perfetto trace or a terminal summary")
    p.add_argument("plan", help="plan file written by `autopar plan -o`")
    p.add_argument("-o", "--out", default=None, help="self-contained HTML report to write")
    p.add_argument("--md", default=None, help="Markdown summary to write (for a pull request or issue)")
    p.add_argument("--trace", default=None, help="Chrome/Perfetto trace JSON of the simulated step to write")
    p.add_argument("--run-log", default=None, help="train_log.jsonl of a run: predicted and measured side by side")
    p.add_argument("--text", action="store_true", help="print a terminal summary (default when no file is asked)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    p.set_defaults(fn=cmd.cmd_report)

    p = sub.add_parser("profile", help="measure layers and collectives on a cluster -> profile.json")
    _add_model_args(p)
    p.add_argument("--cluster", required=True, help="local-cpu:N, a preset[:nodes] or cluster.toml")
    p.add_argument("--batches", default="1,2", help="micro-batch sizes to measure, comma-separated")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="compute dtype to time layers in (default: the cluster's plans' own: bf16 on GPUs, fp32 on CPUs)")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(fn=measure.cmd_profile)

    p = sub.add_parser("calibrate", help="fit the cost model to measured runs and store it in the profile")
    p.add_argument("--run-log", nargs="+", required=True, metavar="RUN",
                   help="PLAN.json:train_log.jsonl, or a run directory holding plan.json and train_log.jsonl")
    p.add_argument("--profile", required=True, help="profile.json of the cluster the runs ran on")
    p.add_argument("-o", "--out", default=None, help="write the calibrated profile here (default: in place)")
    p.add_argument("--keys", default="", help="coefficients to fit, comma-separated (default: all time coefficients)")
    p.add_argument("--warmup", type=count, default=2, help="steps dropped from the front of each log")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out (held-out) error")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=measure.cmd_calibrate)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    fn: Callable[[argparse.Namespace], int] | None = getattr(args, "fn", None)
    if fn is None:
        ap.print_help()
        return 2
    try:
        return fn(args)
    except (AutoparError, ValueError) as e:  # ClusterError, PlanError are ValueErrors
        if args.debug:
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable output path, a full disk
        if args.debug:
            raise
        what = f"{e.filename}: " if e.filename else ""
        print(f"error: {what}{e.strerror or e}: check the path and its permissions", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
