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

Routing (``moe_routing``): a run under Megatron-Core's ``--moe-router-force-load-balancing``
gives every expert the mean load and is priced balanced; a dropless run's learned router gives
the busiest expert-parallel rank more, which the planner takes as ``MoEDims.imbalance``
(``autopar plan --moe-imbalance``: the routed GEMMs' rows and the all-to-alls' buffers scale with
it). Its value for a model is not fitted to the runs priced here: :func:`routing_imbalance` solves,
for each of the source's own forced-balance / dropless pairs of that model (``routing_ab``: one
layout measured both ways), the imbalance at which the model prices the dropless step that much
slower than the balanced one, and takes the median over the pairs. Qwen3's four long-context pairs
(16K-128K tokens, where attention's growing share shrinks the gap from 1.245x to 1.090x) each
give a value, so their spread says how well one imbalance explains them.

    python -m benchmarks.published_moe      # predicted vs published, per run
"""
from __future__ import annotations

import copy
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import replace  # noqa: E402

from cost_models.engines import ENGINES, Engine  # noqa: E402
from planner.plan import ParallelConfig  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "published", "published_runs_moe.json")
CLUSTER = "dgx-h100"
# the words of a run's "selective: '...'" recompute -> Megatron-Core's --recompute-modules
RECOMPUTE_WORDS = {"norm": "layernorm", "act": "moe_act", "moe": "moe"}


def load_runs(path: str = DATA) -> list[dict[str, Any]]:
    with open(path) as f:
        return json.load(f)["runs"]


def load_routing_pairs(path: str = DATA) -> dict[str, list[dict[str, Any]]]:
    """Per model name, the source's forced-balance / dropless pairs (``routing_ab``)."""
    with open(path) as f:
        return json.load(f)["routing_ab"]


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
    under autopar's ``selective``) has them as the engine's ``recompute_modules``
    (``RECOMPUTE_WORDS``, the words of the quoted list): the norms' outputs and the experts'
    activations (or the whole MoE layer: "moe") are not kept (a published-run-only expression). A
    run whose config counts the embedding and the loss as layers of the pipeline split
    (``pipeline_split_ends``) has the engine's ``split_ends``."""
    if run["moe_dispatcher"] == "alltoall":
        name = "megatron-moe"
    else:
        name = "megatron-moe-deepep" + ("-overlap" if run.get("ep_a2a_overlap") else "")
    rc = (run["activation_recompute"] or "").lower()
    named = re.search(r"'([^']*)'", rc) if rc.startswith("selective") else None
    words = {w.strip() for w in named.group(1).split(",")} if named else set()
    modules = tuple(m for word, m in RECOMPUTE_WORDS.items() if word in words)
    return replace(ENGINES[name], recompute_modules=modules, split_ends=bool(run.get("pipeline_split_ends")))


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


def price(run: dict, graph=None, imbalance: float = 1.0) -> dict[str, Any]:
    """Predicted vs published for ``run`` at its layout (even stage split, as Megatron splits),
    its MoE layers' busiest rank getting ``imbalance`` times the mean load."""
    from cost_models.cluster import load_preset
    from planner.frontend.load import with_moe_imbalance
    from planner.search.planning import evaluate_config

    cluster = load_preset(CLUSTER)
    cluster.nodes = run["num_gpus"] // run["gpus_per_node"]
    graph = graph if graph is not None else moe_graph(run)
    graph = with_moe_imbalance(copy.deepcopy(graph), imbalance) if imbalance != 1.0 else graph
    e, problems = evaluate_config(graph, cluster, moe_config(run), run["global_batch_size_seqs"], even_split=True,
                                  engine=moe_engine(run))
    pub = published_step_s(run) if run.get("iteration_time_s") or run.get("tflops_per_gpu") else float("nan")
    return {"id": run["id"], "step_s": e.step_s, "published_step_s": pub, "error": pub / e.step_s - 1.0,
            "fits": e.fits, "memory_gib": max(m.total for m in e.memory) / 2**30, "problems": problems,
            "imbalance": imbalance}


@dataclass(frozen=True)
class RoutingImbalance:
    """A model's dropless load imbalance (module docstring): the median of ``per_pair``, the value
    each forced-balance / dropless pair of the source gives."""
    model: str
    value: float
    per_pair: tuple[float, ...]


def pair_run(run: dict, pair: dict) -> dict:
    """``run`` (a run of the pair's model) at the pair's layout, with no published figure of its own."""
    return dict(run, **pair["layout"], iteration_time_s=None, tflops_per_gpu=None)


def solve_imbalance(run: dict, graph, ratio: float, hi: float = 4.0, tol: float = 1e-3) -> float:
    """The imbalance at which ``run``'s step priced dropless is ``ratio`` times its balanced one
    (bisection over [1, ``hi``]: the price rises with the imbalance); ``hi`` where even that is short."""
    base = price(run, graph)["step_s"]
    lo = 1.0
    if price(run, graph, hi)["step_s"] / base < ratio:
        return hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if price(run, graph, mid)["step_s"] / base < ratio else (lo, mid)
    return (lo + hi) / 2


def routing_imbalance(run: dict, pairs: list[dict], graph=None) -> RoutingImbalance:
    """The dropless imbalance of ``run``'s model from the source's ``pairs`` of it (module
    docstring); each pair's graph is captured at its sequence length unless it is ``run``'s."""
    values = []
    for pair in pairs:
        r = pair_run(run, pair)
        g = graph if graph is not None and r["seq_length"] == run["seq_length"] else moe_graph(r)
        values.append(solve_imbalance(r, g, pair["forced_tflops"] / pair["dropless_tflops"]))
    return RoutingImbalance(run["model_name"], statistics.median(values), tuple(values))


def run_imbalance(run: dict, imbalances: dict[str, RoutingImbalance]) -> float:
    """The load imbalance ``run`` is priced at: 1.0 under forced balance, else its model's."""
    return 1.0 if run["moe_routing"] == "forced-balance" else imbalances[run["model_name"]].value


def main() -> None:
    graphs: dict[str, Any] = {}
    imbalances: dict[str, RoutingImbalance] = {}
    pairs = load_routing_pairs()
    for run in load_runs():
        key = run["model_name"]
        if key not in graphs:
            graphs[key] = moe_graph(run)
            imbalances[key] = routing_imbalance(run, pairs[key], graphs[key])
            ri = imbalances[key]
            print(f"{key}: dropless imbalance {ri.value:.3f} (median of {', '.join(f'{v:.3f}' for v in ri.per_pair)}: "
                  f"the source's forced-balance / dropless pairs)")
        balanced = price(run, graphs[key])
        imbalance = run_imbalance(run, imbalances)
        r = price(run, graphs[key], imbalance) if imbalance != 1.0 else balanced
        print(f"{r['id']:<62} {run['moe_routing']:<14} predicted {r['step_s']:7.2f} s  published "
              f"{r['published_step_s']:7.2f} s  error {r['error']:+6.1%} (balanced {balanced['error']:+6.1%})  "
              f"fits {r['fits']} ({r['memory_gib']:.1f} GiB)"
              + (f"  problems: {'; '.join(r['problems'])}" if r["problems"] else ""))


if __name__ == "__main__":
    main()
