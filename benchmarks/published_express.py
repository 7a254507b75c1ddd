"""A published training run (one row of the development set) in autopar's terms.

``express(run)`` turns a row of ``shared/data/published_runs_dev*.json`` into a
:class:`Case`: the model (a zoo architecture), the cluster, the layout as a
``ParallelConfig``, the engine that ran it (``cost_models.engines``: its overlaps are
what the estimate prices) and the published throughput on the run's own counting basis.
What a source does not state is assumed as below, and every assumption is noted on the
case (printed by ``benchmarks/published_runs.py``):

- sources (the unit left out together in leave-one-source-out): SC21 (Narayanan et al.),
  Korthikanti (Korthikanti et al., 2022), Megatron README (its H100 weak-scaling table),
  Llama 3 (Meta's paper), torchtitan (its benchmarks and performance docs), MegaScale;
- engines: SC21 and Korthikanti ran 2021-22 Megatron-LM (no gradient-reduction overlap:
  Korthikanti et al. state it), the README and MegaScale's baseline Megatron-Core with
  the overlap flags the README lists (MegaScale's 2023 baseline: Megatron-LM's default flags), Llama 3 Meta's own stack as its paper describes it,
  torchtitan runs torchtitan;
- attention: flash everywhere. 2021-22 Megatron-LM ran it unfused (scores materialised);
  priced so (``attention=eager``, cost_models/compute.py) SC21's models up to 39B come
  out 15-24 % slow, so the unfused kernel's speed is not yet what the model says: flash
  is the closer figure for them today;
- zoo architectures: "GPT" -> gpt (GELU MLP, learned positions, untied head), SwiGLU ->
  llama (GQA, RoPE); a GPT row without an FFN size: 4h;
- clusters: A100 runs on ``dgx-a100-80g`` (MegaScale's "Ampere" GPUs taken as A100 80 GB:
  its MFU uses the A100's 312 TFLOP/s); torchtitan's H100s are 96 GB parts at 500 W
  (``benchmarks/published/h100-96g-500w.toml``); other H100s are ``dgx-h100``;
- sequence length not stated (torchtitan): 8192, its Llama 3 configs' length;
- micro-batch not stated: 1; global batch not stated: micro-batch x dp;
- recompute: as stated (SC21's Eq. 3 assumes full); not stated: the engine's default,
  none (Megatron-LM and Meta record no recompute by default); torchtitan's bare
  "selective": its default option, per-op (``selective-op``);
- sequence parallel not stated: on when tp > 1 for Megatron-Core engines, off for 2021;
- optimizer sharding: as stated; Megatron-Core's overlap-param-gather implies its
  distributed optimizer (zero1); Meta's "params not resharded after forward" is zero2;
- an interleaved schedule without its chunk count (SC21 Table 1, Llama 3): one layer per
  chunk at the most that divides the layers per stage, written on the case.

Counting bases: ``iteration_time`` (seconds per step) when given, else tokens/s per GPU,
else TFLOP/s per GPU counted as the source counts them: SC21's Eq. 3 (hardware FLOPs with
the recomputed forward) or model FLOPs (:func:`model_flops`: the MFU of the Megatron README,
Korthikanti's Eq. 7 and Llama 3's Chowdhery et al. definition are one formula).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from planner.plan import ParallelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
H100_500W = os.path.join(HERE, "published", "h100-96g-500w.toml")
TORCHTITAN_SEQ = 8192


@dataclass
class Case:
    """One published run, expressed in autopar's terms."""
    run_id: str
    source: str
    engine: str                    # cost_models.engines name
    model: dict[str, Any]          # ModelConfig keys
    cluster: str                   # preset name or TOML path
    nodes: int
    cfg: ParallelConfig
    global_batch: int
    metric: str                    # iteration_time | tokens_per_s | tflops_eq3 | tflops_model
    published: float               # in the metric's unit (s, tokens/s per GPU, TFLOP/s per GPU)
    assumptions: list[str] = field(default_factory=list)


def source_of(run: dict) -> str:
    """The publication a run comes from (the unit of leave-one-source-out)."""
    p = run["source_paper"]
    for key, name in (("torchtitan", "torchtitan"), ("MegaScale", "MegaScale"), ("Korthikanti", "Korthikanti"),
                      ("Megatron-LM GitHub README", "Megatron README"), ("Llama 3", "Llama 3"),
                      ("Narayanan", "SC21")):
        if key in p:
            return name
    raise ValueError(f"run {run['id']}: unknown source {p!r}: add it to benchmarks/published_express.source_of")


