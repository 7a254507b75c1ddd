"""The training program autopar emits, before a plan fills it in (``codegen/emit.py``).

This file is the program: ``emit`` replaces this docstring with the plan's summary, the
block between the "the plan" and "end of the plan" lines with the plan's literals, and
each ``@name`` in a comment with the plan's words for that concern (``planner.describe``,
the phrases the report prints). Everything else is copied as it is, so what a reader of an
emitted program sees is this code, and a linter checks it here.
"""
import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)

from codegen.runtime import checkpoint
from codegen.runtime.adapters import adapter_for
from codegen.runtime.batch_parallel import per_batch_of
from codegen.runtime.corpus import DTYPES, is_hook, open_tokens, token_batches
from codegen.runtime.data import batch_digest, packed_documents, synthetic, user_hook
from codegen.runtime.mesh import build_mesh, init_distributed, teardown
from codegen.runtime.metrics import ScalarLog, peak_memory_per_rank
from codegen.runtime.multimodal import multimodal_of
from codegen.runtime.multimodal import train_step as sample_step
from codegen.runtime.optim import MAX_GRAD_NORM, adamw, build_optimizer, warmup_cosine
from codegen.runtime.recipe import (
    apply_attention,
    apply_compile,
    apply_dp,
    apply_ep,
    apply_fp8,
    apply_recompute,
    apply_tp,
    build_batch_planner,
    build_schedule,
    check_runnable,
    materialize,
    plan_schedule,
    split_stages,
    tie_weights,
)
from codegen.runtime.tensor_parallel import (
    GatherSequenceInput,
    PackedColwise,
    ReplicatedEmbedding,
    ReplicateRegionInput,
    VocabParallelEmbedding,
)
from codegen.runtime.tp_plan import tp_plan_for
from codegen.runtime.train import ParallelModel, TokenLoss
from planner import zoo
from planner.feasibility import Batch, Nodes
from planner.plan import ModelFacts, ParallelConfig

# ---- the plan --------------------------------------------------------------------------
MODEL, ADAPTER, VOCAB = "llama-tiny", "zoo", 256
# what check_runnable checks before anything is built
FACTS = ModelFacts.from_dict({})
CONFIG = ParallelConfig.parse("dp=1")
CLUSTER, DP_SPANS = Nodes("local-cpu", 1, 1), 1  # the cluster planned for; regions dp x cp spans
GLOBAL_BATCH, SEQ_LEN = 1, 32  # sequences per optimizer step, tokens per sequence
# planned with --seq-lens: synthetic rows pack documents of these lengths (drawn uniformly)
DOCUMENT_LENGTHS = []
# per-batch assignment of each batch's documents to context-parallel groups (None: the fixed layout)
PER_BATCH = per_batch_of(None)
MULTIMODAL = multimodal_of(None)  # each batch's samples (images, text) assigned to the dp ranks (None: fixed split)
STAGES = [["embed", "layers.0", "norm", "head"]]  # layer units per virtual stage; stage j on pp rank j % pp (dualpipev: V-shaped; custom: SCHEDULE's placement)
RECOMPUTE = ["none"]  # activation recomputation per virtual stage
# tensor-parallel style per module (emit keeps the imports of those it writes)
BLOCK_TP_PLAN = {
    "layers": {
        "attn": GatherSequenceInput(),
        "attn.qkv": PackedColwise(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": ReplicateRegionInput(),
        "mlp.up_proj": ColwiseParallel(),
        "norm": SequenceParallel(),
    },
}
TP_PLAN = {"embed.tok": VocabParallelEmbedding(output_layouts=Shard(1)),
           "embed.pos": ReplicatedEmbedding(sp=True),
           "head.proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
PREDICTED = {"step_s": 0.0, "memory_gib": [0.0]}  # per step, per rank: printed beside what the run measures
SCHEDULE = plan_schedule(None)  # the plan's own pipeline schedule (schedule=custom); None: CONFIG's built-in
# ---- end of the plan -------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ckpt-dir", default="checkpoints")
    ap.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (0: never)")
    ap.add_argument("--metrics", default="train_log.jsonl", help="JSON-lines log of every step")
    ap.add_argument("--data", default=None, help="a flat file of token ids, hf:PATH (a saved tokenized dataset) or "
                    "package.module:function(step, global_batch, seq_len) -> batch (default: synthetic tokens)")
    ap.add_argument("--data-dtype", choices=tuple(DTYPES), default=None,
                    help="a token file's ids (default: uint16 if the vocabulary fits, else uint32)")
    ap.add_argument("--data-eos", type=int, default=None, help="token id that ends each document of a token file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    ap.add_argument("--min-lr", type=float, default=3e-5, help="learning rate of the last step (cosine decay)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="steps of linear warmup to --lr")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9, help="AdamW beta1 (SGD: momentum)")
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--clip", type=float, default=MAX_GRAD_NORM, help="max global gradient norm (0: no clipping)")
    return ap.parse_args()


def make_optimizer(args: argparse.Namespace):
    """params -> optimizer with the command line's settings (one per stage module)."""
    if args.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=args.lr, momentum=args.beta1, weight_decay=args.weight_decay)
    return lambda ps: adamw(ps, lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=args.weight_decay)


