"""Published Megatron-Core mixture-of-experts runs, expressed for the GPU cost model.

The runs (``benchmarks/published/published_runs_moe.json``: Mixtral 8x22B on 128 H100, Qwen3-235B-A22B
on 256 H100 at every H100 layout of its table (five rows), from NVIDIA's Megatron-Core MoE model zoo) are priced on the graphs of
their real transformers configs (``hf_config``: the class and the values used), captured on fake
tensors (:func:`moe_graph`; nothing downloads), at their published layouts (:func:`moe_config`),
with their MoE layers run as their engine ran them (:func:`moe_engine`: Megatron-Core's
documented switches as each run set them, ``cost_models/moe_layer.py``). :func:`moe_case_model` gives the nearest zoo ``ModelConfig`` (arch ``moe``) for the
``benchmarks/published_runs.py`` Case glue; it is exact for Mixtral, while Qwen3's 128-wide heads
(64 x 128 = 8192 query features on a 4096 hidden) and its QK norms are not a zoo shape, so price
Qwen3 on :func:`moe_graph`.

Published throughput as a step time (:func:`published_step_s`): the iteration time where the
source gives one, else its TFLOP/s per GPU under Megatron-LM's own count
(``megatron.training.training.num_floating_point_operations``: 3 passes x 2 FLOPs per MAC over
the attention projections, the causal-halved attention core, the top-k routed experts' SwiGLU
(3 matrices), the logits; no router, no recompute): :func:`megatron_step_flops`.

    python -m benchmarks.published_moe      # predicted vs published, per run
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import replace  # noqa: E402

from cost_models.engines import ENGINES, Engine  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "published", "published_runs_moe.json")
CLUSTER = "dgx-h100"


def load_runs(path: str = DATA) -> list[dict[str, Any]]:
    with open(path) as f:
        return json.load(f)["runs"]


def moe_case_model(run: dict) -> dict[str, Any]:
    """ModelConfig keys (``planner.zoo.ModelConfig``, arch ``moe``) of ``run`` from its real
    config values (``hf_config``); the zoo's head width is ``hidden / heads`` (module docstring)."""
    h = run["hf_config"]
    return {"name": run["model_name"].replace(" ", "-").lower(), "arch": "moe", "layers": h["num_hidden_layers"],
            "hidden": h["hidden_size"], "ffn_hidden": h["intermediate_size"], "heads": h["num_attention_heads"],
            "kv_heads": h["num_key_value_heads"], "vocab": h["vocab_size"], "seq_len": run["seq_length"],
            "rope_theta": h["rope_theta"], "tie_embeddings": False, "experts": run["moe_num_experts"],
            "top_k": run["moe_active_experts"], "expert_ffn_hidden": h.get("moe_intermediate_size", h["intermediate_size"]),
            "shared_experts": h["shared_experts"], "dense_layers": 0}


def moe_config(run: dict) -> ParallelConfig:
    """``run``'s published layout: Megatron's distributed optimizer (zero1; FSDP where the run used
    Megatron-Core's FSDP, priced as autopar's), sequence parallel
    with TP (Megatron requires it with EP and TP), the interleaved schedule when it has virtual
    stages, and its recompute: none, or Megatron's selective modules, priced as autopar's
    ``selective`` (the runs recompute norms and activations only, never whole layers)."""
    vpp = run["virtual_pipeline_stages"] or 1
    rc = (run["activation_recompute"] or "none").lower()
    recompute = "full" if rc.startswith("full") else ("selective" if rc.startswith("selective") else "none")
    zero = "fsdp" if "fsdp" in (run.get("zero_or_dist_optimizer") or "").lower() else "zero1"
    return ParallelConfig(dp=run["dp"], pp=run["pp"], cp=run["cp"] or 1, tp=run["tp"], ep=run["ep"],
                          mbs=run["micro_batch_size"], schedule="interleaved-1f1b" if vpp > 1 else "1f1b", vpp=vpp,
                          zero=zero, recompute=recompute, sp=run["tp"] > 1, dtype="bf16")