ENGINE_OF_SOURCE = {"SC21": "megatron-2021", "Korthikanti": "megatron-2021", "Megatron README": "megatron-core",
                    "MegaScale": "megatron-core-2023", "Llama 3": "llama3", "torchtitan": "torchtitan"}


def approx_reason(run: dict) -> str | None:
    """Why autopar can price ``run`` only approximately: its runtime differs from what the
    engines describe (None when the expression is faithful)."""
    if "DeepSpeed" in (run.get("zero_or_dist_optimizer") or ""):
        return "DeepSpeed ZeRO-3 (2021) priced as FSDP2"
    if source_of(run) == "torchtitan" and "layer" in (run.get("activation_recompute") or ""):
        return "torchtitan's per-layer selective checkpointing (every other block) priced as autopar's selective"
    return None


def skip_reason(run: dict) -> str | None:
    """Why autopar cannot express ``run`` (None when it can)."""
    if "parallel transformer block" in run["arch"]:
        return "parallel blocks + sliding-window attention + LAMB: not a zoo architecture"
    return None


def _fp8(run: dict, notes: list[str]) -> str:
    """The float8 recipe of a run: rowwise where its precision says so, else tensorwise (torchao's
    default recipe, the one torchtitan's published float8 runs name); none without FP8."""
    text = (run.get("precision") or "").lower()
    if "fp8" not in text and "float8" not in text:
        return "none"
    recipe = "rowwise" if "rowwise" in text else "tensorwise"
    notes.append(f"float8 {recipe}" + ("" if "tensorwise" in text or "rowwise" in text else " (torchao's default)"))
    return recipe


def _compiled(run: dict, notes: list[str]) -> bool:
    """Whether the run's blocks went through torch.compile (its notes or id say so)."""
    on = "compile" in (run.get("notes") or "").lower() or "compile" in run["id"].lower()
    if on:
        notes.append("torch.compile")
    return on


def _engine(run: dict, src: str) -> str:
    """The engine of the run's source; torchtitan's runs with async TP (their id ends in asyncTP)
    have it on."""
    if src == "torchtitan" and run["id"].lower().rsplit("_", 1)[-1] == "asynctp":
        return "torchtitan-asynctp"
    return ENGINE_OF_SOURCE[src]


def _model(run: dict, seq: int) -> dict[str, Any]:
    h, heads = run["hidden_size"], run["num_attention_heads"]
    llama = "SwiGLU" in run["arch"]
    return {"name": run["model_name"].replace(" ", "-").lower(), "arch": "llama" if llama else "gpt",
            "layers": run["num_layers"], "hidden": h, "ffn_hidden": run["ffn_hidden_size"] or 4 * h,
            "heads": heads, "kv_heads": run["num_kv_heads"] or heads, "vocab": run["vocab_size"],
            "seq_len": seq, "tie_embeddings": False, **({"rope_theta": 500000.0} if llama else {})}


def _zero(run: dict, src: str, notes: list[str]) -> str:
    opt = (run.get("zero_or_dist_optimizer") or "").lower()
    if "not resharded" in opt:
        return "zero2"
    if "zero-3" in opt or "fsdp" in opt:
        return "fsdp"
    if ENGINE_OF_SOURCE[src] == "megatron-2021":
        return "ddp"  # Megatron had no distributed optimizer then
    notes.append("distributed optimizer (zero1)")
    return "zero1"


def _recompute(run: dict, src: str, notes: list[str]) -> str:
    text = (run.get("activation_recompute") or "").lower()
    if text.startswith("full") or (src == "SC21" and "eq" in (run.get("tflops_counting") or "").lower()):
        return "full"
    if text.startswith("none"):
        return "none"
    if src == "torchtitan" and "selective" in text and "layer" not in text:
        if "op" not in text:
            notes.append("selective = torchtitan's default option, op")
        return "selective-op"
    if "selective" in text:
        return "selective"
    notes.append("recompute not stated: none (the engine's default)")
    return "none"


def _schedule(run: dict, layers: int, pp: int, src: str, notes: list[str]) -> tuple[str, int]:
    vpp = run["virtual_pipeline_stages"] or 1
    text = (run.get("pipeline_schedule") or "").lower()
    if pp > 1 and vpp == 1 and "interleaved" in text:
        if src == "torchtitan":  # its interleaved schedules build two stages per pp rank unless split otherwise
            vpp = 2
            notes.append("interleaved, chunks per stage not given: 2 (torchtitan's default)")
        else:
            per_stage = (layers + 2) // pp  # the embedding and the head count as layers (Llama 3 drops one per end)
            vpp = max(v for v in range(1, per_stage + 1) if per_stage % v == 0)
            notes.append(f"interleaved, chunks per stage not given: {vpp} (one layer per chunk)")
    return ("interleaved-1f1b" if vpp > 1 else "1f1b"), vpp