def build(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> ParallelModel:
    """The plan applied to ``model`` on this rank (collective: every rank runs it)."""
    units = [u for s in STAGES for u in s]  # the model's layer units in order
    adapter = adapter_for(model, order=units, seq_len=SEQ_LEN, facts=FACTS)
    batch = Batch(GLOBAL_BATCH, SEQ_LEN, documents=bool(DOCUMENT_LENGTHS))
    check_runnable(CONFIG, adapter, FACTS, batch, CLUSTER)  # refuse what cannot run, before building
    mesh = build_mesh(CONFIG)  # dims (pp, dp, cp, tp) = @mesh
    samples = MULTIMODAL.balancer(CONFIG, mesh["dp"].get_local_rank()) if MULTIMODAL else None  # dp only, fp32
    stages = split_stages(adapter, STAGES, RECOMPUTE, CONFIG, mesh, SCHEDULE)  # this pp rank's stage modules
    materialize(adapter, stages, device, args.seed)  # meta: initialise own units; else take rank 0's weights
    # weights tied across pp ranks (pp > 1), found before TP splits them: their grads are summed
    tied = tie_weights(adapter, stages, mesh)
    # each batch's documents on groups of the dp x cp ranks of the size they need (when planned)
    batch_planner = build_batch_planner(PER_BATCH, CONFIG, FACTS, GLOBAL_BATCH, mesh)
    apply_attention(adapter, stages, CONFIG, mesh, per_batch=batch_planner)  # @attention
    apply_tp(adapter, stages, tp_plan_for(units, BLOCK_TP_PLAN, TP_PLAN), mesh, CONFIG.sp)  # @tp
    experts = apply_ep(stages, CONFIG)  # @ep
    apply_fp8(adapter, stages, CONFIG, device)  # @float_eight
    apply_recompute(adapter, stages)  # @recompute
    apply_compile(adapter, stages, CONFIG)  # @compile
    dp_mesh = apply_dp(adapter, stages, CONFIG, mesh, experts, DP_SPANS, wrap=samples is None)  # @dp: hierarchical across regions; none for MULTIMODAL
    optimizer = build_optimizer(stages.modules, make_optimizer(args), CONFIG.zero, dp_mesh.size(),
                                dp_mesh.get_group())  # @optimizer
    loss_fn = TokenLoss(dp_mesh.size())  # summed token loss / global token count * dp*cp size
    schedule = build_schedule(stages, CONFIG, mesh, GLOBAL_BATCH, loss_fn, device, SCHEDULE)  # @step
    return ParallelModel(adapter, CONFIG, mesh, stages, optimizer, loss_fn, GLOBAL_BATCH, device,
                         dp_mesh=dp_mesh, schedule=schedule, tied=tied, batch_planner=batch_planner,
                         sample_balancer=samples)


def train_step(pm: ParallelModel, batch: dict, lr: float, clip: float) -> tuple[float, float]:
    """One optimizer step on the GLOBAL batch (the same on every rank) at learning rate ``lr``;
    returns (mean token loss of the batch, global gradient norm before clipping)."""
    pm.optimizer.zero_grad()
    if pm.sample_balancer is not None:  # multimodal: this rank's samples whole, gradients summed over dp
        mean = sample_step(pm.model, batch, pm.sample_balancer, pm.dp_mesh.get_group())
    else:
        inputs, targets = pm.local_batch(batch)  # this rank's dp rows and cp sequence shard
        if pm.schedule is not None:  # pp > 1: the schedule runs forward and backward of every micro-batch
            loss = pm.pipeline(inputs, targets)
        else:  # gradient accumulation over the micro-batches
            loss = torch.zeros((), dtype=torch.float64, device=pm.device)
            for mb in range(pm.n_microbatches):
                loss += pm.microbatch(inputs, targets, mb)  # forward + backward of one micro-batch
        pm.sync_grads()
        mean = pm.global_loss(loss)
    norm = pm.clip_grad_norm_(clip)  # @clip
    pm.optimizer_step(lr)
    return mean, norm


def make_data(args: argparse.Namespace, spec: zoo.ModelSpec):
    """step -> the global batch: the user's hook, windows of a token file or dataset (packed
    documents where the plan packs them and the data marks them), or synthetic rows."""
    mllm = spec.cfg if spec.cfg is not None and spec.cfg.arch == "mllm" else None
    if args.data and is_hook(args.data):
        if DOCUMENT_LENGTHS and dist.get_rank() == 0:
            print("--data: this plan was made for packed documents (--seq-lens); give the batches cu_seqlens")
        return user_hook(args.data, GLOBAL_BATCH, SEQ_LEN)
    if args.data:  # windows drawn from (seed, step) alone: the same batches under any layout
        if mllm is not None:
            raise ValueError("--data: token data has no images for this image-text model; use a "
                             "package.module:function hook that returns pixel_values")
        src = open_tokens(args.data, VOCAB, SEQ_LEN, args.data_dtype, args.data_eos)
        if DOCUMENT_LENGTHS and not src.marks_documents and dist.get_rank() == 0:
            print("--data: this plan packs documents (--seq-lens) but the data marks none (--data-eos); plain rows")
        return token_batches(src, GLOBAL_BATCH, SEQ_LEN, args.seed, documents=bool(DOCUMENT_LENGTHS),
                             model_shifts_labels=ADAPTER == "hf", vocab=VOCAB)
    if DOCUMENT_LENGTHS:  # packed documents, as planned: attention within each
        return packed_documents(VOCAB, GLOBAL_BATCH, SEQ_LEN, DOCUMENT_LENGTHS, args.seed,
                                model_shifts_labels=ADAPTER == "hf")
    return synthetic(VOCAB, GLOBAL_BATCH, SEQ_LEN, args.seed, mllm=mllm, model_shifts_labels=ADAPTER == "hf",
                     images=MULTIMODAL.images if MULTIMODAL else None)  # images per sample: the plan's weights


def main() -> None:
    args = parse_args()
    device = init_distributed(threads=CONFIG.threads)  # gloo on CPU (the plan's threads per rank), nccl on GPU
    spec = zoo.load_model_spec(MODEL)
    model = spec.build(None if ADAPTER == "module" else "meta")
    pm = build(model, args, device)
    data = make_data(args, spec)
    start = checkpoint.load_latest(pm, args.ckpt_dir) or 0
    rank = dist.get_rank()
    if rank == 0:  # drop steps logged after the checkpoint we resume from (they are run again)
        checkpoint.trim_log(args.metrics, start)
    times, mem = [], [0.0]
    with (open(args.metrics, "a") if rank == 0 else contextlib.nullcontext()) as log, \
            (ScalarLog(args.metrics, start) if rank == 0 else contextlib.nullcontext()) as scalars:
        for step in range(start, args.steps):
            batch = data(step)
            lr = warmup_cosine(step, args.steps, args.lr, args.min_lr, args.warmup_steps)
            t0 = time.perf_counter()
            loss, norm = train_step(pm, batch, lr, args.clip)
            step_s = time.perf_counter() - t0
            times.append(step_s)
            mem = peak_memory_per_rank(device)  # GiB, one all-reduce of a tensor
            if log:  # logged before the checkpoint, so a checkpointed step is always in the log
                rec = {"step": step + 1, "loss": loss, "step_s": step_s, "memory_gib": mem, "lr": lr,
                       "grad_norm": norm, "tokens_per_s": GLOBAL_BATCH * SEQ_LEN / step_s,
                       "batch": batch_digest(batch)}
                if pm.sample_balancer is not None:  # the predicted seconds per dp rank, fixed split vs assigned
                    rec["dp_work"] = pm.sample_balancer.work()
                log.write(json.dumps(rec) + "\n")
                log.flush()
                scalars.write(rec)  # TensorBoard scalars beside the log, when tensorboard is installed
                print(f"step {step + 1:4d}  loss {loss:.4f}  {step_s * 1e3:8.1f} ms  "
                      f"{rec['tokens_per_s']:,.0f} tok/s  peak {max(mem):.2f} GiB", flush=True)
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                about = {"model": MODEL, "adapter": ADAPTER, "config": CONFIG.to_str()}  # which model: autopar export
                checkpoint.save(pm, args.ckpt_dir, about=about)
    if rank == 0 and times:
        print(f"median step {statistics.median(times):.4g} s (predicted {PREDICTED['step_s']:.4g} s); "
              f"peak {max(mem):.2f} GiB (predicted {max(PREDICTED['memory_gib']):.2f} GiB)", flush=True)
    pm.close()  # the build's process groups, hooks and registry entries
    teardown()  # a barrier, then the default process group


if __name__ == "__main__":
    main()