def moe_engine(run: dict) -> Engine:
    """The engine that ran ``run`` (``cost_models.engines.ENGINES``): Megatron-Core with its
    all-to-all or DeepEP dispatcher (``moe_dispatcher``), and its EP all-to-alls hidden behind
    the other micro-batch under 1F1B where the run turned that on (``ep_a2a_overlap``). A run
    whose recompute is Megatron's ``--recompute-modules layernorm moe_act`` ("norm, act", priced
    under autopar's ``selective``) has them as the engine's ``recompute_modules``: the norms'
    outputs and the experts' activations are not kept (a published-run-only expression)."""
    if run["moe_dispatcher"] == "alltoall":
        name = "megatron-moe"
    else:
        name = "megatron-moe-deepep" + ("-overlap" if run.get("ep_a2a_overlap") else "")
    rc = (run["activation_recompute"] or "").lower()
    modules = tuple(m for m, word in (("layernorm", "norm"), ("moe_act", "act")) if rc.startswith("selective")
                    and word in rc.split(":", 1)[-1])
    return replace(ENGINES[name], recompute_modules=modules) if modules else ENGINES[name]


def hf_config_of(run: dict):
    """The transformers config object of ``run`` (``hf_config``'s class and values)."""
    import transformers

    h = dict(run["hf_config"])
    cls = getattr(transformers, h.pop("class").split(".")[-1])
    h.pop("shared_experts", None)
    return cls(**h, max_position_embeddings=max(run["seq_length"], 4096), use_cache=False)


def moe_graph(run: dict):
    """``run``'s model captured from its transformers config (built on meta, through the
    ``hf:<config.json>`` model spec) at its sequence length."""
    from planner.frontend.load import load_graph

    with tempfile.TemporaryDirectory() as d:
        hf_config_of(run).save_pretrained(d)
        g = load_graph("hf:" + d, seq_len=run["seq_length"])
    g.name = run["model_name"]
    return g


def megatron_step_flops(run: dict) -> float:
    """FLOPs of one step as Megatron-LM counts them (module docstring), for the global batch."""
    h = run["hf_config"]
    hid, L, s = h["hidden_size"], h["num_hidden_layers"], run["seq_length"]
    q = h["head_dim"] * h["num_attention_heads"]
    kv = h["head_dim"] * h["num_key_value_heads"]
    ffn = h.get("moe_intermediate_size", h["intermediate_size"])
    attn = hid * (q + 2 * kv) + q * hid + q * s  # projections, and QK^T + AV causal-halved
    mlp = 3 * hid * ffn * run["moe_active_experts"]
    per_token = 6 * (L * (attn + mlp) + hid * h["vocab_size"])
    return per_token * run["global_batch_size_seqs"] * s


def published_step_s(run: dict) -> float:
    """The published throughput as the step time of the run's global batch, seconds."""
    if run.get("iteration_time_s"):
        return float(run["iteration_time_s"])
    return megatron_step_flops(run) / (run["tflops_per_gpu"] * 1e12 * run["num_gpus"])


def price(run: dict, graph=None) -> dict[str, Any]:
    """Predicted vs published for ``run`` at its layout (even stage split, as Megatron splits)."""
    from cost_models.cluster import load_preset
    from planner.search.planning import evaluate_config

    cluster = load_preset(CLUSTER)
    cluster.nodes = run["num_gpus"] // run["gpus_per_node"]
    graph = graph if graph is not None else moe_graph(run)
    e, problems = evaluate_config(graph, cluster, moe_config(run), run["global_batch_size_seqs"], even_split=True,
                                  engine=moe_engine(run))
    pub = published_step_s(run)
    return {"id": run["id"], "step_s": e.step_s, "published_step_s": pub, "error": pub / e.step_s - 1.0,
            "fits": e.fits, "memory_gib": max(m.total for m in e.memory) / 2**30, "problems": problems}


def main() -> None:
    graphs: dict[str, Any] = {}
    for run in load_runs():
        key = run["model_name"]
        if key not in graphs:
            graphs[key] = moe_graph(run)
        r = price(run, graphs[key])
        print(f"{r['id']:<62} predicted {r['step_s']:7.2f} s  published {r['published_step_s']:7.2f} s  "
              f"error {r['error']:+6.1%}  fits {r['fits']} ({r['memory_gib']:.1f} GiB)"
              + (f"  problems: {'; '.join(r['problems'])}" if r["problems"] else ""))


if __name__ == "__main__":
    main()