def _metric(run: dict) -> tuple[str, float]:
    if run.get("iteration_time_s"):
        return "iteration_time", float(run["iteration_time_s"])
    if run.get("tokens_per_sec_per_gpu"):
        return "tokens_per_s", float(run["tokens_per_sec_per_gpu"])
    counting = (run.get("tflops_counting") or "").lower()
    basis = "tflops_eq3" if "eq.3" in counting or "eq.(3)" in counting else "tflops_model"
    return basis, float(run["tflops_per_gpu"])


def express(run: dict) -> Case | str:
    """The run as a Case, or the reason it cannot be expressed."""
    why = skip_reason(run)
    if why:
        return why
    src, notes = source_of(run), []
    engine = _engine(run, src)
    seq = run["seq_length"]
    if seq is None:
        seq = TORCHTITAN_SEQ
        notes.append(f"seq {seq} (torchtitan default)")
    tp, pp, dp, cp = run["tp"], run["pp"], run["dp"], run["cp"] or 1
    mbs = run["micro_batch_size"] or 1
    if run["micro_batch_size"] is None:
        notes.append("mbs 1")
    elif pp > 1 and src == "torchtitan":
        # torchtitan prints each dp rank's batch ("local batch ... split into microbatches by PP", as its
        # Table 5 notes say), which its pipeline cuts into micro-batches of one (its default)
        mbs = 1
        notes.append("the local batch is the pipeline's: micro-batches of 1 (torchtitan's default)")
    gb = run["global_batch_size_seqs"]
    if gb is None:
        gb = (run["micro_batch_size"] or 1) * dp  # the printed batch per dp rank, times dp
        notes.append(f"global batch {gb} = the printed batch x dp")
    sp = run["sequence_parallel"]
    if sp is None:
        sp = tp > 1 and engine != "megatron-2021"
        if sp:
            notes.append("sequence parallel")
    sched, vpp = _schedule(run, run["num_layers"], pp, src, notes)
    cfg = ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, mbs=mbs, schedule=sched, vpp=vpp, zero=_zero(run, src, notes),
                         recompute=_recompute(run, src, notes), sp=bool(sp and tp > 1), dtype="bf16",
                         fp8=_fp8(run, notes), compile=_compiled(run, notes))
    gpu = run["gpu_type"] or ""
    if "HBM2e" in gpu or "96GB" in gpu:
        cluster = H100_500W
    elif gpu.startswith("H100"):
        cluster = "dgx-h100"
    else:
        cluster = "dgx-a100-80g"
    if "Ampere" in gpu:
        notes.append("A100 80GB")
    metric, value = _metric(run)
    return Case(run["id"], src, engine, _model(run, seq), cluster, run["num_gpus"] // 8, cfg, gb, metric, value, notes)


def eq3_flops(model: dict[str, Any], batch: int) -> float:
    """FLOPs of one step as Narayanan et al. (SC'21) count them, Eq. 3:
    96 B s l h^2 (1 + s / 6h + V / 16 l h) (forward, recomputed forward and backward)."""
    s, l, h, v = model["seq_len"], model["layers"], model["hidden"], model["vocab"]
    return 96.0 * batch * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def model_flops(model: dict[str, Any], batch: int) -> float:
    """Model FLOPs of one step (forward + backward, no recompute), the MFU basis of the Megatron
    README (Megatron's ``num_floating_point_operations``), Korthikanti et al.'s Eq. 7 and
    Chowdhery et al.'s 6N + 12 L H Q T: six per weight of every block matmul and the head, per
    token, plus the full-square attention, 12 L s (heads x head_dim) per token."""
    s, l, h, v = model["seq_len"], model["layers"], model["hidden"], model["vocab"]
    head_dim = h // model["heads"]
    q, kv = model["heads"] * head_dim, model["kv_heads"] * head_dim
    mlp = (3 if model["arch"] == "llama" else 2) * h * model["ffn_hidden"]
    weights = l * (2 * h * q + 2 * h * kv + mlp) + h * v
    return batch * s * (6.0 * weights + 12.0 * l * s * q)


def published_step_s(c: Case) -> float:
    """The published throughput as a step time for ``c``'s global batch."""
    if c.metric == "iteration_time":
        return c.published
    n = c.cfg.world
    if c.metric == "tokens_per_s":
        return c.global_batch * c.model["seq_len"] / (c.published * n)
    flops = eq3_flops(c.model, c.global_batch) if c.metric == "tflops_eq3" else model_flops(c.model, c.global_batch)
    return flops / (c.published * 1e12 * n)
